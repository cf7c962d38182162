"""Regional compilation: the pointwise work of each block runs compiled, the engine's hooks stay outside.

This module is the one place that decides the regions. `CompiledRegions(model)` takes the engine's blocks
(`frontend.discover_blocks`: the innermost modules that own a convolution or linear layer; or the `regions`
given) and, at the default granularity `chains`:

- a block whose forward is a convolution followed by pointwise layers (an `nn.Sequential` such as nnU-Net's
  conv -> dropout -> norm -> nonlin, or a class declaring `conv_then_chain` as the U-Net's ConvNormAct) runs
  its convolution eager (oneDNN's or torch's own kernel, as without compile) and its norm -> activation
  (-> dropout) chain as one `torch.compile(run_layers, dynamic=False)` graph (`CompiledChain`);
- the chain's 3-D convolution (kernel larger than 1x1x1) runs oneDNN's kernel on the CPU in float32
  (`onednn_convolution`; `convolutions="torch"` leaves the choice to torch): torch's own size rule sends the
  small convolutions of a U-Net to its slower im2col kernel. Choosing kernels is part of what compiling
  decides, as inductor does for convolutions on a GPU; the eager step keeps torch's choice;
- a bare convolution or linear layer (a transposed convolution, a segmentation head) stays eager: compiling
  it adds a graph call around the same library kernel;
- any other block (a transformer's attention or MLP, a chain whose norm keeps running statistics) has its
  `forward` compiled whole, as at granularity `blocks`, which compiles every block whole.

Why chains by default: on the CPU the convolutions are the same library kernels compiled or not, and inside
a compiled block they ran slower than eager (docs/memory.md#compiled-steps), while the norm -> activation
chains are what compilation fuses; and a chain is a unit norm_act can replay (below).

A module's `__call__` still runs its hooks eagerly around the compiled code, so the memory engine built on
the model afterwards keeps its decisions at the regions' boundaries:

- its module hooks sit on the blocks, on the eager convolutions and on the modules outside blocks (never
  inside a compiled graph: dynamo would trace them into the graph, or, with `skip_nnmodule_hook_guards`,
  silently skip them);
- a region's saved tensors are those its compiled graph saves (AOTAutograd's partitioner already recomputes
  cheap pointwise ops from what it keeps); the saved-tensor hooks see them at runtime, all at the end of the
  region's compiled forward (pytorch PR #150032), and the region's backward unpacks them at its start.
  Swapping copies a saved tensor out and back unchanged, and block checkpointing replays the same compiled
  graphs, so every policy gives bitwise the weights of `none` compiled;
- norm_act treats a compiled chain as one norm: the chain's output is rebuilt from the convolution's output
  (which the chain's graph saves anyway) by replaying the same compiled graph (`CompiledChain`), bitwise and
  without a new compilation. Inside a block compiled whole the norm and activation are fused with the
  convolution, which a replay of the eager modules would not reproduce bit for bit: those tensors are kept,
  and `StepStats.norm_act_skipped` says so per module;
- checkpointing (`recompute.modules`) a module inside a compiled region is refused: the compiled graph would
  not see the wrapper;
- swap globs naming modules inside regions name the regions' blocks (`at_block_granularity`).

Shapes are static (`dynamic=False`): a step of a new shape (validation's whole cube, eval mode) compiles
once, later steps of a known shape reuse it. Regions of one class share a code object (every chain runs
`run_layers`), and dynamo caches per code object, so the recompile limit is raised to cover every region in
both modes. `remove()` puts the eager forwards back (the fallback after a failed compilation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from brats_swap.config import MemoryConfig
from brats_swap.memory.frontend import COMPUTE_TYPES, discover_blocks
from brats_swap.memory.recompute import (
    DROPOUT_TYPES,
    forward_owner,
    is_pointwise_layer,
    restore_forwards,
    rng_as,
    rng_state,
)

# Models with compiled regions -> their `CompiledRegions` (the engine asks, `compiled_regions`).
COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Cache entries per region that dynamo may keep: train and eval mode, with and without grad, two shapes.
ENTRIES_PER_REGION = 8

# What a region is (module docstring): "chains" compiles each block's norm -> activation (-> dropout) chain and
# leaves its convolution to its library; "blocks" compiles each block whole.
GRANULARITIES = ("chains", "blocks")
# In a block class's body, `conv_then_chain = ("conv", "norm", "act")` declares that its forward(*x) is exactly
# act(norm(conv(*x))), child by child (how `brats_swap.model.unet.ConvNormAct` joins: model/ does not import
# memory/). An `nn.Sequential` says so by being one.
CHAIN_DECLARATION = "conv_then_chain"


def split_block(block: nn.Module) -> tuple[nn.Module, list[tuple[str, nn.Module]]] | None:
    """(its compute layer, the pointwise layers that follow it, in order) when `block`'s forward is exactly
    that chain (an `nn.Sequential`'s own forward, or a class declaring `CHAIN_DECLARATION`), every layer after
    the first is pointwise (`recompute.is_pointwise_layer`) and none keeps running statistics (a replay of
    the compiled chain would update them twice); else None."""
    if type(block).forward is nn.Sequential.forward:
        names = list(block._modules)
    else:
        declared = vars(forward_owner(type(block))).get(CHAIN_DECLARATION)
        if not isinstance(declared, tuple):
            return None
        names = list(declared)
    layers = [(name, block._modules.get(name)) for name in names]
    if len(layers) < 2 or any(layer is None for _name, layer in layers):
        return None
    (_first, compute), chain = layers[0], layers[1:]
    if not isinstance(compute, COMPUTE_TYPES):
        return None
    for _name, layer in chain:
        if not is_pointwise_layer(layer) or getattr(layer, "running_mean", None) is not None:
            return None
    return compute, chain


@functools.cache  # one wrapper per backend: dynamo's cache entries hold the backend they were compiled by
def recomputing_pointwise(backend: str | Callable) -> Callable:
    """`backend` with AOTAutograd's partitioner told to save as little as it can (`activation_memory_budget`
    0): a chain's graph then saves only its input (the convolution's output, which eager saves too) and
    recomputes the norm and activation in its backward. With the default partition nnU-Net's InstanceNorm ->
    in-place LeakyReLU chain saved a one-byte mask besides, and its backward ran 2.1-2.5x slower than eager
    (docs/memory.md#compiled-steps)."""
    compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_chain(graph: torch.fx.GraphModule, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=0.0):
            return compiler(graph, example_inputs)

    return compile_chain


def run_layers(layers: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    """The chain's forward: each layer on the previous one's output (one code object: dynamo shares its graphs
    between chains of the same layer types and shapes)."""
    for layer in layers:
        x = layer(x)
    return x


class CompiledChain(nn.Module):
    """A block's pointwise chain (norm -> activation, dropouts among them) as one compiled region: `run` is
    `run_layers` compiled (with `CompiledRegions`' eager fallback). Not a submodule of the model (its module
    tree is unchanged): the block's forward calls it on its convolution's output.

    To norm_act it is one norm (`replayable_norm`): a recipe rebuilds the chain's output from the
    convolution's output, which the chain's graph saves anyway, by replaying the same compiled graph with the
    forward's grad mode, input `requires_grad` and RNG state (dropout), so the rebuilt tensor is bitwise the
    forward's and dynamo finds the graph in its cache (no recompilation).
    """

    replayable_norm = True

    def __init__(self, name: str, layers: list[nn.Module], run: Callable):
        super().__init__()
        self.name = name
        self.layers = tuple(layers)  # a tuple: not registered as submodules
        self._run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.layers, x)

    def replay_as_in_forward(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """How norm_act re-runs this call on `x` (`recompute.REPLAY_METHOD`): the same graph, output detached."""
        requires_grad, device = x.requires_grad, x.device
        dropout = any(isinstance(layer, DROPOUT_TYPES) and layer.training for layer in self.layers)
        rng = rng_state(device) if dropout else None

        def replay(inp: torch.Tensor) -> torch.Tensor:
            with contextlib.ExitStack() as stack:
                if rng is not None:
                    stack.enter_context(rng_as(rng, device))
                stack.enter_context(torch.enable_grad())
                return self.forward(inp.detach().requires_grad_(requires_grad)).detach()

        return replay

    def extra_repr(self) -> str:
        return self.name


# How a chain's eager convolution is run (module docstring): "onednn" calls oneDNN for a 3-D convolution whose
# kernel is larger than 1 (`onednn_convolution`), "torch" leaves the choice to torch.
CONVOLUTIONS = ("onednn", "torch")


# Below 8³ voxels per channel oneDNN's fixed cost per call outweighs its faster loops: at 4³ and 2³ it took
# 1.7-3.2x torch's time forward and backward, at 8³ 0.4-1.0x, from 16³ 0.09-0.38x (scripts/bench_conv_kernels.py,
# docs/benchmarks.md). oneDNN's forward alone (at stride 2, torch's backward) gains less: 1.0-1.9x at 16³ and 8³,
# 0.58-0.82x from 24³ up.
ONEDNN_MIN_VOXELS = 8**3
ONEDNN_FORWARD_MIN_VOXELS = 24**3
# torch's own rule (aten/src/ATen/native/ConvUtils.h, `ConvParams::use_mkldnn`) takes oneDNN for a float32 CPU
# convolution of one group and a kernel at most 3 wide when the batch is larger than 1 or batch x channels x
# depth x height is larger than this; otherwise its im2col kernel, `slow_conv3d`, forward and backward.
TORCH_ONEDNN_FROM = 20480


def takes_onednn(conv: nn.Module) -> bool:
    """Whether `onednn_convolution` may run `conv`: a `Conv3d` of one group with zero padding given as numbers, a
    kernel larger than 1x1x1 (at 1x1x1 oneDNN's forward took 1.1-7x torch's time with the backward), and a
    torch built with oneDNN."""
    return (type(conv) is nn.Conv3d and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
            and conv.groups == 1 and math.prod(conv.kernel_size) > 1 and torch.backends.mkldnn.is_available())


class OneDNNConvolution(torch.autograd.Function):
    """A stride-1 3-D convolution of a batch of 1 by oneDNN forward and backward: the input's gradient is the
    convolution of the output's gradient with the kernel flipped and its channels swapped, the kernel's
    gradient the convolution of the input (channels as the batch) with the output's gradient (as the kernel).
    Both are oneDNN forward convolutions: torch's `convolution_backward` offers no way to ask for oneDNN's
    backward (it applies the same size rule as the forward) and its im2col backward took 2.5-4x longer here.
    Saves what torch's convolution saves (its input and weight)."""

    @staticmethod
    def forward(ctx, x, weight, bias, padding):
        ctx.save_for_backward(x, weight)
        ctx.padding, ctx.has_bias = padding, bias is not None
        return torch.mkldnn_convolution(x, weight, bias, padding, (1, 1, 1), (1, 1, 1), 1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            flipped = weight.flip(2, 3, 4).transpose(0, 1).contiguous()
            padding = [k - 1 - p for k, p in zip(weight.shape[2:], ctx.padding, strict=True)]
            grad_x = torch.mkldnn_convolution(grad, flipped, None, padding, (1, 1, 1), (1, 1, 1), 1)
        if ctx.needs_input_grad[1]:  # batch 1: both transposes are views of contiguous memory
            grad_weight = torch.mkldnn_convolution(x.transpose(0, 1), grad.transpose(0, 1), None, ctx.padding,
                                                   (1, 1, 1), (1, 1, 1), 1).transpose(0, 1).contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 2, 3, 4))
        return grad_x, grad_weight, grad_bias, None


def onednn_convolution(conv: nn.Conv3d, x: torch.Tensor, min_voxels: int | None = None) -> torch.Tensor:
    """`conv(x)` (a `takes_onednn` convolution) by oneDNN on the CPU in float32 for a batch of 1: forward and
    backward (`OneDNNConvolution`) at stride 1; at other strides the forward only, where torch would run its
    im2col kernel (`TORCH_ONEDNN_FROM`) on at least `ONEDNN_FORWARD_MIN_VOXELS` (the backward is then
    torch's). Elsewhere torch's own choice: a GPU, another dtype, autocast, oneDNN switched off, a larger
    batch (torch takes oneDNN itself), an input under `ONEDNN_MIN_VOXELS` per channel (`min_voxels` if given;
    `onednn_path` says which).

    Why: torch's size rule, written for 2-D images, sends most of a batch-1 3-D U-Net's convolutions to
    `slow_conv3d`, and where it does take oneDNN its backward took about 5x its forward; the same convolutions
    ran forward and backward in a fraction of that time as oneDNN forward convolutions on this project's CPU
    (scripts/bench_conv_kernels.py, docs/benchmarks.md). Choosing kernels is part of what compiling decides (on a
    GPU inductor chooses convolution layouts and kernels); the eager step stays plain PyTorch, the reference
    every policy's weights are compared with bit for bit. A compiled step makes the same choice at every call of
    the same convolution, so its policies stay bitwise equal to each other."""
    path = onednn_path(conv, x, min_voxels)
    if path is None:
        return nn.Conv3d.forward(conv, x)
    if path == "forward and backward":
        return OneDNNConvolution.apply(x.contiguous(), conv.weight, conv.bias, tuple(conv.padding))
    return torch.mkldnn_convolution(x.contiguous(), conv.weight, conv.bias, conv.padding, conv.stride,
                                    conv.dilation, 1)


def onednn_path(conv: nn.Conv3d, x: torch.Tensor, min_voxels: int | None = None) -> str | None:
    """What `onednn_convolution` runs for `conv(x)`: "forward and backward" (`OneDNNConvolution`), "forward"
    (oneDNN's forward, torch's backward) or None (torch's own choice). `min_voxels`, if given, replaces both
    size floors (`ONEDNN_MIN_VOXELS`, `ONEDNN_FORWARD_MIN_VOXELS`: scripts/bench_conv_kernels.py times the
    smaller inputs too)."""
    forward_min_voxels = ONEDNN_FORWARD_MIN_VOXELS if min_voxels is None else min_voxels
    min_voxels = ONEDNN_MIN_VOXELS if min_voxels is None else min_voxels
    if (x.device.type != "cpu" or x.dtype != torch.float32 or conv.weight.dtype != torch.float32
            or torch.is_autocast_enabled("cpu") or not torch.backends.mkldnn.enabled or x.dim() != 5
            or x.shape[0] != 1 or math.prod(x.shape[2:]) < min_voxels):
        return None
    if (all(s == 1 for s in conv.stride) and all(d == 1 for d in conv.dilation)
            and all(p <= k - 1 for p, k in zip(conv.padding, conv.kernel_size, strict=True))):
        return "forward and backward"
    if math.prod(x.shape[:4]) > TORCH_ONEDNN_FROM or math.prod(x.shape[2:]) < forward_min_voxels:
        return None  # torch takes oneDNN itself, forward and backward; or a small input, where it gains nothing
    return "forward"


def _conv_then_chain(compute: nn.Module, chain: CompiledChain, *args, **kwargs) -> torch.Tensor:
    """A split block's forward: its compute layer eager (hooks and all), then its compiled chain."""
    return chain(compute(*args, **kwargs))


def compile_wanted(setting: bool | str, device: torch.device) -> bool:
    """`train.compile` / `evaluate.compile` for `device`: `auto` compiles on CUDA (as nnU-Net does) and not on
    the CPU, where compiling costs 15-90 s before the first step and pays back only on longer runs (a
    prediction of one case, a short fine-tune, the tests); `true` asks for it there (docs/memory.md)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


def is_compile_failure(exc: BaseException) -> bool:
    """The exception (or one it was raised from) comes from the compiler: dynamo, AOTAutograd or inductor
    (no C compiler, a failed lowering or build, an operation it cannot trace)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        module = type(exc).__module__ or ""
        if module.startswith(("torch._dynamo", "torch._inductor", "torch._functorch")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def compile_cause(exc: BaseException) -> str:
    """The compiler's reason in one line: the innermost exception dynamo wrapped (`BackendCompilerFailed` holds
    inductor's), with the first line of its message."""
    innermost, seen = exc, {id(exc)}
    while True:
        inner = getattr(innermost, "inner_exception", None) or innermost.__cause__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        innermost = inner
    lines = [line.strip() for line in str(innermost).splitlines() if line.strip()]
    text = f"{type(innermost).__name__}: {lines[0]}" if lines else type(innermost).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class CompiledRegions:
    """Compile the regions of `model` (module docstring): `regions` are the blocks, (name, module) pairs (default
    the engine's), `granularity` ("chains" or "blocks") what of each block is compiled. `backend` is
    `torch.compile`'s (tests pass one that fails). `regions` lists the blocks whose forward was replaced
    (whole or split into an eager convolution and a chain), `chains` each `CompiledChain` with its name
    ("<block>.<layer>+<layer>"), `onednn` the split blocks whose convolution runs `onednn_convolution`
    (`convolutions`: "onednn", the default, or "torch").

    A region whose compilation fails (the compiler raises before the graph runs) runs its eager forward for
    that call, every region goes back to eager (`remove`) and `on_failure(cause)` is called once, with the
    cause in one line (`failed` keeps it). A failure in a lazily compiled backward surfaces in
    `loss.backward()` instead: the caller retries the step (`run.compiling`).
    """

    def __init__(self, model: nn.Module, regions: Sequence[tuple[str, nn.Module]] | None = None, *,
                 granularity: str = "chains", convolutions: str = "onednn", backend: str | Callable = "inductor",
                 on_failure: Callable[[str], None] | None = None):
        if model in COMPILED:
            raise RuntimeError("the model's regions are compiled already")
        if granularity not in GRANULARITIES:
            raise ValueError(f"CompiledRegions: granularity {granularity!r} is not one of {GRANULARITIES}")
        if convolutions not in CONVOLUTIONS:
            raise ValueError(f"CompiledRegions: convolutions {convolutions!r} is not one of {CONVOLUTIONS}")
        self.model = model
        self.granularity = granularity
        blocks = list(regions) if regions is not None else discover_blocks(model)
        self.on_failure = on_failure
        self.failed: str | None = None
        self.regions: list[tuple[str, nn.Module]] = []  # the blocks whose forward is replaced
        self.chains: list[tuple[str, CompiledChain]] = []
        self.onednn: list[str] = []  # the blocks whose convolution runs `onednn_convolution`
        self._patched: list[tuple[nn.Module, object]] = []
        self._inside: dict[int, str] = {}
        for name, module in blocks:
            split = split_block(module) if granularity == "chains" else None
            if split is None and granularity == "chains" and isinstance(module, COMPUTE_TYPES):
                continue  # a bare convolution or linear layer: its library's kernel, compiled or not
            previous = module.__dict__.get("forward")
            if split is None:
                eager = module.forward
                compiled = torch.compile(eager, dynamic=False, backend=backend)
                module.forward = functools.partial(self._call, compiled, eager)
                inside = [sub for sub in module.modules() if sub is not module]
            else:
                compute, layers = split
                compiled = torch.compile(run_layers, dynamic=False, backend=recomputing_pointwise(backend))
                run = functools.partial(self._call, compiled, run_layers)
                chain_name = f"{name}.{'+'.join(layer_name for layer_name, _layer in layers)}"
                chain = CompiledChain(chain_name, [layer for _layer_name, layer in layers], run)
                module.forward = functools.partial(_conv_then_chain, compute, chain)
                self.chains.append((chain_name, chain))
                if convolutions == "onednn" and takes_onednn(compute):
                    self._patched.append((compute, compute.__dict__.get("forward")))
                    compute.forward = functools.partial(onednn_convolution, compute)
                    self.onednn.append(name)
                inside = [sub for _layer_name, layer in layers for sub in layer.modules()]
            self._patched.append((module, previous))
            self.regions.append((name, module))
            for sub in inside:  # a saved tensor of the region belongs to its block
                self._inside[id(sub)] = name
        limit = ENTRIES_PER_REGION * max(1, len(self.regions))
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, limit)
        COMPILED[model] = self

    def _call(self, compiled: Callable, eager: Callable, *args, **kwargs):
        if self.failed is not None:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            if not is_compile_failure(exc):
                raise
            self.fail(compile_cause(exc))
            return eager(*args, **kwargs)  # nothing of the region ran: its compilation failed before the graph

    def fail(self, cause: str) -> None:
        """Compilation failed (`cause`, one line): every region runs eager from now on; said once."""
        if self.failed is not None:
            return
        self.failed = cause
        self.remove()
        if self.on_failure is not None:
            self.on_failure(cause)

    @property
    def names(self) -> list[str]:
        return [name for name, _module in self.regions]

    def region_around(self, module: nn.Module) -> str | None:
        """The name of the region `module` is strictly inside, if any."""
        return self._inside.get(id(module))

    def at_block_granularity(self, memory_cfg: MemoryConfig) -> MemoryConfig:
        """`memory_cfg` with its swap globs at the regions' granularity: a saved tensor of a compiled region belongs
        to the region, so a `swap.include` glob that names only modules inside regions (as the planner's choices
        do, from the eager step's trace) names those regions instead, and such a `swap.exclude` glob is dropped.
        Either way more is swapped, never less: the memory the policy was planned for still holds."""
        names = [name for name, _module in self.model.named_modules()]
        modules = dict(self.model.named_modules())

        def inner_regions(pattern: str) -> list[str] | None:
            matched = [name for name in names if fnmatchcase(name, pattern)]
            regions = [self.region_around(modules[name]) for name in matched]
            if not matched or any(region is None for region in regions):
                return None
            return list(dict.fromkeys(regions))

        include: list[str] = []
        for pattern in memory_cfg.swap.include:
            include.extend(inner_regions(pattern) or [pattern])
        exclude = [pattern for pattern in memory_cfg.swap.exclude if inner_regions(pattern) is None]
        if include == memory_cfg.swap.include and exclude == memory_cfg.swap.exclude:
            return memory_cfg
        swap = dataclasses.replace(memory_cfg.swap, include=list(dict.fromkeys(include)), exclude=exclude)
        return dataclasses.replace(memory_cfg, swap=swap)

    def remove(self) -> None:
        """The eager forwards back; the model is as before."""
        restore_forwards(self._patched)
        self._patched = []
        self._inside = {}
        if COMPILED.get(self.model) is self:
            del COMPILED[self.model]


def compiled_regions(model: nn.Module) -> CompiledRegions | None:
    """The model's `CompiledRegions`, when its regions are compiled."""
    return COMPILED.get(model)
