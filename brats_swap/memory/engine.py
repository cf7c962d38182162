"""`MemoryEngine`: applies a memory policy (swap / recompute / hybrid) to any `nn.Module`.

The engine installs, reversibly:
- a forward pre/post hook on every module, reported to the step's `rulebook.Rulebook` (which module
  runs, which block runs; a module start is where finished copies are released); the root module's
  pre-hook also reports the model's forward arguments, which are never swapped (the caller holds them);
- on the blocks (`discover_blocks`, or the `blocks` argument) the same hooks number each block call, and
  a prehook on the `grad_fn` of each block output fires when backward reaches that block, where the
  rulebook issues the reloads needed within `swap.lookahead` blocks (TransformerEngine's approach: no
  extra autograd node, no changed outputs);
- for `recompute` / `hybrid`: checkpoint wrappers and norm_act recipes (`recompute.py`).

Saved tensors themselves are handled by `swap.SavedTensorEngine` through `saved_tensors_hooks`, active
only inside `engine.step()` (the forward and the loss); backward runs outside it. When swapped memory
leaves and comes back is the rulebook's business: see `brats_swap.memory.rulebook`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from brats_swap.config import ConfigError, MemoryConfig, validate_memory_config
from brats_swap.config.loader import from_dict
from brats_swap.memory.policy import RECOMPUTE_MODES, SavedRecord, effective_memory_config
from brats_swap.memory.recompute import CheckpointedModules, NormActRecipes
from brats_swap.memory.rulebook import SWAP
from brats_swap.memory.stats import StepStats
from brats_swap.memory.swap import SavedTensorEngine, tensors_in

# Models with a live engine (model -> weak reference to it): the engine's hooks, wrappers and per-step
# state must not be copied with the model (`trace.meta_copy` refuses such a model rather than duplicate
# the engine's weak storage references, which would be freed twice).
ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

COMPUTE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
)


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


def _resolve_blocks(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
    if blocks is None:
        return discover_blocks(model)
    modules = dict(model.named_modules())
    names = {id(module): name for name, module in model.named_modules()}
    resolved = []
    for item in blocks:
        if isinstance(item, str):
            if item not in modules:
                raise ConfigError(f"memory engine blocks: no module named {item!r} in the model")
            resolved.append((item, modules[item]))
        elif isinstance(item, tuple):
            resolved.append((item[0], item[1]))
        elif isinstance(item, nn.Module) and id(item) in names:
            resolved.append((names[id(item)], item))
        else:
            raise ConfigError(f"memory engine blocks: {item!r} is not a module name or a submodule of the model")
    return resolved


def memory_config_from(policy: MemoryConfig | dict | str | None) -> MemoryConfig:
    """A `MemoryConfig` from a config object, a dict shaped like the YAML `memory:` section, or a mode name.

    A dict or a mode name is read and checked exactly as the YAML section is (`brats_swap.config`), so a
    bad key or value is a `ConfigError` naming it. A `MemoryConfig` is taken as it is: it comes from the
    config loader or from this function, both of which validated it.
    """
    if policy is None:
        return MemoryConfig()
    if isinstance(policy, MemoryConfig):
        return policy
    if isinstance(policy, str):
        policy = {"mode": policy}
    if not isinstance(policy, dict):
        raise ConfigError(f"memory policy: expected a MemoryConfig, a dict or a mode name, got {type(policy).__name__}")
    cfg = from_dict(MemoryConfig, policy, prefix="memory")
    validate_memory_config(cfg)
    return cfg


class MemoryEngine:
    """Apply `memory_cfg` to `model`. Mode `none` is a no-op unless `measure=True` (stats only).

    Training-loop use (backward outside the step context):

        engine = MemoryEngine(model, cfg.memory, device)
        with engine.step():
            loss = loss_fn(model(x), y)
        loss.backward()
        stats = engine.last_stats()     # StepStats, .as_dict() for loggers
        ...
        engine.close()                  # removes every hook and wrapper

    `memory_cfg` is a concrete policy: mode `auto` must have been resolved by the planner
    (`planner.choose_policy`) before the engine is built. `self.cfg` is the policy the engine runs:
    `policy.effective_memory_config` of the argument, which is the argument itself when the caller
    resolved it already (as training does, so that the engine, the checkpoint and the run record hold one
    and the same policy).

    Arguments beyond the contract: `blocks` (module names, modules or (name, module) pairs used as
    prefetch blocks; default `discover_blocks`), `measure` (install the hooks in mode none to report
    saved bytes), `prefetch=False` (every reload is a synchronous miss; for tests), `arena_bytes`
    (the host arena's size, `arena.arena_bytes` of the planner's swapped storages; with `device` it is
    allocated here, so a host that cannot hold it is a one-line `ConfigError` before the first step),
    `log` (a list that receives the rulebook's per-tensor event sequence of every step; tests compare it
    with the simulator's).
    """

    def __init__(self, model: nn.Module, memory_cfg: MemoryConfig | dict | str | None = None,
                 device: torch.device | str | None = None, *, blocks: Sequence | None = None,
                 measure: bool = False, prefetch: bool = True, arena_bytes: int = 0, log: list | None = None):
        cfg = memory_config_from(memory_cfg)
        if cfg.mode == "auto":
            raise ConfigError("memory.mode=auto: the planner (brats_swap.memory.planner.choose_policy) must "
                              "resolve it to a concrete policy before the engine is built")
        cfg = effective_memory_config(cfg)
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else None
        self.enabled = cfg.mode != "none" or measure
        self._hooks: list = []
        self._checkpointed: CheckpointedModules | None = None
        self.recipes: NormActRecipes | None = None
        self.blocks: list[tuple[str, nn.Module]] = []
        self._in_forward = False
        self.core: SavedTensorEngine | None = None
        if not self.enabled:
            return

        self.core = SavedTensorEngine(cfg, param_storages=self._param_storages, prefetch=prefetch,
                                      arena_bytes=arena_bytes, log=log)
        if arena_bytes and self.device is not None and self.device.type != "meta":
            self.core.reserve_arena(self.device)
        ATTACHED[model] = weakref.ref(self)
        self.blocks = _resolve_blocks(model, blocks)
        block_ids = {id(module) for _name, module in self.blocks}
        for name, module in model.named_modules():
            is_block = id(module) in block_ids
            self._hooks.append(module.register_forward_pre_hook(
                functools.partial(self._module_start, name, is_block), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                functools.partial(self._module_end, is_block), always_call=True))
        if cfg.mode in RECOMPUTE_MODES:
            if cfg.recompute.modules:
                self._checkpointed = CheckpointedModules(model, cfg.recompute.modules, self._count_checkpoint,
                                                        self._checkpoint_done)
                if not self._checkpointed.names:
                    self.close()
                    raise ConfigError(f"memory.recompute.modules: {cfg.recompute.modules} match no module of the model")
            if cfg.recompute.norm_act:
                self.recipes = NormActRecipes(model, self.core)
                self.core.recipes = self.recipes

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def step(self) -> Iterator[MemoryEngine]:
        """Run the forward (and loss) of one step inside this context; call backward after it."""
        if not self.enabled:
            yield self
            return
        if self._in_forward:
            raise RuntimeError("MemoryEngine.step() is not re-entrant")
        self.core.begin_step()
        self._in_forward = True
        if self.recipes is not None:
            self.recipes.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.core.pack, self.core.unpack):
                yield self
        finally:
            self._in_forward = False
            if self.recipes is not None:
                self.recipes.active = False
                self.core.rulebook.stats.norm_act_skipped = dict(self.recipes.skipped)
                self.recipes.reset()
            self.core.finish_forward()

    def last_stats(self) -> StepStats:
        """Statistics of the latest step (complete once its backward has run)."""
        if self.core is None:
            return StepStats()
        return self.core.step_stats()

    def last_records(self) -> list[SavedRecord]:
        """Every storage saved in the latest forward, as `policy.SavedRecord`s (what a planner predicts)."""
        return self.core.rulebook.records if self.core is not None else []

    def last_swapped(self) -> set[int]:
        """Indices (into `last_records()`) of the storages the latest step swapped."""
        if self.core is None:
            return set()
        return {entry.index for entry in self.core.rulebook.entries if entry.decision == SWAP}

    def last_decisions(self) -> list[tuple[str, str]]:
        """(decision, reason) of every storage of `last_records()`, e.g. ("keep", "smaller than ...")."""
        if self.core is None:
            return []
        return [(entry.decision, entry.reason) for entry in self.core.rulebook.entries]

    @property
    def checkpointed_modules(self) -> list[str]:
        return list(self._checkpointed.names) if self._checkpointed is not None else []

    def close(self) -> None:
        """Remove every hook and wrapper (the model is exactly as before) and return the host memory."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._checkpointed is not None:
            self._checkpointed.remove()
            self._checkpointed = None
        if self.recipes is not None:
            self.recipes.remove()
            self.recipes = None
            self.core.recipes = None
        if self.core is not None:
            self.core.close()
        attached = ATTACHED.get(self.model)
        if attached is not None and attached() is self:
            del ATTACHED[self.model]

    def __enter__(self) -> MemoryEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ forward events
    def _param_storages(self) -> set[int]:
        return {t.untyped_storage()._cdata for t in list(self.model.parameters()) + list(self.model.buffers())}

    def _module_start(self, name: str, is_block: bool, module: nn.Module, args, kwargs) -> None:
        if not self._in_forward:
            return
        if module is self.model:
            self.core.set_inputs(tensors_in((args, kwargs)))
        self.core.rulebook.module_start(name, is_block)

    def _module_end(self, is_block: bool, module: nn.Module, args, output) -> None:
        if not self._in_forward:
            return
        ordinal = self.core.rulebook.module_end(is_block)
        if ordinal is None:
            return
        marker = functools.partial(self._block_backward, self.core.step_id, ordinal)
        for tensor in tensors_in(output):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(marker)

    def _count_checkpoint(self) -> None:
        if self._in_forward:
            self.core.rulebook.stats.recomputed_modules += 1

    def _checkpoint_done(self, args: tuple) -> None:
        """The region's saved inputs are first used when backward recomputes it."""
        if self._in_forward:
            self.core.rulebook.region_done(self.core.lookup(t) for t in tensors_in(list(args)))

    def _block_backward(self, step_id: int, ordinal: int, grad_outputs) -> None:
        if self.core is not None and step_id == self.core.step_id:
            self.core.on_block_backward(ordinal)


@contextlib.contextmanager
def memory_policy(model: nn.Module, policy: MemoryConfig | dict | str | None = None,
                  device: torch.device | str | None = None, **engine_kwargs) -> Iterator[MemoryEngine]:
    """Apply a memory policy to any `nn.Module` for the duration of a `with` block.

    `policy` has the fields of the YAML `memory:` section (a dict, a `MemoryConfig`, or just a mode name).
    Example (README):

        from brats_swap.memory import memory_policy

        policy = {"mode": "hybrid", "swap": {"exclude": ["decoder.*"], "lookahead": 2},
                  "recompute": {"norm_act": True}}
        with memory_policy(model, policy) as engine:
            for x, y in loader:
                with engine.step():                 # saved tensors are swapped/recomputed here
                    loss = loss_fn(model(x), y)
                loss.backward()                     # reloads are prefetched block by block
                optimizer.step(); optimizer.zero_grad()
                print(engine.last_stats().as_dict())
        # leaving the block removes every hook: the model is untouched
    """
    engine = MemoryEngine(model, policy, device, **engine_kwargs)
    try:
        yield engine
    finally:
        engine.close()
