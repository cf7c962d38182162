"""Planner predictions versus the engine's measurements, policy by policy.

    .venv/bin/python scripts/validate_plan.py                                  # GPU: 128³ and 192³, batch 1
    .venv/bin/python scripts/validate_plan.py --device cpu --cubes 32 --base-filters 4 --out /tmp/validate

For each cube and policy (none, the presets in configs/, and the auto plan for `--budget`): the planner's
predicted peak device memory, step time, saved / swapped / peak-resident saved bytes, then the same measured
on the device with the engine (median step time over `--steps` after a warm-up step, with an Adam step, as
training runs; peak = `torch.cuda.max_memory_allocated`). On CPU there is no device-memory counter, so
the peak column compares the engine's peak resident saved bytes; the byte counts must match exactly.
Targets on GPU: peak within 10%, step time within 15%. Writes JSON + a Markdown table to `--out`
(default docs/benchmarks/validate_plan.{json,md}). `bench_memory.py --validate-plan` calls `main`.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config.schema import MemoryConfig, ModelConfig
from brats_swap.memory.engine import MemoryEngine
from brats_swap.memory.planner import Planner, named_policies, profile_device
from brats_swap.memory.simulate import GIB
from brats_swap.model import build_model
from brats_swap.train.losses import weighted_dice_loss

REPO = Path(__file__).resolve().parents[1]
PEAK_TARGET, TIME_TARGET = 0.10, 0.15


def measure(model, cfg: MemoryConfig, x, y, device: torch.device, steps: int, dtype: torch.dtype) -> dict:
    """Run `steps` training steps under `cfg` after one warm-up; the engine's stats and device peaks."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine = MemoryEngine(model, cfg, device, measure=True)
    autocast = dtype != torch.float32 and device.type == "cuda"
    times = []
    try:
        for step in range(steps + 1):
            if step == 1 and device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            with engine.step(), torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = weighted_dice_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:
                times.append(time.perf_counter() - started)
        stats = engine.last_stats()
        row = {"step_s": statistics.median(times), "saved_bytes": stats.saved_bytes,
               "swapped_bytes": stats.swapped_out_bytes, "peak_resident_saved_bytes": stats.peak_resident_saved_bytes,
               "prefetch_misses": stats.prefetch_misses}
        row["peak_bytes"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                             else stats.peak_resident_saved_bytes)
        return row
    finally:
        engine.close()
        del optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def relative_error(predicted: float, measured: float) -> float | None:
    return None if not measured else (predicted - measured) / measured


def markdown(result: dict) -> str:
    gpu = result["device"].startswith("cuda")
    lines = [f"# Planner predictions vs measurements ({result['device_name']})", "",
             f"Command: `{result['command']}`", "",
             "Peak: " + ("`torch.cuda.max_memory_allocated` (target within 10%)" if gpu else
                         "the engine's peak resident saved bytes (CPU has no device counter; must match)")
             + ". Step time: median over the measured steps" + (" (target within 15%)." if gpu else "."), "",
             "| cube | batch | policy | predicted peak GiB | measured GiB | error | predicted step s | measured s "
             "| error | saved bytes equal | swapped bytes equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        def pct(value):
            return "-" if value is None else f"{value * 100:+.1f}%"
        lines.append(
            f"| {row['cube']} | {row['batch']} | {row['policy']} | {row['predicted_peak_bytes'] / GIB:.3f} | "
            f"{row['measured_peak_bytes'] / GIB:.3f} | {pct(row['peak_error'])} | {row['predicted_step_s']:.4f} | "
            f"{row['measured_step_s']:.4f} | {pct(row['step_error'])} | {row['saved_bytes_equal']} | "
            f"{row['swapped_bytes_equal']} |")
    within = [r for r in result["rows"] if r["peak_error"] is not None]
    if gpu and within:
        ok_peak = sum(abs(r["peak_error"]) <= PEAK_TARGET for r in within)
        ok_time = sum(r["step_error"] is not None and abs(r["step_error"]) <= TIME_TARGET for r in within)
        lines += ["", f"Within target: peak {ok_peak}/{len(within)}, step time {ok_time}/{len(within)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cubes", type=int, nargs="+", default=None, help="default: 128 192 (GPU), 32 (CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--base-filters", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-bytes", type=int, default=None, help="override swap.min_bytes of every policy")
    parser.add_argument("--budget", type=float, default=None, help="also validate the auto plan for this GiB")
    parser.add_argument("--policies", nargs="+", default=None, help="subset of policy names")
    parser.add_argument("--bandwidth", type=float, default=None, help="host<->device GB/s (default: measured)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cubes = args.cubes or ([128, 192] if device.type == "cuda" else [32])
    base = MemoryConfig()
    if args.min_bytes is not None:
        base.swap.min_bytes = args.min_bytes
    torch.manual_seed(0)
    model = build_model(ModelConfig(base_filters=args.base_filters)).to(device)
    # The time model is fitted on this device at the smallest cube (GPU: at least 96³ to fill it).
    profile_cube = min(cubes) if device.type == "cpu" else max(96, min(cubes))
    cost = profile_device(model, device, cube=profile_cube, batch=args.batch, dtype=dtype,
                          loss_fn=weighted_dice_loss)
    if args.bandwidth is not None:
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = args.bandwidth * 1e9
    rows = []
    for cube in cubes:
        shape = (args.batch, 4, cube, cube, cube)
        started = time.perf_counter()
        planner = Planner(model, shape, dtype=dtype, cost=cost, loss_fn=weighted_dice_loss)
        policies = named_policies(base)
        if args.budget is not None:
            best, _ = planner.auto(args.budget * GIB, base)
            if best is not None:
                policies["auto"] = best.policy
        if args.policies:
            policies = {k: v for k, v in policies.items() if k in args.policies}
        x = torch.randn(shape, device=device)
        y = (torch.rand(args.batch, 3, cube, cube, cube, device=device) > 0.8).float()
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
                "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": measured["peak_bytes"],
                "peak_error": relative_error(predicted_peak, measured["peak_bytes"]),
                "predicted_step_s": predicted_time.step_s, "measured_step_s": measured["step_s"],
                "step_error": relative_error(predicted_time.step_s, measured["step_s"]),
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
            print(f"{cube}³ {name:26s} peak {predicted_peak / GIB:.3f} vs {measured['peak_bytes'] / GIB:.3f} GiB, "
                  f"step {predicted_time.step_s:.4f} vs {measured['step_s']:.4f} s, "
                  f"saved equal {row['saved_bytes_equal']}, swapped equal {row['swapped_bytes_equal']}")
        print(f"{cube}³: planned and measured in {time.perf_counter() - started:.1f} s")
    result = {
        "command": " ".join(["scripts/validate_plan.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "cost_model": cost.as_dict(), "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "validate_plan.json", result)
    atomic_write_text(args.out / "validate_plan.md", markdown(result))
    print(f"wrote {args.out / 'validate_plan.md'}")
    return result


if __name__ == "__main__":
    main()
