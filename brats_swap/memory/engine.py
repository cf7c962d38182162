"""`MemoryEngine`: applies a memory policy (swap / recompute / hybrid) to any `nn.Module`.

The engine installs, reversibly, through the saved-tensor front end (`frontend.SavedTensorFrontEnd`):
- a forward pre/post hook on every module, reported to the step's `rulebook.Rulebook` (which module
  runs, which block runs; release points depend on the saves alone, rule 6: only a synchronous link
  releases its copies at module starts); the root module's pre-hook also reports the model's forward
  arguments, which are never swapped (the caller holds them);
- on the blocks (`discover_blocks`, or the `blocks` argument) the same hooks number each block call, and
  a prehook on the `grad_fn` of each block output fires when backward reaches that block, where the
  rulebook issues the reloads needed within `swap.lookahead` blocks (TransformerEngine's approach: no
  extra autograd node, no changed outputs);
- for `recompute` / `hybrid`: checkpoint wrappers and norm_act recipes (`recompute.py`).

Saved tensors go through the front end's `saved_tensors_hooks`, active only inside `engine.step()` (the
forward and the loss); backward runs outside it. What happens to them is the rulebook's business (see
`brats_swap.memory.rulebook`); the executor (`executor.SwapExecutor`) carries it out.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from brats_swap.config import ConfigError, MemoryConfig, validate_memory_config
from brats_swap.config.loader import from_dict
from brats_swap.memory.budget import with_inflight_window
from brats_swap.memory.compiled import compiled_regions
from brats_swap.memory.executor import SwapExecutor
from brats_swap.memory.frontend import ATTACHED, SavedTensorFrontEnd, discover_blocks
from brats_swap.memory.recompute import CheckpointedModules, NormActRecipes
from brats_swap.memory.records import RECOMPUTE_MODES, SavedRecord, effective_memory_config
from brats_swap.memory.rulebook import SWAP
from brats_swap.memory.stats import StepStats


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


def _model_device(model: nn.Module) -> torch.device | None:
    """Where the model's parameters live (None: it has none), for the defaults that depend on the card."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else None


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
    `records.effective_memory_config` of the argument with the in-flight window filled for `device` (else
    the model's) when unset (`budget.with_inflight_window`), which is the argument itself when the caller
    resolved it already (as training does, so that the engine, the checkpoint and the run record hold one
    and the same policy).

    Arguments beyond the contract: `blocks` (module names, modules or (name, module) pairs used as
    prefetch blocks; default `discover_blocks`), `measure` (install the hooks in mode none to report
    saved bytes), `prefetch=False` (every reload is a synchronous miss; for tests), `arena_bytes`
    (the host arena's size, `arena.arena_bytes` of the planner's swapped storages; with `device` it is
    allocated here, so a host that cannot hold it is a one-line `ConfigError` before the first step),
    `host_arena` (an `arena.HostArena` the caller owns and reuses across engines: pinned once, never
    closed by the engine), `log` (a list that receives the rulebook's per-tensor event sequence of every step; tests compare it
    with the simulator's).
    """

    def __init__(self, model: nn.Module, memory_cfg: MemoryConfig | dict | str | None = None,
                 device: torch.device | str | None = None, *, blocks: Sequence | None = None,
                 measure: bool = False, prefetch: bool = True, arena_bytes: int = 0, host_arena=None,
                 log: list | None = None):
        cfg = memory_config_from(memory_cfg)
        if cfg.mode == "auto":
            raise ConfigError("memory.mode=auto: the planner (brats_swap.memory.planner.choose_policy) must "
                              "resolve it to a concrete policy before the engine is built")
        self.device = torch.device(device) if device is not None else None
        cfg = with_inflight_window(effective_memory_config(cfg), self.device or _model_device(model))
        regions = compiled_regions(model)
        if regions is not None:  # swap globs that name modules inside compiled blocks name the blocks instead
            cfg = regions.at_block_granularity(cfg)
        self.model = model
        self.cfg = cfg
        self.enabled = cfg.mode != "none" or measure
        self._checkpointed: CheckpointedModules | None = None
        self.recipes: NormActRecipes | None = None
        self.blocks: list[tuple[str, nn.Module]] = []
        self.front: SavedTensorFrontEnd | None = None
        self.executor: SwapExecutor | None = None
        if not self.enabled:
            return

        self.executor = SwapExecutor(cfg, arena_bytes=arena_bytes, host_arena=host_arena)
        self.front = SavedTensorFrontEnd(cfg, self.executor, param_storages=self._param_storages, prefetch=prefetch,
                                         log=log)
        if arena_bytes and self.device is not None and self.device.type != "meta":
            self.executor.reserve_arena(self.device)
        ATTACHED[model] = weakref.ref(self)
        self.blocks = _resolve_blocks(model, blocks)
        inside_compiled = regions.region_around if regions is not None else (lambda module: None)
        self.front.install(model, self.blocks, inside_compiled)
        if cfg.mode in RECOMPUTE_MODES:
            if cfg.recompute.modules:
                self._checkpoint(model, cfg.recompute.modules, inside_compiled)
            if cfg.recompute.norm_act:
                self.recipes = NormActRecipes(model, self.front, inside_compiled,
                                              regions.chains if regions is not None else None)
                self.front.recipes = self.recipes

    def _checkpoint(self, model: nn.Module, patterns: list[str], inside_compiled) -> None:
        """`recompute.modules` under checkpointing; a matched module inside a compiled region is refused (the
        compiled graph would not run the wrapper)."""
        self._checkpointed = CheckpointedModules(model, patterns, self.front.checkpoint_called, self.front.region_done)
        modules = dict(model.named_modules())
        if not self._checkpointed.names:
            self.close()
            raise ConfigError(f"memory.recompute.modules: {patterns} match no module of the model")
        for name in self._checkpointed.names:
            region = inside_compiled(modules[name])
            if region is not None:
                self.close()
                raise ConfigError(f"memory.recompute.modules: {name!r} is inside the compiled region {region!r}; "
                                  "under compile checkpoint whole blocks or the modules around them")

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def step(self) -> Iterator[MemoryEngine]:
        """Run the forward (and loss) of one step inside this context; call backward after it."""
        if not self.enabled:
            yield self
            return
        with self.front.forward():
            yield self

    def last_stats(self) -> StepStats:
        """Statistics of the latest step (complete once its backward has run)."""
        if self.executor is None:
            return StepStats()
        return self.executor.step_stats()

    def last_records(self) -> list[SavedRecord]:
        """Every storage saved in the latest forward, as `records.SavedRecord`s (what a planner predicts)."""
        return self.front.rulebook.records if self.front is not None else []

    def last_swapped(self) -> set[int]:
        """Indices (into `last_records()`) of the storages the latest step swapped."""
        if self.front is None:
            return set()
        return {entry.index for entry in self.front.rulebook.entries if entry.decision == SWAP}

    def last_decisions(self) -> list[tuple[str, str]]:
        """(decision, reason) of every storage of `last_records()`, e.g. ("keep", "smaller than ...")."""
        if self.front is None:
            return []
        return [(entry.decision, entry.reason) for entry in self.front.rulebook.entries]

    @property
    def checkpointed_modules(self) -> list[str]:
        return list(self._checkpointed.names) if self._checkpointed is not None else []

    def close(self) -> None:
        """Remove every hook and wrapper (the model is exactly as before) and return the host memory."""
        if self.front is not None:
            self.front.remove()
        if self._checkpointed is not None:
            self._checkpointed.remove()
            self._checkpointed = None
        if self.recipes is not None:
            self.recipes.remove()
            self.recipes = None
            self.front.recipes = None
        if self.executor is not None:
            self.executor.close()
        attached = ATTACHED.get(self.model)
        if attached is not None and attached() is self:
            del ATTACHED[self.model]

    def __enter__(self) -> MemoryEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _param_storages(self) -> set[int]:
        return {t.untyped_storage()._cdata for t in list(self.model.parameters()) + list(self.model.buffers())}


@contextlib.contextmanager
def memory_policy(model: nn.Module, policy: MemoryConfig | dict | str | None = None,
                  device: torch.device | str | None = None, **engine_kwargs) -> Iterator[MemoryEngine]:
    """Apply a memory policy to any `nn.Module` for the duration of a `with` block.

    `policy` has the fields of the YAML `memory:` section (a dict, a `MemoryConfig`, or just a mode name).
    Example (docs/memory.md):

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
