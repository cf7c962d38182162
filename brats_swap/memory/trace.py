"""Trace one training step on the `meta` device: what is saved for backward, when, and what it costs.

The planner needs, for a model at the real size (192³, batch 2), the full life of every tensor in one
forward + backward: when its storage is allocated, when it would die if autograd did not hold it, which
storages autograd saves (grouped into records exactly as the engine groups them), every event the
memory engine reacts to, and the FLOPs and bytes of every operator. Running the step on `meta` tensors
gives all of it in seconds and without memory: meta tensors have shapes, dtypes, strides, storages and
version counters, but no data.

Three PyTorch mechanisms do the recording:

- a `TorchDispatchMode` sees every aten operator (forward, backward and recomputation alike): it
  numbers them (the "op index" is the trace's clock), registers each new output storage, and notices a
  storage's death through a weak storage reference (`StorageWeakRef.expired()`), checked before each op;
- `saved_tensors_hooks` see every tensor autograd saves. The pack hook groups saves into records with
  the engine's own `swap.StorageIndex` and `swap.saved_facts` and, on purpose, does NOT keep the tensor:
  the trace then shows when each saved storage would die without autograd's reference (what swapping
  can gain). The unpack hook hands backward a fresh meta tensor of the same layout (an "artifact") whose
  death marks when the node that used it has finished;
- module forward hooks and a `grad_fn` prehook on each block output, installed as the engine installs
  them (`discover_blocks`), see the module, block and backward-marker events.

Every event the engine reports to its `rulebook.Rulebook` (module start/end, save, save again, region
done, forward end, marker, unpack, handle death, backward end) is recorded in `Trace.events` with the op
index at which it happened, so `simulate.py` can replay the step through a rulebook under any swap
policy: the engine's decisions and release/reload points, event for event.

Recompute variants run the engine's own machinery on the meta copy: `CheckpointedModules` wraps modules
in non-reentrant checkpointing, `NormActRecipes` recognises norm/activation outputs, and the trace
materializes their recipes in backward, so recomputation shows up as real operators and storages.

Why our own tracer instead of `torch.utils.flop_counter.FlopCounterMode` or `torch.cuda.memory`
snapshots: neither reports saved-tensor lifetimes, and snapshots need a GPU at the real size. We do use
the flop counter's formula table (`flop_registry`) for convolution FLOPs.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from brats_swap.config import MemoryConfig, RecomputeConfig
from brats_swap.memory.engine import ATTACHED, discover_blocks
from brats_swap.memory.policy import SavedRecord, is_param_cast
from brats_swap.memory.recompute import CheckpointedModules, NormActRecipes
from brats_swap.memory.rulebook import RECOMPUTE, Entry, Rulebook
from brats_swap.memory.swap import (
    RecentRebuilds,
    StorageIndex,
    recipe_entries,
    saved_facts,
    storage_keys,
    tensors_in,
)

FORWARD, BACKWARD = 0, 1

# Trace.events kinds: (op index, kind, a, b); a and b as noted.
SAVE, SAVE_AGAIN = 0, 1  # a: record index
MODULE_START, MODULE_END = 2, 3  # a: index into Trace.module_names (start only); b: is a block
REGION_DONE = 4  # a: index into Trace.regions (record indices of a checkpointed region's saved inputs)
FORWARD_END = 5
MARKER = 6  # a: block ordinal
UNPACK_BEGIN, UNPACK_END = 7, 8  # a: record index; b (end): first unpack of that handle
HANDLE_DIED = 9  # a: record index; b: the handle was unpacked
BACKWARD_END = 10

# Ops that only reinterpret or allocate: no kernel runs, so they cost no time in the time model.
_NO_KERNEL = {"view", "_unsafe_view", "as_strided", "expand", "permute", "t", "transpose", "unsqueeze",
              "squeeze", "detach", "alias", "slice", "select", "reshape", "empty", "empty_strided",
              "empty_like", "set_", "lift_fresh", "split", "unbind", "_reshape_alias", "view_as",
              "split_with_sizes", "unflatten", "flatten", "_to_copy_view", "new_empty", "new_empty_strided"}


@dataclass
class Storage:
    """One physical storage seen during the step (an activation, a gradient, a temporary)."""

    sid: int
    nbytes: int
    alloc_op: int
    free_op: int = -1  # first op index at which the storage was seen dead; -1 = alive at the end
    artifact_of: int = -1  # >= 0: a tensor the trace's unpack hook made for record `artifact_of`


@dataclass
class TracedRecord:
    """A `SavedRecord` plus where it lives in the trace."""

    record: SavedRecord
    sid: int  # physical storage (-1 for parameters and buffers, which live outside the step)
    deps: list[int] = field(default_factory=list)  # recomputed: the stored records its recipe reads
    artifact_sids: list[int] = field(default_factory=list)  # one storage per unpack, in unpack order


@dataclass
class OpInfo:
    name: str
    phase: int  # FORWARD or BACKWARD
    flops: float
    bytes_accessed: int  # bytes of the views read and written, per distinct storage at most its size
    kernel: bool  # False for view-like ops that launch nothing
    module: str = ""  # innermost running module ("" in backward outside recomputation)
    recompute: bool = False  # part of a recomputation in backward (checkpoint or norm_act recipe)


@dataclass
class Trace:
    """Everything the memory and time simulations need, for one (model, input shape, dtype, variant)."""

    input_shape: tuple[int, ...]
    dtype: str
    variant: str
    ops: list[OpInfo]
    storages: list[Storage]
    records: list[TracedRecord]
    events: list[tuple[int, int, int, int]]  # (op index, kind, a, b): see the kinds above
    module_names: list[str]
    regions: list[list[int]]
    fwd_end: int  # op index where backward starts
    param_bytes: int
    buffer_bytes: int
    input_bytes: int  # the batch and its target (also storages of the trace, alive for the whole step)
    seconds: float = 0.0
    cache: dict = field(default_factory=dict, repr=False)  # derived arrays, filled by the simulator

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def saved_bytes(self) -> int:
        """Bytes of distinct non-parameter storages saved for backward (the engine's `saved_bytes`)."""
        return sum(r.record.nbytes for r in self.records if not r.record.is_param)

    def saved_records(self) -> list[SavedRecord]:
        return [r.record for r in self.records]

    def unpack_order(self) -> list[int]:
        """Record indices in first-unpack order: what the engine learns in one step for lookahead 0."""
        seen: dict[int, None] = {}
        for _, kind, a, _ in self.events:
            if kind == UNPACK_BEGIN and a not in seen:
                seen[a] = None
        return list(seen)


# --------------------------------------------------------------------------------------------------------
# Modes and the engine stand-in
# --------------------------------------------------------------------------------------------------------


class _AutocastEmulation:
    """bf16 autocast on meta tensors, which CUDA autocast does not apply to: every convolution and linear
    layer of the meta copy casts its input, weight and bias to `dtype` (a patched instance `forward`);
    everything else runs in the dtype it receives, as under autocast for this kind of network (conv ->
    fp32-statistics norm -> activation). Like autocast, a parameter is cast once per forward (its cast
    is reused by later calls) and again in backward recomputation (checkpoint reruns under autocast).
    An instance patch rather than a TorchFunctionMode because modes are thread-local and the autograd
    engine may recompute checkpointed regions on its own thread."""

    _TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
              nn.Linear)
    _PLAIN_FORWARDS = frozenset(cls.forward for cls in _TYPES)

    def __init__(self, model: nn.Module, dtype: torch.dtype, tracer: _Tracer):
        self.dtype = dtype
        self.tracer = tracer
        self.cache: dict[int, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, self._TYPES):
                module.forward = functools.partial(self._forward, module)

    def _cast_param(self, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None or param.dtype == self.dtype:
            return param
        if self.tracer.phase == BACKWARD:
            return param.to(self.dtype)
        if id(param) not in self.cache:
            self.cache[id(param)] = param.to(self.dtype)
        return self.cache[id(param)]

    def _forward(self, module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        inputs = tuple(x.to(self.dtype) if x.is_floating_point() else x for x in inputs)
        weight, bias = self._cast_param(module.weight), self._cast_param(module.bias)
        if type(module).forward not in self._PLAIN_FORWARDS:
            return self._own_forward(module, weight, bias, inputs)
        (x,) = inputs
        if isinstance(module, nn.Linear):
            return torch.nn.functional.linear(x, weight, bias)
        if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            convolution = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
                           3: torch.nn.functional.conv_transpose3d}[x.dim() - 2]
            return convolution(x, weight, bias, module.stride, module.padding, module.output_padding,
                               module.groups, module.dilation)
        return module._conv_forward(x, weight, bias)

    @staticmethod
    def _own_forward(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, inputs: tuple):
        """A subclass's own forward (one that prepares its input, say) run on the cast parameters: what
        autocast does to the convolution inside it. The parameters are swapped for their casts in the
        module's parameter dict for the call, as `torch.func.functional_call` does."""
        params = module._parameters
        saved = params["weight"], params.get("bias")
        params["weight"] = weight
        if saved[1] is not None:
            params["bias"] = bias
        try:
            return type(module).forward(module, *inputs)
        finally:
            params["weight"] = saved[0]
            if saved[1] is not None:
                params["bias"] = saved[1]


class _Handle:
    """What the trace's pack hook returns: an entry and a view layout, never the tensor itself (except
    parameters). Its death is the entry's "handle died" event, as in the engine."""

    __slots__ = ("tracer", "entry", "layout", "tensor", "unpacked", "__weakref__")

    def __init__(self, tracer: _Tracer, entry: Entry, layout: tuple, tensor: torch.Tensor | None):
        self.tracer, self.entry, self.layout, self.tensor = tracer, entry, layout, tensor
        self.unpacked = False

    def __del__(self):
        try:
            self.tracer.handle_died(self)
        except Exception:  # interpreter shutdown
            pass


class _TraceExecutor:
    """The rulebook's executor while tracing: the trace keeps everything (mode none) and moves nothing;
    a dead entry's recipe is forgotten, as the engine forgets it."""

    def __init__(self, tracer: _Tracer):
        self.tracer = tracer

    def swap_out(self, entry: Entry) -> None: ...
    def copy_out_done(self, entry: Entry) -> bool: return True
    def release(self, entry: Entry, wait: bool) -> None: ...
    def reload(self, entry: Entry) -> None: ...
    def await_reload(self, entry: Entry) -> None: ...
    def drop_reload(self, entry: Entry) -> None: ...

    def died(self, entry: Entry) -> None:
        recipe = self.tracer.recipe_of.pop(entry.index, None)
        if recipe is not None:
            self.tracer.rebuilds.forget(recipe)


class _Tracer(TorchDispatchMode):
    def __init__(self, param_storages: set[int], recompute: RecomputeConfig | None):
        super().__init__()
        self.ops: list[OpInfo] = []
        self.storages: list[Storage] = []
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage _cdata -> (weak ref, sid)
        self.param_storages = param_storages  # parameters and buffers: never allocations of the step
        self.input_storages: set[int] = set()
        self.phase = FORWARD
        self.in_forward = False
        self.unpacking = -1  # record index while the unpack hook allocates its artifact
        self.recomputing = 0
        self.module_stack: list[str] = []  # every running module (forward and recomputation): op owners
        # Everything kept (mode none), the variant's recomputation as the engine decides it.
        self.rulebook = Rulebook(MemoryConfig(recompute=recompute or RecomputeConfig()), _TraceExecutor(self))
        self.index = StorageIndex()
        self.rebuilds = RecentRebuilds()
        self.records: list[TracedRecord] = []
        self.events: list[tuple[int, int, int, int]] = []
        self.module_names: list[str] = []
        self.module_ids: dict[str, int] = {}
        self.regions: list[list[int]] = []
        self.recipes = None  # recompute.NormActRecipes when the variant uses norm_act
        self.recipe_of: dict[int, object] = {}
        self._callback_tasks: set[int] = set()

    def event(self, kind: int, a: int = 0, b: int = 0) -> None:
        self.events.append((len(self.ops), kind, a, b))

    # ---- storage bookkeeping -------------------------------------------------------------------------
    def sweep(self) -> None:
        now = len(self.ops)
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            _, sid = self.live.pop(key)
            self.storages[sid].free_op = now

    def storage_id(self, storage: torch.UntypedStorage) -> int:
        """sid of a storage of the step (registered on first sight); -1 for parameters and buffers."""
        key = storage._cdata
        if key in self.param_storages:
            return -1
        hit = self.live.get(key)
        if hit is not None and not hit[0].expired():
            return hit[1]
        if hit is not None:  # the address was recycled by a new storage after the old one died
            self.storages[hit[1]].free_op = len(self.ops)
        sid = len(self.storages)
        self.storages.append(Storage(sid, storage.nbytes(), alloc_op=max(len(self.ops) - 1, 0),
                                     artifact_of=self.unpacking))
        self.live[key] = (StorageWeakRef(storage), sid)
        return sid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.sweep()
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        counter = flop_registry.get(func.overloadpacket)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if counter is not None:
            flops = float(counter(*args, **kwargs, out_val=out))
        else:  # elementwise and reductions: about one operation per output element
            flops = float(sum(t.numel() for t in outputs)) if name not in _NO_KERNEL else 0.0
        module = self.module_stack[-1] if self.module_stack else ""
        recompute = self.phase == BACKWARD and (bool(self.module_stack) or self.recomputing > 0)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.ops.append(OpInfo(name, self.phase, flops, _bytes_accessed(inputs + outputs), name not in _NO_KERNEL,
                               module, recompute))
        for tensor in outputs:
            self.storage_id(tensor.untyped_storage())
        return out

    # ---- saved tensors (the engine's `SavedTensorEngine.pack` / `unpack`) ----------------------------
    def lookup(self, t: torch.Tensor) -> Entry | None:
        """`NormActRecipes` asks the engine this: the live entry of `t`'s storage."""
        return self.index.find(t)

    def pack(self, tensor: torch.Tensor) -> _Handle:
        is_param = isinstance(tensor, nn.Parameter) or is_param_cast(tensor)
        tensor = tensor.detach()
        entry = self.index.find(tensor)
        if entry is None:
            entry = self._first_save(tensor, is_param)
            self.event(SAVE, entry.index)
        else:
            self.rulebook.save_again(entry)
            self.event(SAVE_AGAIN, entry.index)
        keep = entry.record.is_param or self.records[entry.index].sid < 0
        layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype,
                  tensor.untyped_storage().nbytes())
        return _Handle(self, entry, layout, tensor if keep else None)

    def _first_save(self, tensor: torch.Tensor, is_param: bool) -> Entry:
        facts = saved_facts(tensor, is_param, self.param_storages, self.input_storages)
        recipe = None
        if self.recipes is not None and not facts["is_param"]:
            recipe = self.recipes.recipe_for(tensor)
        deps = recipe_entries(recipe) if recipe is not None else []
        entry = self.rulebook.save(**facts, recompute=recipe is not None, deps=deps)
        sid = self.storage_id(tensor.untyped_storage())
        self.records.append(TracedRecord(entry.record, sid, deps=[dep.index for dep in entry.deps]))
        self.index.add(tensor, entry)
        if entry.decision == RECOMPUTE:
            self.recipe_of[entry.index] = recipe
            self.rebuilds.note(recipe, entry)
        return entry

    def rebuild(self, recipe) -> torch.Tensor:
        """`Recipe.materialize` asks this for a nested recipe's result (`swap.RecentRebuilds`)."""
        return self.rebuilds.rebuild(recipe, self)

    def unpack(self, handle: _Handle) -> torch.Tensor:
        entry = handle.entry
        self._register_end_callback()
        self.event(UNPACK_BEGIN, entry.index)
        self.rulebook.unpack_begin(entry)
        if handle.tensor is not None:
            out = handle.tensor
        elif entry.decision == RECOMPUTE:  # rebuilt by running the recipe: real ops and storages in backward
            size, stride, offset, dtype, _ = handle.layout
            self.recomputing += 1
            try:
                storage = self.rebuild(self.recipe_of[entry.index]).untyped_storage()
            finally:
                self.recomputing -= 1
            out = torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, size, stride)
        else:
            out = self._artifact(handle)
        first = not handle.unpacked
        handle.unpacked = True
        self.event(UNPACK_END, entry.index, int(first))
        self.rulebook.unpack_end(entry, first)
        if entry.decision == RECOMPUTE and entry.pending == 0:
            self.rebuilds.forget(self.recipe_of[entry.index])
        return out

    def _artifact(self, handle: _Handle) -> torch.Tensor:
        """A fresh storage of the saved layout: its death marks when the node that read it finished."""
        size, stride, offset, dtype, nbytes = handle.layout
        index = handle.entry.index
        self.unpacking = index
        try:
            base = torch.empty(max(nbytes // dtype.itemsize, 1), dtype=dtype, device="meta")
            self.records[index].artifact_sids.append(self.storage_id(base.untyped_storage()))
        finally:
            self.unpacking = -1
        return base.as_strided(size, stride, offset)

    def handle_died(self, handle: _Handle) -> None:
        self.event(HANDLE_DIED, handle.entry.index, int(handle.unpacked))
        self.rulebook.handle_died(handle.entry, handle.unpacked)

    def _register_end_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._callback_tasks:
            return
        self._callback_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self.event(BACKWARD_END)
        self.rulebook.backward_end()

    # ---- module and block events (the engine's `_module_start` / `_module_end` / markers) ---------------
    def on_module_pre(self, name: str, is_block: bool, module: nn.Module, args, kwargs, root: bool) -> None:
        self.module_stack.append(name)
        if not self.in_forward:
            return
        if root:
            self.input_storages |= storage_keys(tensors_in((args, kwargs)))
        if name not in self.module_ids:
            self.module_ids[name] = len(self.module_names)
            self.module_names.append(name)
        self.event(MODULE_START, self.module_ids[name], int(is_block))
        self.rulebook.module_start(name, is_block)

    def on_module_post(self, is_block: bool, output) -> None:
        if self.module_stack:
            self.module_stack.pop()
        if not self.in_forward:
            return
        self.event(MODULE_END, 0, int(is_block))
        ordinal = self.rulebook.module_end(is_block)
        if ordinal is None:
            return
        for tensor in tensors_in(output):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(functools.partial(self.on_block_backward, ordinal))

    def on_block_backward(self, ordinal: int, grad_outputs) -> None:
        self._register_end_callback()
        self.event(MARKER, ordinal)
        self.rulebook.marker(ordinal)

    def on_region_done(self, args: tuple) -> None:
        if not self.in_forward:
            return
        entries = [entry for entry in (self.index.find(t) for t in tensors_in(list(args))) if entry is not None]
        self.event(REGION_DONE, len(self.regions))
        self.regions.append([entry.index for entry in entries])
        self.rulebook.region_done(entries)


def _bytes_accessed(tensors: list[torch.Tensor]) -> int:
    """Bytes an op touches: each tensor's view (numel x element size), summed per storage and capped at
    the storage's size (an op on a channel slice touches the slice, not the whole tensor)."""
    per_storage: dict[int, list[int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        counted = per_storage.setdefault(storage._cdata, [0, storage.nbytes()])
        counted[0] = min(counted[1], counted[0] + tensor.numel() * tensor.element_size())
    return sum(counted for counted, _ in per_storage.values())


# --------------------------------------------------------------------------------------------------------
# Public entry
# --------------------------------------------------------------------------------------------------------


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers live on `meta` (no data copied). A model with
    a live `MemoryEngine` is refused: copying the engine's hooks would copy its state with them."""
    attached = ATTACHED.get(model)
    if attached is not None and attached() is not None:
        raise ValueError("brats_swap.memory.trace: the model has a MemoryEngine attached; plan before building "
                         "the engine or after engine.close()")
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def variant_name(recompute: RecomputeConfig | None) -> str:
    if recompute is None:
        return "plain"
    parts = []
    if recompute.modules:
        parts.append("checkpoint[" + ",".join(recompute.modules) + "]")
    if recompute.norm_act:
        parts.append("norm_act")
        if recompute.norm_act_exclude:
            parts.append("stored[" + ",".join(recompute.norm_act_exclude) + "]")
    return "+".join(parts) or "plain"


def _instrument(meta_model: nn.Module, tracer: _Tracer, blocks: Sequence[str] | None, dtype: torch.dtype,
                recompute: RecomputeConfig | None) -> list:
    """Install on the meta copy what the engine installs on the real model (module and block hooks,
    checkpoint wrappers, norm_act recipes) plus the autocast emulation; returns the hook handles."""
    block_list = list(blocks) if blocks is not None else [name for name, _ in discover_blocks(meta_model)]
    block_set = set(block_list)
    handles = []
    for name, module in meta_model.named_modules():
        is_block = name in block_set
        handles.append(module.register_forward_pre_hook(
            functools.partial(_pre_hook, tracer, name, is_block, module is meta_model), with_kwargs=True))
        handles.append(module.register_forward_hook(
            lambda m, a, out, is_block=is_block: tracer.on_module_post(is_block, out), always_call=True))
    if dtype in (torch.bfloat16, torch.float16):
        _AutocastEmulation(meta_model, dtype, tracer)
    if recompute is not None and recompute.modules:
        CheckpointedModules(meta_model, list(recompute.modules), on_done=tracer.on_region_done)
    if recompute is not None and recompute.norm_act:
        tracer.recipes = NormActRecipes(meta_model, tracer)
    return handles


def _pre_hook(tracer: _Tracer, name: str, is_block: bool, root: bool, module, args, kwargs) -> None:
    tracer.on_module_pre(name, is_block, module, args, kwargs, root)


def _run_step(meta_model: nn.Module, tracer: _Tracer, step: Callable[[nn.Module], torch.Tensor]) -> int:
    """Forward + loss under the saved-tensor hooks (as inside `engine.step()`), then backward outside
    them. Returns the op index where backward starts."""
    with tracer, torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack):
        tracer.in_forward = True
        if tracer.recipes is not None:
            tracer.recipes.active = True
        try:
            loss = step(meta_model)
        finally:
            tracer.in_forward = False
            if tracer.recipes is not None:
                tracer.recipes.active = False
                tracer.recipes.reset()
        tracer.event(FORWARD_END)
        tracer.rulebook.forward_end()
        fwd_end = len(tracer.ops)
        tracer.phase = BACKWARD
        loss.backward()
        del loss
        tracer.sweep()
    return fwd_end


def trace_step(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    dtype: torch.dtype | str = torch.float32,
    target_channels: int | None = None,
    recompute: RecomputeConfig | None = None,
    blocks: Sequence[str] | None = None,
    train: bool = True,
    step: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> Trace:
    """Run forward + `loss_fn(output, target)` + backward of `model` on `meta` at `input_shape`
    (B, C, D, H, W) and record it.

    The caller passes the training loss: its saved tensors and temporaries are part of the step. A model
    with another calling convention passes `step(model, x) -> loss` instead (x: the meta batch; make any
    other argument on `x.device`). `dtype` bfloat16 or float16 emulates autocast in that dtype.
    `recompute` applies the engine's recompute machinery (checkpointed modules, norm_act recipes) to the
    meta copy. `blocks` overrides the engine's `discover_blocks`. The output may be a tensor or a list,
    tuple or dict of them (deep supervision, full resolution first); the loss gets one target: with
    `target_channels` (default: the model's `out_channels`) at the input's size, else shaped as the
    (first) output. The input model is not modified.
    """
    if (loss_fn is None) == (step is None):
        raise ValueError("trace_step needs exactly one of loss_fn and step")
    started = time.perf_counter()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    meta_model = meta_copy(model)
    meta_model.train(train)
    params = list(meta_model.parameters())
    buffers = list(meta_model.buffers())
    tracer = _Tracer({t.untyped_storage()._cdata for t in params + buffers}, recompute)
    handles = _instrument(meta_model, tracer, blocks, dtype, recompute)

    # The batch and its target are storages of the step, allocated before it and held by the caller to
    # its end; the input is saved by the first convolution and kept (the caller holds it).
    x = torch.empty(tuple(input_shape), device="meta")
    tracer.storage_id(x.untyped_storage())
    held = [x]
    if step is None:
        channels = target_channels or getattr(model, "out_channels", None)
        if channels is not None:
            held.append(torch.empty((input_shape[0], channels, *input_shape[2:]), device="meta"))
            tracer.storage_id(held[-1].untyped_storage())

        def step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
            output = module(batch)
            if len(held) == 1:  # the target takes the shape of the (first) output
                held.append(torch.empty_like(next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))))
                # Allocated before the step (the data loader's), alive to its end like the batch.
                tracer.storages[tracer.storage_id(held[-1].untyped_storage())].alloc_op = 0
            return loss_fn(output, held[1])
    try:
        fwd_end = _run_step(meta_model, tracer, lambda module: step(module, x))
    finally:
        for handle in handles:
            handle.remove()
        if tracer.recipes is not None:
            tracer.recipes.remove()
    n_ops = len(tracer.ops)
    for storage in tracer.storages:
        storage.free_op = min(storage.free_op, n_ops)

    return Trace(
        input_shape=tuple(int(v) for v in input_shape), dtype=str(dtype).removeprefix("torch."),
        variant=variant_name(recompute), ops=tracer.ops, storages=tracer.storages, records=tracer.records,
        events=tracer.events, module_names=tracer.module_names, regions=tracer.regions, fwd_end=fwd_end,
        param_bytes=sum(p.untyped_storage().nbytes() for p in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in buffers),
        input_bytes=sum(t.untyped_storage().nbytes() for t in held), seconds=time.perf_counter() - started,
    )
