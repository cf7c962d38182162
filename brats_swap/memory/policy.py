"""Which saved storages get swapped: the one pure decision the engine and the planner share.

The engine (`brats_swap.memory.engine`) sees every tensor autograd saves for backward through
`torch.autograd.graph.saved_tensors_hooks`. It groups them by *storage* (two views of one storage are
one record, copied once) and describes each storage, at its first save, with a `SavedRecord`. Whether a
record is swapped to host memory is decided by `SwapSelector.decide`, record by record, in forward
order. `select_swapped` runs the same selector over a finished list of records, so a planner that
builds the records from a `meta`-device trace predicts exactly the storages (and bytes) the engine
swaps at run time.

How the engine fills a `SavedRecord` (a trace must follow the same rules to predict it):

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
- `is_param`: the storage belongs to a parameter or buffer of the model (or is an `nn.Parameter`).
  These are never swapped: they stay alive anyway.
- `recompute`: `recompute.norm_act` rebuilds this storage in backward from a stored convolution output
  (a norm or activation output, see `brats_swap.memory.recompute`); it is neither stored nor swapped.
  One decision per storage: a recomputed storage is never also swapped.

Selection rule (`SwapConfig` fields, IBM TFLMS names):

1. never: `is_param`, `recompute`, or `nbytes < swap.min_bytes`;
2. module filter: with a non-empty `swap.include`, the record's module must match one of its globs;
   a record whose module matches any `swap.exclude` glob is not swapped. A glob matches a module when
   it matches its qualified name or the name of any ancestor (`fnmatch`, case-sensitive), so
   `decoder.*` and `decoder` both cover everything under `decoder`;
3. count: `swap.tensors = -1` swaps every record that passed 1-2; `swap.tensors = N` swaps only the
   first N of them in forward order (`index`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from brats_swap.config.schema import MemoryConfig, SwapConfig

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
    dtype: str = ""  # torch dtype name of the first saved view, e.g. "float32" (informational)


def module_matches(name: str, patterns: Iterable[str]) -> bool:
    """True when a glob matches `name` or one of its ancestors (`a.b.c` -> `a.b.c`, `a.b`, `a`)."""
    patterns = list(patterns)
    if not patterns:
        return False
    parts = name.split(".") if name else [""]
    candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return any(fnmatchcase(candidate, pattern) for candidate in candidates for pattern in patterns)


def swap_eligible(record: SavedRecord, swap_cfg: SwapConfig) -> bool:
    """Rules 1-2 of the module docstring: could this record be swapped at all?"""
    if record.is_param or record.recompute or record.nbytes < swap_cfg.min_bytes:
        return False
    if swap_cfg.include and not module_matches(record.module, swap_cfg.include):
        return False
    return not module_matches(record.module, swap_cfg.exclude)


class SwapSelector:
    """The online form of the rule: feed records in forward order, get one decision each.

    The engine creates one selector per step; `select_swapped` replays it over a list of records.
    """

    def __init__(self, swap_cfg: SwapConfig):
        self.swap_cfg = swap_cfg
        self.selected = 0

    def decide(self, record: SavedRecord) -> bool:
        if not swap_eligible(record, self.swap_cfg):
            return False
        if 0 <= self.swap_cfg.tensors <= self.selected:
            return False
        self.selected += 1
        return True


def select_swapped(records: Sequence[SavedRecord], swap_cfg: SwapConfig) -> set[int]:
    """Indices of the records the engine swaps under `swap_cfg` (records in any order; sorted by index).

    Example (a planner predicting swapped bytes from a trace):
        chosen = select_swapped(records, cfg.memory.swap)
        swapped_bytes = sum(r.nbytes for r in records if r.index in chosen)
    """
    selector = SwapSelector(swap_cfg)
    return {record.index for record in sorted(records, key=lambda r: r.index) if selector.decide(record)}


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
