"""Where activations live during training: kept on the device, swapped to host memory, or recomputed.

Public API (see `engine.memory_policy` for a complete example):

    engine = MemoryEngine(model, cfg.memory, device)     # or: with memory_policy(model, policy) as engine
    with engine.step():
        loss = loss_fn(model(x), y)
    loss.backward()
    engine.last_stats().as_dict()

`policy.select_swapped(records, swap_cfg)` is the engine's swap decision as a pure function, for planners.
"""

from brats_swap.memory.engine import MemoryEngine, discover_blocks, memory_config_from, memory_policy
from brats_swap.memory.policy import (
    SavedRecord,
    SwapSelector,
    effective_memory_config,
    module_matches,
    select_swapped,
)
from brats_swap.memory.stats import StepStats
from brats_swap.memory.swap import SavedTensorModifiedError, StaleSavedTensorError

__all__ = [
    "MemoryEngine", "SavedRecord", "SavedTensorModifiedError", "StaleSavedTensorError", "StepStats",
    "SwapSelector", "discover_blocks", "effective_memory_config", "memory_config_from", "memory_policy", "module_matches",
    "select_swapped",
]
