"""The tiny GoAT recipe and phantom training data the trainable-image tests retrain (tests/test_trainable.py,
tests/test_trainable_stop.py)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.config import load_config
from brats_swap.config.loader import config_to_dict, config_to_yaml
from brats_swap.data.discovery import discover_cases
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.model import build_model
from brats_swap.model.targets import run_output_count
from brats_swap.run.checkpoint import save_checkpoint
from brats_swap.run.fold_selection import ALL_CASES
from brats_swap.run.folder import ALL_CASES_FOLD, RunFolder
from brats_swap.ship.bundle import export_bundle

SHAPE = (24, 24, 20)
RECIPE = ["data.challenge=goat", "data.cube=[16,16,16]", "model.base_filters=2", "model.depth=3",
          "model.segmentation_levels=2", "train.device=cpu", "train.steps_per_epoch=2", "data.loader_workers=0",
          "data.prepare_workers=1", "train.threads=1", "train.augment=none", "evaluate.hd95=false", "cv.folds=2",
          "evaluate.threshold=0.45"]


def recipe_bundle(base: Path, name: str, folds: list[int], epochs: int = 2, table: str = "goat") -> Path:
    """A bundle of an untrained tiny GoAT recipe with `folds` (its weights are not what retraining uses);
    `table` another label table it was "trained" on (e.g. "2021")."""
    config = load_config(None, [f"name={name}", f"train.max_epochs={epochs}", *RECIPE,
                                *([] if table == "goat" else ["data.challenge=auto"])])
    run = RunFolder(base / name)
    run.root.mkdir(parents=True)
    run.config.write_text(config_to_yaml(config), encoding="utf-8")
    for k in folds:
        model = build_model(config.model, out_channels=run_output_count(table, config.model))
        save_checkpoint({"model": model.state_dict(), "config": config_to_dict(config), "edition": table,
                         "epoch": 1, "optimizer": {"state": {}, "param_groups": []}}, run.fold(k).latest)
    selection = ALL_CASES if folds == [ALL_CASES_FOLD] else ",".join(map(str, folds))
    return export_bundle(run.root, base / f"{name}.zip", selection, checkpoint="latest").path


def goat_training_data(folder: Path, cases: int = 4) -> list[str]:
    """GoAT-named phantom cases (labels 1, 2, 3); every other case has no ET (label 3), as GoAT cases may."""
    ids = synthesize_dataset(folder, cases, seed=3, edition="goat", shape=SHAPE)
    for case in discover_cases(folder)[::2]:
        image = nib.load(case.seg)
        labels = np.asarray(image.dataobj).copy()
        labels[labels == 3] = 1
        nib.save(nib.Nifti1Image(labels, image.affine, image.header), case.seg)
    return ids
