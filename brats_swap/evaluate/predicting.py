"""Segmenting cases with trained models: a run folder's folds (or a bundle's, `brats_swap.ship.bundle`).

- `predict`: new cases (a case folder or a dataset folder), preprocessed on the fly with the run's data
  config (no cache), segmented by one fold or the average of several folds' probabilities (each model
  loaded once for the whole folder), optionally with the 8-mirror test-time augmentation, postprocessed
  with the run's `postprocessing.json` when there is one, written as `<out>/<case id>.nii.gz` (and the
  probabilities as `<out>/<case id>.npz` on request). A run imported from nnU-Net (`evaluate.inference:
  nnunet`) is segmented with nnU-Net's inference rules instead (`evaluate.nnunet_inference`: the case's
  non-zero crop as loaded, resampled to the plans' spacing and back, no cube, logits blended), so that it
  writes nnU-Net's segmentation.
- `segment_cube` / `case_labels`: one case's probabilities in the network's cube and its labels in the
  table's values, as `evaluate.scoring` scores them too.

A bad case (a missing or unreadable file, a wrong shape, foreign labels) never stops the others: it is
recorded (`evaluate.failures.CaseFailures`), every other case is finished, and then one error names every
failed case.
"""


from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from brats_swap.config import Config
from brats_swap.data.preprocess import probabilities_to_original_grid
from brats_swap.errors import ConfigError
from brats_swap.evaluate.case_prediction import (
    Predictor,
    case_labels,
    check_one_output_kind,
    nnunet_case_labels,
    nnunet_case_prediction,
    predict_case,
    predict_with,
    save_probabilities,
    with_evaluate_settings,
    with_overrides,
)
from brats_swap.evaluate.failures import CaseFailures
from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan, load_plan
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection, parse_fold_selection
from brats_swap.run.folder import BEST, LATEST, RunFolder
from brats_swap.run.inference import predict_cube
from brats_swap.run.trained import (
    CHECKPOINT_NAMES,
    check_checkpoint_choice,
    load_for_inference,
    load_run_config,
)

# Re-exported: the per-case half of prediction lives in `evaluate.case_prediction` (torch-free).
__all__ = ["Predictor", "case_labels", "check_one_output_kind", "nnunet_case_labels", "nnunet_case_prediction",
           "predict", "predict_case", "predict_with", "run_predictor", "save_probabilities", "segment_cube",
           "select_folds", "with_evaluate_settings", "with_overrides"]


def segment_cube(model: torch.nn.Module, image, meta: dict, edition: str, config: Config,
                 device: torch.device, tta: bool = False, case_id: str = "") -> tuple[np.ndarray, np.ndarray]:
    """One case: the probabilities in the network's cube, and the labels (uint8, the edition's convention)
    on the original grid described by `meta`."""
    cube = torch.from_numpy(np.asarray(image, dtype=np.float32))[None]
    probs = predict_cube(model, cube, config, device, tta=tta)[0].numpy()
    return probs, case_labels(probabilities_to_original_grid(probs, meta), edition, config, case_id)


def select_folds(run_dir: Path | RunFolder, folds: FoldSelection = ALL_FOLDS, checkpoint: str = "best",
                 option: str = "--folds") -> list[int]:
    """The folds to predict or evaluate with (`parse_fold_selection`: "all", a fold number, "K,K" or a
    sequence of numbers); "all" is every fold folder holding the checkpoint (`checkpoint_best.pt`, or
    `checkpoint_latest.pt` for "latest"). ConfigError naming `option` for a fold without that checkpoint.
    With a checkpoint file path there is one model: fold 0 (or the first fold given) only names it."""
    run = RunFolder.of(run_dir)
    selection = parse_fold_selection(folds, option)
    if checkpoint not in CHECKPOINT_NAMES:
        check_checkpoint_choice(checkpoint)
        return [0] if selection == ALL_FOLDS else selection[:1]
    name = BEST if checkpoint == "best" else LATEST

    def has_checkpoint(k: int) -> bool:
        folder = run.fold(k)
        return folder.best.is_file() if checkpoint == "best" else folder.latest.is_file() or folder.previous.is_file()

    available = [k for k in run.existing_folds() if has_checkpoint(k)]
    if selection == ALL_FOLDS:
        if not available:
            raise ConfigError(f"{run.root}: no fold has a {name}; train first (brats-swap train or cv)")
        return available
    for k in selection:
        if not has_checkpoint(k):
            raise ConfigError(f"{option}: {run.fold(k).root} has no {name} (folds that have one: "
                              f"{', '.join(map(str, available)) or 'none'})")
    return selection


def _load_ensemble(run: RunFolder, folds: list[int], checkpoint: str,
                   config: Config) -> tuple[list[tuple[torch.nn.Module, Config]], torch.device]:
    """Each fold's model, loaded once, with the config it predicts with; ConfigError when the folds' outputs
    differ (their probabilities could not be averaged)."""
    members, device = [], None
    for k in folds:
        model, predict_config, device = load_for_inference(run, k, checkpoint, config)
        members.append((model, predict_config))
    check_one_output_kind(run.root, folds, members)
    return members, device


def _run_postprocessing(run: RunFolder, enabled: bool) -> PostprocessingPlan | None:
    """The plan of the run's postprocessing.json when enabled and present."""
    return load_plan(run.postprocessing) if enabled and run.postprocessing.is_file() else None


def run_predictor(run_dir: Path | RunFolder, folds: FoldSelection = ALL_FOLDS, checkpoint: str = "best",
                  postprocess: bool = True, device: str | None = None) -> Predictor:
    """The run's folds (`select_folds`), each model loaded once (on `device`, default the run's
    train.device), and its postprocessing.json when enabled."""
    run = RunFolder.of(run_dir)
    config = load_run_config(run)
    if device is not None:
        config = with_overrides(config, [f"train.device={device}"], ("train.device",), "--device")
    chosen = select_folds(run, folds, checkpoint)
    members, device = _load_ensemble(run, chosen, checkpoint, config)
    return Predictor(config, members, device, _run_postprocessing(run, postprocess), run.postprocessing,
                     f"fold(s) {', '.join(map(str, chosen))} ({checkpoint} checkpoint)")


def predict(run_dir: Path | RunFolder, input_path: Path, out_dir: Path, folds: FoldSelection = ALL_FOLDS,
            checkpoint: str = "best", *, tta: bool = False, probabilities: bool = False, postprocess: bool = True,
            progress: bool = True, failures: CaseFailures | None = None, dataset_labels: bool = False) -> list[Path]:
    """Segment new cases; returns the written `<out_dir>/<case id>.nii.gz` paths.
    `dataset_labels`: write the labels of a dataset.json layout's case in that dataset's own values (as
    nnU-Net writes them) instead of the label table's.

    `input_path` is one case folder or a dataset folder; images are preprocessed on the fly with the
    run's data config (crop, normalisation, fit to the cube), no cache is needed. `folds` (`select_folds`):
    the probabilities of these folds' models are averaged, each model loaded once for all cases. `tta`:
    each model averages the 8 mirrorings. `postprocess`: apply the run's postprocessing.json if there is
    one; what it changed is said per case (voxels per label). `probabilities`: also write `<case id>.npz`
    (`save_probabilities`; before postprocessing). The labels are in the case's challenge values, on the
    grid and with the affine of its first modality.

    A bad case (a missing or unreadable modality, images of different shapes, a label table the model does
    not predict) is skipped and the others are written: it is recorded in `failures`, or, without it, all
    such cases end in one DataError naming them after the good cases are written.
    """
    return predict_with(run_predictor(run_dir, folds, checkpoint, postprocess), input_path, out_dir, tta=tta,
                        probabilities=probabilities, postprocess=postprocess, progress=progress, failures=failures,
                        dataset_labels=dataset_labels)

