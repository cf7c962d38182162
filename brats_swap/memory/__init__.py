"""Where activations live during training: kept on the device, swapped to host memory, or recomputed.

Public API (see `engine.memory_policy` for a complete example):

    engine = MemoryEngine(model, cfg.memory, device)     # or: with memory_policy(model, policy) as engine
    with engine.step():
        loss = loss_fn(model(x), y)
    loss.backward()
    engine.last_stats().as_dict()

One front end (`frontend`: hooks, step, pack/unpack, typed `events`) reports every event to the
`rulebook`, which holds the policy's numbered rules (the decision per saved storage, when it is released
and reloaded); the `executor` carries them out on real tensors, the `recorder` records a step on `meta`
tensors into a `Trace` (`trace_data`), the `simulate` module replays it, `cost` prices operators and copies.
`select_swapped(records, swap_cfg)` is its swap decision as a pure function, for planners.
`presets.named_policies(base)` gives the named policies (the paper's swap configurations, recompute,
norm_act, hybrid) as `MemoryConfig`s; `planner` prices them for any model, given its loss.
`CompiledRegions(model)` compiles each block's norm -> activation chain (or a whole block) with
`torch.compile` so that the engine runs compiled steps (`compiled`; `compile_wanted` resolves
`train.compile` / `evaluate.compile` for a device).
`register_norm(cls)` declares a norm class replayable by `recompute.norm_act` (see `recompute`).

The package depends on torch, the standard library and `brats_swap.config` only.
"""

from brats_swap.memory.compiled import CompiledRegions, compile_wanted, compiled_regions, is_compile_failure
from brats_swap.memory.engine import MemoryEngine, memory_config_from, memory_policy
from brats_swap.memory.executor import StaleSavedTensorError
from brats_swap.memory.frontend import SavedTensorModifiedError, discover_blocks
from brats_swap.memory.recompute import register_norm
from brats_swap.memory.records import SavedRecord, effective_memory_config, module_matches
from brats_swap.memory.rulebook import Decider, Decision, Rulebook, select_swapped
from brats_swap.memory.stats import StepStats

__all__ = [
    "CompiledRegions", "Decider", "Decision", "MemoryEngine", "Rulebook", "SavedRecord", "SavedTensorModifiedError",
    "StaleSavedTensorError", "StepStats", "compile_wanted", "compiled_regions", "discover_blocks", "effective_memory_config", "memory_config_from", "memory_policy", "module_matches",
    "is_compile_failure", "register_norm", "select_swapped",
]
