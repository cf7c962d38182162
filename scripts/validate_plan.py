"""Planner predictions versus the engine's measurements, policy by policy.

    .venv/bin/python scripts/validate_plan.py                      # GPU: 128³ and 192³, batch 1
    .venv/bin/python scripts/validate_plan.py --device cpu --emulate-gbs 1 \\
        --json docs/benchmarks/validate_plan_cpu.json               # CPU through the emulated link (minutes)

For each cube and policy (none, the presets of `brats_swap.memory.presets`, and the auto plan for
`--budget` GiB): the planner's predicted peak and step time, then the same measured with the engine
(median step time over `--steps` after a warm-up step, with an Adam step, as training runs).

- GPU: peak = `torch.cuda.max_memory_allocated`; the time model is profiled on the card (ops and the
  pinned link). Targets: peak within 10%, step time within 15%.
- CPU: there is no device-memory counter, so the peak compared is the engine's peak resident saved bytes.
  With `--emulate-gbs G` the engine copies through `memory.swap.emulate_gbs` (a copy thread per
  direction at G GB/s, so copies really overlap the compute) and the planner prices that link: its
  bandwidth, asynchronous copies, and the compute time the copy threads take from the 2-core step
  (`calibrate_interference`). Targets: step time within 15%, peak within 5%. Without it the copies are
  synchronous and the byte counts match exactly.
  The default `--budget` on CPU is half of the `none` policy's predicted peak, so `auto` has to act.

Writes `{"rows": [{"policy", "predicted_step_s", "measured_step_s", "predicted_peak_bytes",
"measured_peak_bytes", ...}, ...]}` to `--json` (default docs/benchmarks/validate_plan_<device>.json, or
validate_plan.json in `--out`) and the same as a Markdown table next to it (`.md`).
`bench_memory.py --validate-plan` and `gpu_check.py` reuse `measure` and `main`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config.schema import MemoryConfig, ModelConfig
from brats_swap.memory.engine import MemoryEngine
from brats_swap.memory.link import EmulatedLink
from brats_swap.memory.planner import Planner, profile_device
from brats_swap.memory.presets import named_policies
from brats_swap.memory.simulate import GIB
from brats_swap.model import build_model
from brats_swap.train.losses import weighted_dice_loss

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"cuda": (0.10, 0.15), "cpu": (0.05, 0.15)}  # (peak, step time) relative error
SAVE_ON_CPU = "save_on_cpu"  # torch.autograd.graph.save_on_cpu(pin_memory=True): a PyTorch baseline


def _step_context(engine: MemoryEngine | None, policy, device: torch.device):
    if engine is not None:
        return engine.step()
    if policy == SAVE_ON_CPU:
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    return contextlib.nullcontext()


def measure(model, policy: MemoryConfig | str, x, y, device: torch.device, steps: int, dtype: torch.dtype,
            *, hooks_for_none: bool = True, arena_bytes: int = 0) -> dict:
    """Run `steps` training steps under `policy` after one warm-up; step time, peaks and engine stats.

    `policy` is a MemoryConfig or `SAVE_ON_CPU`. `hooks_for_none=False` runs mode none without hooks (a
    fair GPU baseline; no stats). Peak: `torch.cuda.max_memory_allocated` on CUDA, else the engine's peak
    resident saved bytes.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine = None
    if isinstance(policy, MemoryConfig) and (policy.mode != "none" or hooks_for_none):
        engine = MemoryEngine(model, policy, device, measure=True, arena_bytes=arena_bytes)
    autocast = dtype != torch.float32 and device.type == "cuda"
    times = []
    try:
        for step in range(steps + 1):
            if step == 1 and device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            with _step_context(engine, policy, device), torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = weighted_dice_loss(model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:
                times.append(time.perf_counter() - started)
        row = {"step_s": statistics.median(times), "step_times_s": [round(t, 4) for t in times]}
        if engine is not None:
            stats = engine.last_stats()
            row.update(saved_bytes=stats.saved_bytes, swapped_bytes=stats.swapped_out_bytes,
                       peak_resident_saved_bytes=stats.peak_resident_saved_bytes,
                       prefetch_misses=stats.prefetch_misses, late_reloads=stats.late_reloads,
                       arena_bytes=stats.arena_bytes)
        if device.type == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        elif engine is not None:
            row["peak_bytes"] = row["peak_resident_saved_bytes"]
        return row
    finally:
        if engine is not None:
            engine.close()
        del optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def relative_error(predicted: float, measured: float) -> float | None:
    return None if not measured else (predicted - measured) / measured


# --------------------------------------------------------------------------------------------------------
# The emulated link's price on this CPU
# --------------------------------------------------------------------------------------------------------


def _conv_work(cube: int) -> Callable[[], None]:
    conv = torch.nn.Conv3d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, cube, cube, cube)

    def run() -> None:
        conv(x).sum().backward()

    return run


def calibrate_interference(gbs: float, seconds: float = 1.0, pairs: int = 3, chunk_bytes: int = 16 << 20) -> dict:
    """Compute time a copy thread of the emulated link takes from a concurrent step on this CPU.

    Times a conv3d forward + backward loop (about `seconds` long) alone and while an `EmulatedLink` at
    `gbs` streams copies of `chunk_bytes` back to back (what a swap step's copies do to it), `pairs` times
    alternately, and returns the medians and the seconds of compute lost per byte copied: on 2 cores the
    copy's `memmove` preempts one of the two intra-op threads, and the parallel region waits for it.
    """
    work = _conv_work(32)
    work()
    rounds = max(1, int(seconds / _timed(work)))
    source = torch.empty(chunk_bytes, dtype=torch.uint8)
    destination = torch.empty_like(source)
    link = EmulatedLink(gbs)
    streaming, stop = threading.Event(), threading.Event()
    copied = [0]

    def feed() -> None:  # keeps the link busy while `streaming` is set, one chunk in flight at a time
        while not stop.is_set():
            if streaming.wait(timeout=0.01):
                link.copy_out(destination, source).wait()
                copied[0] += chunk_bytes

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    alone, busy, moved = [], [], []
    try:
        for _ in range(pairs):
            alone.append(_timed(work, rounds))
            streaming.set()
            time.sleep(0.02)
            before = copied[0]
            busy.append(_timed(work, rounds))
            moved.append(copied[0] - before)
            streaming.clear()
            link.synchronize()
    finally:
        stop.set()
        feeder.join()
        link.close()
    alone_s, busy_s, moved_bytes = statistics.median(alone), statistics.median(busy), statistics.median(moved)
    lost = max(0.0, busy_s - alone_s)
    return {"gbs": gbs, "alone_s": alone_s, "with_copies_s": busy_s, "copied_bytes": moved_bytes,
            "seconds_per_byte": lost / moved_bytes if moved_bytes else 0.0}


def _timed(work, rounds: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        work()
    return time.perf_counter() - started


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    gpu = result["device"].startswith("cuda")
    peak_target, time_target = TARGETS["cuda" if gpu else "cpu"]
    link = f", emulated link {result['emulate_gbs']:g} GB/s" if result.get("emulate_gbs") else ""
    lines = [f"# Planner predictions vs measurements ({result['device_name']}{link})", "",
             f"Command: `{result['command']}`", "",
             "Peak: " + ("`torch.cuda.max_memory_allocated`" if gpu else "the engine's peak resident saved bytes")
             + f" (target within {peak_target:.0%}). Step time: median over the measured steps (target within "
             f"{time_target:.0%}).", "",
             "| cube | batch | policy | predicted peak MiB | measured MiB | error | predicted step s | measured s "
             "| error | swapped bytes equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def pct(value):
        return "-" if value is None else f"{value * 100:+.1f}%"

    for row in result["rows"]:
        lines.append(
            f"| {row['cube']} | {row['batch']} | {row['policy']} | {row['predicted_peak_bytes'] / 2**20:.1f} | "
            f"{row['measured_peak_bytes'] / 2**20:.1f} | {pct(row['peak_error'])} | {row['predicted_step_s']:.4f} | "
            f"{row['measured_step_s']:.4f} | {pct(row['step_error'])} | {row['swapped_bytes_equal']} |")
    rows = result["rows"]
    ok_peak = sum(r["peak_error"] is not None and abs(r["peak_error"]) <= peak_target for r in rows)
    ok_time = sum(r["step_error"] is not None and abs(r["step_error"]) <= time_target for r in rows)
    lines += ["", f"Within target: peak {ok_peak}/{len(rows)}, step time {ok_time}/{len(rows)}."]
    if result.get("interference"):
        item = result["interference"]
        lines += ["", f"Copy-thread interference measured here: a conv3d loop took {item['alone_s']:.3f} s alone "
                      f"and {item['with_copies_s']:.3f} s while the link moved {item['copied_bytes'] / 1e6:.0f} MB "
                      f"({item['seconds_per_byte'] * 1e9:.2f} s per GB copied, priced by the planner)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cubes", type=int, nargs="+", default=None, help="default: 128 192 (GPU), 48 (CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--base-filters", type=int, default=None, help="default: 16 (GPU), 4 (CPU)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-bytes", type=int, default=None, help="override swap.min_bytes of every policy")
    parser.add_argument("--budget", type=float, default=None,
                        help="GiB for the auto plan (default on CPU: half of none's predicted peak)")
    parser.add_argument("--policies", nargs="+", default=None, help="subset of policy names (auto included)")
    parser.add_argument("--bandwidth", type=float, default=None, help="host<->device GB/s (default: measured)")
    parser.add_argument("--emulate-gbs", type=float, default=None,
                        help="CPU: copy through an emulated link of this GB/s (memory.swap.emulate_gbs)")
    parser.add_argument("--json", type=Path, default=None, help="result file (a .md table is written next to it)")
    parser.add_argument("--out", type=Path, default=None, help="folder for validate_plan.{json,md} (instead of --json)")
    args = parser.parse_args(argv)
    if args.emulate_gbs is not None and args.device != "cpu":
        parser.error("--emulate-gbs emulates the link on the CPU; use it with --device cpu")
    return args


def cost_model(model, device: torch.device, args, cube: int, dtype: torch.dtype) -> tuple:
    """The planner's time model for this run: profiled on `device`; with an emulated link, that link."""
    # The time model is fitted on this device at the smallest cube (GPU: at least 96³ to fill it).
    profile_cube = cube if device.type == "cpu" else max(96, cube)
    cost = profile_device(model, device, cube=profile_cube, batch=args.batch, dtype=dtype,
                          loss_fn=weighted_dice_loss)
    interference = None
    if args.emulate_gbs is not None:
        interference = calibrate_interference(args.emulate_gbs)
        cost.sync_copies = False
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = args.emulate_gbs * 1e9
        cost.copy_interference_s_per_byte = interference["seconds_per_byte"]
        cost.name += f", emulated link {args.emulate_gbs:g} GB/s"
    if args.bandwidth is not None:
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = args.bandwidth * 1e9
    return cost, interference


def policies_for(planner: Planner, base: MemoryConfig, budget_gib: float | None, names,
                 half_budget: bool = False) -> dict[str, MemoryConfig]:
    """none, every preset, and the auto plan for `budget_gib` (or, with `half_budget`, for half of none's
    predicted peak), restricted to `names` when given."""
    policies = named_policies(base)
    if budget_gib is None and half_budget:
        budget_gib = planner.memory(policies["none"]).peak_bytes / 2 / GIB
    if budget_gib is not None:
        best, _ = planner.auto(budget_gib * GIB, base)
        if best is not None:
            policies["auto"] = best.policy
    if names:
        policies = {k: v for k, v in policies.items() if k in names}
    return policies


def validate_cube(model, cube: int, args, device, dtype, cost, base: MemoryConfig) -> list[dict]:
    shape = (args.batch, 4, cube, cube, cube)
    planner = Planner(model, shape, dtype=dtype, cost=cost, loss_fn=weighted_dice_loss)
    x = torch.randn(shape, device=device)
    y = (torch.rand(args.batch, 3, cube, cube, cube, device=device) > 0.8).float()
    rows = []
    policies = policies_for(planner, base, args.budget, args.policies, half_budget=device.type == "cpu")
    for name, cfg in policies.items():
        predicted_memory, predicted_time = planner.memory(cfg), planner.time(cfg)
        try:
            measured = measure(model, cfg, x, y, device, args.steps, dtype)
        except torch.OutOfMemoryError:
            print(f"{cube}³ {name}: out of memory", file=sys.stderr)
            continue
        predicted_peak = (predicted_memory.peak_bytes if device.type == "cuda"
                          else predicted_memory.peak_resident_saved_bytes)
        row = {
            "cube": cube, "batch": args.batch, "policy": name,
            "predicted_step_s": predicted_time.step_s, "measured_step_s": measured["step_s"],
            "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": measured["peak_bytes"],
            "peak_error": relative_error(predicted_peak, measured["peak_bytes"]),
            "step_error": relative_error(predicted_time.step_s, measured["step_s"]),
            "measured_step_times_s": measured["step_times_s"],
            "predicted_saved_bytes": predicted_memory.saved_bytes, "measured_saved_bytes": measured["saved_bytes"],
            "saved_bytes_equal": predicted_memory.saved_bytes == measured["saved_bytes"],
            "swapped_bytes_equal": predicted_memory.swapped_bytes == measured["swapped_bytes"],
            "resident_bytes_equal": (predicted_memory.peak_resident_saved_bytes
                                     == measured["peak_resident_saved_bytes"]),
            "predicted_exposed_transfer_s": predicted_time.exposed_transfer_s,
            "measured_prefetch_misses": measured["prefetch_misses"],
            "policy_config": {"mode": cfg.mode, "swap": vars(cfg.swap), "recompute": vars(cfg.recompute)},
        }
        rows.append(row)
        print(f"{cube}³ {name:26s} peak {predicted_peak / 2**20:.1f} vs {measured['peak_bytes'] / 2**20:.1f} MiB, "
              f"step {predicted_time.step_s:.4f} vs {measured['step_s']:.4f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cubes = args.cubes or ([128, 192] if device.type == "cuda" else [48])
    base_filters = args.base_filters or (16 if device.type == "cuda" else 4)
    base = MemoryConfig()
    if args.min_bytes is not None:
        base.swap.min_bytes = args.min_bytes
    base.swap.emulate_gbs = args.emulate_gbs
    torch.manual_seed(0)
    model = build_model(ModelConfig(base_filters=base_filters)).to(device)
    cost, interference = cost_model(model, device, args, min(cubes), dtype)
    started = time.perf_counter()
    rows = [row for cube in cubes for row in validate_cube(model, cube, args, device, dtype, cost, base)]
    result = {
        "command": " ".join(["scripts/validate_plan.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "base_filters": base_filters,
        "threads": torch.get_num_threads(), "emulate_gbs": args.emulate_gbs, "interference": interference,
        "cost_model": copy.deepcopy(cost.as_dict()), "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    if args.json is not None:
        json_path = args.json
    else:
        folder = args.out if args.out is not None else REPO / "docs" / "benchmarks"
        json_path = folder / ("validate_plan.json" if args.out is not None else f"validate_plan_{device.type}.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(json_path, result)
    atomic_write_text(json_path.with_suffix(".md"), markdown(result))
    print(f"wrote {json_path} and {json_path.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
