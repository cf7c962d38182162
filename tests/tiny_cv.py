"""A tiny finished 2-fold cross-validation, made once per test session and shared by the predict and
postprocessing tests: 4 phantom cases of 40x40x32 (BraTS 2021 labels 1, 2, 4) prepared into a 24³ cube, a
3-level U-Net with 4 base filters, 1 epoch of 1 step per fold (seconds on a CPU).

The run keeps a low evaluation threshold (0.05) so that its barely trained model still paints tumour
labels: the predictions then have foreground, which the postprocessing tests need to see an effect.
Tests that change the run work on a copy (`copy_run`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from brats_swap.config import Config, load_config

PHANTOM_SHAPE = (40, 40, 32)
N_CASES = 4
LEGACY_LABELS = {0, 1, 2, 4}
_TINY = [
    "name=tiny-cv", "data.cube=[24,24,24]", "data.loader_workers=0", "data.prepare_workers=1", "model.base_filters=4",
    "model.depth=3", "model.segmentation_levels=2", "train.max_epochs=1", "train.steps_per_epoch=1",
    "train.device=cpu", "train.threads=1", "train.augment=none", "evaluate.hd95=false", "evaluate.threshold=0.05",
    "cv.folds=2",
]
_MADE: dict[str, tuple[Config, Path, Path]] = {}


def tiny_cv_run(tmp_path_factory) -> tuple[Config, Path, Path]:
    """(config, run folder, dataset root) of the finished tiny cross-validation."""
    if "run" not in _MADE:
        from brats_swap.cv import run_cv
        from brats_swap.data.cache import prepare_dataset
        from brats_swap.data.phantom import synthesize_dataset

        base = tmp_path_factory.mktemp("tiny-cv")
        root, cache, run = base / "phantoms", base / "cache", base / "run"
        synthesize_dataset(root, N_CASES, seed=0, shape=PHANTOM_SHAPE)
        config = load_config(None, [f"data.root={root}", f"data.cache={cache}", *_TINY])
        prepare_dataset(root, cache, config.data, workers=1, progress=False)
        outcome = run_cv(config, run)
        assert outcome.complete, outcome.describe()
        _MADE["run"] = (config, run, root)
    return _MADE["run"]


def copy_run(run: Path, destination: Path) -> Path:
    shutil.copytree(run, destination)
    return destination
