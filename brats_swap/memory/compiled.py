"""Regional compilation: every block the engine knows runs compiled, the engine's hooks stay outside.

`CompiledRegions(model)` replaces the `forward` of each region (by default the engine's blocks,
`frontend.discover_blocks`: the innermost modules that own a convolution or linear layer) with
`torch.compile(forward, dynamic=False)`. The module's `__call__` still runs its hooks eagerly around the
compiled forward, so the memory engine built on the model afterwards keeps its decisions at the region
boundaries:

- its module hooks sit on the regions and on the modules outside them (never inside: dynamo would trace
  them into the graph, or, with `skip_nnmodule_hook_guards`, silently skip them);
- a region's saved tensors are those the compiled graph saves (AOTAutograd's partitioner already
  recomputes cheap pointwise ops from what it keeps); the saved-tensor hooks see them at runtime, all at
  the end of the region's compiled forward (pytorch PR #150032), and the region's backward unpacks them
  at its start. Swapping copies a saved tensor out and back unchanged, and block checkpointing replays
  the same compiled graphs, so every policy gives bitwise the weights of `none` compiled;
- norm_act recipes are not learned inside a region (its norm and activation are one fused kernel, which
  a replay of the eager modules would not reproduce bit for bit): those tensors are kept, and
  `StepStats.norm_act_skipped` says so per module;
- checkpointing (`recompute.modules`) a module inside a region is refused: the compiled graph would not
  see the wrapper;
- swap globs naming modules inside regions name the regions (`at_block_granularity`).

Shapes are static (`dynamic=False`): a step of a new shape (validation's whole cube, eval mode) compiles
once, later steps of a known shape reuse it. Regions of one class share a code object, and dynamo caches
per code object, so the recompile limit is raised to cover every region in both modes.
`remove()` puts the eager forwards back (the fallback after a failed compilation).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from brats_swap.config import MemoryConfig
from brats_swap.memory.frontend import discover_blocks
from brats_swap.memory.recompute import restore_forwards

# Models with compiled regions -> their `CompiledRegions` (the engine asks, `compiled_regions`).
COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Cache entries per region that dynamo may keep: train and eval mode, with and without grad, two shapes.
ENTRIES_PER_REGION = 8


def compile_wanted(setting: bool | str, device: torch.device) -> bool:
    """`train.compile` / `evaluate.compile` for `device`: `auto` compiles on CUDA (as nnU-Net does) and not on
    the CPU, where the step is convolution-bound and compilation takes minutes (docs/memory.md)."""
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
    """Compile each region of `model` (module docstring); `regions` are (name, module) pairs (default the
    engine's blocks). `backend` is `torch.compile`'s (tests pass one that fails).

    A region whose compilation fails (the compiler raises before the graph runs) runs its eager forward for
    that call, every region goes back to eager (`remove`) and `on_failure(cause)` is called once, with the
    cause in one line (`failed` keeps it). A failure in a lazily compiled backward surfaces in
    `loss.backward()` instead: the caller retries the step (`run.compiling`).
    """

    def __init__(self, model: nn.Module, regions: Sequence[tuple[str, nn.Module]] | None = None, *,
                 backend: str | Callable = "inductor", on_failure: Callable[[str], None] | None = None):
        if model in COMPILED:
            raise RuntimeError("the model's regions are compiled already")
        self.model = model
        self.regions = list(regions) if regions is not None else discover_blocks(model)
        self.on_failure = on_failure
        self.failed: str | None = None
        self._patched: list[tuple[nn.Module, object]] = []
        for _name, module in self.regions:
            previous = module.__dict__.get("forward")
            eager = module.forward
            compiled = torch.compile(eager, dynamic=False, backend=backend)
            module.forward = functools.partial(self._call, compiled, eager)
            self._patched.append((module, previous))
        self._inside = self._modules_inside()
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

    def _modules_inside(self) -> dict[int, str]:
        """id(module) -> its region's name, for every module strictly inside a region."""
        inside: dict[int, str] = {}
        for name, region in self.regions:
            for sub in region.modules():
                if sub is not region:
                    inside[id(sub)] = name
        return inside

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
