"""Recomputation: checkpoint whole modules, or rebuild only norm + activation outputs from stored conv outputs.

Two mechanisms, both reversible (`remove()`) and both keeping every module's qualified name:

`CheckpointedModules` (`recompute.modules`): the outermost modules whose name matches a glob (same glob
rule as `records.module_matches`) get an instance-level `forward` that runs the original one under
non-reentrant `torch.utils.checkpoint` with `preserve_rng_state=True`, so dropout masks are replayed
exactly. Only the region's inputs are saved (through the engine, so they can also be swapped); every
tensor saved inside is recomputed in backward, convolutions included.

`NormActRecipes` (`recompute.norm_act`): SuperNeurons-style cost-aware recomputation that never re-runs a
convolution. It works inside the engine's saved-tensor hooks instead of restructuring the model: when a
recognised module call produces a tensor, the engine learns a *recipe* for that storage, and a later save
of it is packed as "recompute from the recipe" instead of being stored. The recipe's only stored input is
the norm's input (the conv output), which the norm saves for its own backward anyway, so recomputing
adds no stored tensor. So in a Conv -> Norm -> Act (-> Dropout | Upsample) -> Conv chain only the first
conv's output is stored.

A recipe replays a module's class `forward` on the rebuilt input, under `no_grad` and the forward's
autocast state, so it is only learned where that replay gives bitwise the tensor the forward produced:

- a *norm*: a module whose class `forward` is one registered as replayable. Registered by default:
  torch's `LayerNorm`, `GroupNorm`, `RMSNorm` and the `BatchNorm*` / `InstanceNorm*` families (not
  `SyncBatchNorm`, which communicates). A class joins with `register_norm(cls)`, or by declaring
  `replayable_norm = True` in its body (how `brats_swap.model.KerasInstanceNorm` joins: model/ does not
  import memory/). Registering promises that `forward(x)` is a pure function of `x`, the parameters and
  the buffers, using no RNG. A subclass that overrides `forward` is a different function and is not
  registered by its parent; a class merely named `*Norm` is not a norm. BatchNorm / InstanceNorm in
  train mode with running statistics are replayed on scratch copies of their buffers: their output
  uses the batch statistics only, and the running statistics are updated once, by the forward;
- an activation (not in place) of a convolution's output that the engine stores anyway, as GELU stores its
  input for its own backward: in MedNeXt's GroupNorm -> 1x1x1 expansion -> GELU -> 1x1x1 compression the
  expansion's output (the block's widest tensor) is stored once, not twice;
- a *follower* of a recipe: an activation (`LeakyReLU`, `ReLU`, `ReLU6`, `ELU`, `CELU`, `SELU`, `GELU`,
  `SiLU`, `Mish`, `Hardswish`, `Hardsigmoid`, `Sigmoid`, `Tanh`, `Softplus`; in place or not, and a class
  whose own `forward` is declared an elementwise function of `x` by `norm_act_follower = "act"` in its
  body, as `brats_swap.model.networks.LeakyReLUOnBase`), a dropout
  (`Dropout*`, `AlphaDropout`, `FeatureAlphaDropout`; its RNG state at the call is replayed, so the mask
  is identical) or an `nn.Upsample`, applied to the *whole* output of a norm or follower: same storage,
  size, strides, offset and version. Functional calls (`F.gelu`) are not modules and are not seen. An
  activation that saves its own output (`ReLU`, `Sigmoid`, `Tanh`) saves it inside its forward, before
  its recipe exists, so that output is stored (in place, the save is caught and it is recomputed).

Each call is guarded by four hooks of ours around the module's own: a first pre-hook (the call as the
caller made it), a last pre-hook (the input `forward` receives), a first forward hook (the output
`forward` returned) and a last forward hook (the output the caller receives). Everything else is not
recomputed: its output is kept or swapped like any tensor, and the reason is recorded per module name in
`NormActRecipes.skipped` (the engine reports it as `StepStats.norm_act_skipped`):

- the call has other than exactly one positional tensor argument, or keyword arguments (a conditional
  norm `norm(x, gamma)`): replaying `forward(x)` alone would drop them;
- a pre-hook changed the input, or a forward hook replaced or modified the output: a replay of
  `forward` does not run hooks;
- hooks were added to the module after the engine was built (ours are then not first and last, so the
  effect of the new ones cannot be checked), global module forward hooks are installed (they run before
  ours), or `forward` is replaced on the instance;
- a follower's input is a view of a recipe's output (`permute`, `chunk`, slicing), not all of it;
- a norm's input is not a tensor the engine stores (the recipe would have to keep it alive), or its
  output is written into its input;
- a module that looks like a norm (a torch norm class or a class named `*Norm`) is not registered.

A saved view of a recipe's storage is rebuilt on the replayed storage from the view's own size, strides
and offset (the engine's handles), and the replayed tensor must have the layout the forward produced
(checked), so gradients are bitwise equal to plain PyTorch on deterministic kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.modules.module as torch_module
from torch import nn
from torch.utils.checkpoint import checkpoint

from brats_swap.memory.records import module_matches
from brats_swap.memory.storage_map import StorageMap

ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.LeakyReLU, nn.ReLU, nn.ReLU6, nn.ELU, nn.CELU, nn.SELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish,
    nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.Softplus,
)
DROPOUT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)
RESIZE_TYPES: tuple[type[nn.Module], ...] = (nn.Upsample,)
# What looks like a norm; one that is not registered is reported, never replayed.
NORM_LOOKALIKE_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
REPLAYABLE_NORM_FLAG = "replayable_norm"  # `replayable_norm = True` in a class body registers that class
# `norm_act_follower = "act"` ("dropout", "resize") in a class body registers its forward as a follower.
FOLLOWER_FLAG = "norm_act_follower"
# A module method `replay_as_in_forward(x) -> replay(inp)`: how a norm recipe re-runs that module's call on `x`
# (`compiled.CompiledChain`); without it the class `forward` is re-run under no_grad.
REPLAY_METHOD = "replay_as_in_forward"

# The registry holds `forward` functions, not classes: a module is a norm when the forward it runs is one
# known to be replayable, so a subclass that overrides `forward` is never registered by its parent.
_REPLAYABLE_NORM_FORWARDS: set[Callable] = {
    nn.modules.batchnorm._BatchNorm.forward, nn.modules.instancenorm._InstanceNorm.forward,
    nn.LayerNorm.forward, nn.GroupNorm.forward,
    *((nn.RMSNorm.forward,) if hasattr(nn, "RMSNorm") else ()),
}
_FOLLOWER_FORWARDS: dict[Callable, str] = {
    **{cls.forward: "act" for cls in ACTIVATION_TYPES},
    **{cls.forward: "dropout" for cls in DROPOUT_TYPES},
    **{cls.forward: "resize" for cls in RESIZE_TYPES},
}


def register_norm(cls: type[nn.Module]) -> type[nn.Module]:
    """Declare `cls.forward(x)` a pure function of `x`, parameters and buffers, so norm_act may replay it.

    Usable as a class decorator. What is registered is the forward function `cls` runs, so every class
    running that same function (subclasses that do not override it) is registered with it. In train mode
    with running statistics (`track_running_stats` and a `running_mean` buffer) the replay runs on
    scratch copies of the buffers, as for torch's norms.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or cls.forward is nn.Module.forward:
        raise TypeError(f"memory.recompute.register_norm: {cls!r} is not an nn.Module class with a forward")
    _REPLAYABLE_NORM_FORWARDS.add(cls.forward)
    return cls


def forward_owner(cls: type) -> type:
    """The class in `cls`'s MRO that defines the `forward` its instances run."""
    return next(klass for klass in cls.__mro__ if "forward" in vars(klass))


def is_replayable_norm(module: nn.Module) -> bool:
    """The module's class forward is a registered norm (by `register_norm` or `replayable_norm = True`)."""
    cls = type(module)
    return cls.forward in _REPLAYABLE_NORM_FORWARDS or vars(forward_owner(cls)).get(REPLAYABLE_NORM_FLAG) is True


def _kind_of(module: nn.Module) -> str | None:
    """The kind of module a recipe may replay ("norm", "act", "dropout", "resize"), else None."""
    if is_replayable_norm(module):
        return "norm"
    cls = type(module)
    declared = vars(forward_owner(cls)).get(FOLLOWER_FLAG)
    return _FOLLOWER_FORWARDS.get(cls.forward) or (declared if declared in _FOLLOWER_FORWARDS.values() else None)


def is_pointwise_layer(module: nn.Module) -> bool:
    """A layer a compiled norm-activation chain may hold (`compiled.CompiledChain`): a registered norm, an
    activation or a dropout (what norm_act recognises, resizes aside), or an `nn.Identity`."""
    return isinstance(module, nn.Identity) or _kind_of(module) in ("norm", "act", "dropout")


def _looks_like_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_LOOKALIKE_TYPES) or type(module).__name__.endswith("Norm")


def updates_running_stats(module: nn.Module) -> bool:
    """A train-mode norm with running statistics: each call updates them."""
    return bool(module.training and getattr(module, "track_running_stats", False)
                and getattr(module, "running_mean", None) is not None)


# ---------------------------------------------------------------------------------------------- checkpoint


def _first_call_updates_stats(region: nn.Module, original: Callable) -> Callable:
    """`original`, whose second and later calls (checkpoint's recomputation in backward) run every
    train-mode norm with running statistics inside `region` on scratch copies of its buffers: the
    recomputed outputs are the same (a train-mode norm uses the batch statistics), and the running
    statistics and `num_batches_tracked` are updated once per step, by the forward, as without
    checkpointing."""
    norms = [m for m in region.modules() if updates_running_stats(m)]
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1 or not norms:
            return original(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for norm in norms:
                stack.enter_context(_scratch_buffers(norm))
            return original(*args, **kwargs)

    return run


class CheckpointedModules:
    """Wrap the outermost modules matching `patterns` in non-reentrant checkpointing (names unchanged)."""

    def __init__(self, model: nn.Module, patterns: list[str], on_call: Callable[[], None] | None = None,
                 on_done: Callable[[tuple], None] | None = None):
        self.names: list[str] = []
        self._patched: list[tuple[nn.Module, object]] = []
        wrapped_prefixes: list[str] = []
        for name, module in model.named_modules():
            if not name or not module_matches(name, patterns):
                continue
            if any(name.startswith(prefix + ".") for prefix in wrapped_prefixes):
                continue  # an ancestor is checkpointed already
            previous = module.__dict__.get("forward")
            original = module.forward
            module.forward = functools.partial(self._checkpointed, module, original, on_call, on_done)
            self._patched.append((module, previous))
            self.names.append(name)
            wrapped_prefixes.append(name)

    @staticmethod
    def _checkpointed(module, original, on_call, on_done, *args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if on_call is not None:
            on_call()
        out = checkpoint(_first_call_updates_stats(module, original), *args, use_reentrant=False,
                         preserve_rng_state=True, **kwargs)
        if on_done is not None:
            on_done(args)
        return out

    def remove(self) -> None:
        restore_forwards(self._patched)
        self._patched = []


def restore_forwards(patched: list[tuple[nn.Module, object]]) -> None:
    """Undo instance-level `forward` patches: each module's own `forward` attribute as it was before (None: it
    had none, its class's runs again)."""
    for module, previous in patched:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous


# ---------------------------------------------------------------------------------------------- norm_act


class Recipe:
    """How to rebuild one storage in backward: `fn(*inputs)` under no_grad, inputs being handles or recipes."""

    __slots__ = ("fn", "inputs", "layout", "name", "autocast")

    def __init__(self, fn: Callable, inputs: list, out: torch.Tensor, name: str):
        self.fn = fn
        self.inputs = inputs
        self.layout = _layout(out)
        self.name = name
        # Backward runs without the forward's autocast state; replay it so dtypes and values match.
        device_type = out.device.type if out.device.type in ("cpu", "cuda") else "cpu"
        self.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def materialize(self, engine) -> torch.Tensor:
        # A nested recipe goes through the engine, which may hand back the result of a recent rebuild.
        args = [engine.rebuild(item) if isinstance(item, Recipe) else engine.unpack(item)
                for item in self.inputs]
        device_type, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            out = self.fn(*args)
        if _layout(out) != self.layout:
            raise RuntimeError(
                f"norm_act recompute of {self.name!r} produced layout {_layout(out)}, forward had {self.layout}")
        return out


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.size()), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype


def _data_signature(t: torch.Tensor) -> tuple:
    """Equal for two tensor objects that show the same data: storage, layout and version."""
    return t.untyped_storage()._cdata, _layout(t), t._version


@contextlib.contextmanager
def _training_as(module: nn.Module, training: bool) -> Iterator[None]:
    previous = module.training
    module.training = training
    try:
        yield
    finally:
        module.training = previous


@contextlib.contextmanager
def _scratch_buffers(module: nn.Module) -> Iterator[None]:
    """Run on copies of the module's buffers: a train-mode BatchNorm must not update its running
    statistics a second time (its train-mode output depends on the batch statistics only)."""
    originals = dict(module._buffers)
    for key, buffer in originals.items():
        if buffer is not None:
            module._buffers[key] = buffer.clone()
    try:
        yield
    finally:
        module._buffers.update(originals)


def rng_state(device: torch.device) -> tuple:
    """The RNG state a call on `device` sees now (CPU, and the device's on CUDA), for `rng_as`."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def rng_as(state: tuple, device: torch.device) -> Iterator[None]:
    """The RNG state a call saw in the forward pass, leaving the global RNG untouched."""
    cpu_state, device_state = state
    devices = [device] if device_state is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, device)
        yield


def _replay_as_in_forward(module: nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's class `forward` as it is about to run on `x`: same training flag, same RNG state
    (dropout), running statistics untouched. A module with its own `REPLAY_METHOD` (a compiled chain, whose
    replay must run the very graph of its forward) says how instead."""
    own = getattr(module, REPLAY_METHOD, None)
    if own is not None:
        return own(x)
    forward = type(module).forward
    training = module.training
    scratch = updates_running_stats(module)
    rng = None
    if training and isinstance(module, DROPOUT_TYPES):
        rng = rng_state(x.device)
    device = x.device

    def replay(inp: torch.Tensor) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_training_as(module, training))
            if scratch:
                stack.enter_context(_scratch_buffers(module))
            if rng is not None:
                stack.enter_context(rng_as(rng, device))
            return forward(module, inp)

    return replay


def _convolution_output(x) -> bool:
    """`x` is the output of a convolution (as autograd recorded it): the one input an activation recipe of its
    own starts from; the output of anything else (a refused norm, a hooked module) is left as it is."""
    return isinstance(x, torch.Tensor) and type(x.grad_fn).__name__.startswith("ConvolutionBackward")


@dataclass
class _InplacePending:
    """An in-place activation/dropout is running on a recipe tensor: its save arrives before its hook."""

    cdata: int
    version: int
    make: Callable[[torch.Tensor], Recipe]


@dataclass
class _Call:
    """One guarded call in flight, between its first pre-hook and its last forward hook."""

    signature: tuple  # `_data_signature` of the input as the caller passed it
    source: Recipe | None  # followers: the recipe of that input
    replay: Callable | None = None  # set by the last pre-hook
    raw: tuple | None = None  # `_data_signature` of what `forward` returned


class NormActRecipes:
    """Module hooks that teach the engine recipes for norm / activation / dropout / resize outputs.

    `engine` answers `lookup(t)` (its record of `t`'s storage, with a `decision`), `pack(t)` (a handle)
    and, for `Recipe.materialize`, `unpack(handle)` and `rebuild(recipe)`: the saved-tensor front end
    (`frontend.SavedTensorFrontEnd`), with the executor or the recorder behind it.
    `recognised` maps module names to their kind; `skipped` maps the module names whose output was not
    made recomputable in the current forward to the reason (module docstring), until `reset()`.
    """

    def __init__(self, model: nn.Module, engine,
                 inside_compiled: Callable[[nn.Module], str | None] = lambda module: None,
                 chains: list[tuple[str, nn.Module]] | None = None):
        self.engine = engine
        self.active = False  # only during the engine's forward
        self.registry: StorageMap[Recipe] = StorageMap()  # the recipe of each output made recomputable
        self.pending: _InplacePending | None = None
        self.recognised: dict[str, str] = {}  # module name -> "norm" | "act" | "dropout" | "resize"
        # Modules inside a compiled region (`compiled.py`): never guarded, always reported.
        self.fused: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self._calls: dict[int, _Call] = {}
        self._guard_ids: dict[int, tuple[int, int, int, int]] = {}
        self._hooks = []
        # Compiled norm-activation chains (`compiled.CompiledChain`, not submodules of the model): each is
        # guarded as one norm, replaying its compiled graph; the layers it runs are covered by it.
        chains = list(chains or [])
        in_chain = {id(layer) for _name, chain in chains for layer in chain.layers}
        for name, module in [*model.named_modules(), *chains]:
            if id(module) in in_chain:
                continue
            kind = _kind_of(module)
            region = inside_compiled(module)
            if region is not None and (kind is not None or _looks_like_norm(module)):
                self.fused[name] = (f"inside the compiled region {region!r}, where it is fused with its neighbours: "
                                    "kept as that region's compiled graph saves it (a replay of the eager module "
                                    "would not be bitwise the fused kernel's)")
                continue
            if region is not None:
                continue
            if kind is not None:
                self._guard(name, module, kind)
                self.recognised[name] = kind
            elif _looks_like_norm(module):
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._lookalike_call, name)))
        self.skipped = dict(self.fused)

    def _guard(self, name: str, module: nn.Module, kind: str) -> None:
        first_pre = module.register_forward_pre_hook(
            functools.partial(self._call_start, name, kind), prepend=True, with_kwargs=True)
        last_pre = module.register_forward_pre_hook(
            functools.partial(self._call_ready, name, kind), with_kwargs=True)
        first_post = module.register_forward_hook(self._call_output, prepend=True)
        last_post = module.register_forward_hook(functools.partial(self._call_done, name, kind))
        self._hooks += [first_pre, last_pre, first_post, last_post]
        self._guard_ids[id(module)] = (first_pre.id, last_pre.id, first_post.id, last_post.id)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._guard_ids = {}
        self.reset()

    def reset(self) -> None:
        """Forget every recipe not referenced by a saved tensor and the reasons (at the end of each forward)."""
        self.registry = StorageMap()
        self.pending = None
        self.skipped = dict(self.fused)
        self._calls = {}

    # The engine asks this for every new storage it is about to save.
    def recipe_for(self, t: torch.Tensor) -> Recipe | None:
        recipe = self.registry.get(t)
        if recipe is not None:
            return recipe
        pending = self.pending
        if pending is not None and pending.cdata == t.untyped_storage()._cdata and t._version > pending.version:
            recipe = pending.make(t)
            self._register(t, recipe)
            return recipe
        return None

    def _register(self, out: torch.Tensor, recipe: Recipe) -> None:
        self.registry.put(out, recipe)

    def _lookup(self, t: torch.Tensor) -> Recipe | None:
        return self.registry.get(t)

    def _skip(self, name: str, reason: str) -> None:
        self.skipped.setdefault(name, reason)

    # ---------------------------------------------------------------------------- checks
    def _call_problem(self, module: nn.Module, args: tuple, kwargs: dict) -> str | None:
        """Why a call of a recognised module cannot be replayed as `forward(x)`, from its first pre-hook."""
        if "forward" in vars(module):
            return "its forward is replaced on the instance"
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return (f"called with {len(args)} positional and {len(kwargs)} keyword argument(s); "
                    "only a call with one tensor is replayed")
        first_pre, last_pre, first_post, last_post = self._guard_ids[id(module)]
        pre, post = module._forward_pre_hooks, module._forward_hooks
        if (next(iter(pre)), next(reversed(pre)), next(iter(post)), next(reversed(post))) != \
                (first_pre, last_pre, first_post, last_post):
            return "hooks were added to it after the memory engine was built; their effect cannot be checked"
        if torch_module._global_forward_hooks:
            return "global module forward hooks are installed; they run first and may replace its output"
        return None

    # ---------------------------------------------------------------------------- hooks
    def _lookalike_call(self, name: str, module: nn.Module, args) -> None:
        if self.active:
            self._skip(name, f"{type(module).__name__} is not a registered norm (brats_swap.memory.register_norm)")

    def _call_start(self, name: str, kind: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """First pre-hook: the call as the caller made it."""
        self._calls.pop(id(module), None)
        if not self.active:
            return
        x = args[0] if args else None
        source = None
        if kind != "norm":
            source = self._lookup(x) if isinstance(x, torch.Tensor) else None
            if source is None and not (kind == "act" and _convolution_output(x)
                                       and not getattr(module, "inplace", False)):
                return  # not applied to a recipe's output: nothing to recompute, nothing to report
        problem = self._call_problem(module, args, kwargs)
        if problem is None and source is not None and _layout(x) != source.layout:
            problem = f"its input is a view of the output of {source.name!r}, not that whole tensor"
        if problem is not None:
            self._skip(name, problem)
            return
        self._calls[id(module)] = _Call(_data_signature(x), source)

    def _call_ready(self, name: str, kind: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Last pre-hook: the input `forward` receives must be the caller's."""
        call = self._calls.get(id(module))
        if call is None:
            return
        x = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(x, torch.Tensor) or _data_signature(x) != call.signature:
            del self._calls[id(module)]
            self._skip(name, "a forward pre-hook changed its input")
            return
        call.replay = _replay_as_in_forward(module, x)
        if kind != "norm" and getattr(module, "inplace", False):
            source, replay = call.source, call.replay
            self.pending = _InplacePending(x.untyped_storage()._cdata, x._version,
                                           lambda _saved: Recipe(replay, [source], x, name))

    def _call_output(self, module: nn.Module, args: tuple, output) -> None:
        """First forward hook: what `forward` itself returned."""
        call = self._calls.get(id(module))
        if call is not None:
            call.raw = _data_signature(output) if isinstance(output, torch.Tensor) else None

    def _call_done(self, name: str, kind: str, module: nn.Module, args: tuple, output) -> None:
        """Last forward hook: the caller receives what `forward` returned, unchanged; learn the recipe."""
        if kind != "norm":
            self.pending = None
        call = self._calls.pop(id(module), None)
        if call is None:
            return
        if not isinstance(output, torch.Tensor) or call.raw is None or _data_signature(output) != call.raw:
            self._skip(name, "a forward hook replaced or modified its output")
            return
        if kind == "norm":
            self._learn_norm(name, args[0], output, call)
        elif call.source is None:
            self._learn_root_act(args[0], output, call, name)
        elif _data_signature(output) != call.signature and self._lookup(output) is None:
            # (The same data is an identity, e.g. eval-mode dropout: the input's recipe covers it. An
            # in-place follower whose save arrived already has its recipe.)
            self._register(output, Recipe(call.replay, [call.source], output, name))

    def _learn_norm(self, name: str, x: torch.Tensor, out: torch.Tensor, call: _Call) -> None:
        if out.untyped_storage()._cdata == x.untyped_storage()._cdata:
            self._skip(name, "it writes its output into its input's storage")
            return
        record = self.engine.lookup(x)
        if record is None or record.decision not in ("keep", "swap"):
            self._skip(name, "its input is not a tensor the engine stores; a recipe would have to keep it alive")
            return
        self._register(out, Recipe(call.replay, [self.engine.pack(x)], out, name))

    def _learn_root_act(self, x: torch.Tensor, out: torch.Tensor, call: _Call, name: str) -> None:
        """An activation (not in place) of a tensor that is no recipe's output, e.g. MedNeXt's GELU after its
        1x1x1 expansion: recomputable when its input is stored anyway (GELU saves its input for its own
        backward), silently stored otherwise (ReLU after a convolution saves only its output)."""
        if out.untyped_storage()._cdata == x.untyped_storage()._cdata:
            return
        record = self.engine.lookup(x)
        if record is None or record.decision not in ("keep", "swap"):
            return
        self._register(out, Recipe(call.replay, [self.engine.pack(x)], out, name))
