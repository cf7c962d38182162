"""Replay a traced step under a memory policy: device-memory liveness and a copy-engine timeline.

Input: a `Trace` (brats_swap.memory.trace) and a `Placement` saying, for each saved record, whether it
stays on the device, is swapped to host memory (released in forward, reloaded in backward), or is
recomputed in backward. Output: the predicted peak device memory and step time of that policy.

Memory (a liveness walk, SuperNeurons-style): every storage of the step occupies the device from the op
that allocates it to the op at which it dies. For a saved storage the death depends on the policy:
kept, it dies when both the program and the last backward node that reads it are done with it; swapped,
it dies when the program is done with it and the engine has released its reference (the block after the
save), and a reload of the same size lives from its prefetch point to the end of its last use;
recomputed, it is rebuilt at its first use in backward. Parameters, gradients (in the trace), Adam state
(2 x parameters) and the batch persist. The peak is the maximum over ops of the running sum.

Time (TFLMS-style simulation): op durations come from a roofline model (`OpCostModel`: FLOPs / rate +
bytes / bandwidth + launch), calibrated by a short profile; the host<->device link is two FIFO queues
(device-to-host and host-to-device), as two copy engines are. A swapped tensor's copy starts when it is
saved; the compute stream waits for the copy where the engine releases the tensor (a stall if the
copy is late); a reload is issued `lookahead` blocks ahead in backward and the compute stream waits for
it at its first use (a miss when it was never issued, a stall when it is late).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from brats_swap.memory.trace import BACKWARD, FORWARD, Trace

GIB = float(1 << 30)
ADAM_STATE_FACTOR = 2  # exp_avg and exp_avg_sq: two extra copies of the parameters


@dataclass
class Placement:
    """Where each saved record lives under a policy (record indices from the trace)."""

    swapped: set[int] = field(default_factory=set)
    recomputed: set[int] = field(default_factory=set)
    lookahead: int = 1
    compress_bf16: bool = False  # swapped fp32 storages travel and wait on the host as bf16


@dataclass
class MemoryResult:
    peak_bytes: int
    peak_op: int
    persistent_bytes: int
    saved_bytes: int  # distinct non-parameter storages saved for backward
    swapped_bytes: int  # device-to-host bytes of the swapped storages (halved by bf16 compression)
    recomputed_bytes: int
    peak_resident_saved_bytes: int
    swapped_in_bytes: int = 0  # host-to-device bytes of the reloads (the engine's `swapped_in_bytes`)
    prefetch_misses: int = 0  # reloads with no prefetch issued before the first use
    timeline: np.ndarray | None = None  # bytes in use after each op (without the persistent part)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


@dataclass
class OpCostModel:
    """Roofline-ish op duration: flops / flops_per_s + bytes / bytes_per_s + launch_s, times a per-phase
    scale fitted to a measured profile (see `brats_swap.memory.planner.profile_device`)."""

    name: str = "default"
    flops_per_s: float = 50e12
    bytes_per_s: float = 3.0e12
    launch_s: float = 5e-6
    fwd_scale: float = 1.0
    bwd_scale: float = 1.0
    h2d_bytes_per_s: float = 25e9
    d2h_bytes_per_s: float = 25e9
    # The engine's CPU path copies synchronously (a swapped storage can go at the next module start);
    # on CUDA the copy streams run concurrently and release points depend on copy progress.
    sync_copies: bool = False

    def durations(self, trace: Trace) -> np.ndarray:
        out = np.zeros(trace.n_ops)
        for i, op in enumerate(trace.ops):
            if not op.kernel:
                continue
            raw = op.flops / self.flops_per_s + op.bytes_accessed / self.bytes_per_s + self.launch_s
            out[i] = raw * (self.fwd_scale if op.phase == FORWARD else self.bwd_scale)
        return out

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> OpCostModel:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# --------------------------------------------------------------------------------------------------------
# Shared geometry: the engine's release and reload points for each record
# --------------------------------------------------------------------------------------------------------


@dataclass
class RecordPlan:
    """One non-parameter record under a placement, on the trace's op clock."""

    index: int
    sid: int
    nbytes: int
    decision: str  # "keep", "swap" or "recompute"
    pack_op: int
    death_op: int  # all handles dead (autograd released the record)
    first_use: int  # first unpack (n_ops when never unpacked)
    pending_zero_op: int  # every handle unpacked once or dead: the engine drops its reload here
    last_use_end: int  # the last unpacked view died
    release_op: int | None = None  # swap: where the device reference is dropped (None: never, the tail)
    fetch_op: int | None = None  # swap: where the reload is issued (None: never needed)
    miss: bool = False  # swap: reloaded synchronously at first use
    transfer_bytes: int = 0  # bytes on the link each way (halved by bf16 compression)
    # The same points on the trace's event clock (saves, module starts, markers, unpacks, deaths), which
    # orders events between the same two ops: the engine's resident-bytes counter is exact on it.
    pack_seq: float = 0.0
    death_seq: float = float(1 << 62)
    pending_zero_seq: float = float(1 << 62)
    release_seq: float | None = None
    fetch_seq: float | None = None


_INSTANT = float("inf")


def schedule(trace: Trace, placement: Placement, *, durations: np.ndarray | None = None,
             d2h_bytes_per_s: float = _INSTANT, h2d_bytes_per_s: float = _INSTANT,
             max_inflight_bytes: int | None = None, keep_lanes: bool = False, sync_copies: bool = False,
             ) -> tuple[list[RecordPlan], TimeResult]:
    """Replay the engine (`swap.SavedTensorEngine` + `engine.MemoryEngine`) on one compute stream and two
    FIFO copy queues, event by event in the trace's order:

    - a swapped storage's device-to-host copy starts at its save (after the ops before it);
    - at each module start in forward, swapped storages whose copy has finished are released (FIFO);
      at each block start all are released, the compute stream waiting for unfinished copies; past
      `swap.max_inflight_bytes` of unreleased storages the oldest is released at once (waiting too);
      a storage saved after the last module start is never released (read from the device);
    - at each backward block marker `m`, released storages still pending with `use_marker + lookahead
      >= m` are reloaded (host-to-device queue); a first use with no reload issued reloads at once (a
      miss); the compute stream waits for the reload at the first use.

    With the default (instant) copies and no durations this is the engine's CPU path, whose copies are
    synchronous; with a cost model it is the CUDA path and also returns the step time (`sync_copies`:
    the CPU path's copies stall the compute stream for their whole duration).
    """
    n = trace.n_ops
    durations = np.zeros(n) if durations is None else durations
    plans: list[RecordPlan] = []
    by_index: dict[int, RecordPlan] = {}
    events: list[tuple[int, int, int, object]] = []  # (op, seq, kind, payload); kinds sorted by seq
    PACK, MODULE, MARKER, USE = 0, 1, 2, 3
    uses: dict[int, int] = {}
    pending_seq: dict[int, int] = {}
    death_seq: dict[int, int] = {}
    for traced in trace.records:
        record = traced.record
        if record.is_param:
            continue
        ends = [trace.storages[s].free_op if trace.storages[s].free_op >= 0 else n for s in traced.artifact_sids]
        decision = "swap" if record.index in placement.swapped else "recompute" if record.recompute else "keep"
        death = traced.death_op if traced.death_op >= 0 else n
        plan = RecordPlan(
            index=record.index, sid=traced.sid, nbytes=record.nbytes, decision=decision, pack_op=traced.pack_op,
            death_op=death, first_use=min(traced.unpack_ops) if traced.unpack_ops else n,
            pending_zero_op=traced.pending_zero_op if traced.pending_zero_op >= 0 else n,
            last_use_end=max(ends) if ends else death,
            pack_seq=traced.pack_seq, death_seq=traced.death_seq, pending_zero_seq=traced.pending_zero_seq,
        )
        plans.append(plan)
        by_index[plan.index] = plan
        if decision != "swap":
            continue
        compressed = placement.compress_bf16 and record.dtype == "float32"
        plan.transfer_bytes = record.nbytes // 2 if compressed else record.nbytes
        uses[plan.index] = traced.use_marker
        pending_seq[plan.index] = traced.pending_zero_seq
        death_seq[plan.index] = traced.death_seq
        events.append((traced.pack_op, traced.pack_seq, PACK, plan))
        if traced.unpack_ops:
            events.append((plan.first_use, traced.first_use_seq, USE, plan))
    if any(p.decision == "swap" for p in plans):
        events += [(op, seq, MODULE, is_block) for seq, op, is_block in trace.module_starts]
        events += [(op, seq, MARKER, ordinal) for seq, op, ordinal in trace.markers]
    events.sort(key=lambda e: (e[0], e[1]))

    now = d2h_free = h2d_free = 0.0
    exposed = d2h_busy = h2d_busy = forward_s = 0.0
    misses = 0
    d2h_done: dict[int, float] = {}
    h2d_done: dict[int, float] = {}
    unreleased: list[RecordPlan] = []
    released: list[RecordPlan] = []
    lanes = {"compute": [], "d2h": [], "h2d": [], "stall": []} if keep_lanes else None
    op_start = np.zeros(n + 1) if keep_lanes else None

    def wait_until(t: float) -> None:
        nonlocal now, exposed
        if t > now:
            if lanes is not None:
                lanes["stall"].append((now, t, "stall"))
            exposed += t - now
            now = t

    def release(plan: RecordPlan, op: int, seq: float, wait: bool) -> None:
        if plan.death_seq < seq:
            return  # died meanwhile: nothing to release
        if wait:
            wait_until(d2h_done[plan.index])
        plan.release_op, plan.release_seq = op, seq
        released.append(plan)

    def reload(plan: RecordPlan, op: int, seq: float) -> None:
        nonlocal h2d_free, h2d_busy
        start = max(h2d_free, now, d2h_done.get(plan.index, 0.0))
        took = plan.transfer_bytes / h2d_bytes_per_s
        h2d_free = start + took
        h2d_busy += took
        h2d_done[plan.index] = h2d_free
        plan.fetch_op, plan.fetch_seq = op, seq
        if sync_copies:
            wait_until(h2d_free)
        if lanes is not None and took > 0:
            lanes["h2d"].append((start, h2d_free, f"r{plan.index}"))

    cursor = 0
    for i in range(n + 1):
        if i == trace.fwd_end:
            forward_s = now
        while cursor < len(events) and events[cursor][0] == i:
            _, seq, kind, payload = events[cursor]
            cursor += 1
            if kind == PACK:
                plan = payload
                start = max(d2h_free, now)
                took = plan.transfer_bytes / d2h_bytes_per_s
                d2h_free = start + took
                d2h_busy += took
                d2h_done[plan.index] = d2h_free
                if lanes is not None and took > 0:
                    lanes["d2h"].append((start, d2h_free, f"s{plan.index}"))
                if sync_copies:
                    wait_until(d2h_free)
                unreleased.append(plan)
                if max_inflight_bytes is not None:
                    while sum(p.nbytes for p in unreleased) > max_inflight_bytes and unreleased:
                        release(unreleased.pop(0), i, seq + 0.5, wait=True)
            elif kind == MODULE:
                if payload:  # a block: everything goes, waiting for unfinished copies
                    while unreleased:
                        release(unreleased.pop(0), i, seq, wait=True)
                else:  # any module: what has finished goes (FIFO)
                    while unreleased and d2h_done[unreleased[0].index] <= now:
                        release(unreleased.pop(0), i, seq, wait=False)
            elif kind == MARKER:
                keep = []
                for plan in released:
                    alive = death_seq[plan.index] > seq and plan.death_op >= i
                    pending = pending_seq[plan.index] > seq
                    if plan.fetch_op is not None or not alive:
                        continue
                    if uses[plan.index] + placement.lookahead >= payload and pending:
                        reload(plan, i, seq)
                    else:
                        keep.append(plan)
                released = keep
            else:  # USE
                plan = payload
                if plan.release_op is None:
                    continue  # never released: read from the device
                if plan.fetch_op is None:
                    plan.miss = True
                    misses += 1
                    reload(plan, i, seq)
                wait_until(h2d_done[plan.index])
        if op_start is not None:
            op_start[i] = now
        if i == n:
            break
        if durations[i] > 0:
            if lanes is not None:
                kind = "recompute" if trace.ops[i].recompute else "fwd" if trace.ops[i].phase == FORWARD else "bwd"
                lanes["compute"].append((now, now + durations[i], kind))
            now += durations[i]

    recompute_s = float(sum(d for d, op in zip(durations, trace.ops, strict=True) if op.recompute))
    timing = TimeResult(
        step_s=now, compute_s=float(durations.sum()), forward_s=forward_s, backward_s=now - forward_s,
        exposed_transfer_s=exposed, recompute_s=recompute_s, d2h_s=d2h_busy, h2d_s=h2d_busy,
        prefetch_misses=misses, lanes=lanes, op_start=op_start,
    )
    return plans, timing


def plan_records(trace: Trace, placement: Placement, max_inflight_bytes: int | None = None) -> list[RecordPlan]:
    """The engine's per-record schedule with synchronous copies (its CPU path)."""
    return schedule(trace, placement, max_inflight_bytes=max_inflight_bytes)[0]


# --------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------


def simulate_memory(trace: Trace, placement: Placement, *, optimizer_state_factor: int = ADAM_STATE_FACTOR,
                    max_inflight_bytes: int | None = None, plans: list[RecordPlan] | None = None,
                    keep_timeline: bool = False) -> MemoryResult:
    """Peak device memory of `placement`; `plans` from `schedule` with a cost model give the CUDA
    release points, the default is the engine's synchronous (CPU) schedule."""
    n = trace.n_ops
    delta = np.zeros(n + 2, dtype=np.int64)

    def add(arr, start, end, nbytes):
        start, end = max(start, 0), min(end, n + 1)
        if end > start:
            arr[start] += nbytes
            arr[end] -= nbytes

    if plans is None:
        plans = plan_records(trace, placement, max_inflight_bytes)
    by_sid: dict[int, list[RecordPlan]] = {}
    for plan in plans:
        if plan.sid >= 0:
            by_sid.setdefault(plan.sid, []).append(plan)

    swapped_bytes = recomputed_bytes = swapped_in = misses = 0
    for storage in trace.storages:
        if storage.artifact_of >= 0:
            continue  # the trace's stand-ins for unpacked tensors; modelled per record below
        free = storage.free_op if storage.free_op >= 0 else n
        end = free
        for plan in by_sid.get(storage.sid, ()):
            if plan.decision == "keep":
                end = max(end, plan.death_op, plan.last_use_end)
            elif plan.decision == "swap":
                end = max(end, plan.release_op if plan.release_op is not None else plan.death_op)
        add(delta, storage.alloc_op, end, storage.nbytes)

    resident: list[tuple[float, int]] = []  # (event seq, +/- bytes): the engine's resident counter
    for plan in plans:
        if plan.decision == "keep":
            resident += [(plan.pack_seq, plan.nbytes), (plan.death_seq, -plan.nbytes)]
        elif plan.decision == "recompute":
            recomputed_bytes += plan.nbytes
        else:
            swapped_bytes += plan.nbytes
            if plan.release_op is None:  # the tail: read from the device, resident until it dies
                resident += [(plan.pack_seq, plan.nbytes), (plan.death_seq, -plan.nbytes)]
                continue
            resident += [(plan.pack_seq, plan.nbytes), (plan.release_seq, -plan.nbytes)]
            if plan.fetch_op is not None:
                swapped_in += plan.nbytes
                misses += plan.miss
                end = max(plan.last_use_end, plan.pending_zero_op, plan.fetch_op + 1)
                add(delta, plan.fetch_op, end, plan.transfer_bytes)
                drop = min(plan.pending_zero_seq, plan.death_seq)
                resident += [(plan.fetch_seq, plan.nbytes), (max(drop, plan.fetch_seq + 0.25), -plan.nbytes)]
    resident.sort(key=lambda event: (event[0], event[1]))
    running = peak_resident = 0
    for _, change in resident:
        running += change
        peak_resident = max(peak_resident, running)

    usage = np.cumsum(delta)[: n + 1]
    peak_op = int(np.argmax(usage))
    persistent = trace.param_bytes * (1 + optimizer_state_factor) + trace.buffer_bytes
    # Gradients are in the trace (allocated in backward, alive at its end); the next step's forward runs
    # with them freed (zero_grad(set_to_none=True)), so the trace's timeline covers them.
    return MemoryResult(
        peak_bytes=int(usage[peak_op]) + persistent,
        peak_op=peak_op,
        persistent_bytes=persistent,
        saved_bytes=trace.saved_bytes,
        swapped_bytes=int(swapped_bytes),
        recomputed_bytes=int(recomputed_bytes),
        peak_resident_saved_bytes=int(peak_resident),
        swapped_in_bytes=int(swapped_in),
        prefetch_misses=int(misses),
        timeline=usage if keep_timeline else None,
    )


def floor_bytes(trace: Trace, *, optimizer_state_factor: int = ADAM_STATE_FACTOR) -> int:
    """The theoretical floor of any keep/swap/recompute policy: what must persist (parameters, optimizer
    state) plus the largest working set of the step when every saved storage is off the device except
    while the node that reads it runs (an oracle swap with zero-cost, just-in-time transfers).

    What remains at that peak are the operators' own inputs, outputs and temporaries, the gradients
    being accumulated and the forward outputs the program itself still holds (skip connections).
    """
    oracle = Placement(swapped={t.record.index for t in trace.records if not t.record.is_param})
    n = trace.n_ops
    delta = np.zeros(n + 2, dtype=np.int64)
    plans = {p.sid: p for p in plan_records(trace, oracle)}
    for storage in trace.storages:
        if storage.artifact_of >= 0:
            continue
        free = storage.free_op if storage.free_op >= 0 else n
        plan = plans.get(storage.sid)
        end = free if plan is None or plan.decision == "swap" else max(free, plan.death_op)
        if end > storage.alloc_op:
            delta[storage.alloc_op] += storage.nbytes
            delta[min(end, n + 1)] -= storage.nbytes
    for traced in trace.records:  # each saved storage only while a node reads it
        record = traced.record
        if record.is_param or record.recompute:
            continue
        for sid in traced.artifact_sids:
            artifact = trace.storages[sid]
            end = artifact.free_op if artifact.free_op >= 0 else n
            delta[artifact.alloc_op] += record.nbytes
            delta[min(max(end, artifact.alloc_op + 1), n + 1)] -= record.nbytes
    persistent = trace.param_bytes * (1 + optimizer_state_factor) + trace.buffer_bytes
    return persistent + int(np.cumsum(delta)[: n + 1].max())


# --------------------------------------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------------------------------------


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
    op_start: np.ndarray | None = None  # start time of each op (with keep_lanes)


def simulate_time(trace: Trace, placement: Placement, cost: OpCostModel, *,
                  max_inflight_bytes: int | None = None, durations: np.ndarray | None = None,
                  keep_lanes: bool = False) -> TimeResult:
    """Step time of `placement` under `cost` (see `schedule`)."""
    durations = cost.durations(trace) if durations is None else durations
    return schedule(trace, placement, durations=durations, d2h_bytes_per_s=cost.d2h_bytes_per_s,
                    h2d_bytes_per_s=cost.h2d_bytes_per_s, max_inflight_bytes=max_inflight_bytes,
                    keep_lanes=keep_lanes)[1]


def phase_compute_seconds(trace: Trace, cost: OpCostModel) -> tuple[float, float]:
    """(forward, backward) compute seconds of a trace under a cost model."""
    durations = cost.durations(trace)
    phases = np.array([op.phase for op in trace.ops])
    return float(durations[phases == FORWARD].sum()), float(durations[phases == BACKWARD].sum())
