"""Memory policies on the U-Net: step time, device memory, bytes swapped, prefetch misses.

    .venv/bin/python scripts/bench_memory.py                               # GPU: the default grid, < 8 min on an H200
    .venv/bin/python scripts/bench_memory.py --cap-gib 16                  # + largest cube per policy in 16 GiB (V100)
    .venv/bin/python scripts/bench_memory.py --validate-plan --budget 16   # planner's predictions vs measured
    .venv/bin/python scripts/bench_memory.py --device cpu --cubes 8 --depth 3 --base-filters 2 \\
        --batches 1 --steps 1 --min-bytes 0 --out /tmp/bench              # CPU smoke run (what the test does)

Policies: `none`, the four swap presets (swap_all, swap_first_n, swap_no_decoder, swap_no_decoder_lookahead),
`recompute` (block checkpointing), `norm_act`, `hybrid` (`brats_swap.memory.presets`, the same sections as
configs/*.yaml), and two built-in
PyTorch baselines: `save_on_cpu` (`torch.autograd.graph.save_on_cpu(pin_memory=True)`) and
`checkpoint_blocks` (`torch.utils.checkpoint` around every block of `discover_blocks`).

For every (cube, batch, dtype, policy): median step time over `--steps` after one warm-up step, peak device
memory (`torch.cuda.max_memory_allocated`; on CPU the engine's peak resident saved bytes, none for the
baselines), bytes swapped out/in and prefetch misses. On GPU it first measures pinned host<->device
bandwidth. `--cap-gib` / `--memory-fraction` cap the device with `torch.cuda.set_per_process_memory_fraction`
and search the largest cube (step 32) each policy trains. Results: JSON + a Markdown table in `--out`.
Grid points run cube by cube in the given order (192³ first, every dtype/batch/policy) until
`--time-budget` seconds are used; the rest are listed as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config import MemoryConfig, ModelConfig
from brats_swap.memory import MemoryEngine, cuda_device, discover_blocks
from brats_swap.memory.device_profile import measure_bandwidth
from brats_swap.memory.presets import PRESET_NAMES, named_policies
from brats_swap.memory.recompute import CheckpointedModules
from brats_swap.model import build_model
from brats_swap.train.losses import weighted_dice_loss

REPO = Path(__file__).resolve().parents[1]
BASELINES = ["save_on_cpu", "checkpoint_blocks"]
ALL_POLICIES = ["none", *PRESET_NAMES, *BASELINES]


def policy_memory(name: str, min_bytes: int | None) -> MemoryConfig | None:
    """The memory policy `name` (None for the plain-PyTorch baselines), with `min_bytes` if given."""
    if name in BASELINES:
        return None
    base = MemoryConfig()
    if min_bytes is not None:
        base.swap.min_bytes = min_bytes
    return named_policies(base)[name]


class Case:
    """One model + optimizer + policy, ready to run steps."""

    def __init__(self, policy: str, cube: int, batch: int, dtype: str, device: torch.device, args):
        torch.manual_seed(0)
        self.device = device
        self.dtype = dtype
        self.policy = policy
        self.model = build_model(ModelConfig(base_filters=args.base_filters, depth=args.depth,
                                             segmentation_levels=min(3, args.depth - 1))).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, 4, cube, cube, cube, device=device)
        self.y = (torch.rand(batch, 3, cube, cube, cube, device=device) > 0.8).float()
        memory = policy_memory(policy, args.min_bytes)
        # On GPU `none` runs without hooks (a fair baseline); on CPU the hooks measure its saved bytes.
        self.engine = (MemoryEngine(self.model, memory, device, measure=device.type != "cuda")
                       if memory is not None else None)
        self.wrapped = None
        if policy == "checkpoint_blocks":
            self.wrapped = CheckpointedModules(self.model, [name for name, _ in discover_blocks(self.model)])

    def step(self) -> float:
        started = time.perf_counter()
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.dtype == "bf16"
                    else contextlib.nullcontext())
        if self.engine is not None:
            context = self.engine.step()
        elif self.policy == "save_on_cpu":
            context = torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        else:
            context = contextlib.nullcontext()
        with context, autocast:
            loss = weighted_dice_loss(self.model(self.x).float(), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.wrapped is not None:
            self.wrapped.remove()


def run_point(policy: str, cube: int, batch: int, dtype: str, device: torch.device, args) -> dict:
    row = {"policy": policy, "cube": cube, "batch": batch, "dtype": dtype}
    case = None
    try:
        case = Case(policy, cube, batch, dtype, device, args)
        case.step()  # warm-up: allocator, cuDNN algorithms, the arena, the learned backward order
        cuda_device.reset_peak(device)
        times = [case.step() for _ in range(args.steps)]
        row["step_s"] = round(statistics.median(times), 4)
        if device.type == "cuda":
            row["peak_bytes"] = cuda_device.peak_allocated_bytes(device)
        if case.engine is not None and case.engine.enabled:
            stats = case.engine.last_stats()
            row.update(saved_bytes=stats.saved_bytes, peak_resident_saved_bytes=stats.peak_resident_saved_bytes,
                       swapped_out_bytes=stats.swapped_out_bytes, swapped_in_bytes=stats.swapped_in_bytes,
                       recomputed_bytes=stats.recomputed_bytes, prefetch_misses=stats.prefetch_misses,
                       copy_s=round(stats.copy_seconds, 4))
            if device.type != "cuda":
                row["peak_bytes"] = stats.peak_resident_saved_bytes
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError exists from torch 2.5 only
        row["status"] = "oom"
    finally:
        if case is not None:
            case.close()
        del case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def largest_cube(policy: str, batch: int, dtype: str, device: torch.device, args) -> int | None:
    """Largest cube in [search_min, search_max] (step search_step) that trains under the memory cap."""
    best = None
    for cube in range(args.search_min, args.search_max + 1, args.search_step):
        row = run_point(policy, cube, batch, dtype, device, argparse.Namespace(**{**vars(args), "steps": 1}))
        if row["status"] != "ok":
            break
        best = cube
    return best


def markdown(result: dict) -> str:
    lines = [f"# Memory policies: {result['device']}", "",
             f"U-Net base_filters={result['base_filters']}, depth={result['depth']}; median of {result['steps']} steps after a warm-up. "
             "`peak` is `torch.cuda.max_memory_allocated` on GPU; on CPU it is the engine's peak resident saved bytes, "
             "which does not see what a checkpointed region holds while backward recomputes it.", ""]
    if result.get("bandwidth"):
        lines += [f"Pinned bandwidth: H2D {result['bandwidth']['h2d_gbs']} GB/s, "
                  f"D2H {result['bandwidth']['d2h_gbs']} GB/s.", ""]
    def mib(row: dict, key: str) -> str:
        return f"{row[key] / 2**20:.1f}" if key in row else "-"

    lines += ["| cube | batch | dtype | policy | step s | peak MiB | saved MiB | swapped out MiB | recomputed MiB "
              "| misses | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['cube']} | {row['batch']} | {row['dtype']} | {row['policy']} | "
                     f"{row.get('step_s', '-')} | {mib(row, 'peak_bytes')} | {mib(row, 'saved_bytes')} | "
                     f"{mib(row, 'swapped_out_bytes')} | {mib(row, 'recomputed_bytes')} | "
                     f"{row.get('prefetch_misses', '-')} | {row['status']} |")
    if result.get("largest_cube"):
        lines += ["", f"Largest cube trained under a {result['cap_gib']} GiB cap:", "",
                  "| policy | batch | dtype | largest cube |", "|---|---|---|---|"]
        for item in result["largest_cube"]:
            lines.append(f"| {item['policy']} | {item['batch']} | {item['dtype']} | {item['cube']} |")
    if result.get("skipped"):
        lines += ["", f"Skipped for the time budget: {len(result['skipped'])} grid points."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--validate-plan" in argv:
        # The planner's check (predicted vs measured peak and step time) lives in validate_plan.py;
        # this flag is the entry point the docs name. Every other option is passed through.
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import validate_plan

        return validate_plan.main([a for a in argv if a != "--validate-plan"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cubes", type=int, nargs="+", default=[192, 128, 160, 224, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=None,
                        help="default: fp32 bf16 on GPU, fp32 on CPU")
    parser.add_argument("--policies", nargs="+", choices=ALL_POLICIES, default=ALL_POLICIES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--base-filters", type=int, default=16)
    parser.add_argument("--depth", type=int, default=5, help="U-Net levels (cubes must divide by 2**(depth-1))")
    parser.add_argument("--min-bytes", type=int, default=None, help="override swap.min_bytes of the presets")
    parser.add_argument("--cap-gib", type=float, default=None, help="cap device memory (GiB) and search cubes")
    parser.add_argument("--memory-fraction", type=float, default=None, help="cap as a fraction of the device")
    parser.add_argument("--search-min", type=int, default=128)
    parser.add_argument("--search-max", type=int, default=320)
    parser.add_argument("--search-step", type=int, default=32, help="cube step of the search (multiple of 16)")
    parser.add_argument("--time-budget", type=float, default=390.0, help="seconds for the grid (then skip)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_memory: --device cuda but CUDA is not available (use --device cpu)")
    dtypes = args.dtypes or (["fp32", "bf16"] if device.type == "cuda" else ["fp32"])
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "base_filters": args.base_filters, "depth": args.depth, "steps": args.steps, "rows": [],
              "skipped": []}
    if device.type == "cuda":
        h2d, d2h = measure_bandwidth(device)
        result["bandwidth"] = {"h2d_gbs": round(h2d / 1e9, 2), "d2h_gbs": round(d2h / 1e9, 2)}

    # Most interesting first: cubes in the given order (192³ first), every dtype, batch and policy there.
    started = time.perf_counter()
    for cube in args.cubes:
        for dtype in dtypes:
            for batch in args.batches:
                for policy in args.policies:
                    point = {"policy": policy, "cube": cube, "batch": batch, "dtype": dtype}
                    if time.perf_counter() - started > args.time_budget:
                        result["skipped"].append(point)
                        continue
                    row = run_point(policy, cube, batch, dtype, device, args)
                    result["rows"].append(row)
                    print(row, flush=True)

    if args.cap_gib is not None or args.memory_fraction is not None:
        if device.type != "cuda":
            sys.exit("bench_memory: --cap-gib / --memory-fraction need a CUDA device")
        total = cuda_device.total_bytes(device)
        fraction = args.memory_fraction if args.memory_fraction is not None else args.cap_gib * 2**30 / total
        result["cap_gib"] = round(min(fraction, 1.0) * total / 2**30, 2)
        result["largest_cube"] = []
        with cuda_device.memory_cap(device, min(fraction, 1.0) * total):
            for policy in args.policies:
                cube = largest_cube(policy, args.batches[0], dtypes[0], device, args)
                result["largest_cube"].append({"policy": policy, "batch": args.batches[0], "dtype": dtypes[0],
                                               "cube": cube})
                print(result["largest_cube"][-1], flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if device.type == "cuda" else "cpu"
    atomic_write_json(args.out / f"bench_memory_{tag}.json", result)
    atomic_write_text(args.out / f"bench_memory_{tag}.md", markdown(result))
    return result


if __name__ == "__main__":
    main()
