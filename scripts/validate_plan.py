"""Planner predictions versus the engine's measurements, policy by policy.

    .venv/bin/python scripts/validate_plan.py                      # GPU: 128³ and 192³, batch 1
    .venv/bin/python scripts/validate_plan.py --device cpu --emulate-gbs 1 \\
        --json docs/benchmarks/validate_plan_cpu.json               # CPU through the emulated link (minutes)

For each cube and policy (none, the presets of `brats_swap.memory.presets`, and the auto plan for
`--budget` GiB): the planner's predicted peak and step time, then the same measured with the engine
(the step time of `--steps` steps after a warm-up step, each with an Adam step, as training runs).

- GPU: peak = `torch.cuda.max_memory_allocated`; the time model is profiled on the card (ops and the
  pinned link). Policies run one after the other. Targets: peak within 10%, step time relative to no
  policy within 15%.
- CPU: there is no device-memory counter, so the peak compared is the engine's peak resident saved bytes.
  With `--emulate-gbs G` the engine copies through `memory.swap.emulate_gbs` (a copy thread per
  direction at G GB/s, so copies really overlap the compute) and the planner prices that link: its
  bandwidth, asynchronous copies, and the compute time the copy threads take from the step
  (`calibrate_interference`, measured here). Targets: step time relative to no policy within 15%, peak
  within 5% and never
  above the prediction (the largest of the steps counts). Without it the copies are synchronous and the
  byte counts match exactly. `--delays` delays every copy by a random time (`memory.swap.copy_delay_s`):
  where storages are released does not depend on copy timing, so the peaks must not move.
  `--inflight-mib` sets `swap.max_inflight_bytes` of every policy (default on the CPU: 8 MiB, sized
  to these small cubes; on a GPU the config's default, a share of the budget or the card).
  A shared CPU's speed drifts with other processes' load, so the policies run interleaved (one step of
  each per round, each on its own copy of the model) and the planner's profile (`profile_device`) is
  taken once per round too. Other processes only ever slow a step down, so on the CPU the measured step
  is the fastest of the policy's steps and the prices use the fastest round's profile (the JSON keeps
  every step time and every round's profile). What the planner decides with is a policy's step relative
  to no policy's, and that is the step-time target: measured, the median over the rounds of the policy's
  step over none's step of the same round (on a GPU, the ratio of the medians), so a machine whose speed
  drifts between the profile and the steps moves both alike. The absolute step time is reported
  beside it. Torch runs one compute thread unless
  `--threads` says otherwise: a second OpenMP thread that loses its core to another process stalls
  every parallel region, which no time model can price.
  The default `--budget` on CPU lies half way between the planner's floor and none's predicted peak,
  so `auto` has to act.

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
import os
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
from brats_swap.memory import cuda_device
from brats_swap.memory.budget import with_inflight_window
from brats_swap.memory.cost import OpCostModel, default_cost_model
from brats_swap.memory.device_profile import profile_device
from brats_swap.memory.engine import MemoryEngine
from brats_swap.memory.link import EmulatedLink
from brats_swap.memory.planner import Planner
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


class PolicyRun:
    """One model training under one policy (a MemoryConfig or `SAVE_ON_CPU`), step by step, with Adam.

    `hooks_for_none=False` runs mode none without hooks (a fair GPU baseline; no stats). The first step
    warms up (allocator, cuDNN algorithms, the arena, the learned backward order) and is not timed.
    """

    def __init__(self, model, policy: MemoryConfig | str, x, y, device: torch.device, dtype: torch.dtype,
                 *, hooks_for_none: bool = True, arena_bytes: int = 0, host_arena=None):
        self.model, self.policy, self.x, self.y, self.device, self.dtype = model, policy, x, y, device, dtype
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.engine = None
        if isinstance(policy, MemoryConfig) and (policy.mode != "none" or hooks_for_none):
            self.engine = MemoryEngine(model, policy, device, measure=True, arena_bytes=arena_bytes,
                                       host_arena=host_arena)
        self.times: list[float] = []
        self.resident_peaks: list[int] = []  # the engine's peak resident saved bytes of each timed step
        self.steps = 0

    def step(self) -> None:
        cuda = self.device.type == "cuda"
        if self.steps == 1 and cuda:  # the peak of the steps after the warm-up
            torch.cuda.synchronize(self.device)
            cuda_device.reset_peak(self.device)
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32 and cuda)
        started = time.perf_counter()
        with _step_context(self.engine, self.policy, self.device), autocast:
            loss = weighted_dice_loss(self.model(self.x).float(), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(self.device)
        if self.steps:
            self.times.append(time.perf_counter() - started)
            if self.engine is not None:
                self.resident_peaks.append(self.engine.last_stats().peak_resident_saved_bytes)
        self.steps += 1

    def result(self) -> dict:
        """Step time (CUDA: the median; CPU: the fastest step) and the peak of the timed steps:
        `torch.cuda.max_memory_allocated` (and `max_memory_reserved`) on CUDA, else the engine's peak
        resident saved bytes, the largest over the steps (release points do not depend on copy timing, so
        every step should give the same); the engine's statistics of the last step."""
        # A shared CPU's other processes only ever slow a step down: there the fastest step is the
        # measurement (as `timeit` advises), the median on a GPU.
        step_s = statistics.median(self.times) if self.device.type == "cuda" else min(self.times)
        row = {"step_s": step_s, "step_times_s": [round(t, 4) for t in self.times]}
        if self.engine is not None:
            stats = self.engine.last_stats()
            row.update(saved_bytes=stats.saved_bytes, swapped_bytes=stats.swapped_out_bytes,
                       peak_resident_saved_bytes=max(self.resident_peaks),
                       peak_resident_max_bytes=max(self.resident_peaks),
                       prefetch_misses=stats.prefetch_misses, late_reloads=stats.late_reloads,
                       arena_bytes=stats.arena_bytes)
        if self.device.type == "cuda":
            row["peak_bytes"] = cuda_device.peak_allocated_bytes(self.device)
            row["peak_reserved_bytes"] = cuda_device.peak_reserved_bytes(self.device)
        elif self.engine is not None:
            row["peak_bytes"] = row["peak_resident_saved_bytes"]
        return row

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.optimizer = self.engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def measure(model, policy: MemoryConfig | str, x, y, device: torch.device, steps: int, dtype: torch.dtype,
            *, hooks_for_none: bool = True, arena_bytes: int = 0, host_arena=None) -> dict:
    """`steps` training steps under `policy` after one warm-up, one after the other (`PolicyRun.result`);
    `arena_bytes` (the plan's) or a lent `host_arena` keeps the first timed step from re-pinning."""
    run = PolicyRun(model, policy, x, y, device, dtype, hooks_for_none=hooks_for_none, arena_bytes=arena_bytes,
                    host_arena=host_arena)
    try:
        for _ in range(steps + 1):
            run.step()
        return run.result()
    finally:
        run.close()


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
    if result.get("copy_delay_s"):
        link += f", random copy delays up to {result['copy_delay_s'] * 1e3:g} ms"
    lines = [f"# Planner predictions vs measurements ({result['device_name']}{link})", "",
             f"Command: `{result['command']}`", "",
             "Peak: " + ("`torch.cuda.max_memory_allocated`" if gpu else
                         "the engine's peak resident saved bytes, the largest over the steps")
             + f" (target within {peak_target:.0%}). Step time: "
             + ("median" if gpu else "fastest (the CPU is shared; the profile's fastest round prices it)")
             + " of the measured steps. Step / none: the step relative to no policy's"
             + ("" if gpu else ", measured as the median over rounds of the two steps of the same round")
             + f" (target within {time_target:.0%}).", "",
             "| cube | batch | policy | predicted peak MiB | measured MiB | error | predicted step s | measured s "
             "| error | predicted step / none | measured | error | swapped bytes equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def pct(value):
        return "-" if value is None else f"{value * 100:+.1f}%"

    def ratio(value):
        return "-" if value is None else f"{value:.3f}"

    for row in result["rows"]:
        lines.append(
            f"| {row['cube']} | {row['batch']} | {row['policy']} | {row['predicted_peak_bytes'] / 2**20:.1f} | "
            f"{row['measured_peak_bytes'] / 2**20:.1f} | {pct(row['peak_error'])} | {row['predicted_step_s']:.4f} | "
            f"{row['measured_step_s']:.4f} | {pct(row['step_error'])} | {ratio(row.get('predicted_step_ratio'))} | "
            f"{ratio(row.get('measured_step_ratio'))} | {pct(row.get('step_ratio_error'))} | "
            f"{row['swapped_bytes_equal']} |")
    rows = result["rows"]
    ok_peak = sum(r["peak_error"] is not None and abs(r["peak_error"]) <= peak_target for r in rows)
    ok_time = sum(r.get("step_ratio_error") is not None and abs(r["step_ratio_error"]) <= time_target for r in rows)
    ok_absolute = sum(r["step_error"] is not None and abs(r["step_error"]) <= time_target for r in rows)
    bound = sum(bool(r.get("peak_within_bound")) for r in rows)
    lines += ["", f"Within target: peak {ok_peak}/{len(rows)}, step relative to none {ok_time}/{len(rows)}; "
                  f"measured peak at most the predicted one: {bound}/{len(rows)}. Absolute step time within "
                  f"{time_target:.0%}: {ok_absolute}/{len(rows)}."]
    if result.get("load_average") and not gpu:
        load = result["load_average"]
        lines += ["", f"Load average of this machine (1 min) at the start and end of the run: "
                      f"{load['start'][0]:.1f} and {load['end'][0]:.1f} on {os.cpu_count()} cores."]
    if result.get("interference"):
        item = result["interference"]
        lines += ["", f"Copy-thread interference measured here: a conv3d loop took {item['alone_s']:.3f} s alone "
                      f"and {item['with_copies_s']:.3f} s while the link moved {item['copied_bytes'] / 1e6:.0f} MB "
                      f"({item['seconds_per_byte'] * 1e9:.2f} s per GB copied, priced by the planner)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cubes", type=int, nargs="+", default=None, help="default: 128 192 (GPU), 48 64 (CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--base-filters", type=int, default=None, help="default: 16 (GPU), 4 (CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per policy (default: 3 GPU, 9 CPU)")
    parser.add_argument("--min-bytes", type=int, default=None, help="override swap.min_bytes of every policy")
    parser.add_argument("--budget", type=float, default=None,
                        help="GiB for the auto plan (default on CPU: half of none's predicted peak)")
    parser.add_argument("--policies", nargs="+", default=None, help="subset of policy names (auto included)")
    parser.add_argument("--bandwidth", type=float, default=None, help="host<->device GB/s (default: measured)")
    parser.add_argument("--emulate-gbs", type=float, default=None,
                        help="CPU: copy through an emulated link of this GB/s (memory.swap.emulate_gbs)")
    parser.add_argument("--delays", type=float, nargs="?", const=0.005, default=None,
                        help="delay every copy by a random 0..S seconds (default S: 0.005)")
    parser.add_argument("--inflight-mib", type=float, default=None,
                        help="swap.max_inflight_bytes of every policy in MiB (default: 8 on CPU, the config's on GPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on CPU: 1, leaving a core to the copy threads)")
    parser.add_argument("--json", type=Path, default=None, help="result file (a .md table is written next to it)")
    parser.add_argument("--out", type=Path, default=None, help="folder for validate_plan.{json,md} (instead of --json)")
    args = parser.parse_args(argv)
    if args.emulate_gbs is not None and args.device != "cpu":
        parser.error("--emulate-gbs emulates the link on the CPU; use it with --device cpu")
    return args


def cpu_rates() -> OpCostModel:
    """The CPU roofline's two rates measured on this machine's torch threads: a conv3d's FLOP/s (FLOPs
    counted as the tracer counts them, 2 per multiply-add) and an elementwise op's bytes/s. The planner's
    constants assume a fixed ratio between them; when it is off, the per-phase scale that
    `profile_device` fits over a conv-dominated step misprices the memory-bound operators that norm_act
    replays in backward."""
    conv = torch.nn.Conv3d(8, 8, 3, padding=1, bias=False)
    x = torch.randn(1, 8, 32, 32, 32)
    a, b = torch.randn(4 << 20), torch.randn(4 << 20)
    out = torch.empty_like(a)
    with torch.no_grad():
        conv_s = min(_timed(lambda: conv(x)) for _ in range(5))
        add_s = min(_timed(lambda: torch.add(a, b, out=out)) for _ in range(5))
    cost = default_cost_model("cpu")
    cost.flops_per_s = 2 * x.numel() * conv.weight[0].numel() / conv_s
    cost.bytes_per_s = 3 * a.numel() * a.element_size() / add_s
    return cost


def profile(model, device: torch.device, cube: int, batch: int, dtype: torch.dtype, steps: int,
            base: OpCostModel | None = None) -> OpCostModel:
    """The planner's profile of `model` on `device` (GPU: at least 96³, to fill the card), over the
    roofline rates of `base` when given."""
    profile_cube = cube if device.type == "cpu" else max(96, cube)
    return profile_device(model, device, cube=profile_cube, batch=batch, dtype=dtype, loss_fn=weighted_dice_loss,
                          steps=steps, base=base)


def price_link(cost: OpCostModel, args) -> dict | None:
    """Give the time model this run's link: the emulated one (bandwidth, asynchronous copies, the compute
    its copy threads take: `calibrate_interference`) or `--bandwidth`. Returns the calibration."""
    interference = None
    if args.emulate_gbs is not None:
        interference = calibrate_interference(args.emulate_gbs)
        cost.sync_copies = False
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = args.emulate_gbs * 1e9
        cost.copy_interference_s_per_byte = interference["seconds_per_byte"]
        cost.name += f", emulated link {args.emulate_gbs:g} GB/s"
    if args.bandwidth is not None:
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = args.bandwidth * 1e9
    return interference


def policies_for(planner: Planner, base: MemoryConfig, budget_gib: float | None, names,
                 default_budget: bool = False) -> dict[str, MemoryConfig]:
    """none, every preset, and the auto plan for `budget_gib` (with `default_budget` and no budget: half
    way between the planner's floor and none's predicted peak, so auto has to act), restricted to `names`."""
    policies = named_policies(base)
    want_auto = not names or "auto" in names
    if want_auto and budget_gib is None and default_budget:
        budget_gib = (planner.floor_bytes() + planner.memory(policies["none"]).peak_bytes) / 2 / GIB
    if want_auto and budget_gib is not None:
        best, _ = planner.auto(budget_gib * GIB, base)
        if best is not None:
            policies["auto"] = best.policy
    if names:
        policies = {k: v for k, v in policies.items() if k in names}
    return policies


def measure_interleaved(model, policies: dict, x, y, args, dtype: torch.dtype, cost: OpCostModel,
                        arenas: dict[str, int]) -> tuple[dict, list]:
    """CPU: every policy on its own copy of `model`, one step each per round (the first a warm-up), and the
    planner's profile once per round, so that a machine whose load drifts (other processes on a shared
    CPU) shifts the profile and every policy alike. Returns the results and the profiled scales."""
    device = torch.device("cpu")
    runs = {name: PolicyRun(copy.deepcopy(model), cfg, x, y, device, dtype, arena_bytes=arenas[name])
            for name, cfg in policies.items()}
    rates = copy.deepcopy(cost)
    rates.fwd_scale = rates.bwd_scale = 1.0  # the profile fits the scales over the bare roofline
    scales = []
    try:
        for _ in range(args.steps + 1):
            fitted = profile(model, device, x.shape[2], args.batch, dtype, steps=1, base=rates)
            scales.append((fitted.fwd_scale, fitted.bwd_scale))
            for run in runs.values():
                run.step()
        return {name: run.result() for name, run in runs.items()}, scales
    finally:
        for run in runs.values():
            run.close()


def validate_cube(model, cube: int, args, device, dtype, cost: OpCostModel, base: MemoryConfig) -> tuple[list, dict]:
    """Rows for one cube, and the cost model that priced them (with the profile's scales per round)."""
    shape = (args.batch, 4, cube, cube, cube)
    planner = Planner(model, shape, dtype=dtype, cost=cost, loss_fn=weighted_dice_loss)
    x = torch.randn(shape, device=device)
    y = (torch.rand(args.batch, 3, cube, cube, cube, device=device) > 0.8).float()
    policies = policies_for(planner, base, args.budget, args.policies, default_budget=device.type == "cpu")
    arenas = {name: planner.arena_bytes(cfg) for name, cfg in policies.items()}  # pinned once, from the plan
    scales = []
    if device.type == "cpu":
        measured, scales = measure_interleaved(model, policies, x, y, args, dtype, cost, arenas)
        cost = copy.deepcopy(cost)
        cost.fwd_scale = min(s[0] for s in scales)  # the least disturbed profile, as for the steps
        cost.bwd_scale = min(s[1] for s in scales)
        planner = Planner(model, shape, dtype=dtype, cost=cost, loss_fn=weighted_dice_loss)
    else:
        measured = {}
        for name, cfg in policies.items():
            try:
                measured[name] = measure(model, cfg, x, y, device, args.steps, dtype, arena_bytes=arenas[name])
            except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError exists from torch 2.5 only
                print(f"{cube}³ {name}: out of memory", file=sys.stderr)
    rows = [compare(planner, cfg, name, cube, args.batch, measured[name], device)
            for name, cfg in policies.items() if name in measured]
    add_step_ratios(rows, interleaved=device.type == "cpu")
    return rows, {**cost.as_dict(), "profile_scales_per_round": scales}


def add_step_ratios(rows: list[dict], interleaved: bool) -> None:
    """Each row's step relative to the `none` row of the same cube, predicted and measured, and the
    error between them (module docstring). `interleaved` (CPU): the steps of round i of every policy ran
    together, so the measured ratio is the median over rounds of step_i / none's step_i; otherwise the
    ratio of the measured steps."""
    none = next((row for row in rows if row["policy"] == "none"), None)
    for row in rows:
        if none is None:
            row.update(predicted_step_ratio=None, measured_step_ratio=None, step_ratio_error=None)
            continue
        predicted = row["predicted_step_s"] / none["predicted_step_s"]
        if interleaved:
            pairs = zip(row["measured_step_times_s"], none["measured_step_times_s"], strict=True)
            measured = statistics.median(step / base for step, base in pairs)
        else:
            measured = row["measured_step_s"] / none["measured_step_s"]
        row.update(predicted_step_ratio=predicted, measured_step_ratio=measured,
                   step_ratio_error=relative_error(predicted, measured))


def compare(planner: Planner, cfg: MemoryConfig, name: str, cube: int, batch: int, measured: dict,
            device: torch.device) -> dict:
    """One row: the planner's prediction of `cfg` next to the measurement."""
    predicted_memory, predicted_time = planner.memory(cfg), planner.time(cfg)
    predicted_peak = (predicted_memory.peak_bytes if device.type == "cuda"
                      else predicted_memory.peak_resident_saved_bytes)
    row = {
        "cube": cube, "batch": batch, "policy": name,
        "predicted_step_s": predicted_time.step_s, "measured_step_s": measured["step_s"],
        "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": measured["peak_bytes"],
        "peak_error": relative_error(predicted_peak, measured["peak_bytes"]),
        "peak_within_bound": measured["peak_bytes"] <= predicted_peak,
        "measured_peak_reserved_bytes": measured.get("peak_reserved_bytes"),
        "step_error": relative_error(predicted_time.step_s, measured["step_s"]),
        "measured_step_times_s": measured["step_times_s"],
        "measured_peak_max_bytes": measured.get("peak_resident_max_bytes"),
        "predicted_saved_bytes": predicted_memory.saved_bytes, "measured_saved_bytes": measured["saved_bytes"],
        "saved_bytes_equal": predicted_memory.saved_bytes == measured["saved_bytes"],
        "swapped_bytes_equal": predicted_memory.swapped_bytes == measured["swapped_bytes"],
        "resident_bytes_equal": predicted_memory.peak_resident_saved_bytes == measured["peak_resident_saved_bytes"],
        "predicted_exposed_transfer_s": predicted_time.exposed_transfer_s,
        "measured_prefetch_misses": measured["prefetch_misses"],
        "policy_config": {"mode": cfg.mode, "swap": vars(cfg.swap), "recompute": vars(cfg.recompute)},
    }
    print(f"{cube}³ {name:26s} peak {predicted_peak / 2**20:.1f} vs {measured['peak_bytes'] / 2**20:.1f} MiB, "
          f"step {predicted_time.step_s:.4f} vs {measured['step_s']:.4f} s", flush=True)
    return row


@contextlib.contextmanager
def torch_threads(count: int | None):
    """Run with `count` torch CPU threads (None: unchanged), then restore the previous count (callers
    such as the tests share the process)."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # One compute thread by default on the CPU: on a shared 2-core machine a second OpenMP thread that
    # loses its core to another process stalls every parallel region, which no cost model can price.
    threads = args.threads or (1 if args.device == "cpu" else None)
    with torch_threads(threads):
        return run(args, argv if argv is not None else sys.argv[1:])


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    """Validate every cube (see the module docstring); `argv` is recorded as the command."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cubes = args.cubes or ([128, 192] if device.type == "cuda" else [48, 64])
    args.steps = args.steps or (3 if device.type == "cuda" else 9)
    base_filters = args.base_filters or (16 if device.type == "cuda" else 4)
    base = MemoryConfig()
    if args.min_bytes is not None:
        base.swap.min_bytes = args.min_bytes
    base.swap.emulate_gbs = args.emulate_gbs
    if args.delays is not None:
        base.swap.copy_delay_s = args.delays
    inflight_mib = args.inflight_mib if args.inflight_mib is not None else (8 if device.type == "cpu" else None)
    if inflight_mib is not None:
        base.swap.max_inflight_bytes = int(inflight_mib * 2**20)
    base = with_inflight_window(base, device)  # the planner prices the window the engine runs on this card
    torch.manual_seed(0)
    model = build_model(ModelConfig(base_filters=base_filters)).to(device)
    rates = cpu_rates() if device.type == "cpu" else None
    cost = profile(model, device, min(cubes), args.batch, dtype, steps=args.steps, base=rates)
    interference = price_link(cost, args)
    started, load_before = time.perf_counter(), os.getloadavg()
    rows, cost_models = [], {}
    for cube in cubes:
        cube_rows, cost_models[cube] = validate_cube(model, cube, args, device, dtype, cost, base)
        rows += cube_rows
    result = {
        "command": " ".join(["scripts/validate_plan.py", *argv]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "base_filters": base_filters,
        "threads": torch.get_num_threads(), "emulate_gbs": args.emulate_gbs, "interference": interference,
        "copy_delay_s": args.delays, "max_inflight_bytes": base.swap.max_inflight_bytes,
        "cost_models": cost_models, "seconds": round(time.perf_counter() - started, 1),
        # Other processes' load (1, 5, 15 minute averages) when the run started and ended: on a shared
        # CPU it is what the step times vary with.
        "load_average": {"start": load_before, "end": os.getloadavg()},
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
