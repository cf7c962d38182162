"""What the engine knows about each saved storage (`SavedRecord`), and the helpers its rules use.

The engine (`brats_swap.memory.engine`) sees every tensor autograd saves for backward through
`torch.autograd.graph.saved_tensors_hooks`. It groups them by *storage* (two views of one storage are
one record, copied once) and describes each storage, at its first save, with a `SavedRecord`. What
happens to it (keep, swap, recompute) and when is decided by `brats_swap.memory.rulebook`, the one
place the policy's rules live; the recorder (`recorder.trace_step`) fills records by the same rules, so
a planner that builds them from a `meta`-device trace predicts exactly the storages (and bytes) the
engine swaps at run time.

How a `SavedRecord` is filled:

- `index`: 0-based ordinal of the storage among all distinct storages saved during this forward, in the
  order of their first save. A storage saved again after an in-place change (new `_version`) is a new
  record; a storage saved again unchanged is the same record.
- `nbytes`: bytes of the whole storage (`t.untyped_storage().nbytes()`), not of the saved view: the
  engine copies whole storages so every view can be rebuilt.
- `module`: qualified name (as in `model.named_modules()`) of the innermost module whose `forward` is
  running when the storage is first saved; `""` when it is saved outside every submodule (the root
  module's own code, or the loss after the forward). Recompute wrappers keep these names: a module
  wrapped in checkpointing still saves its inputs under its own name.
- `block`: forward ordinal of the innermost running *block* (see `engine.discover_blocks`), or of the
  last block that started when the save happens between blocks; -1 before the first block.
- `is_param`: the storage belongs to a parameter or buffer of the model, is an `nn.Parameter`, or is an
  autocast copy of a parameter (`is_param_cast`). These are never swapped: they stay alive anyway.
- `is_input`: the storage is an argument of the model's forward (the batch): the caller holds it.
- `dense`: a plain strided tensor whose storage can be copied byte for byte and viewed again
  (`is_plain_dense`).
- `recompute`: `recompute.norm_act` rebuilds this storage in backward from a stored convolution output
  (a norm or activation output, see `brats_swap.memory.recompute`); it is neither stored nor swapped.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from brats_swap.config.schema import MemoryConfig

SWAP_MODES = ("swap", "hybrid")  # memory modes in which the engine swaps at all
RECOMPUTE_MODES = ("recompute", "hybrid")  # memory modes in which `memory.recompute` applies


@dataclass(frozen=True)
class SavedRecord:
    """One storage saved for backward, described at its first save (see the module docstring)."""

    index: int
    nbytes: int
    module: str
    block: int = -1
    is_param: bool = False
    recompute: bool = False
    dtype: str = ""  # torch dtype name of the first saved view, e.g. "float32"
    is_input: bool = False
    dense: bool = True


def is_param_cast(t: torch.Tensor) -> bool:
    """An autocast copy of a parameter (`ToCopyBackward0` straight from a leaf that accumulates a gradient).

    `torch.autocast` caches the low-precision cast of every leaf that requires grad for the whole forward,
    so a convolution under AMP saves a plain bf16/fp16 tensor that is really a parameter: the cache keeps
    it alive, and swapping it out would copy bytes without freeing any. `isinstance(t, nn.Parameter)`
    misses it; this rule catches it.
    """
    node = t.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return False
    return any(next_node is not None and next_node.name() == "torch::autograd::AccumulateGrad"
               for next_node, _ in node.next_functions)


def is_plain_dense(t: torch.Tensor) -> bool:
    """A tensor whose storage can be copied byte for byte and viewed again (`SavedRecord.dense`)."""
    return (
        t.layout == torch.strided
        and type(t) in (torch.Tensor, torch.nn.Parameter)
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.device.type in ("cpu", "cuda", "meta")
    )


def module_matches(name: str, patterns: Iterable[str]) -> bool:
    """True when a glob matches `name` or one of its ancestors (`a.b.c` -> `a.b.c`, `a.b`, `a`)."""
    patterns = tuple(patterns)
    if not patterns:
        return False
    return _matcher(patterns)(name)


# Distinct glob lists matched against in one process: the rulebook asks at every save of every replay, and the
# planner's search replays hundreds of swap lists over the same module names (a tenth of a plan's time at 192³
# when each answer was computed afresh); a search moves from list to list, so a few recent ones are enough.
MATCHERS_KEPT = 64
# Names one list's answers are kept for: more than any network's modules.
NAMES_KEPT = 1 << 14


@functools.lru_cache(maxsize=MATCHERS_KEPT)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """`module_matches` for one glob list, each name's answer remembered (`NAMES_KEPT`)."""

    @functools.lru_cache(maxsize=NAMES_KEPT)
    def matches(name: str) -> bool:
        parts = name.split(".") if name else [""]
        candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        return any(fnmatchcase(candidate, pattern) for candidate in candidates for pattern in patterns)

    return matches


def effective_memory_config(memory_cfg: MemoryConfig) -> MemoryConfig:
    """The configuration the engine actually applies (a copy; the input is not modified).

    `mode: recompute` or `hybrid` with nothing to recompute (no `recompute.modules`, `norm_act: false`)
    means norm_act: the cheap recomputation that never re-runs a convolution. So
    `--set memory.mode=recompute` alone does something useful.
    """
    cfg = copy.deepcopy(memory_cfg)
    if cfg.mode in RECOMPUTE_MODES and not cfg.recompute.modules and not cfg.recompute.norm_act:
        cfg.recompute.norm_act = True
    return cfg
