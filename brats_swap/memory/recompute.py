"""Recomputation: checkpoint whole modules, or rebuild only norm + activation outputs from stored conv outputs.

Two mechanisms, both reversible (`remove()`) and both keeping every module's qualified name:

`CheckpointedModules` (`recompute.modules`): the outermost modules whose name matches a glob (same glob
rule as `policy.module_matches`) get an instance-level `forward` that runs the original one under
non-reentrant `torch.utils.checkpoint` with `preserve_rng_state=True`, so dropout masks are replayed
exactly. Only the region's inputs are saved (through the engine, so they can also be swapped); every
tensor saved inside is recomputed in backward, convolutions included.

`NormActRecipes` (`recompute.norm_act`): SuperNeurons-style cost-aware recomputation that never re-runs a
convolution. It works inside the engine's saved-tensor hooks instead of restructuring the model: when a
recognised module produces a tensor, the engine learns a *recipe* for that storage, and a later save of
it is packed as "recompute from the recipe" instead of being stored. The recipe's only stored input is
the norm's input (the conv output), which the norm saves for its own backward anyway, so recomputing
adds no stored tensor. What it recognises, at run time, by data flow:

- a *norm* module (torch's `_NormBase` family, `GroupNorm`, `LayerNorm`, or any module whose class name
  ends in "Norm", e.g. the U-Net's `KerasInstanceNorm`) whose input is a tensor the engine stores;
  BatchNorm-style modules that update running statistics in training are skipped (re-running them would
  update the statistics twice);
- an *activation* module (`LeakyReLU`, `ReLU`, `ReLU6`, `ELU`, `CELU`, `SELU`, `GELU`, `SiLU`, `Mish`,
  `Hardswish`, `Hardsigmoid`, `Sigmoid`, `Tanh`, `Softplus`; in place or not) whose input is a norm
  output with a recipe;
- a *dropout* module (`Dropout`, `Dropout1d/2d/3d`, `AlphaDropout`, `FeatureAlphaDropout`) whose input
  has a recipe; its RNG state is captured before the forward and replayed, so the mask is identical;
- an `nn.Upsample` whose input has a recipe (the decoder's resize of the previous level's activation).

So in a Conv -> Norm -> Act (-> Dropout | Upsample) -> Conv chain only the first conv's output is stored: the
norm's input save, the activation's input save and the next convolution's input save all share one
stored storage. Recipes run the modules' own `forward` under `no_grad` (no hooks fire), and the result
must have the layout the forward produced (checked), so rebuilt views are exact and gradients are
bitwise equal to plain PyTorch on deterministic kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from brats_swap.memory.policy import module_matches

ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.LeakyReLU, nn.ReLU, nn.ReLU6, nn.ELU, nn.CELU, nn.SELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish,
    nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.Softplus,
)
DROPOUT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)
RESIZE_TYPES: tuple[type[nn.Module], ...] = (nn.Upsample,)


def is_norm_module(module: nn.Module) -> bool:
    return isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)) or \
        type(module).__name__.endswith("Norm")


def _updates_running_stats(module: nn.Module) -> bool:
    return bool(module.training and getattr(module, "track_running_stats", False)
                and getattr(module, "running_mean", None) is not None)


# ---------------------------------------------------------------------------------------------- checkpoint


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
            module.forward = functools.partial(self._checkpointed, original, on_call, on_done)
            self._patched.append((module, previous))
            self.names.append(name)
            wrapped_prefixes.append(name)

    @staticmethod
    def _checkpointed(original, on_call, on_done, *args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if on_call is not None:
            on_call()
        out = checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        if on_done is not None:
            on_done(args)
        return out

    def remove(self) -> None:
        for module, previous in self._patched:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._patched = []


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
        args = [item.materialize(engine) if isinstance(item, Recipe) else engine.unpack(item)
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


def _replay_rng(forward: Callable, cpu_state: torch.Tensor, device: torch.device, device_state):
    """Run `forward` with the RNG state it saw in the forward pass, leaving the global RNG untouched."""

    def replay(x: torch.Tensor) -> torch.Tensor:
        devices = [device] if device_state is not None else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            torch.set_rng_state(cpu_state)
            if device_state is not None:
                torch.cuda.set_rng_state(device_state, device)
            return forward(x)

    return replay


@dataclass
class _Entry:
    weak: StorageWeakRef
    version: int
    recipe: Recipe


@dataclass
class _InplacePending:
    """An in-place activation/dropout is running on a recipe tensor: its save arrives before its hook."""

    cdata: int
    version: int
    make: Callable[[torch.Tensor], Recipe]


class NormActRecipes:
    """Forward hooks that teach the engine recipes for norm / activation / dropout outputs."""

    def __init__(self, model: nn.Module, engine):
        self.engine = engine  # swap.SavedTensorEngine
        self.active = False  # only during the engine's forward
        self.registry: dict[int, _Entry] = {}
        self.pending: _InplacePending | None = None
        self.recognised: dict[str, str] = {}  # module name -> "norm" | "act" | "dropout" | "resize"
        self._hooks = []
        for name, module in model.named_modules():
            if is_norm_module(module):
                kind = "norm"
                self._hooks.append(module.register_forward_hook(functools.partial(self._norm_done, name)))
            elif isinstance(module, ACTIVATION_TYPES):
                kind = "act"
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._follower_start, name)))
                self._hooks.append(module.register_forward_hook(functools.partial(self._follower_done, name)))
            elif isinstance(module, DROPOUT_TYPES + RESIZE_TYPES):
                kind = "dropout" if isinstance(module, DROPOUT_TYPES) else "resize"
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._follower_start, name)))
                self._hooks.append(module.register_forward_hook(functools.partial(self._follower_done, name)))
            else:
                continue
            self.recognised[name] = kind
        self._starts: dict[int, tuple] = {}

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.reset()

    def reset(self) -> None:
        """Forget every recipe not referenced by a saved tensor (called at the end of each forward)."""
        self.registry = {}
        self.pending = None
        self._starts = {}

    # The engine asks this for every new storage it is about to save.
    def recipe_for(self, t: torch.Tensor) -> Recipe | None:
        cdata = t.untyped_storage()._cdata
        entry = self.registry.get(cdata)
        if entry is not None and not entry.weak.expired() and entry.version == t._version:
            return entry.recipe
        pending = self.pending
        if pending is not None and pending.cdata == cdata and t._version > pending.version:
            recipe = pending.make(t)
            self._register(t, recipe)
            return recipe
        return None

    def _register(self, out: torch.Tensor, recipe: Recipe) -> None:
        storage = out.untyped_storage()
        self.registry[storage._cdata] = _Entry(StorageWeakRef(storage), out._version, recipe)

    def _lookup(self, t: torch.Tensor) -> Recipe | None:
        entry = self.registry.get(t.untyped_storage()._cdata)
        if entry is None or entry.weak.expired() or entry.version != t._version:
            return None
        return entry.recipe

    # ---------------------------------------------------------------------------- hooks
    def _norm_done(self, name: str, module: nn.Module, args, out) -> None:
        if not self.active or not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        x = args[0]
        if _updates_running_stats(module) or out.untyped_storage()._cdata == x.untyped_storage()._cdata:
            return
        record = self.engine.lookup(x)
        if record is None or record.decision not in ("keep", "swap"):
            return  # the input is not stored by the engine: a recipe would have to keep it alive
        self._register(out, Recipe(module.forward, [self.engine.pack(x)], out, name))

    def _follower_start(self, name: str, module: nn.Module, args) -> None:
        if not self.active or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        source = self._lookup(x)
        if source is None:
            self._starts.pop(id(module), None)
            return
        forward = module.forward
        if isinstance(module, DROPOUT_TYPES) and module.training:
            device_state = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
            forward = _replay_rng(module.forward, torch.get_rng_state(), x.device, device_state)
        self._starts[id(module)] = (source, forward, x._version)
        if getattr(module, "inplace", False):
            layout_source = x
            self.pending = _InplacePending(
                x.untyped_storage()._cdata, x._version,
                lambda _saved: Recipe(forward, [source], layout_source, name))

    def _follower_done(self, name: str, module: nn.Module, args, out) -> None:
        started = self._starts.pop(id(module), None)
        self.pending = None
        if not self.active or started is None or not isinstance(out, torch.Tensor):
            return
        source, forward, version_before = started
        if args and out is args[0] and out._version == version_before:
            return  # identity (eval-mode dropout): the input's recipe already covers it
        if self._lookup(out) is None:
            self._register(out, Recipe(forward, [source], out, name))
