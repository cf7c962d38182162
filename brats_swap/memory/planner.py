"""The planner: predict the device memory and step time of any memory policy, and auto-tune to a budget.

    trace (meta device, real size; one per recompute variant)
        ->  replay through the rulebook (`simulate.replay`: the engine's own schedule, on a clock)
        ->  peak bytes (liveness walk)  +  step seconds (compute stream and two copy queues)

`choose_policy` is what training calls for `memory.mode: auto`; `plan_report` is what `brats-swap plan`
prints. Both are reached through `brats_swap.train.planning`, which knows the project's model and
configs; this package plans any model, given its loss and the dtype its activations are saved in.

`Planner.auto` searches the policies the engine can run (the knobs of `MemoryConfig`) for the fastest
whose predicted peak fits `memory.budget.tensor_limit` (the budget less the device overhead, times
`BUDGET_HEADROOM`):

1. the named policies (`presets.py`);
2. recompute variants, each with its own trace, cheapest first (one whose compute alone cannot beat
   the best plan so far is skipped): none; `recompute.norm_act`; norm_act with the storages whose own
   rebuild costs most and whose copy out and back fits between save and use stored instead
   (`recompute.norm_act_exclude`, then swapped: swap and recompute mixed per tensor); checkpointing
   (`recompute.modules`) of the blocks that free the most bytes at the peak per second of
   recomputation (measured on the plain trace), in a few amounts sized to what the link cannot hide;
   and the same on top of norm_act (blocks ranked on norm_act's trace, sized to its own peak);
3. per variant, what to swap, decided per module by whether its copy can hide: on the timeline of
   keeping everything, a module's saved storages matter during the ops over the limit; its copy hides
   when the link (a FIFO queue of the copies chosen before it) finishes it before the first of those
   ops. Candidates are the modules that matter, the hiding ones first in forward order, then the others
   least late first; the shortest prefix that fits (bisection, with the leanest schedule) becomes
   `swap.include`, mixed with the variant's recomputation;
4. per swap set and reload distance (`swap.lookahead`), the largest in-flight budget that fits
   (`swap.max_inflight_bytes`: how much may be saved after a swapped storage before the compute waits
   for its copy) and, only when allowed, bf16 transport, priced by the replay;
5. the three fastest plans that reload ahead and wait for the link, with a longer reload distance in the
   middle of backward (`swap.mid_lookahead`, between the peaks at its two ends): the fastest plan that
   fits wins.

Nothing fits -> `ConfigError` naming `memory.budget_gib` and the floor.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from brats_swap.config import ConfigError, MemoryConfig, RecomputeConfig
from brats_swap.memory.arena import arena_bytes
from brats_swap.memory.budget import (
    BUDGET_HEADROOM,
    GIB,
    inflight_window_bytes,
    overhead_bytes,
    tensor_limit,
    with_inflight_window,
    with_overhead,
)
from brats_swap.memory.cost import OpCostModel, default_cost_model
from brats_swap.memory.device_profile import resolve_cost_model
from brats_swap.memory.prediction import PolicyPrediction
from brats_swap.memory.presets import named_policies, resolve_presets
from brats_swap.memory.recorder import TraceCompileError, trace_step
from brats_swap.memory.records import RECOMPUTE_MODES, SWAP_MODES, SavedRecord
from brats_swap.memory.rulebook import select_swapped, transfer_bytes
from brats_swap.memory.simulate import (
    MemoryResult,
    Schedule,
    TimeResult,
    floor_bytes,
    persistent_bytes,
    replay,
    simulate_memory,
)
from brats_swap.memory.swap_search import SwapSearch, mid_lookahead_plans, recompute_variants
from brats_swap.memory.trace_data import Trace

__all__ = ["GIB", "BUDGET_HEADROOM", "Planner", "PlanReport", "PolicyPrediction", "choose_policy", "plan_report",
           "resolve_cost_model"]




# --------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------


@dataclass
class PlanReport:
    input_shape: tuple[int, ...]
    dtype: str
    budget_gib: float | None
    floor_gib: float
    bandwidth_gbs: float
    cost_model: dict
    policies: list[PolicyPrediction] = field(default_factory=list)
    chosen: PolicyPrediction | None = None
    reason: str = ""
    plan_seconds: float = 0.0
    device_overhead_gib: float = 0.0  # in every peak and the floor (`memory.budget`)
    step: str = "eager"  # the step priced: "compiled" (train.compile) or "eager" (`Planner.priced_step`)
    eager_reason: str | None = None  # why a compiled step was asked for and the eager one priced
    step_reason: str = ""  # why that step was asked for (the caller's setting, e.g. "train.compile auto ...")

    @property
    def size(self) -> int:
        return int(self.input_shape[2])

    @property
    def batch(self) -> int:
        return int(self.input_shape[0])

    def baseline_step_s(self) -> float | None:
        for policy in self.policies:
            if policy.name == "none":
                return policy.step_s
        return None

    def as_dict(self) -> dict:
        chosen = None
        if self.chosen is not None:
            chosen = {**self.chosen.row(), "policy": memory_config_dict(self.chosen.policy)}
        return {
            "size": self.size,
            "batch": self.batch,
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "budget_gib": self.budget_gib,
            "floor_gib": round(self.floor_gib, 4),
            "device_overhead_gib": self.device_overhead_gib,
            "bandwidth_gbs": self.bandwidth_gbs,
            "cost_model": self.cost_model,
            "policies": [p.row() for p in self.policies],
            "chosen": chosen,
            "reason": self.reason,
            "plan_seconds": round(self.plan_seconds, 3),
            "step": self.step,
            "eager_reason": self.eager_reason,
            "step_reason": self.step_reason,
        }


def memory_config_dict(cfg: MemoryConfig) -> dict:
    return asdict(cfg)


# --------------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------------


class Planner:
    """Traces once per recompute variant, then prices any MemoryConfig in milliseconds.

    `loss_fn(output, target)` is the training loss (part of the traced step); a model with another
    calling convention passes `step(model, x) -> loss` instead (see `recorder.trace_step`). `dtype` is the
    dtype the activations are computed and saved in (float32, or bfloat16 / float16 under autocast).
    `prelude_bytes` are device bytes a step holds before its forward and frees when the forward starts (the
    batch's augmentation on the device: sampling grids, label channels, the batch as it arrived); they sit on
    top of the persistent bytes alone (the previous step's gradients are gone), so a peak is the larger of
    the step's own and theirs.
    `compiled` prices the step as `train.compile` runs it (the regions `CompiledRegions` compiles,
    docs/planner.md): each trace is taken with those regions compiled; if that compilation fails, or under
    autocast (bf16, fp16), every trace is eager and `eager_reason` says why (`priced_step` says which step the
    prices are for).
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int], *, loss_fn: Callable | None = None,
                 dtype: torch.dtype | str = torch.float32, cost: OpCostModel | None = None,
                 optimizer_state_factor: int = 2, step: Callable | None = None, prelude_bytes: int = 0,
                 autocast: str | None = None, compiled: bool = False):
        self.model = model
        self.compiled = compiled
        self.eager_reason: str | None = None
        self.prelude_bytes = int(prelude_bytes)
        self.input_shape = tuple(int(v) for v in input_shape)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.cost = cost or default_cost_model("cpu", self.dtype)
        # Under AMP, the autocast policy traced: the device type the costs are for unless told ("cuda", "cpu").
        self.autocast = autocast or self.cost.device_type
        self.loss_fn = loss_fn
        self.step = step
        self.optimizer_state_factor = optimizer_state_factor
        self.budget_gib: float | None = None  # set by plan_report; drawn in the timeline figure
        self._traces: dict[tuple, Trace] = {}
        self._durations: dict[tuple, list[float]] = {}
        self._schedules: dict[str, Schedule] = {}

    @functools.cached_property
    def presets(self) -> dict[str, dict]:
        """The named policies in this model's module names (`presets.resolve_presets`)."""
        return resolve_presets(self.model, self.input_shape, self.step)

    # ---- traces --------------------------------------------------------------------------------------
    @staticmethod
    def variant_key(cfg: MemoryConfig) -> tuple:
        """Policies that share a forward share a trace: the recompute part changes it, swapping does not."""
        if cfg.mode not in RECOMPUTE_MODES:
            return ((), False, ())
        recompute = cfg.recompute
        return (tuple(recompute.modules), bool(recompute.norm_act),
                tuple(recompute.norm_act_exclude) if recompute.norm_act else ())

    def trace(self, cfg: MemoryConfig | None = None) -> Trace:
        key = self.variant_key(cfg) if cfg is not None else ((), False, ())
        if key not in self._traces:
            recompute = None
            if key != ((), False, ()):
                recompute = RecomputeConfig(modules=list(key[0]), norm_act=key[1], norm_act_exclude=list(key[2]))
            self._traces[key] = self._trace_step(recompute)
        return self._traces[key]

    @property
    def priced_step(self) -> str:
        """"compiled" or "eager": the step the prices are for."""
        return "compiled" if self.compiled and self.eager_reason is None else "eager"

    def _trace_step(self, recompute: RecomputeConfig | None) -> Trace:
        """One trace, compiled while `priced_step` is compiled; the first compilation that fails makes every
        trace eager (those taken compiled before are dropped: one planner prices one kind of step)."""
        trace = functools.partial(trace_step, self.model, self.input_shape, dtype=self.dtype, loss_fn=self.loss_fn,
                                  recompute=recompute, step=self.step, autocast=self.autocast)
        if self.priced_step == "compiled" and self.dtype in (torch.bfloat16, torch.float16):
            # The trace emulates autocast with a torch function mode (`recorder._AutocastOps`), which dynamo
            # traces into and breaks at every op: that would not be the compiled step, so the eager one is priced.
            self.eager_reason = "autocast (train.amp) is not traced compiled"
        if self.priced_step == "compiled":
            try:
                return trace(compiled=True)
            except TraceCompileError as exc:
                self.eager_reason = str(exc)
                self._traces.clear()
                self._durations.clear()
                self._schedules.clear()
        return trace()

    def durations(self, cfg: MemoryConfig | None = None) -> list[float]:
        key = (self.variant_key(cfg) if cfg is not None else ((), False, ()), repr(self.cost))
        if key not in self._durations:
            self._durations[key] = self.cost.durations(self.trace(cfg))
        return self._durations[key]

    def records(self, cfg: MemoryConfig) -> list[SavedRecord]:
        """The records the engine will see under `cfg` (`MemoryEngine.last_records()` predicted)."""
        return self.trace(cfg).saved_records()

    def swapped(self, cfg: MemoryConfig) -> set[int]:
        """Indices of the records the engine swaps under `cfg` (`MemoryEngine.last_swapped()` predicted)."""
        return select_swapped(self.records(cfg), cfg.swap) if cfg.mode in SWAP_MODES else set()

    def arena_bytes(self, cfg: MemoryConfig) -> int:
        """Host bytes of the arena that holds one step's swapped storages under `cfg` (their size on the
        link, `rulebook.transfer_bytes`, rounded as the arena hands out slices); 0 when nothing swaps."""
        swapped = self.swapped(cfg)
        return arena_bytes(transfer_bytes(record, cfg.swap) for record in self.records(cfg) if record.index in swapped)

    # ---- pricing -------------------------------------------------------------------------------------
    def schedule(self, cfg: MemoryConfig, keep_lanes: bool = False) -> Schedule:
        """The rulebook's replay of `cfg` on this planner's clock (cached per policy)."""
        key = self._replay_key(cfg)
        if keep_lanes or key not in self._schedules:
            schedule = replay(self.trace(cfg), cfg, cost=self.cost, durations=self.durations(cfg),
                              keep_lanes=keep_lanes)
            if keep_lanes:
                return schedule
            self._schedules[key] = schedule
        return self._schedules[key]

    def _replay_key(self, cfg: MemoryConfig) -> str:
        """What a replay depends on: the trace, the mode, the swap knobs and the clock. Rule 7's window is
        keyed as the rulebook resolves it (`budget.inflight_window_bytes`: unset, it comes from the budget),
        and a window larger than every byte the step saves releases nothing early, so all such windows share
        one replay: on a small step the search's in-flight budgets (64 MiB to 16 GiB) are then one replay,
        not seven."""
        window = min(inflight_window_bytes(cfg), self.trace(cfg).saved_bytes + 1)
        return repr((self.variant_key(cfg), cfg.mode, replace(cfg.swap, max_inflight_bytes=window), self.cost))

    def memory(self, cfg: MemoryConfig, keep_timeline: bool = False) -> MemoryResult:
        result = simulate_memory(self.trace(cfg), schedule=self.schedule(cfg), keep_timeline=keep_timeline,
                                 optimizer_state_factor=self.optimizer_state_factor)
        before_forward = result.persistent_bytes + self.prelude_bytes
        if before_forward > result.peak_bytes:  # the augmentation's moment is the step's peak
            result = dataclasses.replace(result, peak_bytes=before_forward, peak_op=0)
        return result

    def time(self, cfg: MemoryConfig, keep_lanes: bool = False) -> TimeResult:
        return self.schedule(cfg, keep_lanes).timing

    def recompute_flops(self, cfg: MemoryConfig) -> float:
        """FLOPs run again in backward (checkpointed modules re-run; norm_act recipes)."""
        trace = self.trace(cfg)
        if "recompute_flops" not in trace.cache:
            trace.cache["recompute_flops"] = float(sum(op.flops for op in trace.ops if op.recompute))
        return trace.cache["recompute_flops"]

    def predict(self, name: str, cfg: MemoryConfig, budget_bytes: float | None = None) -> PolicyPrediction:
        mem = self.memory(cfg)
        timing = self.time(cfg)
        return PolicyPrediction(  # the peak on the card: the step's tensors and the device overhead
            name=name, policy=cfg, peak_bytes=mem.peak_bytes + overhead_bytes(cfg), saved_bytes=mem.saved_bytes,
            swapped_bytes=mem.swapped_bytes, recompute_flops=self.recompute_flops(cfg),
            peak_resident_saved_bytes=mem.peak_resident_saved_bytes, step_s=timing.step_s,
            exposed_transfer_s=timing.exposed_transfer_s, prefetch_misses=timing.prefetch_misses,
            fits=budget_bytes is None or mem.peak_bytes <= tensor_limit(budget_bytes, cfg),
        )

    def floor_bytes(self) -> int:
        floor = floor_bytes(self.trace(), optimizer_state_factor=self.optimizer_state_factor)
        return max(floor, persistent_bytes(self.trace(), self.optimizer_state_factor) + self.prelude_bytes)

    # ---- search --------------------------------------------------------------------------------------
    def auto(self, budget_bytes: float, base: MemoryConfig | None = None,
             allow_compress: bool | None = None) -> tuple[PolicyPrediction | None, list[PolicyPrediction]]:
        """The fastest policy whose predicted tensors fit `budget.tensor_limit` (None if none),
        and every fitting policy priced on the way (module docstring). Recompute variants are tried
        cheapest first; one whose compute alone is no faster than the best plan so far is skipped."""
        base = copy.deepcopy(base or MemoryConfig())
        if base.swap.max_inflight_bytes is None:  # unset: the window of the card planned for (memory.budget)
            base.swap.max_inflight_bytes = inflight_window_bytes(replace(base, budget_gib=budget_bytes / GIB))
        if allow_compress is None:
            allow_compress = base.swap.compress == "bf16"
        limit = tensor_limit(budget_bytes, base)
        fitting = [p for p in (self.predict(name, cfg, budget_bytes) for name, cfg in named_policies(base, self.presets).items())
                   if p.fits]
        for variant, compute_s in sorted(recompute_variants(self, base, limit), key=lambda item: item[1]):
            if compute_s >= min((p.step_s for p in fitting), default=float("inf")):
                continue
            fitting += SwapSearch(self, variant, limit, allow_compress).plans(budget_bytes)
        fitting += mid_lookahead_plans(self, fitting, budget_bytes)
        if not fitting:
            return None, []
        best = copy.copy(min(fitting, key=lambda p: (p.step_s, p.peak_bytes)))
        best.name = "auto"
        return best, fitting


# --------------------------------------------------------------------------------------------------------
# Public entries
# --------------------------------------------------------------------------------------------------------


def plan_report(model: nn.Module, memory_cfg: MemoryConfig, input_shape: Sequence[int], *, loss_fn: Callable,
                dtype: torch.dtype | str = torch.float32, cost: OpCostModel | None = None,
                optimizer_state_factor: int = 2, prelude_bytes: int = 0,
                compiled: bool = False) -> tuple[PlanReport, Planner]:
    """Price every named policy over `memory_cfg` and, with `memory_cfg.budget_gib`, auto-tune; never
    raises when nothing fits. Peaks and the floor include `memory_cfg`'s device overhead; `prelude_bytes`
    and `compiled` as `Planner` takes them."""
    started = time.perf_counter()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    planner = Planner(model, input_shape, dtype=dtype, cost=cost, loss_fn=loss_fn,
                      optimizer_state_factor=optimizer_state_factor, prelude_bytes=prelude_bytes, compiled=compiled)
    budget_gib = memory_cfg.budget_gib
    planner.budget_gib = budget_gib
    budget_bytes = budget_gib * GIB if budget_gib is not None else None
    report = PlanReport(
        input_shape=planner.input_shape, dtype=str(dtype).split(".")[-1], budget_gib=budget_gib,
        floor_gib=(planner.floor_bytes() + overhead_bytes(memory_cfg)) / GIB,
        bandwidth_gbs=planner.cost.link_gbs(), cost_model=planner.cost.as_dict(),
        device_overhead_gib=float(memory_cfg.device_overhead_gib or 0.0),
    )
    for name, cfg in named_policies(memory_cfg, planner.presets).items():
        report.policies.append(planner.predict(name, cfg, budget_bytes))
    if budget_bytes is not None:
        best, _ = planner.auto(budget_bytes, memory_cfg)
        if best is not None:
            report.policies.append(best)
            report.chosen = best
            report.reason = (f"fastest of the priced policies whose tensors fit {BUDGET_HEADROOM:.0%} of "
                             f"{budget_gib:g} GiB less the {report.device_overhead_gib:g} GiB device overhead")
        else:
            report.reason = (f"no policy fits memory.budget_gib={budget_gib:g}: the floor is "
                             f"{report.floor_gib:.2f} GiB and the best plan needs "
                             f"{min(p.peak_bytes for p in report.policies) / GIB:.2f} GiB")
    else:
        report.chosen = min(report.policies, key=lambda p: p.peak_bytes)
        report.reason = "no budget given: the policy with the lowest predicted peak"
    report.step, report.eager_reason = planner.priced_step, planner.eager_reason
    report.plan_seconds = time.perf_counter() - started
    return report, planner


def choose_policy(model: nn.Module, memory_cfg: MemoryConfig, input_shape: Sequence[int],
                  dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                  *, loss_fn: Callable, cost: OpCostModel | None = None, optimizer_state_factor: int = 2,
                  prelude_bytes: int = 0, compiled: bool = False) -> tuple[MemoryConfig, PlanReport]:
    """`memory.mode: auto`: the fastest concrete policy predicted to fit `memory.budget_gib`.

    `memory_cfg` is a validated memory section with a budget (the config loader requires one for mode
    auto). Returns the MemoryConfig to hand to the engine (mode none/swap/recompute/hybrid, knobs filled,
    the budget, bandwidth and device overhead (default: `device`'s) carried over from `memory_cfg`) and the
    report to save with the run. `compiled`: the step runs under `train.compile` (priced compiled, `Planner`).
    Raises ConfigError naming `memory.budget_gib` and the floor when nothing fits.
    """
    memory_cfg = with_inflight_window(with_overhead(memory_cfg, device), device)
    if memory_cfg.budget_gib is None:
        raise ValueError("choose_policy needs memory_cfg.budget_gib (a validated config with mode auto has one)")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if cost is None:
        cost = resolve_cost_model(model, device, dtype, loss_fn=loss_fn, bandwidth_gbs=memory_cfg.bandwidth_gbs)
    report, _ = plan_report(model, memory_cfg, input_shape, dtype=dtype, cost=cost, loss_fn=loss_fn,
                            optimizer_state_factor=optimizer_state_factor, prelude_bytes=prelude_bytes,
                            compiled=compiled)
    if report.chosen is None:
        raise ConfigError(report.reason)
    return copy.deepcopy(report.chosen.policy), report
