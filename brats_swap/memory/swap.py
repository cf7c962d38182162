"""The saved-tensor engine: carries out the rulebook on real tensors, through a host<->device link.

`SavedTensorEngine.pack` / `.unpack` are the two `torch.autograd.graph.saved_tensors_hooks`. Pack groups
saved tensors by storage (`StorageIndex`: an `Entry` of the rulebook per storage, a `_Handle` per saved
view) and reports the save to the step's `rulebook.Rulebook`, which decides (keep, swap, recompute) and
says when to copy out, release, reload and drop; `engine.py` reports module, block and backward events.
This class is the rulebook's `Executor`: it owns the tensors, the host arena and the copies, and decides
nothing itself.

Every copy goes through one narrow interface, a `link.CopyLink` (`link.open_link` picks CUDA streams,
an emulated asynchronous link on the CPU, or synchronous CPU copies):
`copy_out(host, source) -> event` and `copy_in(buffer, host, after=event) -> event`, where an event has
`done()` (asks, never blocks) and `wait()` (orders the compute after the copy: a device-side wait of the
compute stream on CUDA). The engine copies the whole storage, not the saved view: views, storage
offsets, padded strides and stride-0 (expanded) layouts are rebuilt exactly on the reloaded storage,
where `empty_like` + `copy_` of the view would lose them.

Memory safety on CUDA:

- a swapped storage stays referenced (`gpu_ref`) until its release, where the *compute* stream waits on
  its copy's event unless the copy was found finished: the caching allocator only tracks the stream
  that allocated a block, so a storage freed while a side stream still reads it could be reused under
  the copy; the event wait makes the free safe without `record_stream`, which would delay the reuse
  until the allocator polls the event and make peaks nondeterministic;
- reload buffers are allocated on the compute stream (freed and reused in compute order); the link's
  reload waits for the compute stream and for the storage's copy out (never read a host slot before
  its bytes landed); the compute waits for the reload at use, and before a buffer is dropped;
- a bf16-compressed storage is converted on the copy's own stream, before its event fires.

Safety rules implemented here:

- only `t.detach()` is ever retained: the pack hook receives the live tensor with its `grad_fn`, and
  keeping a saved *output* would make the cycle output -> grad_fn -> saved variable -> handle -> output,
  which no garbage collection reclaims when backward never runs (or runs with `retain_graph=True`);
  `detach` shares the storage and the version counter, and autograd re-attaches `grad_fn` on unpack;
- a storage saved twice (an in-place LeakyReLU saves its output and the next convolution saves the same
  storage as its input) is one record: keyed by the storage impl plus a `StorageWeakRef` (a recycled
  address of a dead storage never matches) and by the version counter (a storage changed in place
  since is a new record);
- every handle keeps a storage-less "version probe" sharing the saved tensor's version counter, so an
  in-place change after the save raises at unpack exactly as plain autograd would: autograd skips its
  own version check when saved-tensor hooks are installed;
- all state is per step (`begin_step` starts a new rulebook; the host arena is reused only after the
  link's copies finished), records die with their last handle, and handles of saved tensors that are
  never unpacked (a head whose loss term is unused) die with their graph, so no step leaks into the
  next; a graph kept past the next step raises `StaleSavedTensorError` instead of reading reused memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import _unsafe_preserve_version_counter
from torch.multiprocessing.reductions import StorageWeakRef

from brats_swap.config.schema import MemoryConfig
from brats_swap.memory.arena import HostArena
from brats_swap.memory.link import FINISHED, CopyLink, open_link
from brats_swap.memory.policy import RECOMPUTE_MODES, is_param_cast, is_plain_dense
from brats_swap.memory.rulebook import RECOMPUTE, SWAP, Entry, Rulebook
from brats_swap.memory.stats import StepStats


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


def _flat(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.Tensor:
    """The whole storage as one flat tensor of `dtype` (copies of it move every view at once)."""
    numel = storage.nbytes() // torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple, list or dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def saved_facts(t: torch.Tensor, is_param: bool, param_storages: set[int], input_storages: set[int]) -> dict:
    """What the rulebook needs to know about a storage at its first save (engine and tracer alike).

    `is_param` is what the pack hook saw before detaching (an `nn.Parameter`, an autocast copy of one);
    storages of parameters and buffers and of the model's inputs are matched by storage impl address.
    """
    storage = t.untyped_storage()
    key = storage._cdata
    return {"nbytes": storage.nbytes(), "dtype": str(t.dtype).removeprefix("torch."),
            "is_param": is_param or key in param_storages, "is_input": key in input_storages,
            "dense": is_plain_dense(t)}


def storage_keys(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def recipe_entries(recipe) -> list[Entry]:
    """The stored entries a norm_act recipe reads (through nested recipes): their use markers follow its."""
    stack, out = list(recipe.inputs), []
    while stack:
        item = stack.pop()
        if hasattr(item, "entry"):
            out.append(item.entry)
        else:
            stack.extend(item.inputs)
    return out


class StorageIndex:
    """The live entry of each saved storage, so every save of one storage is one record (engine and tracer)."""

    def __init__(self):
        self._by_key: dict[int, tuple[StorageWeakRef, int, Entry]] = {}

    def find(self, t: torch.Tensor) -> Entry | None:
        """The entry of `t`'s storage at `t`'s current version, if it is alive in this step."""
        hit = self._by_key.get(t.untyped_storage()._cdata)
        if hit is None:
            return None
        weak, version, entry = hit
        if weak.expired() or version != t._version or entry.alive == 0:
            return None
        return entry

    def add(self, t: torch.Tensor, entry: Entry) -> None:
        storage = t.untyped_storage()
        self._by_key[storage._cdata] = (StorageWeakRef(storage), t._version, entry)


class RecentRebuilds:
    """Results of nested norm_act recipes, kept for the entry that unpacks them next (engine and tracer).

    In a Conv -> Norm -> Act -> Conv chain, backward first unpacks the activation's output (the next
    convolution's input), whose recipe replays the norm and then the activation, and right after it the
    norm's output (the activation's own saved input), whose recipe would replay the norm again. Keeping
    the first replay's norm output until that unpack (one tensor, held across the next convolution's
    backward) saves the second replay: about half of norm_act's recompute time. A result is kept only
    while the entry whose recipe made it is alive and not unpacked by every handle; the replay is
    deterministic, so the kept tensor equals a second replay bit for bit.
    """

    def __init__(self):
        self._owner: dict[int, tuple[object, Entry]] = {}  # id(recipe) -> (recipe, its entry)
        self._kept: dict[int, tuple[object, torch.Tensor]] = {}

    def note(self, recipe, entry: Entry) -> None:
        """`entry` is rebuilt from `recipe` when unpacked."""
        self._owner[id(recipe)] = (recipe, entry)

    def rebuild(self, recipe, engine) -> torch.Tensor:
        """`recipe`'s result: the kept one, else a fresh replay (kept when its entry will want it)."""
        kept = self._kept.get(id(recipe))
        if kept is not None and kept[0] is recipe:
            return kept[1]
        out = recipe.materialize(engine)
        owner = self._owner.get(id(recipe))
        if owner is not None and owner[0] is recipe and owner[1].alive > 0 and owner[1].pending > 0:
            self._kept[id(recipe)] = (recipe, out)
        return out

    def forget(self, recipe) -> None:
        """Its entry needs the result no more (every handle unpacked, or dead); drop the references (the
        recipe holds the handles of its inputs)."""
        for table in (self._kept, self._owner):
            held = table.get(id(recipe))
            if held is not None and held[0] is recipe:
                del table[id(recipe)]


class _Slot:
    """The engine's tensors for one entry (its `payload`)."""

    __slots__ = ("step", "device", "gpu_ref", "host", "out_event", "reloaded", "in_event", "recipe")

    def __init__(self, step: int, t: torch.Tensor):
        self.step = step
        self.device = t.device
        self.gpu_ref: torch.Tensor | None = t  # the detached saved tensor, until release (swap only)
        self.host: torch.Tensor | None = None  # arena slice holding the storage's bytes (bf16 if compressed)
        self.out_event = FINISHED  # the copy out
        self.reloaded: torch.Tensor | None = None  # device buffer restored from host
        self.in_event = FINISHED
        self.recipe = None  # recompute: how to rebuild the storage


class _Handle:
    """What autograd stores instead of a saved tensor: a view description on an entry."""

    __slots__ = ("rulebook", "entry", "size", "stride", "offset", "dtype", "probe", "version", "tensor",
                 "unpacked")

    def __init__(self, rulebook: Rulebook, entry: Entry, t: torch.Tensor, keep_tensor: bool):
        self.rulebook = rulebook
        self.entry = entry
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype
        self.version = t._version
        self.unpacked = False
        self.tensor = t if keep_tensor else None  # already detached by pack
        self.probe = t if keep_tensor else _version_probe(t)

    def __del__(self):
        try:
            self.rulebook.handle_died(self.entry, self.unpacked)
        except Exception:  # interpreter shutdown: nothing left to account for
            pass


class SavedTensorEngine:
    """Pack/unpack hooks and the rulebook's executor. Used through `MemoryEngine`, which reports the
    module, block and backward events to `self.rulebook`. `log` (a list) receives the rulebook's
    per-tensor event sequence of every step (tests)."""

    def __init__(self, memory_cfg: MemoryConfig, *, param_storages: Callable[[], set[int]], prefetch: bool = True,
                 arena_bytes: int = 0, log: list | None = None):
        self.cfg = memory_cfg
        self.swap_cfg = memory_cfg.swap
        self.norm_act = memory_cfg.mode in RECOMPUTE_MODES and memory_cfg.recompute.norm_act
        self.prefetch = prefetch
        self.log = log
        self._param_storages = param_storages
        self.recipes = None  # set by MemoryEngine when norm_act is on (recompute.NormActRecipes)
        self._arena_bytes = arena_bytes
        self._arenas: dict[bool, HostArena] = {}
        self._links: dict[torch.device, CopyLink] = {}
        self.step_id = 0
        self.late_reloads = 0
        self._learned: tuple[list[int], int] | None = None
        self._callback_tasks: set[int] = set()
        self._new_rulebook()

    # ------------------------------------------------------------------ step lifecycle
    def _new_rulebook(self) -> None:
        self.rulebook = Rulebook(self.cfg, self, prefetch=self.prefetch, learned=self._learned, log=self.log)
        self.index = StorageIndex()
        self.rebuilds = RecentRebuilds()
        self.param_storages: set[int] = set()
        self.input_storages: set[int] = set()
        self.late_reloads = 0
        self._callback_tasks = set()

    def begin_step(self) -> None:
        """Start a new step: forget the last one (records still referenced by a retained graph go stale)."""
        # The arena may be rewritten only after last step's copies finished.
        for link in self._links.values():
            link.synchronize()
        for arena in self._arenas.values():
            arena.reset()
        if self.rulebook.unpack_order:
            self._learned = (self.rulebook.unpack_order, len(self.rulebook.entries))
        self.step_id += 1
        self._new_rulebook()
        self.param_storages = self._param_storages()

    def set_inputs(self, tensors) -> None:
        """The model's forward arguments (the caller holds them): never swapped."""
        self.input_storages |= storage_keys(tensors)

    def finish_forward(self) -> None:
        self.rulebook.forward_end()

    def on_block_backward(self, ordinal: int) -> None:
        self._register_end_callback()
        self.rulebook.marker(ordinal)

    def step_stats(self) -> StepStats:
        stats = self.rulebook.stats
        stats.late_reloads = self.late_reloads
        stats.copy_seconds = sum(link.seconds() for link in self._links.values())
        stats.arena_bytes = sum(arena.capacity for arena in self._arenas.values())
        return stats

    def close(self) -> None:
        """Wait for every copy, stop the links and return the host arenas."""
        for link in self._links.values():
            link.close()
        for arena in self._arenas.values():
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

    # ------------------------------------------------------------------ pack / unpack
    def lookup(self, t: torch.Tensor) -> Entry | None:
        """The live entry of `t`'s storage at `t`'s current version, if this step saved it."""
        return self.index.find(t)

    def pack(self, t: torch.Tensor) -> _Handle:
        is_param = isinstance(t, torch.nn.Parameter) or is_param_cast(t)
        t = t.detach()  # never retain the live tensor: its grad_fn would close a cycle (module docstring)
        entry = self.index.find(t)
        if entry is None:
            entry = self._first_save(t, is_param)
        else:
            self.rulebook.save_again(entry)
        keep = entry.decision not in (SWAP, RECOMPUTE) or t.device.type == "meta"
        return _Handle(self.rulebook, entry, t, keep_tensor=keep)

    def _first_save(self, t: torch.Tensor, is_param: bool) -> Entry:
        facts = saved_facts(t, is_param, self.param_storages, self.input_storages)
        recipe = None
        if self.recipes is not None and not facts["is_param"]:
            recipe = self.recipes.recipe_for(t)
        slot = _Slot(self.step_id, t)
        slot.recipe = recipe
        deps = recipe_entries(recipe) if recipe is not None else ()
        entry = self.rulebook.save(**facts, recompute=recipe is not None, deps=deps, payload=slot)
        if entry.decision != SWAP:
            slot.gpu_ref = None  # kept: the handles hold it; recomputed: rebuilt from the recipe
        if entry.decision == RECOMPUTE:
            self.rebuilds.note(recipe, entry)
        else:
            slot.recipe = None  # stored after all (`recompute.norm_act_exclude`)
        self.index.add(t, entry)
        return entry

    def rebuild(self, recipe) -> torch.Tensor:
        """`Recipe.materialize` asks this for a nested recipe's result (see `RecentRebuilds`)."""
        return self.rebuilds.rebuild(recipe, self)

    def unpack(self, handle: _Handle) -> torch.Tensor:
        entry = handle.entry
        if handle.probe._version != handle.version:
            raise SavedTensorModifiedError(
                f"a tensor saved for backward by module {entry.record.module or '<root>'!r} was modified in "
                f"place after it was saved (version {handle.version} -> {handle.probe._version}); "
                "use an out-of-place operation")
        self._register_end_callback()
        rulebook = handle.rulebook
        rulebook.unpack_begin(entry)
        slot: _Slot = entry.payload
        if handle.tensor is not None:
            out = handle.tensor
        elif entry.decision == RECOMPUTE:
            storage = self.rebuild(slot.recipe).untyped_storage()
            out = _view_of(storage, handle.dtype, handle.size, handle.stride, handle.offset)
        else:
            source = slot.gpu_ref if entry.unreleased else slot.reloaded
            out = _view_of(source.untyped_storage(), handle.dtype, handle.size, handle.stride, handle.offset)
        first = not handle.unpacked
        handle.unpacked = True
        rulebook.unpack_end(entry, first)
        if entry.decision == RECOMPUTE and entry.pending == 0:
            self.rebuilds.forget(slot.recipe)
        return out

    def _register_end_callback(self) -> None:
        """Once per backward pass: clean up what that pass did not unpack (unused heads, branches)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._callback_tasks:
            return
        self._callback_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(self.rulebook.backward_end)

    # ------------------------------------------------------------------ the rulebook's executor
    def swap_out(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        if slot.device.type == "meta":  # a trace: decide and count, move nothing
            return
        storage = slot.gpu_ref.untyped_storage()
        host = self._arena(slot.device).alloc(entry.transfer_bytes)
        if entry.transfer_bytes != entry.record.nbytes:  # bf16 on the host: the link converts
            slot.host = host.view(torch.bfloat16)
            source = _flat(storage, torch.float32)
        else:
            slot.host = host
            source = _flat(storage, torch.uint8)
        slot.out_event = self._link(slot.device).copy_out(slot.host, source)

    def copy_out_done(self, entry: Entry) -> bool:
        return entry.payload.out_event.done()

    def release(self, entry: Entry, wait: bool) -> None:
        slot: _Slot = entry.payload
        if wait:
            slot.out_event.wait()  # the block returns to the compute stream's pool only after the copy read it
        slot.gpu_ref = None

    def died(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        if slot.gpu_ref is not None:
            self.release(entry, wait=True)
        if slot.recipe is not None:
            self.rebuilds.forget(slot.recipe)
        slot.recipe = None  # its handles keep the recipe's inputs alive

    def reload(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        if slot.step != self.step_id:
            raise StaleSavedTensorError(
                f"a tensor saved in step {slot.step} by {entry.record.module or 'the model'} was used after "
                "the next engine.step() began; run backward before the next step")
        if slot.device.type == "meta":
            slot.reloaded = torch.empty(entry.record.nbytes, dtype=torch.uint8, device="meta")
            return
        # Allocated on the compute stream: freed and reused in compute order, never under the copy.
        if slot.host.dtype == torch.bfloat16:
            buffer = torch.empty(entry.record.nbytes // 4, dtype=torch.float32, device=slot.device)
        else:
            buffer = torch.empty(entry.record.nbytes, dtype=torch.uint8, device=slot.device)
        slot.in_event = self._link(slot.device).copy_in(buffer, slot.host, after=slot.out_event)
        slot.reloaded = buffer

    def await_reload(self, entry: Entry) -> None:
        event = entry.payload.in_event
        if not event.done():
            self.late_reloads += 1
        event.wait()

    def drop_reload(self, entry: Entry) -> None:
        slot: _Slot = entry.payload
        slot.in_event.wait()  # the buffer was written by the link: free it only after the compute waited
        slot.reloaded = None
