"""The cache that `train --resume` on a run will read, prepared in this process beforehand.

A run's `data.prepare_workers` (auto: every CPU) would prepare a few phantoms in a pool of spawned processes
(each imports torch: seconds of CPU for nothing a test checks; the pool's arrays are tests/test_data_cache.py's),
and a resumed run refuses a changed `data.prepare_workers`. Prepared here first, the resumed run finds every
case up to date.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from brats_swap.config import load_config
from brats_swap.data.cache import prepare_missing


def prepare_in_one_process(run: Path, overrides: list[str]) -> None:
    """Prepare the cases of `run`'s config.yaml with `overrides` (`key=value`, as `train --set` takes them)."""
    config = load_config(Path(run) / "config.yaml", overrides)
    prepare_missing(dataclasses.replace(config.data, prepare_workers=1), progress=False)
