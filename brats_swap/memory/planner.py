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
3. per variant, what to swap, decided per module by whether its copy can hide: on the timeline of
   keeping everything, a module's saved storages matter during the ops over the limit; its copy hides
   when the link (a FIFO queue of the copies chosen before it) finishes it before the first of those
   ops. Candidates are the modules that matter, the hiding ones first in forward order, then the others
   least late first; the shortest prefix that fits (bisection, with the leanest schedule) becomes
   `swap.include`, mixed with the variant's recomputation;
4. per swap set and reload distance (`swap.lookahead`), the largest in-flight budget that fits
   (`swap.max_inflight_bytes`: how much may be saved after a swapped storage before the compute waits
   for its copy) and, only when allowed, bf16 transport, priced by the replay: the fastest plan that
   fits wins.

Nothing fits -> `ConfigError` naming `memory.budget_gib` and the floor.
"""

from __future__ import annotations

import copy
import functools
import glob
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import accumulate

import numpy as np
import torch
from torch import nn

from brats_swap.config import ConfigError, MemoryConfig, RecomputeConfig
from brats_swap.memory.budget import BUDGET_HEADROOM, overhead_bytes, tensor_limit, with_overhead
from brats_swap.memory.policy import RECOMPUTE_MODES, SWAP_MODES, SavedRecord
from brats_swap.memory.presets import named_policies, resolve_presets
from brats_swap.memory.rulebook import select_swapped, transfer_bytes
from brats_swap.memory.simulate import (
    GIB,
    MemoryResult,
    OpCostModel,
    Schedule,
    TimeResult,
    floor_bytes,
    phase_compute_seconds,
    replay,
    simulate_memory,
)
from brats_swap.memory.trace import (
    MODULE_END,
    MODULE_START,
    SAVE,
    UNPACK_BEGIN,
    UNPACK_END,
    Trace,
    trace_step,
)

# Pinned host<->device copies over PCIe 5 x16 measure about 50-55 GB/s per direction (PCIe 4 x16: about
# 22-25 GB/s); `--bandwidth` / `memory.bandwidth_gbs` set another link, a CUDA profile measures it.
DEFAULT_BANDWIDTH_GBS = 50.0
LOOKAHEADS = (0, 1, 2, 4, 8, 16, 32)
INFLIGHT_BUDGETS = tuple(mib << 20 for mib in (64, 256, 1024, 2048, 4096, 8192, 16384))
LEANEST_INFLIGHT = INFLIGHT_BUDGETS[0]
# Checkpointing amounts tried, as shares of the bytes the link cannot hide before the peak.
CHECKPOINT_SHARES = (0.6, 1.0, 1.4)

# Roofline constants when nothing was measured. CPU: this project's CI machine at 32³-48³ (about 60
# GFLOP/s per step for the U-Net). GPU: an H200-class card in fp32 (TF32 convolutions) and in half
# precision (bf16 and fp16 run on the same tensor cores at the same rate), on a PCIe 5 x16 link.
_GPU_LINK = f"PCIe 5 link {DEFAULT_BANDWIDTH_GBS:g} GB/s"
DEFAULT_COSTS = {
    "cpu": OpCostModel(name="cpu (assumed)", flops_per_s=60e9, bytes_per_s=20e9, launch_s=20e-6,
                       h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9, sync_copies=True, host_lead_kernels=0),
    "gpu-float32": OpCostModel(name=f"H200-class GPU, fp32/TF32, {_GPU_LINK} (assumed)", flops_per_s=60e12,
                               bytes_per_s=3.0e12, launch_s=6e-6, h2d_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9,
                               d2h_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9),
    "gpu-half": OpCostModel(name=f"H200-class GPU, bf16/fp16, {_GPU_LINK} (assumed)", flops_per_s=150e12,
                            bytes_per_s=3.0e12, launch_s=6e-6, h2d_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9,
                            d2h_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9),
}
HALF_DTYPES = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------


@dataclass
class PolicyPrediction:
    name: str
    policy: MemoryConfig
    peak_bytes: int
    saved_bytes: int
    swapped_bytes: int
    recompute_flops: float
    peak_resident_saved_bytes: int
    step_s: float
    exposed_transfer_s: float
    prefetch_misses: int
    fits: bool

    def row(self) -> dict:
        return {
            "name": self.name,
            "predicted_peak_gib": round(self.peak_bytes / GIB, 4),
            "swapped_gib": round(self.swapped_bytes / GIB, 4),
            "recompute_gflop": round(self.recompute_flops / 1e9, 3),
            "predicted_step_s": round(float(self.step_s), 5),
            "prefetch_misses": self.prefetch_misses,
            "fits": self.fits,
        }


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
        }


def memory_config_dict(cfg: MemoryConfig) -> dict:
    return asdict(cfg)


# --------------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------------


class Planner:
    """Traces once per recompute variant, then prices any MemoryConfig in milliseconds.

    `loss_fn(output, target)` is the training loss (part of the traced step); a model with another
    calling convention passes `step(model, x) -> loss` instead (see `trace.trace_step`). `dtype` is the
    dtype the activations are computed and saved in (float32, or bfloat16 / float16 under autocast).
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int], *, loss_fn: Callable | None = None,
                 dtype: torch.dtype | str = torch.float32, cost: OpCostModel | None = None,
                 optimizer_state_factor: int = 2, step: Callable | None = None):
        self.model = model
        self.input_shape = tuple(int(v) for v in input_shape)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.cost = cost or default_cost_model("cpu", self.dtype)
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
            self._traces[key] = trace_step(self.model, self.input_shape, dtype=self.dtype, loss_fn=self.loss_fn,
                                           recompute=recompute, step=self.step)
        return self._traces[key]

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

    # ---- pricing -------------------------------------------------------------------------------------
    def schedule(self, cfg: MemoryConfig, keep_lanes: bool = False) -> Schedule:
        """The rulebook's replay of `cfg` on this planner's clock (cached per policy)."""
        key = repr((self.variant_key(cfg), cfg.mode, cfg.swap, self.cost))
        if keep_lanes or key not in self._schedules:
            schedule = replay(self.trace(cfg), cfg, cost=self.cost, durations=self.durations(cfg),
                              keep_lanes=keep_lanes)
            if keep_lanes:
                return schedule
            self._schedules[key] = schedule
        return self._schedules[key]

    def memory(self, cfg: MemoryConfig, keep_timeline: bool = False) -> MemoryResult:
        return simulate_memory(self.trace(cfg), schedule=self.schedule(cfg), keep_timeline=keep_timeline,
                               optimizer_state_factor=self.optimizer_state_factor)

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
        return floor_bytes(self.trace(), optimizer_state_factor=self.optimizer_state_factor)

    # ---- search --------------------------------------------------------------------------------------
    def auto(self, budget_bytes: float, base: MemoryConfig | None = None,
             allow_compress: bool | None = None) -> tuple[PolicyPrediction | None, list[PolicyPrediction]]:
        """The fastest policy whose predicted tensors fit `budget.tensor_limit` (None if none),
        and every fitting policy priced on the way (module docstring). Recompute variants are tried
        cheapest first; one whose compute alone is no faster than the best plan so far is skipped."""
        base = copy.deepcopy(base or MemoryConfig())
        if allow_compress is None:
            allow_compress = base.swap.compress == "bf16"
        limit = tensor_limit(budget_bytes, base)
        fitting = [p for p in (self.predict(name, cfg, budget_bytes) for name, cfg in named_policies(base, self.presets).items())
                   if p.fits]
        for variant, compute_s in sorted(self._variants(base, limit), key=lambda item: item[1]):
            if compute_s >= min((p.step_s for p in fitting), default=float("inf")):
                continue
            fitting += _SwapSearch(self, variant, limit, allow_compress).plans(budget_bytes)
        if not fitting:
            return None, []
        best = copy.copy(min(fitting, key=lambda p: (p.step_s, p.peak_bytes)))
        best.name = "auto"
        return best, fitting

    def _variants(self, base: MemoryConfig, limit: float) -> list[tuple[MemoryConfig, float]]:
        """The recompute variants `auto` tries, each with its compute seconds (estimated for the ones not
        traced yet): none; norm_act; norm_act with the storages whose own rebuild costs most stored and
        swapped instead, where their copies can hide; checkpointing of the cheapest blocks in amounts
        sized to the bytes the link cannot hide before the peak (module docstring)."""
        plain = _variant(base, RecomputeConfig())
        norm_act = _variant(base, RecomputeConfig(norm_act=True))
        variants = [(plain, sum(self.durations(plain))), (norm_act, sum(self.durations(norm_act)))]
        stored = _stored_rebuilds(self, norm_act)
        if stored:
            names, saved_s = stored
            variants.append((_variant(base, RecomputeConfig(norm_act=True, norm_act_exclude=names)),
                             variants[1][1] - saved_s))
        keep_all = self.memory(plain, keep_timeline=True)
        deficit = keep_all.peak_bytes - limit
        if deficit <= 0:
            return variants
        starts = list(accumulate(self.durations(plain), initial=0.0))
        hideable = self.cost.d2h_bytes_per_s * starts[keep_all.peak_op]  # what the link moves before the peak

        def with_stall(compute_s: float, excess: float) -> float:
            """A lower bound of the step: the bytes over the limit that even a busy link cannot move out
            before the peak stall the compute."""
            return compute_s + max(0.0, excess - hideable) / self.cost.d2h_bytes_per_s

        variants[0] = (plain, with_stall(variants[0][1], deficit))
        needed = max(deficit - hideable, deficit * 0.25)
        ranking = checkpoint_ranking(self.trace(plain), self.durations(plain),
                                     resident_records(self.trace(plain), self.schedule(plain), keep_all.peak_op))
        chosen: dict[tuple[str, ...], float] = {}
        for share in CHECKPOINT_SHARES:
            names, freed, seconds = [], 0, 0.0
            for name, block_s, nbytes in ranking:
                if freed >= share * needed:
                    break
                names.append(name)
                freed, seconds = freed + nbytes, seconds + block_s
            if names:
                chosen[tuple(names)] = with_stall(starts[-1] + seconds, deficit - freed)
        variants += [(_variant(base, RecomputeConfig(modules=list(names))), compute_s)
                     for names, compute_s in chosen.items()]
        return variants


def _stored_rebuilds(planner: Planner, norm_act: MemoryConfig) -> tuple[list[str], float] | None:
    """Modules whose norm_act storage costs a rebuild of its own (not shared with another storage of the
    same stored input, see `swap.RecentRebuilds`) and whose copy out and back fits comfortably between
    its save and its use: storing and swapping them saves their rebuild. Returns (escaped module names,
    rebuild seconds saved), most expensive first while the copies take at most half the forward."""
    trace, durations = planner.trace(norm_act), planner.durations(norm_act)
    cum = list(accumulate(durations, initial=0.0))
    cost: dict[int, float] = {}
    pack_op, first_use, open_unpacks = {}, {}, []
    for op, kind, a, _ in trace.events:
        if kind == SAVE:
            pack_op[a] = op
        elif kind == UNPACK_BEGIN:
            first_use.setdefault(a, op)
            open_unpacks.append((a, op))
        elif kind == UNPACK_END and open_unpacks and open_unpacks[-1][0] == a:
            _, start = open_unpacks.pop()
            cost[a] = cost.get(a, 0.0) + cum[op] - cum[start]
    groups: dict[tuple[int, ...], list[int]] = {}
    for traced in trace.records:
        if traced.record.recompute:
            groups.setdefault(tuple(traced.deps), []).append(traced.record.index)
    candidates = [index for members in groups.values() if min(cost.get(i, 0.0) for i in members) > 0
                  for index in members]
    link_budget = 0.5 * cum[trace.fwd_end]
    names, saved = [], 0.0
    def gap(index: int) -> float:  # seconds between the save and the first use
        return cum[first_use.get(index, trace.n_ops)] - cum[pack_op[index]]

    for index in sorted(candidates, key=lambda i: (-cost[i], -gap(i))):
        record = trace.records[index].record
        round_trip = 2 * transfer_bytes(record, norm_act.swap) / planner.cost.d2h_bytes_per_s
        if round_trip > link_budget or gap(index) < 2 * round_trip:
            continue
        link_budget -= round_trip
        names.append(glob.escape(record.module))
        saved += cost[index]
    return (names, saved) if names else None


def _variant(base: MemoryConfig, recompute: RecomputeConfig) -> MemoryConfig:
    """`base` with this recomputation and nothing swapped (mode none or recompute)."""
    cfg = copy.deepcopy(base)
    cfg.recompute = recompute
    cfg.mode = "recompute" if recompute.modules or recompute.norm_act else "none"
    cfg.budget_gib, cfg.bandwidth_gbs = base.budget_gib, base.bandwidth_gbs
    return cfg


def checkpoint_ranking(trace: Trace, durations: list[float], at_peak: set[int]) -> list[tuple[str, float, int]]:
    """Blocks by recompute seconds per byte freed at the peak, cheapest first: (name, seconds, bytes).

    Checkpointing a block stores only its inputs; what it frees are the storages saved inside it that
    were also allocated inside it (the storages saved for its own backward), and what counts of those
    are the ones resident at the peak (`at_peak`, record indices). The cost is its forward, run again
    in backward. Both are summed over every call of the block.
    """
    pack_op = {a: op for op, kind, a, _ in trace.events if kind == SAVE}
    stack: list[tuple[str, int]] = []
    seconds: dict[str, float] = {}
    freed: dict[str, int] = {}
    cum = list(accumulate(durations, initial=0.0))
    for op, kind, a, b in trace.events:
        if kind == MODULE_START and b:
            stack.append((trace.module_names[a], op))
        elif kind == MODULE_END and b and stack:
            name, start = stack.pop()
            seconds[name] = seconds.get(name, 0.0) + cum[op] - cum[start]
            prefix = name + "."
            inside = [r for r in trace.records if not r.record.is_param and r.sid >= 0
                      and r.record.index in at_peak and start <= pack_op[r.record.index] <= op
                      and trace.storages[r.sid].alloc_op >= start
                      and (r.record.module == name or r.record.module.startswith(prefix))]
            freed[name] = freed.get(name, 0) + sum(r.record.nbytes for r in inside)
    ranked = [(name, seconds[name], freed[name]) for name in seconds if freed[name] > 0]
    return sorted(ranked, key=lambda item: item[1] / item[2])


def resident_records(trace: Trace, schedule: Schedule, op: int) -> set[int]:
    """Records whose storage occupies the device at `op` in this replay (the program or the engine
    holds it)."""
    out = set()
    for traced in trace.records:
        if traced.sid < 0:
            continue
        storage = trace.storages[traced.sid]
        index = traced.record.index
        end = max(storage.free_op if storage.free_op >= 0 else trace.n_ops,
                  schedule.hold_end.get(index, 0), schedule.use_end.get(index, 0))
        if storage.alloc_op <= op < end:
            out.add(index)
    return out


@dataclass
class _Unit:
    """The saved storages of one module that the engine may swap, as one swap candidate."""

    module: str
    nbytes: int = 0
    seconds: float = 0.0  # link time of its copy out
    pack_op: int = 1 << 62
    free_op: int = -1  # the program itself drops the storages here; before it, swapping frees nothing
    first_use: int = -1


class _SwapSearch:
    """What to swap on top of one recompute variant, and how (module docstring, steps 3 and 4)."""

    def __init__(self, planner: Planner, variant: MemoryConfig, limit: float, allow_compress: bool):
        self.planner = planner
        self.variant = variant
        self.limit = limit
        self.allow_compress = allow_compress

    def plans(self, budget_bytes: float) -> list[PolicyPrediction]:
        planner = self.planner
        keep_all = planner.memory(self.variant, keep_timeline=True)
        if keep_all.peak_bytes <= self.limit:
            return [planner.predict("auto", self.variant, budget_bytes)]
        order = self._candidates(keep_all)
        if not order or not self._fits(len(order), LEANEST_INFLIGHT, 0):
            return []
        low, high = 1, len(order)  # the shortest prefix that fits with the leanest schedule
        while low < high:
            mid = (low + high) // 2
            if self._fits(mid, LEANEST_INFLIGHT, 0):
                high = mid
            else:
                low = mid + 1
        self.order = order
        out = []
        for count in sorted({low, min(len(order), low + max(1, low // 4))}):
            for compress in ("none", "bf16") if self.allow_compress else ("none",):
                for lookahead in LOOKAHEADS:
                    # A larger in-flight budget waits less and holds more: the largest that fits is the pick.
                    for inflight in reversed(INFLIGHT_BUDGETS):
                        prediction = planner.predict("auto", self._config(count, inflight, lookahead, compress),
                                                     budget_bytes)
                        if prediction.fits:
                            out.append(prediction)
                            break
        return out

    def _candidates(self, keep_all: MemoryResult) -> list[_Unit]:
        """Modules whose storages are resident during an op over the limit: those whose copy hides before
        the first such op (link as a FIFO of the ones chosen before) in forward order, then the rest,
        least late first."""
        planner, trace = self.planner, self.planner.trace(self.variant)
        starts = list(accumulate(planner.durations(self.variant), initial=0.0))
        over = np.flatnonzero(np.asarray(keep_all.timeline) + keep_all.persistent_bytes > self.limit)
        hiding, late, link_free = [], [], 0.0
        for unit in sorted(self._units(trace), key=lambda u: u.pack_op):
            k = int(np.searchsorted(over, max(unit.pack_op, unit.free_op)))
            if k == len(over) or over[k] >= unit.first_use:
                continue  # not resident while memory is over the limit: swapping it gains nothing
            finish = max(link_free, starts[unit.pack_op]) + unit.seconds
            needed = starts[int(over[k])]
            if finish <= needed:
                hiding.append(unit)
                link_free = finish
            else:
                late.append((finish - needed, unit.pack_op, unit))
        self.order = hiding + [unit for *_, unit in sorted(late, key=lambda item: item[:2])]
        return self.order

    def _units(self, trace: Trace) -> list[_Unit]:
        swap_cfg = copy.deepcopy(self.variant.swap)
        swap_cfg.tensors = -1
        eligible = select_swapped(trace.saved_records(), swap_cfg)
        pack_op, first_use = {}, {}
        for op, kind, a, _ in trace.events:
            if kind == SAVE:
                pack_op[a] = op
            elif kind == UNPACK_BEGIN:
                first_use.setdefault(a, op)
        units: dict[str, _Unit] = {}
        for index in eligible:
            record = trace.records[index].record
            unit = units.setdefault(record.module, _Unit(record.module))
            unit.nbytes += record.nbytes
            unit.seconds += transfer_bytes(record, swap_cfg) / self.planner.cost.d2h_bytes_per_s
            unit.pack_op = min(unit.pack_op, pack_op[index])
            free = trace.storages[trace.records[index].sid].free_op
            unit.free_op = max(unit.free_op, free if free >= 0 else trace.n_ops)
            unit.first_use = max(unit.first_use, first_use.get(index, trace.n_ops))
        return list(units.values())

    def _config(self, count: int, inflight: int, lookahead: int, compress: str = "none") -> MemoryConfig:
        cfg = copy.deepcopy(self.variant)
        recomputes = bool(cfg.recompute.modules or cfg.recompute.norm_act)
        cfg.mode = "hybrid" if recomputes else "swap"
        cfg.swap.include = [glob.escape(unit.module) for unit in self.order[:count]]
        cfg.swap.tensors = -1
        cfg.swap.max_inflight_bytes = inflight
        cfg.swap.lookahead = lookahead
        cfg.swap.compress = compress
        return cfg

    def _fits(self, count: int, inflight: int, lookahead: int) -> bool:
        return self.planner.memory(self._config(count, inflight, lookahead)).peak_bytes <= self.limit


# --------------------------------------------------------------------------------------------------------
# Cost models: measured profile, saved profile, defaults
# --------------------------------------------------------------------------------------------------------


def default_cost_model(device: str | torch.device, dtype: torch.dtype = torch.float32) -> OpCostModel:
    """Unmeasured constants: "cpu" for a CPU device, H200-class GPU constants otherwise."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    if kind == "cpu":
        return copy.deepcopy(DEFAULT_COSTS["cpu"])
    return copy.deepcopy(DEFAULT_COSTS["gpu-half" if dtype in HALF_DTYPES else "gpu-float32"])


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of pinned copies on CUDA.

    One unmeasured copy first (it pays for the lazy setup of the pinned path), then `repeats` copies of a
    256 MiB buffer timed with events on `device`'s stream: large enough to reach the link's sustained rate.
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)  # the copies run on `device`'s stream, not the current device's
        start.record(stream)
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
        torch.cuda.synchronize(device)
        rates.append(nbytes * repeats / (start.elapsed_time(end) / 1e3))
    return rates[0], rates[1]


def profile_device(model: nn.Module, device: torch.device, *, loss_fn: Callable, cube: int | None = None,
                   batch: int = 1, dtype: torch.dtype = torch.float32, steps: int = 3,
                   base: OpCostModel | None = None) -> OpCostModel:
    """Time forward and backward of `model` on `device` at a small cube and fit the roofline's per-phase
    scale so the trace of the same cube predicts the measured times (then scaled by FLOPs and bytes).
    `base` gives the roofline's rates (e.g. measured compute and memory rates of this CPU) instead of
    the defaults of `default_cost_model`."""
    device = torch.device(device)
    cost = copy.deepcopy(base) if base is not None else default_cost_model(device.type, dtype)
    cube = cube or (96 if device.type == "cuda" else 32)
    in_channels = next(m for m in model.modules() if isinstance(m, nn.Conv3d)).in_channels
    shape = (batch, in_channels, cube, cube, cube)
    trace = trace_step(model, shape, dtype=dtype, loss_fn=loss_fn)
    raw_fwd, raw_bwd = phase_compute_seconds(trace, cost)

    work = copy.deepcopy(model).to(device).train()
    x = torch.randn(shape, device=device)
    fwd_times, bwd_times = [], []
    autocast = device.type == "cuda" and dtype in HALF_DTYPES
    for step in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            probs = work(x)
            loss = loss_fn(probs, torch.rand_like(probs))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mid = time.perf_counter()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        work.zero_grad(set_to_none=True)
        if step:  # the first step warms caches and picks cuDNN algorithms
            fwd_times.append(mid - start)
            bwd_times.append(end - mid)
    fwd_times.sort()
    bwd_times.sort()
    cost.fwd_scale = fwd_times[len(fwd_times) // 2] / max(raw_fwd, 1e-12)
    cost.bwd_scale = bwd_times[len(bwd_times) // 2] / max(raw_bwd, 1e-12)
    cost.name = f"measured on {device} at {cube}³ batch {batch}"
    if device.type == "cuda":
        cost.h2d_bytes_per_s, cost.d2h_bytes_per_s = measure_bandwidth(device)
    return cost


def resolve_cost_model(model: nn.Module, device: torch.device | str, dtype: torch.dtype, *, loss_fn: Callable,
                       profile: dict | None = None, bandwidth_gbs: float | None = None) -> OpCostModel:
    """The time model for `device`: a saved profile, else a short measurement on a CUDA device, else
    constants ("cpu"; "gpu" or any other device: an assumed H200-class card on a 50 GB/s PCIe 5 link).
    `bandwidth_gbs`, when given, replaces the link rate (measured, saved or assumed), and the model's
    name says so."""
    kind = str(device)
    if profile is not None:
        cost = OpCostModel.from_dict(profile)
    elif kind.startswith("cuda"):
        cost = profile_device(model, torch.device(kind), loss_fn=loss_fn, dtype=dtype)
    else:
        cost = default_cost_model(kind, dtype)
    if bandwidth_gbs is not None:
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = float(bandwidth_gbs) * 1e9
        cost.name = cost.name.replace(f", {_GPU_LINK} (assumed)", " (assumed)")
        cost.name += f"; link {float(bandwidth_gbs):g} GB/s (given)"
    return cost


# --------------------------------------------------------------------------------------------------------
# Public entries
# --------------------------------------------------------------------------------------------------------


def plan_report(model: nn.Module, memory_cfg: MemoryConfig, input_shape: Sequence[int], *, loss_fn: Callable,
                dtype: torch.dtype | str = torch.float32, cost: OpCostModel | None = None,
                optimizer_state_factor: int = 2) -> tuple[PlanReport, Planner]:
    """Price every named policy over `memory_cfg` and, with `memory_cfg.budget_gib`, auto-tune; never
    raises when nothing fits. Peaks and the floor include `memory_cfg`'s device overhead."""
    started = time.perf_counter()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    planner = Planner(model, input_shape, dtype=dtype, cost=cost, loss_fn=loss_fn,
                      optimizer_state_factor=optimizer_state_factor)
    budget_gib = memory_cfg.budget_gib
    planner.budget_gib = budget_gib
    budget_bytes = budget_gib * GIB if budget_gib is not None else None
    report = PlanReport(
        input_shape=planner.input_shape, dtype=str(dtype).split(".")[-1], budget_gib=budget_gib,
        floor_gib=(planner.floor_bytes() + overhead_bytes(memory_cfg)) / GIB,
        bandwidth_gbs=planner.cost.h2d_bytes_per_s / 1e9, cost_model=planner.cost.as_dict(),
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
    report.plan_seconds = time.perf_counter() - started
    return report, planner


def choose_policy(model: nn.Module, memory_cfg: MemoryConfig, input_shape: Sequence[int],
                  dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                  *, loss_fn: Callable, cost: OpCostModel | None = None, optimizer_state_factor: int = 2,
                  ) -> tuple[MemoryConfig, PlanReport]:
    """`memory.mode: auto`: the fastest concrete policy predicted to fit `memory.budget_gib`.

    `memory_cfg` is a validated memory section with a budget (the config loader requires one for mode
    auto). Returns the MemoryConfig to hand to the engine (mode none/swap/recompute/hybrid, knobs filled,
    the budget, bandwidth and device overhead (default: `device`'s) carried over from `memory_cfg`) and the
    report to save with the run. Raises ConfigError naming `memory.budget_gib` and the floor when nothing fits.
    """
    memory_cfg = with_overhead(memory_cfg, device)
    if memory_cfg.budget_gib is None:
        raise ValueError("choose_policy needs memory_cfg.budget_gib (a validated config with mode auto has one)")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if cost is None:
        cost = resolve_cost_model(model, device, dtype, loss_fn=loss_fn, bandwidth_gbs=memory_cfg.bandwidth_gbs)
    report, _ = plan_report(model, memory_cfg, input_shape, dtype=dtype, cost=cost, loss_fn=loss_fn,
                            optimizer_state_factor=optimizer_state_factor)
    if report.chosen is None:
        raise ConfigError(report.reason)
    return copy.deepcopy(report.chosen.policy), report
