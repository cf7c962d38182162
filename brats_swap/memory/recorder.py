"""The recorder: the saved-tensor front end's back end on the `meta` device, which records a step.

`trace_step` runs one training step of a `meta` copy of the model (shapes, dtypes, strides, storages and
version counters, no data) through the same front end the engine uses (`frontend.SavedTensorFrontEnd`:
module and block hooks, pack/unpack, checkpoint wrappers, norm_act recipes), with a `TraceRecorder` as
its back end. The recorder adds what only a trace needs:

- a `TorchDispatchMode` that sees every aten operator (forward, backward and recomputation alike): it
  numbers them (the "op index" is the trace's clock), registers each new output storage, and notices a
  storage's death through a weak storage reference (`StorageWeakRef.expired()`), checked before each op;
- every event the front end reports, with the op index at which it happened (`Trace.events`);
- handles that, on purpose, do NOT keep the saved tensor (except parameters): the trace then shows when
  each saved storage would die without autograd's reference (what swapping can gain); at unpack it
  hands backward a fresh meta tensor of the same layout (an "artifact") whose death marks when the
  node that used it has finished.

Why our own recorder instead of `torch.utils.flop_counter.FlopCounterMode` or `torch.cuda.memory`
snapshots: neither reports saved-tensor lifetimes, and snapshots need a GPU at the real size. We do use
the flop counter's formula table (`flop_registry`) for convolution FLOPs.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import flop_registry

from brats_swap.config import MemoryConfig, RecomputeConfig
from brats_swap.memory.compiled import CompiledRegions, compile_cause, compiled_regions, is_compile_failure
from brats_swap.memory.events import BACKWARD, FORWARD, Event
from brats_swap.memory.frontend import (
    ATTACHED,
    BackEnd,
    SavedHandle,
    SavedTensorFrontEnd,
    discover_blocks,
    tensors_in,
)
from brats_swap.memory.meta_results import META_RESULTS, aten_tensors
from brats_swap.memory.recompute import CheckpointedModules, NormActRecipes
from brats_swap.memory.rulebook import Entry
from brats_swap.memory.trace_data import OpInfo, Storage, Trace, TracedRecord, variant_name

# Ops that only reinterpret or allocate: no kernel runs, so they cost no time in the time model.
_NO_KERNEL = {"view", "_unsafe_view", "as_strided", "expand", "permute", "t", "transpose", "unsqueeze",
              "squeeze", "detach", "alias", "slice", "select", "reshape", "empty", "empty_strided",
              "empty_like", "set_", "lift_fresh", "split", "unbind", "_reshape_alias", "view_as",
              "split_with_sizes", "unflatten", "flatten", "_to_copy_view", "new_empty", "new_empty_strided"}



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

    def __init__(self, model: nn.Module, dtype: torch.dtype, recorder: TraceRecorder):
        self.dtype = dtype
        self.recorder = recorder
        self.cache: dict[int, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, self._TYPES):
                module.forward = functools.partial(self._forward, module)

    def _cast_param(self, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None or param.dtype == self.dtype:
            return param
        if self.recorder.phase == BACKWARD:
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


# The autocast policy a trace emulates, by the names torch functions, Tensor methods and torch.nn.functional
# share (torch's AMP docs, "op reference", torch 2.13). Convolutions and linear layers are cast by
# `_AutocastEmulation` (with autocast's weight cache); `_AutocastOps` casts the other listed ops' floating
# inputs: to the low precision for LOWER, to float32 for FP32 (unless the call passes its own `dtype=`).
# Unlisted ops run in the dtype they receive, as under autocast. Ops that promote to the widest input
# (cat, addcmul, index_put, ...) need nothing: torch promotes them natively.
CUDA_LOWER_OPS = frozenset({"matmul", "mm", "bmm", "mv", "addmm", "addbmm", "baddbmm", "addmv", "addr",
                            "multi_dot", "chain_matmul", "prelu", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                            "conv_transpose2d", "conv_transpose3d", "linear"})
CUDA_FP32_OPS = frozenset({
    "pow", "rdiv", "rpow", "rtruediv", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss"})
# CPU autocast: bf16 for the matrix products and convolutions (conv_transpose too: the docs list it as fp32,
# torch 2.13 runs it in bf16, checked by tests/test_autocast_policy.py against the real CPU autocast), fp32
# for the pooling and losses below; norms, softmax, exp, pow and sums stay in the input's dtype.
CPU_LOWER_OPS = frozenset({"matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "conv1d", "conv2d", "conv3d",
                           "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear"})
CPU_FP32_OPS = frozenset({
    "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d", "fractional_max_pool3d",
    "max_unpool3d", "binary_cross_entropy", "grid_sample", "prod", "cdist", "trace", "mse_loss", "kl_div",
    "ctc_loss", "multilabel_margin_loss", "quantile", "nanquantile", "stft"})
AUTOCAST_OPS = {"cuda": (CUDA_LOWER_OPS, CUDA_FP32_OPS), "cpu": (CPU_LOWER_OPS, CPU_FP32_OPS)}
_REDUCED = (torch.bfloat16, torch.float16)


def _policy_name(func) -> str | None:
    """The name autocast lists `func` under; None for an in-place variant (`exp_`), which autocast leaves
    alone. `__pow__` -> pow, `_max_pool3d` (F.max_pool3d's body) -> max_pool3d."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2]
    if name.endswith("_"):
        return None
    return name.lstrip("_")


class _AutocastOps(TorchFunctionMode):
    """The listed ops of `AUTOCAST_OPS[device_type]` with their floating inputs cast as autocast casts them
    (parameters through `_AutocastEmulation`'s cache). Active for the whole traced step: backward and its
    recomputation of a meta model run in the thread that called backward."""

    def __init__(self, device_type: str, emulation: _AutocastEmulation):
        super().__init__()
        self.lower, self.fp32 = AUTOCAST_OPS[device_type]
        self.emulation = emulation
        # func -> "lower", "fp32" or None: a step calls a few dozen functions thousands of times (every
        # tensor method and attribute passes here), and the name alone decides.
        self._listed: dict = {}

    def _list_of(self, func) -> str | None:
        try:
            listed = self._listed.get(func, False)
        except TypeError:  # an unhashable callable: decided afresh
            return self._decide(func)
        if listed is False:
            listed = self._listed[func] = self._decide(func)
        return listed

    def _decide(self, func) -> str | None:
        name = _policy_name(func)
        return "lower" if name in self.lower else "fp32" if name in self.fp32 else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        listed = self._list_of(func)
        if listed == "lower":
            cast = self._to_lower
        elif listed == "fp32" and kwargs.get("dtype") is None:
            cast = self._to_fp32
        else:
            return func(*args, **kwargs)
        return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})

    def _to_lower(self, value):
        if isinstance(value, nn.Parameter):
            return self.emulation._cast_param(value)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.emulation.dtype:
            return value.to(self.emulation.dtype)
        return value

    @staticmethod
    def _to_fp32(value):
        if isinstance(value, torch.Tensor) and value.dtype in _REDUCED:
            return value.float()
        return value


# Set while the compiled trace runs an op whose result inductor computes inside its consumer's kernel (never
# allocated: `inductor_allocations`); the recorder registers such an op's new storages as 0 bytes.
_IN_FUSED_KERNEL: contextvars.ContextVar[bool] = contextvars.ContextVar("in_fused_kernel", default=False)


class TraceCompileError(RuntimeError):
    """The compiled trace failed to compile (one line: the compiler's cause)."""


class _RecordedSlot:
    """The recorder's state of one entry (its `payload`): the recipe that rebuilds it, if any."""

    __slots__ = ("recipe",)

    def __init__(self):
        self.recipe = None


class TraceRecorder(TorchDispatchMode, BackEnd):
    """The front end's back end while tracing (module docstring). As the rulebook's executor it keeps
    everything (the trace runs mode none) and moves nothing."""

    checks_versions = False  # meta tensors hold no data a change could corrupt

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while dynamo and AOTAutograd compile a region (else dynamo would not compile under this mode
        at all), on while the compiled graphs run: the trace records the ops they run."""
        return True

    def __init__(self, param_storages: set[int]):
        super().__init__()
        self.ops: list[OpInfo] = []
        self.storages: list[Storage] = []
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage _cdata -> (weak ref, sid)
        self.param_storages = param_storages  # parameters and buffers: never allocations of the step
        self.phase = FORWARD
        self.unpacking = -1  # record index while `stored_view` allocates its artifact
        self._recomputing = 0
        self.module_stack: list[str] = []  # every running module (forward and recomputation): op owners
        self.records: list[TracedRecord] = []
        self.events: list[Event] = []
        self.fused: set[int] = set()  # sids of results computed inside a fused kernel (0 bytes: never allocated)
        self.artifacts: dict[int, weakref.ref] = {}  # record index -> its latest artifact (a view keeps it alive)

    # ---- the front end's back end ----------------------------------------------------------------------
    def now(self) -> int:
        return len(self.ops)

    def record(self, event: Event) -> None:
        self.events.append(event)

    def module_entered(self, name: str) -> None:
        self.module_stack.append(name)

    def module_left(self) -> None:
        if self.module_stack:
            self.module_stack.pop()

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        self._recomputing += 1
        try:
            yield
        finally:
            self._recomputing -= 1

    def new_payload(self, t: torch.Tensor) -> _RecordedSlot:
        return _RecordedSlot()

    def saved(self, entry: Entry, t: torch.Tensor) -> None:
        sid = self.storage_id(t.untyped_storage())
        self.records.append(TracedRecord(entry.record, sid, deps=[dep.index for dep in entry.deps]))

    def holds(self, entry: Entry, t: torch.Tensor) -> bool:
        """Only parameters (and autocast copies of them) are held by their handles."""
        return entry.record.is_param or self.records[entry.index].sid < 0

    def stored_view(self, handle: SavedHandle) -> torch.Tensor:
        """A fresh storage of the saved layout (an "artifact"): its death marks when the node that read
        it finished. A record unpacked again while an artifact of it is alive gets a view of that one, as the
        engine reloads a storage once for all its views: a compiled block's backward unpacks every saved
        tensor at its start, and the channel slices of one storage (a chunked norm's) are several handles."""
        size, stride, offset, dtype, nbytes = handle.size, handle.stride, handle.offset, handle.dtype, handle.nbytes
        index = handle.entry.index
        alive = self.artifacts.get(index)
        base = alive() if alive is not None else None
        if base is not None and base.dtype == dtype and base.numel() * dtype.itemsize >= nbytes:
            self.records[index].artifact_sids.append(self.records[index].artifact_sids[-1])
            return base.as_strided(size, stride, offset)
        self.unpacking = index
        try:
            base = torch.empty(max(nbytes // dtype.itemsize, 1), dtype=dtype, device="meta")
            self.records[index].artifact_sids.append(self.storage_id(base.untyped_storage()))
        finally:
            self.unpacking = -1
        self.artifacts[index] = weakref.ref(base)
        return base.as_strided(size, stride, offset)

    # ---- the rulebook's executor: nothing moves -------------------------------------------------------
    def swap_out(self, entry: Entry) -> None: ...
    def release(self, entry: Entry, wait: bool) -> None: ...
    def reload(self, entry: Entry) -> None: ...
    def await_reload(self, entry: Entry) -> None: ...
    def drop_reload(self, entry: Entry) -> None: ...

    # ---- storage bookkeeping -------------------------------------------------------------------------
    def sweep(self) -> None:
        now = len(self.ops)
        # Before every op, over every live storage: `StorageWeakRef.expired()`'s own call, without its two
        # Python frames around it (a fifth of a trace's time at 192³).
        expired = torch.UntypedStorage._expired
        dead = [key for key, (ref, _) in self.live.items() if expired(ref.cdata)]
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
        fused = _IN_FUSED_KERNEL.get()
        if fused:
            self.fused.add(sid)
        self.storages.append(Storage(sid, 0 if fused else storage.nbytes(), alloc_op=max(len(self.ops) - 1, 0),
                                     artifact_of=self.unpacking))
        self.live[key] = (StorageWeakRef(storage), sid)
        return sid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.sweep()
        out = META_RESULTS.run(func, args, kwargs)  # func(*args, **kwargs), its layout remembered (meta_results.py)
        name = func.overloadpacket.__name__
        counter = flop_registry.get(func.overloadpacket)
        outputs = aten_tensors(out)
        if counter is not None:
            flops = float(counter(*args, **kwargs, out_val=out))
        else:  # elementwise and reductions: about one operation per output element
            flops = float(sum(t.numel() for t in outputs)) if name not in _NO_KERNEL else 0.0
        module = self.module_stack[-1] if self.module_stack else ""
        recompute = self.phase == BACKWARD and (bool(self.module_stack) or self._recomputing > 0)
        fused = _IN_FUSED_KERNEL.get()
        op = OpInfo(name, self.phase, flops, 0, name not in _NO_KERNEL, module, recompute,
                    _grouped_convolution(name, args), fused=fused)
        self.ops.append(op)
        for tensor in outputs:
            self.storage_id(tensor.untyped_storage())
        touched = aten_tensors(args) + aten_tensors(kwargs) + outputs
        if fused:  # part of its consumer's kernel: it moves only the tensors that exist in memory
            touched = [t for t in touched if not self._in_fused_kernel(t)]
        op.bytes_accessed = _bytes_accessed(touched)
        return out

    def _in_fused_kernel(self, tensor: torch.Tensor) -> bool:
        hit = self.live.get(tensor.untyped_storage()._cdata)
        return hit is not None and hit[1] in self.fused


def _grouped_convolution(name: str, args: tuple) -> bool:
    """aten.convolution (groups is its 9th argument) or convolution_backward (10th) with groups > 1."""
    index = {"convolution": 8, "convolution_backward": 9}.get(name)
    return index is not None and len(args) > index and isinstance(args[index], int) and args[index] > 1


def _bytes_accessed(tensors: list[torch.Tensor]) -> int:
    """Bytes an op touches: each tensor's view (numel x element size), summed per storage and capped at
    the storage's size (an op on a channel slice touches the slice, not the whole tensor)."""
    per_storage: dict[int, list[int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        counted = per_storage.setdefault(storage._cdata, [0, storage.nbytes()])
        counted[0] = min(counted[1], counted[0] + tensor.numel() * tensor.element_size())
    return sum(counted for counted, _ in per_storage.values())


def inductor_allocations(graph: torch.fx.GraphModule, example_inputs: Sequence, *, is_backward: bool,
                         is_inference: bool) -> set[str]:
    """Names of the nodes of a partitioned graph whose results inductor allocates, as its lowering decides.

    Inductor lowers a graph to buffers: an extern kernel's output (a convolution, its backward), a reduction's,
    a graph output (what the forward saves, the gradients) and a pointwise result it chooses to realize (read by
    an extern kernel, by several kernels, or too expensive to inline) each get one; every other pointwise result
    is computed inside its consumers' kernels and never exists in memory, and a view is a view of a buffer. Its
    scheduler then fuses kernels, and a buffer written and last read inside one fused kernel is never allocated
    either (`_fused_away`). Inductor's reuse of freed buffers and its reordering for peak memory are not modelled,
    so the set bounds the compiled step's allocations from above. `graph` keeps its nodes (the lowering adds
    `meta` entries)."""
    from torch._guards import detect_fake_mode
    from torch._inductor import ir
    from torch._inductor.compile_fx import _recursive_record_original_output_strides
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    results: dict[str, object] = {}

    class Lowering(GraphLowering):
        def run_node(self, n: torch.fx.Node):
            result = super().run_node(n)
            results[n.name] = result
            return result

    def buffers(value) -> list[str]:
        """The buffers `value` (a node's lowered result) allocates: realized, not an input of the graph; a view
        (ir.BaseView, ir.ReinterpretView) allocates nothing."""
        if isinstance(value, (list, tuple)):  # a multi-output extern kernel (convolution_backward)
            return [name for v in value for name in buffers(v)]
        if isinstance(value, ir.TensorBox):
            value = value.data
        if (isinstance(value, ir.StorageBox) and ir.IRNode.is_realized_node(value.data)
                and not isinstance(value.data, (ir.InputBuffer, ir.ConstantBuffer))):
            return [value.data.get_name()]
        return []

    fake_mode = detect_fake_mode(example_inputs)
    _recursive_record_original_output_strides(graph)
    # The lowering's own tensor ops are no ops of the step: the recorder's mode (active) stands aside.
    with _disable_current_modes(), V.set_fake_mode(fake_mode):
        lowering = Lowering(graph, example_inputs=example_inputs, shape_env=fake_mode.shape_env,
                            is_inference=is_inference, is_backward=is_backward)
        with V.set_graph_handler(lowering), V.set_extern_kernel_nodes([]), DebugContext():
            lowering.run(*example_inputs)
            lowering._update_scheduler()
            removed = _fused_away(lowering.scheduler)
    return {name for name, value in results.items() if any(b not in removed for b in buffers(value))}


def _fused_away(scheduler) -> set[str]:
    """Buffers inductor's scheduler removes: written and last read inside one fused kernel (as
    `Kernel.remove_kernel_local_buffers` decides at code generation)."""
    removed: set[str] = set()
    for node in scheduler.nodes:
        inner = node.get_nodes()
        if len(inner) < 2:
            continue
        names = {snode.get_name() for snode in inner}
        for snode in inner:
            for buf in snode.get_outputs():
                if scheduler.can_buffer_be_removed_through_fusion(buf.get_name(), names):
                    removed.add(buf.get_name())
    return removed


class _PartitionedGraph(torch.fx.Interpreter):
    """A partitioned forward or backward graph run op by op; the ops whose results inductor never allocates
    (not in `allocated`) run under `_IN_FUSED_KERNEL`."""

    def __init__(self, graph: torch.fx.GraphModule, allocated: set[str]):
        super().__init__(graph)
        self.allocated = allocated

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function" or n.name in self.allocated:
            return super().run_node(n)
        token = _IN_FUSED_KERNEL.set(True)
        try:
            return super().run_node(n)
        finally:
            _IN_FUSED_KERNEL.reset(token)


def _constructors_before_first_use(graph: torch.fx.Graph) -> None:
    """Move each node that reads no other node (`empty`, `full`: a buffer the graph fills later) to just before
    its first user: inductor allocates a buffer where its first kernel runs (and orders kernels for its peak
    memory, `reorder_for_peak_memory`), where the partitioned graph's order may create it well before."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_function" and not node.all_input_nodes and node.users:
            min(node.users, key=position.__getitem__).prepend(node)


def _nop_inner_compile(graph: torch.fx.GraphModule, example_inputs, **kwargs):
    """Inductor's inner compiler replaced: the partitioned forward or backward graph is lowered as inductor
    lowers it, to learn which results it allocates (`inductor_allocations`), and then runs op by op, with the
    tensors it creates on `meta` (it was partitioned on CPU fake tensors: `inductor_partition_backend`)."""
    allocated = inductor_allocations(graph, example_inputs, is_backward=bool(kwargs.get("is_backward")),
                                     is_inference=bool(kwargs.get("is_inference")))
    for node in graph.graph.nodes:
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu":
            node.kwargs = {**node.kwargs, "device": torch.device("meta")}
    _constructors_before_first_use(graph.graph)
    graph.recompile()

    def run(args):
        return _PartitionedGraph(graph, allocated).boxed_run(args)

    run._boxed_call = True
    return run


def inductor_partition_backend(graph: torch.fx.GraphModule, example_inputs: list, **kwargs):
    """A `torch.compile` backend that runs inductor's whole pipeline up to code generation (pre-grad passes,
    its decompositions, joint-graph passes, the min-cut partitioner: what the forward saves for backward)
    and then runs the partitioned graphs eagerly, so a meta-device trace records the saved tensors and ops
    the inductor-compiled region has, and counts the memory of only the results inductor allocates
    (`inductor_allocations`). The example inputs are re-faked on the CPU: inductor's joint-graph
    passes do not support the meta device (they fold the backward's outputs into empty tensors and the
    partition fails). Inductor's caches are off: they would hand back compiled kernels."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode:
        on_cpu = [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)
                  if isinstance(t, torch.Tensor) and t.device.type == "meta" else t for t in example_inputs]
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        return compile_fx(graph, on_cpu, inner_compile=_nop_inner_compile)


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers live on `meta` (no data copied). A model with
    a live `MemoryEngine` is refused: copying the engine's hooks would copy its state with them."""
    attached = ATTACHED.get(model)
    if attached is not None and attached() is not None:
        raise ValueError("brats_swap.memory.recorder.meta_copy: the model has a MemoryEngine attached; plan before building "
                         "the engine or after engine.close()")
    memo: dict[int, object] = {}
    # Compiled regions (`CompiledRegions`): the copy gets its class's eager forward, not the compiled one of
    # the original (whose eager fallback would run the original module).
    regions = compiled_regions(model)
    compiled_forwards = [name for name, module in (regions.regions if regions is not None else [])
                         if "forward" in module.__dict__]
    for name in compiled_forwards:
        memo[id(model.get_submodule(name).__dict__["forward"])] = None
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    copied = copy.deepcopy(model, memo)
    for name in compiled_forwards:
        del copied.get_submodule(name).__dict__["forward"]
    return copied


def _instrument(meta_model: nn.Module, front: SavedTensorFrontEnd, recorder: TraceRecorder,
                blocks: Sequence[str] | None, dtype: torch.dtype, recompute: RecomputeConfig | None,
                autocast: str, regions: CompiledRegions | None) -> _AutocastOps | None:
    """Install on the meta copy what the engine installs on the real model (the front end's module and
    block hooks, checkpoint wrappers, norm_act recipes; none inside the compiled `regions`, as the engine)
    plus the autocast emulation of `autocast`'s policy ("cuda" or "cpu"); returns the op part of that
    emulation, to be active while the step runs."""
    inside = regions.region_around if regions is not None else (lambda module: None)
    front.install(meta_model, _block_pairs(meta_model, blocks), inside)
    ops = None
    if dtype in _REDUCED:
        ops = _AutocastOps(autocast, _AutocastEmulation(meta_model, dtype, recorder))
    if recompute is not None and recompute.modules:
        CheckpointedModules(meta_model, list(recompute.modules), front.checkpoint_called, front.region_done)
    if recompute is not None and recompute.norm_act:
        # The compiled chains are norm_act's units, as in the engine (a chain replays its own graph).
        front.recipes = NormActRecipes(meta_model, front, inside, regions.chains if regions is not None else None)
    return ops


def _block_pairs(meta_model: nn.Module, blocks: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The engine's blocks of the meta copy: `discover_blocks`, or the modules named in `blocks`."""
    if blocks is None:
        return discover_blocks(meta_model)
    names = set(blocks)
    return [(name, module) for name, module in meta_model.named_modules() if name in names]


def _run_step(meta_model: nn.Module, front: SavedTensorFrontEnd, recorder: TraceRecorder,
              step: Callable[[nn.Module], torch.Tensor]) -> int:
    """Forward + loss inside the front end's step (as inside `engine.step()`), then backward outside it.
    Returns the op index where backward starts."""
    with recorder:
        with front.forward():
            loss = step(meta_model)
        fwd_end = len(recorder.ops)
        recorder.phase = BACKWARD
        _backward(loss)
        del loss
        recorder.sweep()
    return fwd_end


def _run_instrumented(meta_model: nn.Module, front: SavedTensorFrontEnd, recorder: TraceRecorder,
                      step: Callable[[nn.Module], torch.Tensor], autocast_ops: _AutocastOps | None,
                      regions: CompiledRegions | None) -> int:
    """`_run_step` under the autocast emulation, then the instrumentation removed; a compilation that failed
    (a region that ran eager, or a backward compiled lazily at its first use) raises `TraceCompileError`."""
    try:
        with autocast_ops if autocast_ops is not None else contextlib.nullcontext():
            fwd_end = _run_step(meta_model, front, recorder, step)
    except Exception as exc:
        if regions is not None and is_compile_failure(exc):
            raise TraceCompileError(compile_cause(exc)) from exc
        raise
    finally:
        front.remove()
        if front.recipes is not None:
            front.recipes.remove()
        if regions is not None:
            regions.remove()
    if regions is not None and regions.failed is not None:  # a region ran eager: the trace is not the compiled step
        raise TraceCompileError(regions.failed)
    return fwd_end


def _backward(loss: torch.Tensor) -> None:
    """`loss.backward()` as `torch.autograd.backward` runs it, minus its hand-off to torch function modes: an
    active mode (the autocast emulation's `_AutocastOps`) would run the whole backward with itself switched
    off, and the recomputation in backward (checkpointed modules, norm_act recipes) must run under it, as
    it runs under autocast in training. The engine call is torch's own (`torch.autograd.graph`)."""
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def first_output(output) -> torch.Tensor:
    """The first tensor of a network's output: the output itself, or the first of a list, tuple or dict of
    tensors (deep supervision puts the full resolution first). A loss's target takes its shape."""
    return tensors_in(output)[0]


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
    autocast: str = "cpu",
    compiled: bool = False,
) -> Trace:
    """Run forward + `loss_fn(output, target)` + backward of `model` on `meta` at `input_shape`
    (B, C, D, H, W) and record it.

    The caller passes the training loss: its saved tensors and temporaries are part of the step. A model
    with another calling convention passes `step(model, x) -> loss` instead (x: the meta batch; make any
    other argument on `x.device`). `dtype` bfloat16 or float16 emulates autocast in that dtype, with the op
    policy of the device type `autocast` ("cuda": a GPU's, "cpu"; see `AUTOCAST_OPS`).
    `recompute` applies the engine's recompute machinery (checkpointed modules, norm_act recipes) to the
    meta copy. `blocks` overrides the engine's `discover_blocks`. `compiled` traces the step as training runs
    it under `train.compile` (`CompiledRegions` with the regions it chooses, as training builds it, each
    region's graph partitioned, lowered and fused as inductor does: `inductor_partition_backend`); a
    compilation that fails raises `TraceCompileError`. The output may be a tensor or a list,
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
    keys = {t.untyped_storage()._cdata for t in params + buffers}
    recorder = TraceRecorder(keys)
    front = SavedTensorFrontEnd(MemoryConfig(recompute=recompute or RecomputeConfig()), recorder,
                                param_storages=lambda: keys)
    regions = None
    if compiled:
        # The regions training compiles: `CompiledRegions`' own choice (run.compiling passes none either).
        regions = CompiledRegions(meta_model, backend=inductor_partition_backend)
    autocast_ops = _instrument(meta_model, front, recorder, blocks, dtype, recompute, autocast, regions)

    # The batch and its target are storages of the step, allocated before it and held by the caller to
    # its end; the input is saved by the first convolution and kept (the caller holds it).
    x = torch.empty(tuple(input_shape), device="meta")
    recorder.storage_id(x.untyped_storage())
    held = [x]
    if step is None:
        channels = target_channels or getattr(model, "out_channels", None)
        if channels is not None:
            held.append(torch.empty((input_shape[0], channels, *input_shape[2:]), device="meta"))
            recorder.storage_id(held[-1].untyped_storage())

        def step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
            output = module(batch)
            if len(held) == 1:  # the target takes the shape of the (first) output
                held.append(torch.empty_like(first_output(output)))
                # Allocated before the step (the data loader's), alive to its end like the batch.
                recorder.storages[recorder.storage_id(held[-1].untyped_storage())].alloc_op = 0
            return loss_fn(output, held[1])
    fwd_end = _run_instrumented(meta_model, front, recorder, lambda module: step(module, x), autocast_ops, regions)
    n_ops = len(recorder.ops)
    for storage in recorder.storages:
        storage.free_op = min(storage.free_op, n_ops)

    return Trace(
        input_shape=tuple(int(v) for v in input_shape), dtype=str(dtype).removeprefix("torch."),
        variant=variant_name(recompute), ops=recorder.ops, storages=recorder.storages, records=recorder.records,
        events=recorder.events, module_names=front.module_names, regions=front.regions, fwd_end=fwd_end,
        param_bytes=sum(p.untyped_storage().nbytes() for p in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in buffers),
        input_bytes=sum(t.untyped_storage().nbytes() for t in held), seconds=time.perf_counter() - started,
        compiled=compiled,
    )
