"""The saved-tensor engine: every tensor autograd saves for backward is kept, swapped or recomputed.

`SavedTensorEngine.pack` / `.unpack` are the two `torch.autograd.graph.saved_tensors_hooks`. Pack groups
saved tensors by storage (a `_Record` per storage, a `_Handle` per saved view), decides once per storage
(keep, swap, recompute; see `policy.py`) and starts the device-to-host copy; block markers driven by
`engine.py` release swapped device memory in forward and issue reloads `lookahead` blocks ahead in
backward; unpack rebuilds the saved view on the kept, reloaded or recomputed storage.

Two copy paths share all of that bookkeeping (reference/swap.md §8.1; each pitfall number is §6):

- CUDA: a device-to-host and a host-to-device stream, one pinned `HostArena` for the whole step.
  Pack records a ready event on the live compute stream, the D2H stream waits on it and copies the whole
  storage (views, offsets, padded and stride-0 layouts survive, pitfall 3). The device storage stays
  referenced until the release point, where the *compute* stream waits on the copy's event (no
  `record_stream`, deterministic peaks, pitfall 5). Reload buffers are allocated on the compute stream;
  the H2D stream waits for the compute stream and for the D2H event (Megatron #7398) before writing; the
  compute stream waits for that one reload event at unpack. A record that was never released is read
  from its device storage directly (the tail of the forward).
- CPU: the same records, events replaced by synchronous copies into the (unpinned) arena; the original
  reference is dropped at the same release point and the storage is restored at unpack. CI tests run
  this path, so every decision above is exercised without a GPU.

Safety rules implemented here: only `t.detach()` is ever retained (no `grad_fn` reference cycle,
pitfall 15); dedupe is keyed by the storage impl plus a `StorageWeakRef` (a recycled address never
matches a dead storage, TRL #6241) and the version counter (pitfall 2); every handle keeps a storage-less
"version probe" sharing the saved tensor's version counter, so an in-place change after the save raises
at unpack exactly as plain autograd would (autograd skips that check under hooks, pitfall 1); parameters,
buffers, autocast copies of parameters and tensors under `min_bytes` are never swapped (pitfall 4); all
state is per step and reset by `begin_step`, records die with their last handle, and handles of saved
tensors that are never unpacked (unused heads) die with their graph (pitfall 7).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import _unsafe_preserve_version_counter
from torch.multiprocessing.reductions import StorageWeakRef

from brats_swap.config.schema import MemoryConfig
from brats_swap.memory.arena import HostArena
from brats_swap.memory.policy import RECOMPUTE_MODES, SWAP_MODES, SavedRecord, SwapSelector
from brats_swap.memory.stats import StepStats

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"


class SavedTensorModifiedError(RuntimeError):
    """A tensor saved for backward was modified in place before backward used it."""


class StaleSavedTensorError(RuntimeError):
    """A swapped tensor of an earlier step was unpacked after the next step reused the host arena."""


def _version_probe(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `t`'s version counter but holds no storage.

    `detach()` shares storage and version counter; pointing the copy at an empty storage drops the
    storage reference. `set_` would bump the shared counter, hence `_unsafe_preserve_version_counter`.
    """
    probe = t.detach()
    with torch.no_grad(), _unsafe_preserve_version_counter(probe):
        probe.set_(torch.empty(0, dtype=t.dtype, device=t.device))
    return probe


def _view_of(storage: torch.UntypedStorage, dtype: torch.dtype, size, stride, offset: int) -> torch.Tensor:
    """Rebuild a saved view on a (kept, reloaded or recomputed) storage."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a uint8 tensor (copies of it move every view at once)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _flat_typed(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.Tensor:
    numel = storage.nbytes() // torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def _is_plain_dense(t: torch.Tensor) -> bool:
    """Tensors whose storage we can copy byte for byte and view again."""
    return (
        t.layout == torch.strided
        and type(t) in (torch.Tensor, torch.nn.Parameter)
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.device.type in ("cpu", "cuda", "meta")
    )


def _is_param_cast(t: torch.Tensor) -> bool:
    """An autocast copy of a parameter (`ToCopyBackward0` straight from a leaf): alive anyway (pitfall 4)."""
    node = t.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return False
    return any(next_node is not None and next_node.name() == "torch::autograd::AccumulateGrad"
               for next_node, _ in node.next_functions)


@dataclass
class _Where:
    """Where the forward is when a tensor is saved (filled by `engine.py`'s module and block hooks)."""

    module: str = ""
    block: int = -1  # innermost running block, else the last block that started
    use_marker: int = 0  # backward marker before which this save is needed (see `_Record.use_marker`)


class _Record:
    """One saved storage in one step. Device memory it holds is counted in `resident`."""

    __slots__ = ("info", "decision", "step", "version", "weak", "device", "nbytes", "gpu_ref", "host",
                 "typed_dtype", "d2h_done", "reloaded", "h2d_done", "released", "alive", "pending",
                 "use_marker", "recipe", "resident", "stale", "seen", "__weakref__")

    def __init__(self, info: SavedRecord, decision: str, step: int, t: torch.Tensor, use_marker: int):
        storage = t.untyped_storage()
        self.info = info
        self.decision = decision
        self.step = step
        self.version = t._version
        self.weak = StorageWeakRef(storage)
        self.device = t.device
        self.nbytes = storage.nbytes()
        self.gpu_ref: torch.Tensor | None = None  # the detached saved tensor until release
        self.host: torch.Tensor | None = None  # arena slice holding the storage's bytes
        self.typed_dtype: torch.dtype | None = None  # set when the host copy is compressed (bf16)
        self.d2h_done = None
        self.reloaded: torch.Tensor | None = None  # device buffer restored from host
        self.h2d_done = None
        self.released = False
        self.alive = 0  # live handles
        self.pending = 0  # live handles not unpacked yet
        # Backward marker (a block ordinal) at or after which this storage's first backward use comes:
        # the block it was saved in, or the next block when saved between blocks; the max over saves.
        self.use_marker = use_marker
        self.recipe = None
        self.resident = 0
        self.stale = False
        self.seen = False  # unpacked at least once in this step


class _Handle:
    """What autograd stores instead of a saved tensor: a view description on a record."""

    __slots__ = ("record", "owner", "size", "stride", "offset", "dtype", "probe", "version", "tensor",
                 "unpacked")

    def __init__(self, owner: SavedTensorEngine, record: _Record, t: torch.Tensor):
        self.owner = owner
        self.record = record
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype
        self.version = t._version
        self.unpacked = False
        if record.decision == KEEP or t.device.type == "meta":
            self.tensor = t  # already detached by pack
            self.probe = t
        else:
            self.tensor = None
            self.probe = _version_probe(t)
        record.alive += 1
        record.pending += 1

    def __del__(self):
        try:
            self.owner._handle_died(self)
        except Exception:  # interpreter shutdown: nothing left to account for
            pass


class _CopyTimer:
    """Copy time: CUDA events on the copy streams (summed lazily) or host wall time."""

    def __init__(self):
        self.host_seconds = 0.0
        self.event_pairs: list[tuple] = []

    def seconds(self) -> float:
        total = self.host_seconds
        for start, end in self.event_pairs:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        self.host_seconds, self.event_pairs = total, []
        return total


class SavedTensorEngine:
    """Pack/unpack hooks plus the per-step state of every saved storage. Used through `MemoryEngine`."""

    def __init__(self, memory_cfg: MemoryConfig, *, param_storages: Callable[[], set[int]],
                 where: Callable[[], _Where], prefetch: bool = True, arena_bytes: int = 0):
        self.cfg = memory_cfg
        self.swap_cfg = memory_cfg.swap
        self.swapping = memory_cfg.mode in SWAP_MODES
        self.norm_act = memory_cfg.mode in RECOMPUTE_MODES and memory_cfg.recompute.norm_act
        self.prefetch = prefetch
        self._param_storages = param_storages
        self._where = where
        self.recipes = None  # set by MemoryEngine when norm_act is on (recompute.NormActRecipes)
        self._arena_bytes = arena_bytes
        self._arenas: dict[bool, HostArena] = {}
        self._streams: dict[torch.device, tuple] = {}
        self.step_id = 0
        self._last_copy_events: dict = {}  # (direction, device) -> last event recorded on that copy stream
        self._learned_order: list[int] = []  # record indices in first-unpack order, from the last step
        self._learned_count = -1  # number of records of the step that order was learned on
        self._reset_state()

    # ------------------------------------------------------------------ step lifecycle
    def _reset_state(self) -> None:
        self.live: dict[int, _Record] = {}  # storage impl address -> newest record of that storage
        self.records: list[SavedRecord] = []
        self.decisions: list[str] = []
        self.by_index: list[_Record] = []
        self.unpack_order: list[int] = []
        self.unreleased: deque[_Record] = deque()
        self.unreleased_bytes = 0
        self.released: list[_Record] = []
        self.reloaded: list[_Record] = []
        self.selector = SwapSelector(self.swap_cfg)
        self.param_storages: set[int] = set()
        self.stats = StepStats()
        self.timer = _CopyTimer()
        self.resident = 0
        self._callback_tasks: set[int] = set()

    def begin_step(self) -> None:
        """Start a new step: forget the last one (records still referenced by a retained graph go stale)."""
        for record in self.by_index:
            record.stale = True
        # The arena may be rewritten (or a spilled slab freed) only after last step's copies finished.
        for event in self._last_copy_events.values():
            event.synchronize()
        self._last_copy_events = {}
        for arena in self._arenas.values():
            arena.reset()
        if self.unpack_order:
            self._learned_order, self._learned_count = self.unpack_order, len(self.records)
        self.step_id += 1
        self._reset_state()
        self._learned_position = {index: position for position, index in enumerate(self._learned_order)}
        self.param_storages = self._param_storages()

    def finish_forward(self, last_block: int = -1) -> None:
        """End of forward. With lookahead >= 1 the tail of unreleased records stays on the device: it is
        needed first in backward and its copies may still run; released records saved after the last
        block (a loss module, say) are needed before any block marker fires, so their reload starts now.
        With lookahead 0 (smallest footprint) finished copies are released too and the first tensor
        backward will need is reloaded at once.
        """
        if not self.prefetch:
            return
        if self.swap_cfg.lookahead != 0:
            for record in self.released:
                if record.use_marker > last_block and record.reloaded is None and record.pending > 0:
                    self._reload(record)
            return
        self.release_completed()
        if not self.released:
            return
        if self._learned_count == len(self.records) and self._learned_order:
            first = self.by_index[self._learned_order[0]]
            if first.released and first.reloaded is None and first.pending > 0:
                self._reload(first)
            else:
                self._prefetch_next(after=first.info.index)
        else:
            self._prefetch_next(after=None)

    def step_stats(self) -> StepStats:
        self.stats.copy_seconds = self.timer.seconds()
        self.stats.arena_bytes = sum(arena.capacity for arena in self._arenas.values())
        return self.stats

    # ------------------------------------------------------------------ helpers
    def _arena(self, device: torch.device) -> HostArena:
        pin = device.type == "cuda"
        if pin not in self._arenas:
            self._arenas[pin] = HostArena(self._arena_bytes, pin=pin)
        return self._arenas[pin]

    def _copy_streams(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _add_resident(self, record: _Record, nbytes: int) -> None:
        record.resident += nbytes
        self.resident += nbytes
        if self.resident > self.stats.peak_resident_saved_bytes:
            self.stats.peak_resident_saved_bytes = self.resident

    def _drop_resident(self, record: _Record) -> None:
        if record.step == self.step_id:  # a graph of an earlier step dying late is not this step's memory
            self.resident -= record.resident
        record.resident = 0

    def lookup(self, t: torch.Tensor) -> _Record | None:
        """The live record of `t`'s storage at `t`'s current version, if this step saved it."""
        record = self.live.get(t.untyped_storage()._cdata)
        if record is None or record.weak.expired() or record.version != t._version or record.alive == 0:
            return None
        return record

    # ------------------------------------------------------------------ pack
    def pack(self, t: torch.Tensor):
        is_param = isinstance(t, torch.nn.Parameter) or _is_param_cast(t)
        t = t.detach()  # pitfall 15: never retain the live tensor
        record = self.lookup(t)
        if record is None:
            record = self._new_record(t, is_param)
        self.raise_use_marker(record, self._where().use_marker)
        return _Handle(self, record, t)

    def raise_use_marker(self, record: _Record, marker: int) -> None:
        """`record` is needed in backward no earlier than block `marker`; so are its recipe's inputs."""
        record.use_marker = max(record.use_marker, marker)
        if record.recipe is not None:
            stack = list(record.recipe.inputs)
            while stack:
                item = stack.pop()
                if isinstance(item, _Handle):
                    item.record.use_marker = max(item.record.use_marker, marker)
                else:
                    stack.extend(item.inputs)

    def _new_record(self, t: torch.Tensor, is_param: bool) -> _Record:
        storage = t.untyped_storage()
        if not is_param and storage.data_ptr() != 0 and storage.data_ptr() in self.param_storages:
            is_param = True
        where = self._where()
        recipe = None
        if self.recipes is not None and not is_param:
            recipe = self.recipes.recipe_for(t)
        info = SavedRecord(index=len(self.records), nbytes=storage.nbytes(), module=where.module,
                           block=where.block, is_param=is_param, recompute=recipe is not None,
                           dtype=str(t.dtype).removeprefix("torch."))
        if recipe is not None:
            decision = RECOMPUTE
        elif is_param or not _is_plain_dense(t):
            decision = KEEP
        elif self.swapping and self.selector.decide(info):
            decision = SWAP
        else:
            decision = KEEP
        record = _Record(info, decision, self.step_id, t, where.use_marker)
        record.recipe = recipe
        self.records.append(info)
        self.decisions.append(decision)
        self.by_index.append(record)
        self.live[storage._cdata] = record
        if not is_param:
            self.stats.saved_bytes += record.nbytes
            self.stats.saved_tensors += 1
        if decision == RECOMPUTE:
            self.stats.recomputed_bytes += record.nbytes
            self.stats.recomputed_tensors += 1
        elif decision == SWAP and t.device.type == "meta":  # a trace: decide and count, move nothing
            self.stats.swapped_out_bytes += record.nbytes
            self.stats.swapped_tensors += 1
        elif decision == SWAP:
            self._swap_out(record, t)
        elif not is_param:
            self.stats.kept_bytes += record.nbytes
            if t.device.type != "meta":
                self._add_resident(record, record.nbytes)
        return record

    def _swap_out(self, record: _Record, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        compress = self.swap_cfg.compress == "bf16" and t.dtype == torch.float32
        if compress:
            record.typed_dtype = torch.float32
            record.host = self._arena(t.device).alloc(record.nbytes // 2).view(torch.bfloat16)
            source = _flat_typed(storage, torch.float32)
        else:
            record.host = self._arena(t.device).alloc(record.nbytes)
            source = _flat_bytes(storage)
        record.gpu_ref = t
        self._add_resident(record, record.nbytes)
        if t.device.type == "cuda":
            d2h, _ = self._copy_streams(t.device)
            ready = torch.cuda.current_stream(t.device).record_event()  # live compute stream (pitfall 5)
            d2h.wait_event(ready)
            start = torch.cuda.Event(enable_timing=True)
            record.d2h_done = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(d2h):
                start.record(d2h)
                record.host.copy_(source, non_blocking=True)
                record.d2h_done.record(d2h)
            self.timer.event_pairs.append((start, record.d2h_done))
            self._last_copy_events[("d2h", t.device)] = record.d2h_done
            if self.swap_cfg.sync:
                record.d2h_done.synchronize()
        else:
            began = time.perf_counter()
            record.host.copy_(source)
            self.timer.host_seconds += time.perf_counter() - began
        self.stats.swapped_out_bytes += record.nbytes
        self.stats.swapped_tensors += 1
        self.unreleased.append(record)
        self.unreleased_bytes += record.nbytes
        # Cap on device bytes held only because their copy may still be running (Megatron's
        # max_inflight_offloads): past it, release the oldest now (the compute stream waits for its copy).
        while self.unreleased_bytes > self.swap_cfg.max_inflight_bytes and self.unreleased:
            self._release(self.unreleased.popleft())

    # ------------------------------------------------------------------ forward release
    def release_completed(self) -> None:
        """A module starts: release swapped storages whose copy already finished (never waits)."""
        while self.unreleased:
            record = self.unreleased[0]
            if record.gpu_ref is not None and record.d2h_done is not None and not record.d2h_done.query():
                break  # FIFO on one copy stream: later copies are not done either
            self._release(self.unreleased.popleft())

    def release_pending(self) -> None:
        """A block starts: every swapped storage saved before it leaves the device."""
        while self.unreleased:
            self._release(self.unreleased.popleft())

    def _release(self, record: _Record) -> None:
        self.unreleased_bytes -= record.nbytes
        if record.gpu_ref is None:  # died meanwhile
            return
        if record.device.type == "cuda":
            # The block returns to the compute stream's pool only after the copy read it.
            torch.cuda.current_stream(record.device).wait_event(record.d2h_done)
        record.gpu_ref = None
        record.released = True
        self._drop_resident(record)
        self.released.append(record)

    # ------------------------------------------------------------------ backward
    def on_block_backward(self, marker: int) -> None:
        """Backward reached block `marker`: reload what is needed within `lookahead` blocks from here."""
        if not self.prefetch:
            return
        self._register_end_callback()
        lookahead = self.swap_cfg.lookahead
        if lookahead == 0:
            if self._learned_count != len(self.records):
                self._prefetch_next(after=None)
            return
        remaining = []
        for record in self.released:
            if record.alive == 0 or record.reloaded is not None:
                continue
            if record.use_marker + lookahead >= marker and record.pending > 0:
                self._reload(record)
            else:
                remaining.append(record)
        self.released = remaining

    def _prefetch_next(self, after: int | None) -> None:
        """lookahead 0: keep exactly one swapped tensor reloaded ahead of backward.

        The backward order is learned: the previous step's first-unpack order of records (forward
        ordinals), valid while the forward saves the same number of storages. Without it (first step),
        the heuristic is reverse forward order: the pending record with the largest ordinal below the
        one just unpacked. Either way at most one reload is outstanding; a wrong guess is a counted miss.
        """
        if self._learned_count == len(self.records) and after is not None and after in self._learned_position:
            candidates = (self.by_index[i] for i in self._learned_order[self._learned_position[after] + 1:]
                          if i < len(self.by_index))
        elif after is None:
            candidates = reversed(self.released)
        else:
            # Tensors one op saved together are unpacked in save order (ascending), so first the nearest
            # pending ones saved just after `after`, then the ones before it, nearest first.
            above = sorted((r for r in self.released if after < r.info.index <= after + 8),
                           key=lambda r: r.info.index)
            below = (r for r in reversed(self.released) if r.info.index < after)
            candidates = (*above, *below)
        for record in candidates:
            if not record.released or record.alive == 0 or record.pending == 0:
                continue
            if record.reloaded is None:
                self._reload(record)
            return

    def _reload(self, record: _Record) -> None:
        if record.stale:
            raise StaleSavedTensorError(
                f"a tensor saved in step {record.step} by {record.info.module or 'the model'} was used after "
                "the next engine.step() began; run backward before the next step")
        dtype = record.typed_dtype
        if record.device.type == "cuda":
            compute = torch.cuda.current_stream(record.device)
            # Allocated on the compute stream: freed and reused in compute order (pytorch #106360).
            if dtype is None:
                buffer = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)
            else:
                buffer = torch.empty(record.nbytes // 4, dtype=dtype, device=record.device)
            _, h2d = self._copy_streams(record.device)
            h2d.wait_stream(compute)
            h2d.wait_event(record.d2h_done)  # never read a host slot before its D2H landed (Megatron #7398)
            start = torch.cuda.Event(enable_timing=True)
            record.h2d_done = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(h2d):
                start.record(h2d)
                buffer.copy_(record.host, non_blocking=True)
                record.h2d_done.record(h2d)
            self.timer.event_pairs.append((start, record.h2d_done))
            self._last_copy_events[("h2d", record.device)] = record.h2d_done
            if self.swap_cfg.sync:
                record.h2d_done.synchronize()
        else:
            began = time.perf_counter()
            if dtype is None:
                buffer = torch.empty(record.nbytes, dtype=torch.uint8)
            else:
                buffer = torch.empty(record.nbytes // 4, dtype=dtype)
            buffer.copy_(record.host)
            self.timer.host_seconds += time.perf_counter() - began
        record.reloaded = buffer
        self.reloaded.append(record)
        self._add_resident(record, record.nbytes)
        self.stats.swapped_in_bytes += record.nbytes

    def _register_end_callback(self) -> None:
        """Once per backward pass: clean up what that pass did not unpack (unused heads, branches)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._callback_tasks:
            return
        self._callback_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        for record in self.reloaded:
            if record.reloaded is not None:
                self._drop_reloaded(record)
        self.reloaded = []

    def _drop_reloaded(self, record: _Record) -> None:
        if record.device.type == "cuda" and record.h2d_done is not None:
            # The buffer was written on the H2D stream; free it only after the compute stream has waited.
            torch.cuda.current_stream(record.device).wait_event(record.h2d_done)
        record.reloaded = None
        self._drop_resident(record)

    # ------------------------------------------------------------------ unpack
    def unpack(self, handle: _Handle) -> torch.Tensor:
        record = handle.record
        if handle.probe._version != handle.version:
            raise SavedTensorModifiedError(
                f"a tensor saved for backward by module {record.info.module or '<root>'!r} was modified in "
                f"place after it was saved (version {handle.version} -> {handle.probe._version}); "
                "use an out-of-place operation")
        self._register_end_callback()
        if handle.tensor is not None:
            out = handle.tensor
        elif record.decision == RECOMPUTE:
            storage = record.recipe.materialize(self).untyped_storage()
            out = _view_of(storage, handle.dtype, handle.size, handle.stride, handle.offset)
        else:
            out = self._unpack_swapped(record, handle)
        if not record.seen:
            record.seen = True
            self.unpack_order.append(record.info.index)
        if not handle.unpacked:
            handle.unpacked = True
            record.pending -= 1
            if record.pending == 0 and record.reloaded is not None:
                record.reloaded = None  # autograd's tensor now owns the storage
                self._drop_resident(record)
            if self.prefetch and self.swap_cfg.lookahead == 0 and self.released:
                self._prefetch_next(after=record.info.index)
        return out

    def _unpack_swapped(self, record: _Record, handle: _Handle) -> torch.Tensor:
        if record.gpu_ref is not None:  # never released (tail of the forward): still on the device
            storage = record.gpu_ref.untyped_storage()
        else:
            if record.reloaded is None:
                self.stats.prefetch_misses += 1  # still correct, just synchronous
                self._reload(record)
            if record.device.type == "cuda":
                if not record.h2d_done.query():
                    self.stats.late_reloads += 1
                torch.cuda.current_stream(record.device).wait_event(record.h2d_done)
            storage = record.reloaded.untyped_storage()
        return _view_of(storage, handle.dtype, handle.size, handle.stride, handle.offset)

    # ------------------------------------------------------------------ lifetime
    def _handle_died(self, handle: _Handle) -> None:
        record = handle.record
        record.alive -= 1
        if not handle.unpacked:
            record.pending -= 1
            if record.pending == 0 and record.reloaded is not None:
                self._drop_reloaded(record)
        if record.alive == 0:
            self._record_died(record)

    def _record_died(self, record: _Record) -> None:
        if record.reloaded is not None:
            self._drop_reloaded(record)
        if record.gpu_ref is not None and record.device.type == "cuda" and record.d2h_done is not None:
            torch.cuda.current_stream(record.device).wait_event(record.d2h_done)
        record.gpu_ref = None
        record.recipe = None
        self._drop_resident(record)
        if record.step == self.step_id:
            storage_key = record.weak.cdata
            if self.live.get(storage_key) is record:
                del self.live[storage_key]
