"""The executor: carries out the rulebook on real tensors, through a host arena and a host<->device link.

`SwapExecutor` is the back end of the saved-tensor front end (`frontend.SavedTensorFrontEnd`, which
reports every event to the rulebook) and the rulebook's `Executor`: it owns the saved tensors, the host
arena and the copies, and decides nothing itself.

Every copy goes through one narrow interface, a `link.CopyLink` (`link.open_link` picks CUDA streams,
an emulated asynchronous link on the CPU, or synchronous CPU copies):
`copy_out(host, source) -> event` and `copy_in(buffer, host, after=event) -> event`, where an event has
`done()` (asks, never blocks) and `wait()` (orders the compute after the copy: a device-side wait of the
compute stream on CUDA). The engine copies the whole storage, not the saved view: views, storage
offsets, padded strides and stride-0 (expanded) layouts are rebuilt exactly on the reloaded storage,
where `empty_like` + `copy_` of the view would lose them.

Memory safety on CUDA:

- a swapped storage stays referenced (`gpu_ref`) until its release, where the *compute* stream waits on
  its copy's event (device-side: the host runs on): the caching allocator only tracks the stream
  that allocated a block, so a storage freed while a side stream still reads it could be reused under
  the copy; the event wait makes the free safe without `record_stream`, which would delay the reuse
  until the allocator polls the event and make peaks nondeterministic;
- reload buffers are allocated on the compute stream (freed and reused in compute order); the link's
  reload waits for the compute stream and for the storage's copy out (never read a host slot before
  its bytes landed); the compute waits for the reload at use, and before a buffer is dropped;
- a bf16-compressed storage is converted on the copy's own stream, before its event fires, through a
  staging buffer allocated on the compute stream (so it comes from, and returns to, the pool the planner
  counts) and held until the compute has waited for that copy: from the save to the release for a copy
  out, from the reload to its first use (or its drop) for a copy in (`staging_bytes`, rulebook rule 15).
- a storage of an earlier step is never read from the reused arena: `StaleSavedTensorError` instead.
"""

from __future__ import annotations

import torch

from brats_swap.config.schema import MemoryConfig
from brats_swap.memory.arena import HostArena, empty_unfilled
from brats_swap.memory.frontend import BackEnd, SavedHandle, view_of
from brats_swap.memory.link import FINISHED, CopyLink, open_link
from brats_swap.memory.rulebook import RECOMPUTE, SWAP, Entry, EntryState
from brats_swap.memory.stats import StepStats


class StaleSavedTensorError(RuntimeError):
    """A swapped tensor of an earlier step was unpacked after the next step reused the host arena."""


def _flat(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.Tensor:
    """The whole storage as one flat tensor of `dtype` (copies of it move every view at once)."""
    numel = storage.nbytes() // torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


class _Slot:
    """The executor's tensors for one entry (its `payload`)."""

    __slots__ = ("step", "device", "gpu_ref", "host", "out_event", "reloaded", "in_event", "recipe", "staging")

    def __init__(self, step: int, t: torch.Tensor):
        self.step = step
        self.device = t.device
        self.gpu_ref: torch.Tensor | None = t  # the detached saved tensor, until release (swap only)
        self.host: torch.Tensor | None = None  # arena slice holding the storage's bytes (bf16 if compressed)
        self.out_event = FINISHED  # the copy out
        self.reloaded: torch.Tensor | None = None  # device buffer restored from host
        self.in_event = FINISHED
        self.recipe = None  # recompute: how to rebuild the storage (set by the front end)
        self.staging: torch.Tensor | None = None  # CUDA bf16 transport: the conversion's buffer (module docstring)


class SwapExecutor(BackEnd):
    """The rulebook's executor on real tensors. `arena_bytes`: the host arena's planned size; `host_arena`:
    an arena the caller owns and lends (reused across engines, never closed here)."""

    def __init__(self, memory_cfg: MemoryConfig, *, arena_bytes: int = 0, host_arena: HostArena | None = None):
        self.swap_cfg = memory_cfg.swap
        self._arena_bytes = arena_bytes
        self._arenas: dict[bool, HostArena] = {}
        self._lent = host_arena
        if host_arena is not None:
            host_arena.reset()
            self._arenas[host_arena.pin] = host_arena
        self._links: dict[torch.device, CopyLink] = {}
        self.late_reloads = 0

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self) -> None:
        # The arena is rewritten by this step's copies out: they run after last step's copies (a fence on
        # the copy engines; the host does not wait), unless an arena that spilled frees memory now.
        freeing = any(arena.spilled for arena in self._arenas.values())
        for link in self._links.values():
            if freeing:
                link.synchronize()
            else:
                link.fence()
        for arena in self._arenas.values():
            arena.reset()
        self.late_reloads = 0

    def step_stats(self) -> StepStats:
        stats = self.front.rulebook.stats
        stats.late_reloads = self.late_reloads
        stats.copy_seconds = sum(link.seconds() for link in self._links.values())
        stats.arena_bytes = sum(arena.capacity for arena in self._arenas.values())
        return stats

    def close(self) -> None:
        """Wait for every copy, stop the links and return the host arenas."""
        for link in self._links.values():
            link.close()
        for arena in self._arenas.values():
            if arena is not self._lent:
                arena.close()
        self._links, self._arenas = {}, {}

    def _link(self, device: torch.device) -> CopyLink:
        if device not in self._links:
            self._links[device] = open_link(device, self.swap_cfg)
        return self._links[device]

    def reserve_arena(self, device: torch.device) -> None:
        """Allocate (and pin, on CUDA) the planned host arena now, so that a host without the memory
        fails with a one-line error before the first step instead of in the middle of a forward."""
        self._arena(device)

    def _arena(self, device: torch.device) -> HostArena:
        pin = device.type == "cuda"
        if pin not in self._arenas:
            self._arenas[pin] = HostArena(self._arena_bytes, pin=pin)
        return self._arenas[pin]

    # ------------------------------------------------------------------ the front end's back end
    def new_payload(self, t: torch.Tensor) -> _Slot:
        return _Slot(self.front.step_id, t)

    def saved(self, entry: Entry, t: torch.Tensor) -> None:
        if entry.decision != SWAP:
            entry.payload.gpu_ref = None  # kept: the handles hold it; recomputed: rebuilt from the recipe

    def holds(self, entry: Entry, t: torch.Tensor) -> bool:
        """The handle itself keeps the tensor: kept storages (and everything on `meta`)."""
        return entry.decision not in (SWAP, RECOMPUTE) or t.device.type == "meta"

    def stored_view(self, handle: SavedHandle) -> torch.Tensor:
        slot: _Slot = handle.entry.payload
        source = slot.gpu_ref if handle.entry.state is EntryState.COPYING else slot.reloaded
        return view_of(source.untyped_storage(), handle.dtype, handle.size, handle.stride, handle.offset)

    # ------------------------------------------------------------------ the rulebook's executor
    def copies_synchronously(self) -> bool:
        return any(not link.asynchronous for link in self._links.values())

    def staging_bytes(self, entry: Entry) -> int:
        """Device bytes of the conversion buffer a copy of `entry` holds: CUDA bf16 transport only."""
        return entry.transfer_bytes if entry.compressed and entry.payload.device.type == "cuda" else 0

    def _staging(self, entry: Entry) -> torch.Tensor | None:
        """A bf16 buffer on the compute stream for the link's conversion (CUDA), else None."""
        if not self.staging_bytes(entry):
            return None
        return empty_unfilled(entry.transfer_bytes // 2, dtype=torch.bfloat16, device=entry.payload.device)

    def swap_out(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        if slot.device.type == "meta":  # a trace: decide and count, move nothing
            return
        storage = slot.gpu_ref.untyped_storage()
        host = self._arena(slot.device).alloc(entry.transfer_bytes)
        if entry.compressed:  # bf16 on the host: the link converts
            slot.host = host.view(torch.bfloat16)
            source = _flat(storage, torch.float32)
        else:
            slot.host = host
            source = _flat(storage, torch.uint8)
        slot.staging = self._staging(entry)
        slot.out_event = self._link(slot.device).copy_out(slot.host, source, staging=slot.staging)

    def release(self, entry: Entry, wait: bool) -> None:
        slot: _Slot = entry.payload
        if wait:
            slot.out_event.wait()  # the block returns to the compute stream's pool only after the copy read it
        slot.gpu_ref = slot.staging = None

    def died(self, entry: Entry) -> None:
        if entry.payload.gpu_ref is not None:
            self.release(entry, wait=True)
        super().died(entry)

    def reload(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        if slot.step != self.front.step_id:
            raise StaleSavedTensorError(
                f"a tensor saved in step {slot.step} by {entry.record.module or 'the model'} was used after "
                "the next engine.step() began; run backward before the next step")
        if slot.device.type == "meta":
            slot.reloaded = torch.empty(entry.record.nbytes, dtype=torch.uint8, device="meta")
            return
        # Allocated on the compute stream: freed and reused in compute order, never under the copy.
        if slot.host.dtype == torch.bfloat16:
            buffer = empty_unfilled(entry.record.nbytes // 4, dtype=torch.float32, device=slot.device)
        else:
            buffer = empty_unfilled(entry.record.nbytes, dtype=torch.uint8, device=slot.device)
        slot.staging = self._staging(entry)
        slot.in_event = self._link(slot.device).copy_in(buffer, slot.host, after=slot.out_event, staging=slot.staging)
        slot.reloaded = buffer

    def await_reload(self, entry: Entry) -> None:
        event = entry.payload.in_event
        if not event.done():
            self.late_reloads += 1
        event.wait()
        entry.payload.staging = None  # the compute waited for the copy that used it

    def drop_reload(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        slot.in_event.wait()  # the buffer was written by the link: free it only after the compute waited
        slot.reloaded = slot.staging = None
