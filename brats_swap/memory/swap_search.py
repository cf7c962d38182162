"""The planner's search (`Planner.auto`, steps 2-4 of `planner.py`'s docstring): which recompute
variants to try, and what to swap on top of each.

Everything here prices through the planner (its traces, the simulator's replay and the cost model,
`cost.OpCostModel`): link seconds come from `OpCostModel.copy_seconds`, liveness from
`simulate.resident_records`.
"""

from __future__ import annotations

import copy
import glob
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, product
from typing import Protocol

import numpy as np

from brats_swap.config import MemoryConfig, RecomputeConfig
from brats_swap.memory.cost import D2H, OpCostModel
from brats_swap.memory.events import EventKind
from brats_swap.memory.prediction import PolicyPrediction
from brats_swap.memory.rulebook import select_swapped, transfer_bytes
from brats_swap.memory.simulate import MemoryResult, Schedule, rebuilt_at, resident_records
from brats_swap.memory.trace_data import Trace


class Planner(Protocol):
    """What the search asks of the planner (`planner.Planner`, which searches with this module): a step
    traced per recompute variant, replayed and priced under any policy."""

    cost: OpCostModel

    def trace(self, cfg: MemoryConfig | None = None) -> Trace: ...

    def durations(self, cfg: MemoryConfig | None = None) -> list[float]: ...

    def schedule(self, cfg: MemoryConfig, keep_lanes: bool = False) -> Schedule: ...

    def memory(self, cfg: MemoryConfig, keep_timeline: bool = False) -> MemoryResult: ...

    def predict(self, name: str, cfg: MemoryConfig, budget_bytes: float | None = None) -> PolicyPrediction: ...

LOOKAHEADS = (0, 1, 2, 4, 8, 16, 32)
# Step 5: reload distances for the middle of backward, how many markers its start keeps the plan's own
# distance, and how many of the last markers (the high-resolution end) do.
MID_LOOKAHEADS = (4, 8, 16)
MID_FROM_MARKERS = (1, 4)
MID_LAST_MARKERS = (4, 7, 10)
INFLIGHT_BUDGETS = tuple(mib << 20 for mib in (64, 256, 1024, 2048, 4096, 8192, 16384))
LEANEST_INFLIGHT = INFLIGHT_BUDGETS[0]
# Checkpointing amounts tried, as shares of the bytes the link cannot hide before the peak.
CHECKPOINT_SHARES = (0.6, 1.0, 1.4)
# The same with norm_act on top: norm_act frees the norm/act outputs almost for free, checkpointing the
# cheapest blocks frees the convolution outputs the link cannot move before the peak; larger amounts,
# since each block frees less once its norm/act outputs are rebuilt anyway.
NORM_ACT_CHECKPOINT_SHARES = (1.0, 1.5, 2.0, 3.0)


def save_and_first_use(trace: Trace) -> tuple[dict[int, int], dict[int, int]]:
    """(record -> op of its first save, record -> op of its first unpack), cached on the trace."""
    cached = trace.cache.get("save_and_first_use")
    if cached is None:
        pack_op, first_use = {}, {}
        for event in trace.events:
            if event.kind is EventKind.SAVE:
                pack_op[event.arg] = event.op
            elif event.kind is EventKind.UNPACK_BEGIN:
                first_use.setdefault(event.arg, event.op)
        cached = trace.cache["save_and_first_use"] = (pack_op, first_use)
    return cached


def recompute_variants(planner: Planner, base: MemoryConfig, limit: float) -> list[tuple[MemoryConfig, float]]:
    """The recompute variants `auto` tries, each with its compute seconds (estimated for the ones not
    traced yet): none; norm_act; norm_act with the storages whose own rebuild costs most stored and
    swapped instead, where their copies can hide; checkpointing of the cheapest blocks in amounts
    sized to the bytes the link cannot hide before the peak, alone and on top of norm_act; norm_act
    storing the outputs whose rebuilds hold the peak when everything else swaps (module docstring)."""
    plain = variant_of(base, RecomputeConfig())
    norm_act = variant_of(base, RecomputeConfig(norm_act=True))
    variants = [(plain, sum(planner.durations(plain))), (norm_act, sum(planner.durations(norm_act)))]
    stored = _stored_rebuilds(planner, norm_act)
    if stored:
        names, saved_s = stored
        variants.append((variant_of(base, RecomputeConfig(norm_act=True, norm_act_exclude=names)),
                         variants[1][1] - saved_s))
    rebuilt = _rebuilds_at_peak(planner, base, limit)
    if rebuilt:  # its compute lies between plain's and norm_act's: plain's is the lower bound
        variants.append((variant_of(base, RecomputeConfig(norm_act=True, norm_act_exclude=rebuilt)), variants[0][1]))
    keep_all = planner.memory(plain, keep_timeline=True)
    deficit = keep_all.peak_bytes - limit
    if deficit <= 0:
        return variants
    starts = list(accumulate(planner.durations(plain), initial=0.0))
    hideable = planner.cost.bytes_moved(starts[keep_all.peak_op])  # what the link moves before the peak

    def with_stall(compute_s: float, excess: float) -> float:
        """A lower bound of the step: the bytes over the limit that even a busy link cannot move out
        before the peak stall the compute."""
        late = max(0.0, excess - hideable)
        return compute_s + planner.cost.copy_seconds(late, late, D2H)

    variants[0] = (plain, with_stall(variants[0][1], deficit))
    chosen = _checkpoint_amounts(planner, plain, limit, CHECKPOINT_SHARES, with_stall)
    variants += [(variant_of(base, RecomputeConfig(modules=names)), compute_s) for names, compute_s in chosen]
    # norm_act frees the norm/act outputs almost for free; on top, the cheapest blocks of its own trace
    # (each frees its convolution outputs) in amounts sized to what the link cannot move before its peak.
    chosen = _checkpoint_amounts(planner, norm_act, limit, NORM_ACT_CHECKPOINT_SHARES,
                                 lambda compute_s, excess: compute_s)
    variants += [(variant_of(base, RecomputeConfig(modules=names, norm_act=True)), compute_s)
                 for names, compute_s in chosen]
    return variants


def _checkpoint_amounts(planner: Planner, variant: MemoryConfig, limit: float, shares: tuple[float, ...],
                        estimate: Callable[[float, float], float]) -> list[tuple[list[str], float]]:
    """Checkpointing on top of `variant`: per share of the bytes the link cannot move out before
    `variant`'s peak (at least a quarter of its excess over `limit`), the cheapest blocks of its trace
    (`checkpoint_ranking`) that free that share, with `estimate(compute seconds, bytes still over)`."""
    keep_all = planner.memory(variant, keep_timeline=True)
    deficit = keep_all.peak_bytes - limit
    if deficit <= 0:
        return []
    trace, durations = planner.trace(variant), planner.durations(variant)
    starts = list(accumulate(durations, initial=0.0))
    hideable = planner.cost.bytes_moved(starts[keep_all.peak_op])
    needed = max(deficit - hideable, deficit * 0.25)
    # What checkpointing can free at the peak are the storages backward has not reached yet: a block whose
    # backward holds the peak would be rebuilt right there, beside what it was meant to free.
    _, first_use = save_and_first_use(trace)
    waiting = {index for index in resident_records(trace, planner.schedule(variant), keep_all.peak_op)
               if first_use.get(index, trace.n_ops) > keep_all.peak_op}
    ranking = checkpoint_ranking(trace, durations, waiting)
    chosen: dict[tuple[str, ...], float] = {}
    for share in shares:
        names, freed, seconds = [], 0, 0.0
        for name, block_s, nbytes in ranking:
            if freed >= share * needed:
                break
            names.append(name)
            freed, seconds = freed + nbytes, seconds + block_s
        if names:
            chosen.setdefault(tuple(names), estimate(starts[-1] + seconds, deficit - freed))
    return [(list(names), compute_s) for names, compute_s in chosen.items()]


def _stored_rebuilds(planner: Planner, norm_act: MemoryConfig) -> tuple[list[str], float] | None:
    """Modules whose norm_act storage costs a rebuild of its own (not shared with another storage of the
    same stored input, see `frontend.RecentRebuilds`) and whose copy out and back fits comfortably between
    its save and its use: storing and swapping them saves their rebuild. Returns (escaped module names,
    rebuild seconds saved), most expensive first while the copies take at most half the forward."""
    trace, durations = planner.trace(norm_act), planner.durations(norm_act)
    cum = list(accumulate(durations, initial=0.0))
    cost: dict[int, float] = {}
    pack_op, first_use = save_and_first_use(trace)
    for index, start, end in unpack_spans(trace):
        cost[index] = cost.get(index, 0.0) + cum[end] - cum[start]
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
        round_trip = planner.cost.round_trip_seconds(transfer_bytes(record, norm_act.swap), record.nbytes)
        if round_trip > link_budget or gap(index) < 2 * round_trip:
            continue
        link_budget -= round_trip
        names.append(glob.escape(record.module))
        saved += cost[index]
    return (names, saved) if names else None


def unpack_spans(trace: Trace) -> list[tuple[int, int, int]]:
    """(record, first op, last op) of every unpack of a stored record, rebuilds included."""
    spans, open_unpacks = [], []
    for event in trace.events:
        if event.kind is EventKind.UNPACK_BEGIN:
            open_unpacks.append((event.arg, event.op))
        elif event.kind is EventKind.UNPACK_END and open_unpacks and open_unpacks[-1][0] == event.arg:
            _, start = open_unpacks.pop()
            spans.append((event.arg, start, event.op))
    return spans


def _rebuilds_at_peak(planner: Planner, base: MemoryConfig, limit: float, rounds: int = 3) -> list[str] | None:
    """Modules whose norm_act rebuilds hold the peak when everything else that can swap is swapped.

    A rebuild in the last blocks of backward (the high-resolution stage) occupies a full-size storage
    beside that stage's reloads and gradients; storing the output instead (and swapping it) leaves
    only its reload there. Found from the peak of swapping every candidate with the leanest schedule,
    a few rounds (excluding one rebuild may expose the next). None: no such module."""
    excluded: list[str] = []
    for _ in range(rounds):
        variant = variant_of(base, RecomputeConfig(norm_act=True, norm_act_exclude=excluded))
        search = SwapSearch(planner, variant, limit, allow_compress=False)
        keep_all = planner.memory(variant, keep_timeline=True)
        order = search._candidates(keep_all) if keep_all.peak_bytes > limit else []
        if not order:
            break
        swap_all = search._config(len(order), LEANEST_INFLIGHT, 0)
        result = planner.memory(swap_all)
        if result.peak_bytes <= limit:
            break
        trace = planner.trace(swap_all)
        ops = rebuilt_at(trace, planner.schedule(swap_all), result.peak_op)
        found = {glob.escape(trace.records[index].record.module) for index, start, end in unpack_spans(trace)
                 if any(start <= op <= end for op in ops)} - set(excluded)
        if not found:
            break
        excluded = sorted({*excluded, *found})
    return excluded or None


def mid_lookahead_plans(planner: Planner, fitting: list[PolicyPrediction], budget_bytes: float,
                        top: int = 3) -> list[PolicyPrediction]:
    """Step 5: the `top` fastest plans that reload ahead (`swap.lookahead >= 1`) and wait for the link,
    each with a longer reload distance in the middle of backward (`swap.mid_lookahead`, rulebook rule 9):
    the peaks sit at the start of backward and at its high-resolution end, and in between the reloads
    can go further ahead. The ones that fit."""
    waiting = sorted((p for p in fitting if p.swapped_bytes and p.policy.swap.lookahead >= 1
                      and p.exposed_transfer_s > 0), key=lambda p: p.step_s)[:top]
    out = []
    for plan in waiting:
        markers = [event.arg for event in planner.trace(plan.policy).events if event.kind is EventKind.MARKER]
        lasts = sorted({min(count, len(markers)) for count in MID_LAST_MARKERS})
        for last, first, distance in product(lasts, MID_FROM_MARKERS, MID_LOOKAHEADS):
            if distance <= plan.policy.swap.lookahead or first + last >= len(markers):
                continue
            cfg = copy.deepcopy(plan.policy)
            cfg.swap.mid_lookahead, cfg.swap.mid_from_marker = distance, first
            cfg.swap.mid_until_block = markers[-last]
            prediction = planner.predict("auto", cfg, budget_bytes)
            if prediction.fits:
                out.append(prediction)
    return out


def variant_of(base: MemoryConfig, recompute: RecomputeConfig) -> MemoryConfig:
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
    pack_op, _ = save_and_first_use(trace)
    stack: list[tuple[str, int]] = []
    seconds: dict[str, float] = {}
    freed: dict[str, int] = {}
    cum = list(accumulate(durations, initial=0.0))
    for event in trace.events:
        op = event.op
        if event.kind is EventKind.MODULE_START and event.flag:
            stack.append((trace.module_names[event.arg], op))
        elif event.kind is EventKind.MODULE_END and event.flag and stack:
            name, start = stack.pop()
            seconds[name] = seconds.get(name, 0.0) + cum[op] - cum[start]
            # By op range, not by name: a block may run modules registered under another name (nnU-Net's
            # `ConvDropoutNormReLU.all_modules` runs its `conv`, `norm` and `nonlin`).
            inside = [r for r in trace.records if not r.record.is_param and r.sid >= 0
                      and r.record.index in at_peak and start <= pack_op[r.record.index] <= op
                      and trace.storages[r.sid].alloc_op >= start]
            freed[name] = freed.get(name, 0) + sum(r.record.nbytes for r in inside)
    ranked = [(name, seconds[name], freed[name]) for name in seconds if freed[name] > 0]
    return sorted(ranked, key=lambda item: item[1] / item[2])


@dataclass
class _Unit:
    """The saved storages of one module that the engine may swap, as one swap candidate."""

    module: str
    nbytes: int = 0
    seconds: float = 0.0  # link time of its copy out
    pack_op: int = 1 << 62
    free_op: int = -1  # the program itself drops the storages here; before it, swapping frees nothing
    first_use: int = -1


class SwapSearch:
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
        pack_op, first_use = save_and_first_use(trace)
        units: dict[str, _Unit] = {}
        for index in eligible:
            record = trace.records[index].record
            unit = units.setdefault(record.module, _Unit(record.module))
            unit.nbytes += record.nbytes
            unit.seconds += self.planner.cost.copy_seconds(transfer_bytes(record, swap_cfg), record.nbytes, D2H)
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
