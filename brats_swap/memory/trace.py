"""Trace one training step on the `meta` device: what is saved for backward, when, and what it costs.

The planner needs, for a model at the real size (192³, batch 2), the full life of every tensor in one
forward + backward: when its storage is allocated, when it would die if autograd did not hold it, which
storages autograd saves (grouped into records exactly as the engine groups them), when backward unpacks
them, and the FLOPs and bytes of every operator. Running the step on `meta` tensors gives all of it in
about a second and without memory: meta tensors have shapes, dtypes, strides, storages and version
counters, but no data.

Three PyTorch mechanisms do the recording:

- a `TorchDispatchMode` sees every aten operator (forward, backward and recomputation alike): it
  numbers them (the "op index" is the trace's clock), registers each new output storage, and notices a
  storage's death through a weak storage reference (`StorageWeakRef.expired()`), checked before each op;
- `saved_tensors_hooks` see every tensor autograd saves. The pack hook groups saves into records with
  the engine's rules (`brats_swap.memory.swap.SavedTensorEngine.pack`: storage + version + live handles;
  parameters and autocast copies of parameters flagged) and, on purpose, does NOT keep the tensor: the
  trace then shows when each saved storage would die without autograd's reference (what swapping can
  gain). The unpack hook hands backward a fresh meta tensor of the same layout (an "artifact") whose
  death marks when the node that used it has finished;
- module forward hooks keep the stack of running modules and the block ordinals exactly as
  `brats_swap.memory.engine.MemoryEngine` numbers them (`discover_blocks`), and a `grad_fn` prehook on
  each block output marks where backward enters that block (where the engine issues its reloads).

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

from brats_swap.config.schema import RecomputeConfig
from brats_swap.memory.policy import SavedRecord

FORWARD, BACKWARD = 0, 1

# Ops that only reinterpret or allocate: no kernel runs, so they cost no time in the time model.
_NO_KERNEL = {"view", "_unsafe_view", "as_strided", "expand", "permute", "t", "transpose", "unsqueeze",
              "squeeze", "detach", "alias", "slice", "select", "reshape", "empty", "empty_strided",
              "empty_like", "set_", "lift_fresh", "split", "unbind", "_reshape_alias", "view_as",
              "split_with_sizes", "unflatten", "flatten", "_to_copy_view"}


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
    """A `SavedRecord` plus its life on the trace's op clock."""

    record: SavedRecord
    sid: int  # physical storage (-1 for parameters and buffers, which live outside the step)
    pack_op: int  # op index at the first save
    use_marker: int  # the engine's `_Record.use_marker`: block ordinal before whose backward it is needed
    unpack_ops: list[int] = field(default_factory=list)  # op index of every unpack in backward
    artifact_sids: list[int] = field(default_factory=list)  # storages the unpack hook created
    death_op: int = -1  # op index at which its last handle died (autograd released it); -1 = at the end
    pack_seq: int = 0  # position of the first save among the trace's forward events (saves, module starts)
    pending_zero_op: int = -1  # op at which every handle was unpacked once or died (-1 = at the end)
    pending_zero_seq: int = 1 << 62
    death_seq: int = 1 << 62
    first_use_seq: int = 1 << 62


@dataclass
class OpInfo:
    name: str
    phase: int  # FORWARD or BACKWARD
    flops: float
    bytes_accessed: int  # inputs + outputs, each distinct storage once
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
    fwd_end: int  # op index where backward starts
    block_names: list[str]  # per block ordinal (call order), the block module's name
    block_fwd_start: list[int]  # op index at which each block ordinal's forward started
    block_bwd_start: list[int]  # op index at which backward reached each block ordinal (-1: never)
    module_starts: list[tuple[int, int, bool]]  # forward module pre-hooks: (event seq, op index, is a block)
    markers: list[tuple[int, int, int]]  # backward block markers in firing order: (event seq, op index, ordinal)
    param_bytes: int
    buffer_bytes: int
    input_bytes: int  # the batch and its target (also storages of the trace, alive for the whole step)
    module_output_bytes: dict[str, int]
    module_conv_flops: dict[str, float]
    seconds: float = 0.0

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def saved_bytes(self) -> int:
        """Bytes of distinct non-parameter storages saved for backward (the engine's `saved_bytes`)."""
        return sum(r.record.nbytes for r in self.records if not r.record.is_param)

    def saved_records(self) -> list[SavedRecord]:
        return [r.record for r in self.records]

    def forward_flops(self) -> float:
        return sum(op.flops for op in self.ops[: self.fwd_end])


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

    def _forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype) if x.is_floating_point() else x
        weight, bias = self._cast_param(module.weight), self._cast_param(module.bias)
        if isinstance(module, nn.Linear):
            return torch.nn.functional.linear(x, weight, bias)
        if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            convolution = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
                           3: torch.nn.functional.conv_transpose3d}[x.dim() - 2]
            return convolution(x, weight, bias, module.stride, module.padding, module.output_padding,
                               module.groups, module.dilation)
        return module._conv_forward(x, weight, bias)


class _Handle:
    """What the trace's pack hook returns: a record and a view layout, never the tensor itself (except
    parameters). Its death is the record's "handle died" event, as in the engine."""

    __slots__ = ("tracer", "index", "layout", "tensor", "unpacked", "__weakref__")

    def __init__(self, tracer: _Tracer, index: int, layout: tuple, tensor: torch.Tensor | None):
        self.tracer, self.index, self.layout, self.tensor = tracer, index, layout, tensor
        self.unpacked = False
        tracer.alive[index] = tracer.alive.get(index, 0) + 1
        tracer.pending[index] = tracer.pending.get(index, 0) + 1

    def __del__(self):
        try:
            self.tracer.handle_died(self)
        except Exception:  # interpreter shutdown
            pass


@dataclass
class _Decision:
    decision: str  # what `NormActRecipes` asks of the engine's record: keep/swap (stored) or recompute


def _is_param_cast(t: torch.Tensor) -> bool:
    """The engine's rule: an autocast copy of a parameter (ToCopyBackward0 from a leaf) counts as one."""
    from brats_swap.memory.swap import _is_param_cast as engine_rule

    return engine_rule(t)


class _Tracer(TorchDispatchMode):
    def __init__(self, param_storages: set[int]):
        super().__init__()
        self.ops: list[OpInfo] = []
        self.storages: list[Storage] = []
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage _cdata -> (weak ref, sid)
        self.param_storages = param_storages  # parameters and buffers: never allocations of the step
        self.phase = FORWARD
        self.in_forward = False
        self.unpacking = -1  # record index while the unpack hook allocates its artifact
        self.recomputing = 0
        self.module_stack: list[str] = []
        self.engine_module_stack: list[str] = []  # the engine's: pushed only during forward
        self.block_stack: list[int] = []
        self.last_block = -1
        self.block_names: list[str] = []
        self.block_fwd: list[int] = []
        self.block_bwd: dict[int, int] = {}
        self.records: list[TracedRecord] = []
        self.record_of: dict[int, int] = {}  # storage _cdata -> newest record index
        self.record_version: dict[int, int] = {}
        self.record_weak: dict[int, StorageWeakRef] = {}
        self.alive: dict[int, int] = {}  # record index -> live handles
        self.pending: dict[int, int] = {}  # record index -> live handles not unpacked yet
        self.seq = 0  # orders saves and module starts that happen between the same two ops
        self.module_starts: list[tuple[int, int, bool]] = []
        self.markers: list[tuple[int, int, int]] = []
        self.recipes = None  # recompute.NormActRecipes when the variant uses norm_act
        self.recipe_of: dict[int, object] = {}
        self.module_output_bytes: dict[str, int] = {}
        self.module_conv_flops: dict[str, float] = {}

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
            if self.phase == FORWARD and self.module_stack:
                owner = self.module_stack[-1]
                self.module_conv_flops[owner] = self.module_conv_flops.get(owner, 0.0) + flops
        else:  # elementwise and reductions: about one operation per output element
            flops = float(sum(t.numel() for t in outputs)) if name not in _NO_KERNEL else 0.0
        module = self.module_stack[-1] if self.module_stack else ""
        recompute = self.phase == BACKWARD and (bool(self.module_stack) or self.recomputing > 0)
        self.ops.append(OpInfo(name, self.phase, flops, 0, name not in _NO_KERNEL, module, recompute))
        seen: set[int] = set()
        accessed = 0
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    accessed += storage.nbytes()
        for tensor in outputs:
            storage = tensor.untyped_storage()
            self.storage_id(storage)
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                accessed += storage.nbytes()
        self.ops[-1].bytes_accessed = accessed
        return out

    # ---- saved tensors (the engine's `SavedTensorEngine.pack` rules) ----------------------------------
    def _where(self) -> tuple[str, int, int]:
        module = self.engine_module_stack[-1] if self.engine_module_stack else ""
        if self.block_stack:
            return module, self.block_stack[-1], self.block_stack[-1]
        return module, self.last_block, self.last_block + 1

    def lookup(self, t: torch.Tensor) -> int | None:
        key = t.untyped_storage()._cdata
        index = self.record_of.get(key)
        if index is None or self.record_weak[index].expired() or self.record_version[index] != t._version \
                or self.alive.get(index, 0) == 0:
            return None
        return index

    def pack(self, tensor: torch.Tensor) -> _Handle:
        is_param = isinstance(tensor, nn.Parameter) or _is_param_cast(tensor)
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        index = self.lookup(tensor)
        if index is None:
            index = self._new_record(tensor, is_param)
        else:
            self.records[index].use_marker = max(self.records[index].use_marker, self._where()[2])
        traced = self.records[index]
        keep = traced.record.is_param or traced.sid < 0
        layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype,
                  storage.nbytes())
        return _Handle(self, index, layout, tensor if keep else None)

    def _new_record(self, tensor: torch.Tensor, is_param: bool) -> int:
        storage = tensor.untyped_storage()
        if storage._cdata in self.param_storages:
            is_param = True
        module, block, use_marker = self._where()
        recipe = None
        if self.recipes is not None and not is_param:
            recipe = self.recipes.recipe_for(tensor)
        index = len(self.records)
        record = SavedRecord(index=index, nbytes=storage.nbytes(), module=module, block=block,
                             is_param=is_param, recompute=recipe is not None,
                             dtype=str(tensor.dtype).removeprefix("torch."))
        sid = self.storage_id(storage)
        self.seq += 1
        self.records.append(TracedRecord(record, sid, pack_op=len(self.ops), use_marker=use_marker,
                                         pack_seq=self.seq))
        self.record_of[storage._cdata] = index
        self.record_version[index] = tensor._version
        self.record_weak[index] = StorageWeakRef(storage)
        if recipe is not None:
            self.recipe_of[index] = recipe
        return index

    def unpack(self, handle: _Handle) -> torch.Tensor:
        traced = self.records[handle.index]
        traced.unpack_ops.append(len(self.ops))
        if len(traced.unpack_ops) == 1:
            self.seq += 1
            traced.first_use_seq = self.seq
        if not handle.unpacked:
            handle.unpacked = True
            self._pending_down(handle.index)
        if handle.tensor is not None:
            return handle.tensor
        size, stride, offset, dtype, nbytes = handle.layout
        recipe = self.recipe_of.get(handle.index)
        if recipe is not None:  # rebuilt by running the recipe: real ops and a real storage in backward
            self.recomputing += 1
            try:
                storage = recipe.materialize(self).untyped_storage()
            finally:
                self.recomputing -= 1
            return torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, size, stride)
        self.unpacking = handle.index
        try:
            base = torch.empty(max(nbytes // dtype.itemsize, 1), dtype=dtype, device="meta")
            view = base.as_strided(size, stride, offset)
            traced.artifact_sids.append(self.storage_id(base.untyped_storage()))
        finally:
            self.unpacking = -1
        return view

    def _pending_down(self, index: int) -> None:
        self.pending[index] -= 1
        if self.pending[index] == 0:
            self.seq += 1
            self.records[index].pending_zero_op = len(self.ops)
            self.records[index].pending_zero_seq = self.seq

    def handle_died(self, handle: _Handle) -> None:
        index = handle.index
        if not handle.unpacked:
            self._pending_down(index)
        self.alive[index] -= 1
        if self.alive[index] == 0:
            self.seq += 1
            self.records[index].death_op = len(self.ops)
            self.records[index].death_seq = self.seq
            if self.phase == BACKWARD or not self.in_forward:
                self.recipe_of.pop(index, None)

    # `NormActRecipes` talks to "the engine" through these two.
    def lookup_record(self, t: torch.Tensor) -> _Decision | None:
        index = self.lookup(t)
        if index is None:
            return None
        return _Decision("recompute" if self.records[index].record.recompute else "keep")

    # ---- module and block positions (the engine's `_module_start` / `_block_start` / `_block_end`) -----
    def on_module_pre(self, name: str, is_block: bool) -> None:
        self.module_stack.append(name)
        if self.in_forward:
            self.engine_module_stack.append(name)
            self.seq += 1
            self.module_starts.append((self.seq, len(self.ops), is_block))

    def on_module_post(self, name: str, output) -> None:
        if self.module_stack:
            self.module_stack.pop()
        if self.in_forward and self.engine_module_stack:
            self.engine_module_stack.pop()
        if self.in_forward:
            total = sum(t.untyped_storage().nbytes() for t in tree_leaves(output) if isinstance(t, torch.Tensor))
            self.module_output_bytes[name] = self.module_output_bytes.get(name, 0) + total

    def on_block_pre(self, name: str) -> None:
        if not self.in_forward:
            return
        ordinal = len(self.block_fwd)
        self.block_fwd.append(len(self.ops))
        self.block_names.append(name)
        self.block_stack.append(ordinal)
        self.last_block = ordinal

    def on_block_post(self, output) -> None:
        if not self.in_forward or not self.block_stack:
            return
        ordinal = self.block_stack.pop()
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(functools.partial(self.on_block_backward, ordinal))

    def on_block_backward(self, ordinal: int, grad_outputs) -> None:
        self.seq += 1
        self.markers.append((self.seq, len(self.ops), ordinal))
        self.block_bwd.setdefault(ordinal, len(self.ops))


class _EngineView:
    """The two engine methods `NormActRecipes` calls (`lookup`, `pack`) and the one `Recipe.materialize`
    calls (`unpack`), answered by the tracer."""

    def __init__(self, tracer: _Tracer):
        self.tracer = tracer

    def lookup(self, t: torch.Tensor):
        return self.tracer.lookup_record(t)

    def pack(self, t: torch.Tensor):
        return self.tracer.pack(t)

    def unpack(self, handle):
        return self.tracer.unpack(handle)


# --------------------------------------------------------------------------------------------------------
# Public entry
# --------------------------------------------------------------------------------------------------------


def soft_dice_loss(probs: torch.Tensor, target: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """Ellis's weighted Dice loss (model.md §1.6), the default loss of a traced step."""
    dims = tuple(range(2, probs.dim()))
    numerator = 2 * (probs * target).sum(dims) + smooth
    denominator = probs.sum(dims) + target.sum(dims) + smooth
    return -(numerator / denominator).mean()


def default_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss (`brats_swap.train.losses.weighted_dice_loss`) when available."""
    try:
        from brats_swap.train.losses import weighted_dice_loss
    except ImportError:
        return soft_dice_loss
    return weighted_dice_loss


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers live on `meta` (no data copied)."""
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
    return "+".join(parts) or "plain"


def trace_step(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    dtype: torch.dtype | str = torch.float32,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    target_channels: int | None = None,
    recompute: RecomputeConfig | None = None,
    blocks: Sequence[str] | None = None,
    train: bool = True,
) -> Trace:
    """Run forward + loss + backward of `model` on `meta` at `input_shape` (B, C, D, H, W) and record it.

    `dtype` bfloat16 emulates bf16 autocast. `recompute` applies the engine's recompute machinery
    (checkpointed modules, norm_act recipes) to the meta copy. `blocks` overrides the engine's
    `discover_blocks`. The input model is not modified.
    """
    from brats_swap.memory.engine import discover_blocks
    from brats_swap.memory.recompute import CheckpointedModules, NormActRecipes

    started = time.perf_counter()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    loss_fn = loss_fn or default_loss()
    meta_model = meta_copy(model)
    meta_model.train(train)
    params = list(meta_model.parameters())
    buffers = list(meta_model.buffers())
    tracer = _Tracer({t.untyped_storage()._cdata for t in params + buffers})
    modules = dict(meta_model.named_modules())
    block_list = list(blocks) if blocks is not None else [name for name, _ in discover_blocks(meta_model)]

    handles = []
    block_set = set(block_list)
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, name=name, is_block=name in block_set: tracer.on_module_pre(name, is_block)))
        handles.append(module.register_forward_hook(
            lambda m, a, out, name=name: tracer.on_module_post(name, out), always_call=True))
    for name in block_list:
        module = modules[name]
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: tracer.on_block_pre(name)))
        handles.append(module.register_forward_hook(lambda m, a, out: tracer.on_block_post(out), always_call=True))
    if dtype in (torch.bfloat16, torch.float16):
        _AutocastEmulation(meta_model, dtype, tracer)
    if recompute is not None and recompute.modules:
        CheckpointedModules(meta_model, list(recompute.modules))
    if recompute is not None and recompute.norm_act:
        tracer.recipes = NormActRecipes(meta_model, _EngineView(tracer))

    # The batch and its target are storages of the step, allocated before it and held by the caller to
    # its end; the input is saved by the first convolution like any activation.
    x = torch.empty(tuple(input_shape), device="meta")
    tracer.storage_id(x.untyped_storage())
    channels = target_channels or getattr(model, "out_channels", None)
    target = None
    if channels is not None:
        target = torch.empty((input_shape[0], channels, *input_shape[2:]), device="meta")
        tracer.storage_id(target.untyped_storage())

    try:
        with tracer, torch.autograd.graph.saved_tensors_hooks(tracer.pack, tracer.unpack):
            tracer.in_forward = True
            if tracer.recipes is not None:
                tracer.recipes.active = True
            try:
                probs = meta_model(x)
                if target is None:
                    target = torch.empty_like(probs)
                    tracer.storage_id(target.untyped_storage())
                loss = loss_fn(probs, target)
            finally:
                tracer.in_forward = False
                if tracer.recipes is not None:
                    tracer.recipes.active = False
                    tracer.recipes.reset()
            del probs
            fwd_end = len(tracer.ops)
            tracer.phase = BACKWARD
            loss.backward()
            del loss
            tracer.sweep()
    finally:
        for handle in handles:
            handle.remove()
        if tracer.recipes is not None:
            tracer.recipes.remove()
    n_ops = len(tracer.ops)
    for storage in tracer.storages:
        if storage.free_op > n_ops:
            storage.free_op = n_ops
    input_bytes = x.untyped_storage().nbytes() + target.untyped_storage().nbytes()

    return Trace(
        input_shape=tuple(int(v) for v in input_shape),
        dtype=str(dtype).removeprefix("torch."),
        variant=variant_name(recompute),
        ops=tracer.ops,
        storages=tracer.storages,
        records=tracer.records,
        fwd_end=fwd_end,
        block_names=tracer.block_names,
        block_fwd_start=tracer.block_fwd,
        block_bwd_start=[tracer.block_bwd.get(b, -1) for b in range(len(tracer.block_fwd))],
        module_starts=tracer.module_starts,
        markers=tracer.markers,
        param_bytes=sum(p.untyped_storage().nbytes() for p in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in buffers),
        input_bytes=input_bytes,
        module_output_bytes=tracer.module_output_bytes,
        module_conv_flops=tracer.module_conv_flops,
        seconds=time.perf_counter() - started,
    )
