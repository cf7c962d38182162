"""A network's stages, found from its own structure, and the module globs of a memory policy checked
against it.

The named policies (`presets.py`) are written for "the encoder's two high-resolution stages" or "every
stage", not for one network's module names. `model_stages` finds those stages in any encoder-decoder
network by running it once on the `meta` device (no memory, no data) and watching its convolutions:

- each convolution (or linear layer) belongs to the stage of its output: a *level* (0 = the largest
  spatial size, 1 = the next smaller, ...) on a *side*: the encoder up to and including the last
  convolution at the smallest size (the bottleneck), the decoder after it. A strided convolution opens
  the stage it computes, a transposed one the decoder level it produces;
- a stage's modules are the outermost modules that ran in the forward and whose convolutions all belong
  to that stage (nnU-Net's `encoder.stages.2`, the U-Net's `encoder.level2`); modules without a
  convolution (a residual addition's activation, say) belong to the stage of the module around them.

`unmatched_globs` is the check that a policy's globs (`swap.include`, `swap.exclude`,
`recompute.modules`, `recompute.norm_act_exclude`) name modules of the model: a glob that matches none
would make that part of the policy silently do nothing.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from brats_swap.config import ConfigError, MemoryConfig
from brats_swap.memory.frontend import COMPUTE_TYPES, tensors_in
from brats_swap.memory.recorder import meta_copy
from brats_swap.memory.records import module_matches

ENCODER, DECODER = "encoder", "decoder"


@dataclass
class Stage:
    side: str  # ENCODER or DECODER
    level: int  # 0 = the largest spatial size
    modules: list[str] = field(default_factory=list)  # outermost modules wholly in this stage, forward order

    @property
    def globs(self) -> list[str]:
        """The modules as globs that match exactly them (and what they contain)."""
        return [glob.escape(name) for name in self.modules]


def model_stages(model: nn.Module, input_shape: Sequence[int], step: Callable | None = None) -> list[Stage]:
    """The stages of `model` at `input_shape` (B, C, *spatial), encoder first, each side by level (module
    docstring). Runs one forward of a meta copy under `no_grad` (`step(model, x)` for a model with another
    calling convention, as `recorder.trace_step`); `model` is not modified."""
    meta = meta_copy(model)
    order: dict[int, int] = {}  # id(module) -> first-call ordinal
    sizes: dict[int, int] = {}  # id(compute module) -> spatial size of its first output
    handles = [module.register_forward_hook(_recorder(module, order, sizes)) for module in meta.modules()]
    try:
        with torch.no_grad():
            x = torch.empty(tuple(input_shape), device="meta")
            meta(x) if step is None else step(meta, x)
    finally:
        for handle in handles:
            handle.remove()
    return _group(meta, order, _stage_of_compute(meta, order, sizes))


def _recorder(module: nn.Module, order: dict[int, int], sizes: dict[int, int]):
    def hook(_module, _args, output):
        order.setdefault(id(module), len(order))
        if isinstance(module, COMPUTE_TYPES) and id(module) not in sizes:
            tensors = [t for t in tensors_in(output) if t.dim() > 2]
            if tensors:
                sizes[id(module)] = math.prod(tensors[0].shape[2:])
    return hook


def _stage_of_compute(model: nn.Module, order: dict[int, int], sizes: dict[int, int]) -> dict[int, tuple[str, int]]:
    """(side, level) of every convolution that ran, by the rules of the module docstring."""
    ran = sorted((order[id(m)], id(m)) for m in model.modules() if id(m) in sizes)
    if not ran:
        return {}
    levels = {size: level for level, size in enumerate(sorted(set(sizes.values()), reverse=True))}
    smallest = min(sizes.values())
    bottleneck_end = max(position for position, key in ran if sizes[key] == smallest)
    return {key: (ENCODER if position <= bottleneck_end else DECODER, levels[sizes[key]]) for position, key in ran}


def _group(model: nn.Module, order: dict[int, int], stage_of: dict[int, tuple[str, int]]) -> list[Stage]:
    members: dict[int, frozenset] = {}  # id(module) -> the stages of the convolutions it contains

    def stages_in(module: nn.Module) -> frozenset:
        if id(module) not in members:
            members[id(module)] = frozenset(stage_of[id(m)] for m in module.modules() if id(m) in stage_of)
        return members[id(module)]

    found: dict[tuple[str, int], list[tuple[int, str]]] = {}
    seen: set[int] = set()  # a module registered twice (nnU-Net's decoder holds the encoder) has its first name

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        inside = stages_in(module)
        if name and id(module) in order and len(inside) == 1:
            found.setdefault(next(iter(inside)), []).append((order[id(module)], name))
            return
        for child_name, child in module.named_children():
            if stages_in(child):
                visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return [Stage(side, level, [name for _, name in sorted(found[(side, level)])])
            for side, level in sorted(found, key=lambda key: (key[0] != ENCODER, key[1] if key[0] == ENCODER
                                                              else -key[1]))]


def encoder_globs(stages: list[Stage], levels: int | None = None) -> list[str]:
    """Globs of the encoder stages, the `levels` highest-resolution ones (None: all)."""
    chosen = [stage for stage in stages if stage.side == ENCODER and (levels is None or stage.level < levels)]
    return [g for stage in chosen for g in stage.globs]


def decoder_globs(stages: list[Stage]) -> list[str]:
    return [g for stage in stages if stage.side == DECODER for g in stage.globs]


def policy_globs(cfg: MemoryConfig) -> dict[str, list[str]]:
    """The module-glob knobs of a policy that apply in its mode, by dotted key."""
    globs = {}
    if cfg.mode in ("swap", "hybrid"):
        globs["memory.swap.include"] = cfg.swap.include
        globs["memory.swap.exclude"] = cfg.swap.exclude
    if cfg.mode in ("recompute", "hybrid"):
        globs["memory.recompute.modules"] = cfg.recompute.modules
        if cfg.recompute.norm_act:
            globs["memory.recompute.norm_act_exclude"] = cfg.recompute.norm_act_exclude
    return globs


def unmatched_globs(model: nn.Module, cfg: MemoryConfig) -> list[tuple[str, str]]:
    """(dotted key, glob) for every glob of `cfg` (in its mode) that matches no module of `model`."""
    names = [name for name, _ in model.named_modules() if name]
    return [(key, pattern) for key, patterns in policy_globs(cfg).items() for pattern in patterns
            if not any(module_matches(name, [pattern]) for name in names)]


def check_globs(model: nn.Module, cfg: MemoryConfig) -> None:
    """ConfigError (one line) when a glob of `cfg` matches no module of `model`: never a silent no-op."""
    unmatched = unmatched_globs(model, cfg)
    if not unmatched:
        return
    key, pattern = unmatched[0]
    top = ", ".join(name for name, _ in model.named_children()) or "none"
    more = f" (and {len(unmatched) - 1} more)" if len(unmatched) > 1 else ""
    raise ConfigError(f"{key}: {pattern!r} matches no module of {type(model).__name__}{more}; "
                      f"its top-level modules are: {top}")
