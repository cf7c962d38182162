"""The saved-tensor front end: the one place that sees a step's events and reports them to the rulebook.

`SavedTensorFrontEnd` installs the module hooks (module start/end, and a `grad_fn` prehook on each
block's outputs: the backward markers), runs the forward under `saved_tensors_hooks` (`pack` /
`unpack`), groups saved tensors by storage (`StorageIndex`: one rulebook `Entry` per storage, one
`SavedHandle` per saved view), queues the end-of-backward callback, and turns all of it into typed
`events.Event`s that `events.deliver` hands to the step's `rulebook.Rulebook`. It decides nothing.

Its back end (`BackEnd`) is the rulebook's executor and owns the tensors:

- `executor.SwapExecutor`: real tensors, a host arena and a copy link (the engine at run time);
- `recorder.TraceRecorder`: `meta` tensors; it records every event and operator into a `trace_data.Trace`
  (what the planner and the simulator replay), and hands backward fresh storages instead of saved ones.

Safety rules implemented here (both back ends):

- only `t.detach()` is ever retained: the pack hook receives the live tensor with its `grad_fn`, and
  keeping a saved *output* would make the cycle output -> grad_fn -> saved variable -> handle -> output,
  which no garbage collection reclaims when backward never runs (or runs with `retain_graph=True`);
- a storage saved twice (an in-place LeakyReLU saves its output and the next convolution saves the same
  storage as its input) is one record: keyed by the storage impl plus a `StorageWeakRef` (a recycled
  address of a dead storage never matches) and by the version counter (a storage changed in place
  since is a new record), as `storage_map.StorageMap` keys it (the norm_act recipes use the same map);
- every handle the executor makes keeps a storage-less "version probe" sharing the saved tensor's
  version counter, so an in-place change after the save raises at unpack exactly as plain autograd
  would: autograd skips its own version check when saved-tensor hooks are installed;
- a retained graph (`backward(retain_graph=True)`, then another backward) unpacks its handles again: a
  swapped storage is reloaded again, and a recomputed one keeps its recipe until its entry dies, so the
  second pass rebuilds it as the first did;
- all state is per step (`begin_step` starts a new rulebook), records die with their last handle, and
  handles of saved tensors that are never unpacked die with their graph, so no step leaks into the next;
  a handle reports to the rulebook of its own step.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.autograd import _unsafe_preserve_version_counter
from torch.utils._pytree import tree_leaves

from brats_swap.config.schema import MemoryConfig
from brats_swap.memory.events import Event, EventKind, deliver
from brats_swap.memory.records import is_param_cast, is_plain_dense
from brats_swap.memory.rulebook import RECOMPUTE, Entry, Rulebook, SaveFacts
from brats_swap.memory.storage_map import StorageMap

# Models with a live engine (model -> weak reference to it), set by `engine.MemoryEngine`: the engine's
# hooks, wrappers and per-step state must not be copied with the model (`recorder.meta_copy` refuses such a
# model rather than duplicate the engine's weak storage references, which would be freed twice).
ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

COMPUTE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
)


class SavedTensorModifiedError(RuntimeError):
    """A tensor saved for backward was modified in place before backward used it."""


def discover_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Blocks for prefetch markers, found structurally: the innermost modules that own a conv/linear layer.

    A module is a candidate when one of its direct children is a convolution or linear layer. Candidates
    that contain other candidates are not blocks themselves; their direct conv/linear children are, unless
    a candidate inside holds the same layer; a ModuleList / ModuleDict (never called) is not a block either:
    its layers are. For the U-Net each ConvNormAct is a block (and a bare 1x1 segmentation conv); for
    nnU-Net's networks each ConvDropoutNormReLU's `all_modules`, each transposed conv and segmentation layer. Returns (name, module)
    pairs in registration order; block *ordinals* are assigned per call at run time.
    """
    parents: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(isinstance(child, COMPUTE_TYPES) for child in module.children()):
            parents[name] = module
    if not parents:
        return [("", model)] if isinstance(model, COMPUTE_TYPES) else []

    def contains_candidate(name: str) -> bool:
        prefix = f"{name}." if name else ""
        return any(other != name and other.startswith(prefix) for other in parents)

    def in_candidate_below(name: str, layer: nn.Module) -> bool:
        """The layer is also a child of a candidate inside `name` (nnU-Net's ConvDropoutNormReLU holds its conv
        as `conv` and again in `all_modules`, which runs it): that candidate is its block."""
        prefix = f"{name}." if name else ""
        return any(other.startswith(prefix) and any(c is layer for c in parents[other].children())
                   for other in parents if other != name)

    blocks: list[tuple[str, nn.Module]] = []
    for name, module in parents.items():
        # A ModuleList / ModuleDict is never called, so it cannot mark anything: its layers are the blocks.
        if not contains_candidate(name) and not isinstance(module, nn.ModuleList | nn.ModuleDict):
            blocks.append((name, module))
            continue
        for child_name, child in module.named_children():
            if isinstance(child, COMPUTE_TYPES) and not in_candidate_below(name, child):
                blocks.append((f"{name}.{child_name}" if name else child_name, child))
    return blocks


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in a (nested) structure: the tensor leaves of torch's pytree (tuples, lists, dicts,
    named tuples, ...), in order."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def storage_keys(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def view_of(storage: torch.UntypedStorage, dtype: torch.dtype, size, stride, offset: int) -> torch.Tensor:
    """Rebuild a saved view on a (kept, reloaded or recomputed) storage."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _version_probe(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `t`'s version counter but holds no storage.

    `detach()` shares storage and version counter; pointing the copy at an empty storage drops the
    storage reference. `set_` would bump the shared counter, hence `_unsafe_preserve_version_counter`.
    """
    probe = t.detach()
    with torch.no_grad(), _unsafe_preserve_version_counter(probe):
        probe.set_(torch.empty(0, dtype=t.dtype, device=t.device))
    return probe


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


class StorageIndex(StorageMap[Entry]):
    """The live entry of each saved storage, so every save of one storage is one record."""

    def find(self, t: torch.Tensor) -> Entry | None:
        """The entry of `t`'s storage at `t`'s current version, if it is alive in this step."""
        entry = self.get(t)
        return None if entry is None or entry.alive == 0 else entry

    add = StorageMap.put


class RecentRebuilds:
    """Results of nested norm_act recipes, kept for the entry that unpacks them next.

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

    def rebuild(self, recipe, front: SavedTensorFrontEnd) -> torch.Tensor:
        """`recipe`'s result: the kept one, else a fresh replay (kept when its entry will want it)."""
        kept = self._kept.get(id(recipe))
        if kept is not None and kept[0] is recipe:
            return kept[1]
        out = recipe.materialize(front)
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


class SavedHandle:
    """What autograd stores instead of a saved tensor: a view description on an entry of one step."""

    __slots__ = ("front", "rulebook", "entry", "size", "stride", "offset", "dtype", "nbytes", "probe", "version",
                 "tensor", "unpacked")

    def __init__(self, front: SavedTensorFrontEnd, entry: Entry, t: torch.Tensor, keep_tensor: bool):
        self.front = front
        self.rulebook = front.rulebook
        self.entry = entry
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype
        self.nbytes = t.untyped_storage().nbytes()
        self.version = t._version
        self.unpacked = False
        self.tensor = t if keep_tensor else None  # already detached by pack
        self.probe = None
        if front.backend.checks_versions:
            self.probe = t if keep_tensor else _version_probe(t)

    def __del__(self):
        try:
            self.front.handle_died(self)
        except Exception:  # interpreter shutdown: nothing left to account for
            pass


class BackEnd:
    """What the front end asks of its back end besides the rulebook's `Executor` methods. The defaults
    are those of a back end that records nothing (the executor); the recorder overrides them."""

    checks_versions = True  # handles keep a version probe (module docstring)
    front: SavedTensorFrontEnd

    def now(self) -> int:
        """The op index of the next event (the recorder's clock)."""
        return 0

    def record(self, event: Event) -> None:
        """Every event, before the rulebook sees it."""

    def module_entered(self, name: str) -> None:
        """A module's forward starts, in or outside the step's forward (recomputation)."""

    def module_left(self) -> None:
        """The innermost running module's forward returned."""

    def recomputing(self) -> contextlib.AbstractContextManager:
        """Around a norm_act recipe's replay in backward."""
        return contextlib.nullcontext()

    def begin_step(self) -> None:
        """A new step starts (the front end's per-step state is new)."""

    def staging_bytes(self, entry: Entry) -> int:
        """The rulebook's `Executor.staging_bytes`: no conversion buffers."""
        return 0

    def copies_synchronously(self) -> bool:
        """The rulebook's `Executor.copies_synchronously`: nothing is copied."""
        return True

    def died(self, entry: Entry) -> None:
        """Rule 14 (the rulebook's `Executor.died`): a dead entry's recipe is forgotten."""
        self.front.forget_recipe(entry)


class SavedTensorFrontEnd:
    """Hooks, step and events (module docstring). `param_storages()` gives the storage keys of the model's
    parameters and buffers at each step; `log` (a list) receives the rulebook's per-tensor event sequence
    of every step; `prefetch=False` issues no reload ahead of use (tests)."""

    def __init__(self, memory_cfg: MemoryConfig, backend, *, param_storages: Callable[[], set[int]],
                 prefetch: bool = True, log: list | None = None):
        self.cfg = memory_cfg
        self.backend = backend
        backend.front = self
        self.prefetch = prefetch
        self.log = log
        self._param_storages = param_storages
        self.recipes = None  # recompute.NormActRecipes when norm_act is on
        self.step_id = 0
        self.in_forward = False
        self.module_names: list[str] = []
        self._module_ids: dict[str, int] = {}
        self._hooks: list = []
        self._learned: tuple[list[int], int] | None = None
        self._new_step()

    # ------------------------------------------------------------------ step lifecycle
    def _new_step(self) -> None:
        self.rulebook = Rulebook(self.cfg, self.backend, prefetch=self.prefetch, learned=self._learned, log=self.log)
        self.index = StorageIndex()
        self.rebuilds = RecentRebuilds()
        self.param_storages: set[int] = set()
        self.input_storages: set[int] = set()
        self.regions: list[list[int]] = []
        self._callback_tasks: set[int] = set()
        self._facts: SaveFacts | None = None

    def begin_step(self) -> None:
        """Start a new step: forget the last one (records still referenced by a retained graph go stale)."""
        self.backend.begin_step()
        if self.rulebook.unpack_order:
            self._learned = (self.rulebook.unpack_order, len(self.rulebook.entries))
        self.step_id += 1
        self._new_step()
        self.param_storages = self._param_storages()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run the forward (and loss) of one step inside this context: the saved-tensor hooks are active
        and module events count; its end is the forward's end. Backward runs after it."""
        if self.in_forward:
            raise RuntimeError("MemoryEngine.step() is not re-entrant")
        self.begin_step()
        self.in_forward = True
        if self.recipes is not None:
            self.recipes.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.in_forward = False
            if self.recipes is not None:
                self.recipes.active = False
                self.rulebook.stats.norm_act_skipped = dict(self.recipes.skipped)
                self.recipes.reset()
            self.emit(EventKind.FORWARD_END)

    def install(self, model: nn.Module, blocks: list[tuple[str, nn.Module]],
                inside_compiled: Callable[[nn.Module], str | None] = lambda module: None) -> None:
        """Module hooks on every submodule of `model`; `blocks` (name, module) pairs get backward markers.
        A module inside a compiled region (`inside_compiled` names the region) gets none: its region's
        hooks stand for it, and the compiled graph must not trace ours (`compiled.py`)."""
        block_ids = {id(module) for _name, module in blocks}
        for name, module in model.named_modules():
            if inside_compiled(module) is not None:
                continue
            is_block = id(module) in block_ids
            self._hooks.append(module.register_forward_pre_hook(
                functools.partial(self._module_start, name, is_block, module is model), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                functools.partial(self._module_end, is_block), always_call=True))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ------------------------------------------------------------------ events
    def emit(self, kind: EventKind, arg: int = 0, flag: bool = False, rulebook: Rulebook | None = None):
        """Record the event (recorder) and deliver it to the rulebook (that of the handle's step, when
        given): `events.deliver`'s result."""
        event = Event(self.backend.now(), kind, arg, flag)
        self.backend.record(event)
        return deliver(rulebook if rulebook is not None else self.rulebook, event, self)

    def module_name(self, index: int) -> str:
        return self.module_names[index]

    def region(self, index: int) -> list[int]:
        return self.regions[index]

    def first_save(self, index: int) -> SaveFacts:
        return self._facts

    # ------------------------------------------------------------------ module and block events
    def _module_start(self, name: str, is_block: bool, root: bool, module: nn.Module, args, kwargs) -> None:
        self.backend.module_entered(name)
        if not self.in_forward:
            return
        if root:  # the model's forward arguments (the caller holds them): never swapped
            self.input_storages |= storage_keys(tensors_in((args, kwargs)))
        if name not in self._module_ids:
            self._module_ids[name] = len(self.module_names)
            self.module_names.append(name)
        self.emit(EventKind.MODULE_START, self._module_ids[name], is_block)

    def _module_end(self, is_block: bool, module: nn.Module, args, output) -> None:
        self.backend.module_left()
        if not self.in_forward:
            return
        ordinal = self.emit(EventKind.MODULE_END, 0, is_block)
        if ordinal is None:
            return
        marker = functools.partial(self._block_backward, self.step_id, ordinal)
        for tensor in tensors_in(output):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(marker)

    def _block_backward(self, step_id: int, ordinal: int, grad_outputs) -> None:
        if step_id == self.step_id:
            self._register_end_callback()
            self.emit(EventKind.MARKER, ordinal)

    def checkpoint_called(self) -> None:
        """A checkpointed module (`recompute.modules`) runs in this forward."""
        if self.in_forward:
            self.rulebook.stats.recomputed_modules += 1

    def region_done(self, args: tuple) -> None:
        """A checkpointed region returned: its saved inputs are needed when backward reruns it."""
        if not self.in_forward:
            return
        entries = [entry for entry in (self.index.find(t) for t in tensors_in(list(args))) if entry is not None]
        self.regions.append([entry.index for entry in entries])
        self.emit(EventKind.REGION_DONE, len(self.regions) - 1)

    # ------------------------------------------------------------------ pack / unpack
    def lookup(self, t: torch.Tensor) -> Entry | None:
        """The live entry of `t`'s storage at `t`'s current version, if this step saved it."""
        return self.index.find(t)

    def pack(self, t: torch.Tensor) -> SavedHandle:
        is_param = isinstance(t, nn.Parameter) or is_param_cast(t)
        t = t.detach()  # never retain the live tensor: its grad_fn would close a cycle (module docstring)
        entry = self.index.find(t)
        if entry is None:
            entry = self._first_save(t, is_param)
        else:
            self.emit(EventKind.SAVE_AGAIN, entry.index)
        return SavedHandle(self, entry, t, keep_tensor=self.backend.holds(entry, t))

    def _first_save(self, t: torch.Tensor, is_param: bool) -> Entry:
        storage = t.untyped_storage()
        key = storage._cdata
        recipe = None
        is_param = is_param or key in self.param_storages
        if self.recipes is not None and not is_param:
            recipe = self.recipes.recipe_for(t)
        payload = self.backend.new_payload(t)
        self._facts = SaveFacts(
            nbytes=storage.nbytes(), dtype=str(t.dtype).removeprefix("torch."), is_param=is_param,
            is_input=key in self.input_storages, dense=is_plain_dense(t), recompute=recipe is not None,
            deps=recipe_entries(recipe) if recipe is not None else [], payload=payload)
        entry = self.emit(EventKind.SAVE, len(self.rulebook.entries))
        self._facts = None
        if entry.decision == RECOMPUTE:
            payload.recipe = recipe
            self.rebuilds.note(recipe, entry)
        self.backend.saved(entry, t)
        self.index.add(t, entry)
        return entry

    def rebuild(self, recipe) -> torch.Tensor:
        """`Recipe.materialize` asks this for a nested recipe's result (see `RecentRebuilds`)."""
        return self.rebuilds.rebuild(recipe, self)

    def forget_recipe(self, entry: Entry) -> None:
        """`entry` will not be rebuilt again: drop its recipe (which holds the handles of its inputs)."""
        recipe = entry.payload.recipe
        if recipe is not None:
            self.rebuilds.forget(recipe)
            entry.payload.recipe = None

    def unpack(self, handle: SavedHandle) -> torch.Tensor:
        entry = handle.entry
        if handle.probe is not None and handle.probe._version != handle.version:
            raise SavedTensorModifiedError(
                f"a tensor saved for backward by module {entry.record.module or '<root>'!r} was modified in "
                f"place after it was saved (version {handle.version} -> {handle.probe._version}); "
                "use an out-of-place operation")
        self._register_end_callback()
        self.emit(EventKind.UNPACK_BEGIN, entry.index, rulebook=handle.rulebook)
        if handle.tensor is not None:
            out = handle.tensor
        elif entry.decision == RECOMPUTE:  # rebuilt by running the recipe
            with self.backend.recomputing():
                storage = self.rebuild(entry.payload.recipe).untyped_storage()
            out = view_of(storage, handle.dtype, handle.size, handle.stride, handle.offset)
        else:
            out = self.backend.stored_view(handle)
        first = not handle.unpacked
        handle.unpacked = True
        self.emit(EventKind.UNPACK_END, entry.index, first, rulebook=handle.rulebook)
        if entry.decision == RECOMPUTE and entry.pending == 0:
            # Every handle has unpacked once: the kept replay goes, but the recipe stays until the entry dies
            # (rule 14). A retained graph (`backward(retain_graph=True)`, then another backward) unpacks the
            # same handles again; without retain_graph they die right after their node, taking the recipe.
            self.rebuilds.forget(entry.payload.recipe)
        return out

    def handle_died(self, handle: SavedHandle) -> None:
        self.emit(EventKind.HANDLE_DIED, handle.entry.index, handle.unpacked, rulebook=handle.rulebook)

    def _register_end_callback(self) -> None:
        """Once per backward pass: clean up what that pass did not unpack (unused heads, branches)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._callback_tasks:
            return
        self._callback_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(self.emit, EventKind.BACKWARD_END, rulebook=self.rulebook))
