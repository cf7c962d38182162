"""Replay a traced step under a memory policy: the rulebook's schedule, device memory and step time.

Input: a `Trace` (brats_swap.memory.trace_data), which recorded every event the engine reacts to, and a
`MemoryConfig`. `replay` feeds the trace's events to a `rulebook.Rulebook` of that policy, exactly as the
engine does at run time, with a clock as the rulebook's executor instead of real copies. The rulebook
decides every save, release and reload, so the per-tensor event sequence, the swapped bytes and the
engine's resident-bytes counter are the engine's own; the clock adds when each thing happens.

Time (TFLMS-style): op durations come from a roofline model (`OpCostModel`: FLOPs / rate +
bytes / bandwidth + launch), calibrated by a short profile; the host<->device link is two FIFO queues
(device-to-host and host-to-device), as two copy engines are. A copy out starts when its storage is
saved and the link is free; a reload starts when it is issued, the link is free and the copy out has
landed. The compute stream waits (a stall) where the engine waits: a release forced by
`swap.max_inflight_bytes` waits for that copy, every use waits for its reload.

Where storages are released does not depend on the clock (rulebook rule 6): the clock only prices the
waits, so the predicted memory is the same for any link speed of a kind (synchronous, as the CPU
engine's default link; or asynchronous: CUDA streams, the emulated link) and holds for every timing.

Memory (a liveness walk, SuperNeurons-style): every storage of the step occupies the device from the op
that allocates it to the op at which the program drops it, or later while the engine holds it (kept:
until its record dies; swapped: until its release) or autograd uses a view of it; a reload occupies its
size from its issue to its drop or the end of its last use; recomputed storages are real operators of
the trace. Parameters, gradients (in the trace), Adam state (2 x parameters) and the batch persist. The
peak is the maximum over ops of the running sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from brats_swap.config.schema import MemoryConfig
from brats_swap.memory.budget import GIB
from brats_swap.memory.cost import D2H, H2D, INSTANT, OpCostModel
from brats_swap.memory.events import FORWARD, EventKind, deliver
from brats_swap.memory.rulebook import RECOMPUTE, SWAP, Entry, EntryState, Rulebook, SaveFacts
from brats_swap.memory.stats import StepStats
from brats_swap.memory.trace_data import Trace

ADAM_STATE_FACTOR = 2  # exp_avg and exp_avg_sq: two extra copies of the parameters


@dataclass
class MemoryResult:
    peak_bytes: int
    peak_op: int
    persistent_bytes: int
    saved_bytes: int  # distinct non-parameter storages saved for backward
    swapped_bytes: int  # device bytes of the swapped storages (the engine's `swapped_out_bytes`)
    recomputed_bytes: int
    peak_resident_saved_bytes: int
    swapped_in_bytes: int = 0  # bytes reloaded (the engine's `swapped_in_bytes`)
    prefetch_misses: int = 0  # uses with no reload issued before them
    timeline: list[int] | None = None  # bytes in use after each op (without the persistent part)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


@dataclass
class TimeResult:
    step_s: float
    compute_s: float
    forward_s: float
    backward_s: float
    exposed_transfer_s: float  # time the compute stream waited for copies
    recompute_s: float
    d2h_s: float  # busy time of the device-to-host queue
    h2d_s: float
    prefetch_misses: int
    lanes: dict[str, list[tuple[float, float, str]]] | None = None  # for the timeline figure
    op_start: list[float] | None = None  # start time of each op (with keep_lanes)


@dataclass
class Schedule:
    """One replay: the rulebook's statistics and event log, the clock's timing, and where the engine held
    device memory (op indices) for the liveness walk."""

    stats: StepStats
    log: list | None
    timing: TimeResult | None = None
    hold_end: dict[int, int] = field(default_factory=dict)  # record -> op where the engine dropped its storage
    use_end: dict[int, int] = field(default_factory=dict)  # record -> op where its last on-device use ended
    reloads: list[list[int]] = field(default_factory=list)  # [record, issue op, end op]
    staging: list[list[int]] = field(default_factory=list)  # bf16 conversion buffers: [bytes, start op, end op]


class _Timing:
    """The clock's state of one entry (its `payload`)."""

    __slots__ = ("out_done", "in_done", "reload", "staging")

    def __init__(self):
        self.out_done = 0.0
        self.in_done = 0.0
        self.reload: list[int] | None = None  # the current reload interval in `Schedule.reloads`
        self.staging: list[int] | None = None  # the open conversion-buffer interval in `Schedule.staging`


class _Clock:
    """The rulebook's executor in a replay: a compute clock (`now` at the current op) and two FIFO copy
    queues. Stalls shift every later op; nothing else changes the order of events."""

    def __init__(self, trace: Trace, durations: list[float], cost: OpCostModel, schedule: Schedule,
                 keep_lanes: bool):
        self.cum = list(accumulate(durations, initial=0.0))
        self.cost = cost
        self.schedule = schedule
        self.op = 0
        self.stalled = 0.0
        self.d2h_free = self.h2d_free = self.d2h_busy = self.h2d_busy = 0.0
        self.stalls: list[tuple[int, float]] = []  # (op, seconds) for op start times
        self.lanes = {"compute": [], "d2h": [], "h2d": [], "stall": []} if keep_lanes else None

    @property
    def now(self) -> float:
        return self.cum[self.op] + self.stalled

    def stall_until(self, t: float) -> None:
        now = self.now
        if t > now:
            if self.lanes is not None:
                self.lanes["stall"].append((now, t, "stall"))
            self.stalls.append((self.op, t - now))
            self.stalled += t - now

    def _copy(self, lane: str, start: float, seconds: float, label: str) -> float:
        if self.lanes is not None and seconds > 0:
            self.lanes[lane].append((start, start + seconds, label))
        return start + seconds

    def staging_bytes(self, entry: Entry) -> int:
        return entry.transfer_bytes if entry.compressed and self.cost.staged_conversion else 0

    def copies_synchronously(self) -> bool:
        return self.cost.sync_copies

    def _open_staging(self, entry: Entry) -> None:
        nbytes = self.staging_bytes(entry)
        if nbytes:
            entry.payload.staging = [nbytes, self.op, -1]
            self.schedule.staging.append(entry.payload.staging)

    def _close_staging(self, entry: Entry) -> None:
        interval = entry.payload.staging
        if interval is not None:
            interval[2] = max(self.op, interval[1] + 1)
            entry.payload.staging = None

    def swap_out(self, entry: Entry) -> None:
        timing: _Timing = entry.payload
        self._open_staging(entry)
        start = max(self.d2h_free, self.now)
        seconds = self.cost.copy_seconds(entry.transfer_bytes, entry.record.nbytes, D2H)
        self.d2h_busy += seconds
        self.d2h_free = timing.out_done = self._copy("d2h", start, seconds, f"s{entry.index}")
        if self.cost.sync_copies:
            self.stall_until(timing.out_done)
        self._interfere(entry)

    def _interfere(self, entry: Entry) -> None:
        """The compute time a CPU copy thread takes from the step for this copy (`OpCostModel`)."""
        seconds = self.cost.interference_seconds(entry.transfer_bytes)
        if seconds:
            self.stall_until(self.now + seconds)

    def release(self, entry: Entry, wait: bool) -> None:
        if wait:
            self.stall_until(entry.payload.out_done)
        self.schedule.hold_end[entry.index] = self.op
        self._close_staging(entry)

    def reload(self, entry: Entry) -> None:
        timing: _Timing = entry.payload
        start = max(self.h2d_free, self.now, timing.out_done)
        seconds = self.cost.copy_seconds(entry.transfer_bytes, entry.record.nbytes, H2D)
        self.h2d_busy += seconds
        self.h2d_free = timing.in_done = self._copy("h2d", start, seconds, f"r{entry.index}")
        timing.reload = [entry.index, self.op, self.op + 1]
        self.schedule.reloads.append(timing.reload)
        self._open_staging(entry)
        if self.cost.sync_copies:
            self.stall_until(timing.in_done)
        self._interfere(entry)

    def await_reload(self, entry: Entry) -> None:
        self.stall_until(entry.payload.in_done)
        self._close_staging(entry)

    def drop_reload(self, entry: Entry) -> None:
        reload = entry.payload.reload
        reload[2] = max(reload[2], self.op)
        self._close_staging(entry)

    def died(self, entry: Entry) -> None:
        if entry.decision != RECOMPUTE:  # kept, or swapped and never released: held until now
            self.schedule.hold_end.setdefault(entry.index, self.op)
        self._close_staging(entry)

    def used(self, entry: Entry, artifact_end: int) -> None:
        """A use of `entry` whose view lives until `artifact_end`: on the device or on its reload."""
        if entry.decision == SWAP and entry.state is not EntryState.COPYING:
            reload = entry.payload.reload
            reload[2] = max(reload[2], artifact_end)
        else:
            self.schedule.use_end[entry.index] = max(self.schedule.use_end.get(entry.index, 0), artifact_end)


def replay(trace: Trace, memory_cfg: MemoryConfig, *, cost: OpCostModel = INSTANT,
           durations: list[float] | None = None, learned: bool = True, log: list | None = None,
           keep_lanes: bool = False) -> Schedule:
    """Run the trace's events through a rulebook of `memory_cfg` (the engine's own decisions) on a clock.

    `learned` gives the rulebook the first-unpack order of the trace, as the engine has it from the
    second step on (lookahead 0); `learned=False` replays a first step. `log` receives the rulebook's
    per-tensor event sequence. `durations` (seconds per op, default `cost.durations(trace)`).
    """
    durations = cost.durations(trace) if durations is None else durations
    schedule = Schedule(StepStats(), log)
    clock = _Clock(trace, durations, cost, schedule, keep_lanes)
    order = (trace.unpack_order(), len(trace.records)) if learned else None
    rulebook = Rulebook(memory_cfg, clock, learned=order, log=log)
    forward_s = _run_events(trace, rulebook, clock)
    schedule.stats = rulebook.stats
    schedule.timing = _timing(trace, clock, durations, forward_s, rulebook.stats.prefetch_misses, keep_lanes)
    return schedule


class _TraceSource:
    """The tables a recorded trace's events index (`events.EventSource`), and a fresh clock payload per
    saved storage."""

    def __init__(self, trace: Trace, rulebook: Rulebook):
        self.trace, self.rulebook = trace, rulebook

    def module_name(self, index: int) -> str:
        return self.trace.module_names[index]

    def region(self, index: int) -> list[int]:
        return self.trace.regions[index]

    def first_save(self, index: int) -> SaveFacts:
        traced = self.trace.records[index]
        record = traced.record
        return SaveFacts(nbytes=record.nbytes, dtype=record.dtype, is_param=record.is_param,
                         is_input=record.is_input, dense=record.dense, recompute=record.recompute,
                         deps=[self.rulebook.entries[d] for d in traced.deps], payload=_Timing())


def _run_events(trace: Trace, rulebook: Rulebook, clock: _Clock) -> float:
    """Deliver every event of the trace to the rulebook (`events.deliver`, as the front end does at run
    time); the clock follows each use of a stored view. Returns the forward's end time."""
    records, entries = trace.records, rulebook.entries
    artifact_ends = trace.cache.get("artifact_ends")
    if artifact_ends is None:
        artifact_ends = trace.cache["artifact_ends"] = [
            [_free_op(trace, sid) for sid in traced.artifact_sids] for traced in records]
    unpacks = [0] * len(records)
    forward_s = 0.0
    source = _TraceSource(trace, rulebook)
    for event in trace.events:
        clock.op = event.op
        deliver(rulebook, event, source)
        kind, index = event.kind, event.arg
        if kind is EventKind.UNPACK_BEGIN:
            entry = entries[index]
            if entry.decision != RECOMPUTE and not entry.record.is_param:
                clock.used(entry, artifact_ends[index][unpacks[index]])
                unpacks[index] += 1
        elif kind is EventKind.FORWARD_END:
            forward_s = clock.now
    clock.op = trace.n_ops
    return forward_s


def _free_op(trace: Trace, sid: int) -> int:
    storage = trace.storages[sid]
    return storage.free_op if storage.free_op >= 0 else trace.n_ops


def _timing(trace: Trace, clock: _Clock, durations: list[float], forward_s: float, misses: int,
            keep_lanes: bool) -> TimeResult:
    op_start = None
    if keep_lanes:
        shift = np.zeros(trace.n_ops + 2)
        for op, seconds in clock.stalls:
            shift[op] += seconds
        op_start = (np.asarray(clock.cum) + np.cumsum(shift)[: trace.n_ops + 1]).tolist()
        for i, seconds in enumerate(durations):
            if seconds > 0:
                op = trace.ops[i]
                kind = "recompute" if op.recompute else "fwd" if op.phase == FORWARD else "bwd"
                clock.lanes["compute"].append((op_start[i], op_start[i] + seconds, kind))
    step_s = clock.now
    cached = trace.cache.get("recompute_s")
    if cached is None or cached[0] is not durations:  # the same durations list: the same sum
        cached = trace.cache["recompute_s"] = (
            durations, float(sum(d for d, op in zip(durations, trace.ops, strict=True) if op.recompute)))
    return TimeResult(
        step_s=step_s, compute_s=clock.cum[-1], forward_s=forward_s, backward_s=step_s - forward_s,
        exposed_transfer_s=clock.stalled, recompute_s=cached[1],
        d2h_s=clock.d2h_busy, h2d_s=clock.h2d_busy, prefetch_misses=misses, lanes=clock.lanes, op_start=op_start,
    )


# --------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------


def _storage_arrays(trace: Trace) -> dict:
    """Per-trace arrays of the liveness walk (cached): program storages and which record owns which."""
    cached = trace.cache.get("storages")
    if cached is not None:
        return cached
    owner = {traced.sid: traced.record.index for traced in trace.records if traced.sid >= 0}
    program = [s for s in trace.storages if s.artifact_of < 0]
    cached = {
        "alloc": np.array([s.alloc_op for s in program], dtype=np.int64),
        "free": np.array([_free_op(trace, s.sid) for s in program], dtype=np.int64),
        "nbytes": np.array([s.nbytes for s in program], dtype=np.int64),
        "owner": np.array([owner.get(s.sid, -1) for s in program], dtype=np.int64),
    }
    trace.cache["storages"] = cached
    return cached


def _peak(n: int, starts: np.ndarray, ends: np.ndarray, nbytes: np.ndarray, keep_timeline: bool):
    """(peak bytes, first op at the peak, usage per op or None) of intervals [start, end)."""
    ends = np.minimum(ends, n + 1)
    mask = ends > starts
    delta = np.zeros(n + 2, dtype=np.int64)
    np.add.at(delta, starts[mask], nbytes[mask])
    np.add.at(delta, ends[mask], -nbytes[mask])
    usage = np.cumsum(delta)[: n + 1]
    peak_op = int(np.argmax(usage))
    return int(usage[peak_op]), peak_op, usage.tolist() if keep_timeline else None


def persistent_bytes(trace: Trace, optimizer_state_factor: int = ADAM_STATE_FACTOR) -> int:
    """Parameters, their optimizer state and buffers: on the device for the whole step."""
    return trace.param_bytes * (1 + optimizer_state_factor) + trace.buffer_bytes


def _held_ends(trace: Trace, schedule: Schedule) -> np.ndarray:
    """The op at which each program storage leaves the device in this replay: when the program drops it,
    or later while the engine holds it or autograd uses a view of it."""
    arrays = _storage_arrays(trace)
    ends = arrays["free"].copy()
    owner = arrays["owner"]
    for index in np.nonzero(owner >= 0)[0]:
        record = int(owner[index])
        held = max(schedule.hold_end.get(record, 0), schedule.use_end.get(record, 0))
        if held > ends[index]:
            ends[index] = held
    return ends


def resident_records(trace: Trace, schedule: Schedule, op: int) -> set[int]:
    """Records whose storage occupies the device at `op` in this replay (the liveness walk's intervals)."""
    arrays = _storage_arrays(trace)
    ends = _held_ends(trace, schedule)
    inside = (arrays["owner"] >= 0) & (arrays["alloc"] <= op) & (op < ends)
    return {int(record) for record in arrays["owner"][inside]}


def rebuilt_at(trace: Trace, schedule: Schedule, op: int) -> set[int]:
    """Ops of a recomputation in backward whose outputs occupy the device at `op` in this replay."""
    arrays = _storage_arrays(trace)
    ends = _held_ends(trace, schedule)
    live = arrays["alloc"][(arrays["alloc"] <= op) & (op < ends)]
    return {int(alloc) for alloc in live if trace.ops[int(alloc)].recompute}


def simulate_memory(trace: Trace, memory_cfg: MemoryConfig | None = None, *, schedule: Schedule | None = None,
                    optimizer_state_factor: int = ADAM_STATE_FACTOR, keep_timeline: bool = False) -> MemoryResult:
    """Peak device memory of `memory_cfg` (default: keep everything) from a replay (`schedule`, default the
    engine's synchronous CPU replay)."""
    if schedule is None:
        schedule = replay(trace, memory_cfg or MemoryConfig())
    n = trace.n_ops
    arrays = _storage_arrays(trace)
    ends = _held_ends(trace, schedule)
    reloads = np.array(schedule.reloads, dtype=np.int64).reshape(-1, 3)
    reload_bytes = np.array([trace.records[r].record.nbytes for r in reloads[:, 0]], dtype=np.int64)
    staging = np.array(schedule.staging, dtype=np.int64).reshape(-1, 3)
    staging_ends = np.where(staging[:, 2] < 0, n, staging[:, 2])  # still held at the end of the step
    starts = np.concatenate([arrays["alloc"], reloads[:, 1], staging[:, 1]])
    stops = np.concatenate([ends, np.maximum(reloads[:, 2], reloads[:, 1] + 1), staging_ends])
    peak, peak_op, timeline = _peak(n, starts, stops, np.concatenate([arrays["nbytes"], reload_bytes, staging[:, 0]]),
                                    keep_timeline)
    stats = schedule.stats
    persistent = persistent_bytes(trace, optimizer_state_factor)
    # Gradients are in the trace (allocated in backward, alive at its end); the next step's forward runs
    # with them freed (zero_grad(set_to_none=True)), so the trace's timeline covers them.
    return MemoryResult(
        peak_bytes=peak + persistent, peak_op=peak_op, persistent_bytes=persistent, saved_bytes=stats.saved_bytes,
        swapped_bytes=stats.swapped_out_bytes, recomputed_bytes=stats.recomputed_bytes,
        peak_resident_saved_bytes=stats.peak_resident_saved_bytes, swapped_in_bytes=stats.swapped_in_bytes,
        prefetch_misses=stats.prefetch_misses, timeline=timeline,
    )


def floor_bytes(trace: Trace, *, optimizer_state_factor: int = ADAM_STATE_FACTOR) -> int:
    """The theoretical floor of any keep/swap/recompute policy: what must persist (parameters, optimizer
    state) plus the largest working set of the step when every saved storage is off the device except
    while the node that reads it runs (an oracle swap with zero-cost, just-in-time transfers).

    What remains at that peak are the operators' own inputs, outputs and temporaries, the gradients
    being accumulated and the forward outputs the program itself still holds (skip connections).
    """
    arrays = _storage_arrays(trace)
    starts, stops, sizes = [arrays["alloc"]], [arrays["free"]], [arrays["nbytes"]]
    for traced in trace.records:  # each saved storage only while a node reads it
        record = traced.record
        if record.is_param or record.recompute or not traced.artifact_sids:
            continue
        sids = list(dict.fromkeys(traced.artifact_sids))  # unpacks that shared a storage count it once
        alloc = np.array([trace.storages[sid].alloc_op for sid in sids], dtype=np.int64)
        free = np.array([_free_op(trace, sid) for sid in sids], dtype=np.int64)
        starts.append(alloc)
        stops.append(np.maximum(free, alloc + 1))
        sizes.append(np.full(len(alloc), record.nbytes, dtype=np.int64))
    peak, _, _ = _peak(trace.n_ops, np.concatenate(starts), np.concatenate(stops), np.concatenate(sizes), False)
    return persistent_bytes(trace, optimizer_state_factor) + peak
