"""Evaluation entry points: score a trained fold, score any tool's NIfTI predictions, segment new cases.

- `evaluate_fold`: the fold's validation cases from the cache -> inference in the cube (whole cube, or
  sliding window for patch models) -> probabilities mapped back to the original grid -> labels in the
  edition's convention, saved as `fold_<k>/predictions/<case>.nii.gz` with the original affine -> BraTS
  metrics against the original segmentation file -> `fold_<k>/{metrics.csv, summary.json, ...}`.
- `evaluate_predictions`: `<case id>.nii.gz` files from any tool (nnU-Net names them so) against a
  dataset's ground truth, with the same metrics and report.
- `predict`: new cases (a case folder or a dataset folder), preprocessed on the fly with the run's data
  config (no cache), written as `<out>/<case id>.nii.gz`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from brats_swap.config import Config
from brats_swap.data.cache import load_prepared
from brats_swap.data.discovery import discover_cases
from brats_swap.data.editions import get_edition
from brats_swap.data.nifti import read_volume, save_label_nifti
from brats_swap.data.preprocess import header_from_meta, probabilities_to_original_grid
from brats_swap.errors import DataError
from brats_swap.evaluate.metrics import case_metrics, write_metrics_report
from brats_swap.model.targets import labels_from_probs
from brats_swap.progress import progress_bar
from brats_swap.run.console import console, warn
from brats_swap.run.folder import RunFolder
from brats_swap.run.inference import predict_cube
from brats_swap.run.trained import load_for_inference, load_run_config
from brats_swap.splits import fold_cases, read_splits


def _progress(show: bool) -> Progress:
    return progress_bar(console=console, transient=True, disable=not show)


def _segment(model: torch.nn.Module, image, meta: dict, edition: str, config: Config,
             device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """One case: the probabilities in the network's cube, and the labels (uint8, the edition's convention)
    on the original grid described by `meta`."""
    cube = torch.from_numpy(np.asarray(image, dtype=np.float32))[None]
    probs = predict_cube(model, cube, config, device)[0].numpy()
    original_probs = probabilities_to_original_grid(probs, meta)
    labels = labels_from_probs(original_probs, edition, config.model.outputs, config.evaluate.threshold)
    return probs, np.asarray(labels, dtype=np.uint8)


def _read_label(case_id: str, path: Path, edition: str) -> tuple[np.ndarray, np.ndarray, object]:
    """A label NIfTI as uint8, checked against the edition's label values."""
    data, affine, header = read_volume(case_id, path, as_float=False)
    values = np.unique(data)
    allowed = {0, *get_edition(edition).label_values}
    unknown = [v for v in values.tolist() if v not in allowed]
    if unknown:
        raise DataError(f"case {case_id}: file {path.name}: label value {unknown[0]} is not one of "
                        f"{sorted(allowed)} (edition {edition})")
    return data.astype(np.uint8), affine, header


def _spacing(header) -> tuple[float, float, float]:
    return tuple(float(z) for z in header.get_zooms()[:3])  # type: ignore[return-value]


def evaluate_fold(config: Config, run_dir: Path | RunFolder, fold: int, *, checkpoint: str = "best",
                  data_root: Path | None = None, progress: bool = True) -> dict:
    """Predict and score the validation cases of one fold (see the module docstring).

    Args:
        config: the run's config (cache, data root, evaluation settings; the architecture comes
            from the checkpoint).
        run_dir: run folder holding `splits.json` and `fold_<k>/`.
        fold: fold number.
        checkpoint: "best", "latest" or a path to a checkpoint file.
        data_root: dataset folder with the original segmentations (default `data.root`).
        progress: show a progress bar.

    Returns:
        The summary written to `fold_<k>/summary.json` by `write_metrics_report`.
    """
    run = RunFolder.of(run_dir)
    folder = run.fold(fold)
    _, val_ids = fold_cases(read_splits(run.splits), fold)
    model, predict_config, device = load_for_inference(run, fold, checkpoint, config)
    outputs = predict_config.model.outputs
    cache = Path(config.data.cache)
    on_original_grid = config.evaluate.grid == "original"
    root = Path(data_root) if data_root is not None else Path(config.data.root)
    cases = {c.case_id: c for c in discover_cases(root, config.data.edition, config.data.modalities)}
    missing = [c for c in val_ids if c not in cases or cases[c].seg is None]
    if missing:
        raise DataError(f"{root}: case {missing[0]} of fold {fold} has no segmentation file there "
                        "(pass --data with the dataset the run was prepared from)")

    rows = []
    with _progress(progress) as bar:
        task = bar.add_task(f"evaluate fold {fold}", total=len(val_ids))
        for case_id in val_ids:
            prepared = load_prepared(cache, case_id, mmap=True)
            edition = prepared.meta["edition"]
            probs, prediction = _segment(model, prepared.image, prepared.meta, edition, predict_config, device)
            truth, truth_affine, truth_header = _read_label(case_id, cases[case_id].seg, edition)
            # The prediction takes the image's grid (affine and header of the first modality, as prepared).
            if prediction.shape != truth.shape:
                raise DataError(f"case {case_id}: prediction mapped back to {prediction.shape} but "
                                f"{cases[case_id].seg.name} is {truth.shape}")
            affine = np.asarray(prepared.meta.get("affine", truth_affine), dtype=np.float64)
            if config.evaluate.save_predictions:
                header = header_from_meta(prepared.meta) if "header" in prepared.meta else truth_header
                save_label_nifti(prediction, affine, folder.prediction(case_id), header=header)
            if on_original_grid:
                metrics = case_metrics(prediction, truth, edition, spacing=_spacing(truth_header),
                                       hd95=config.evaluate.hd95)
            else:  # in the network's cube, against the cached (resampled) label
                cube_prediction = np.asarray(labels_from_probs(probs, edition, outputs, config.evaluate.threshold))
                metrics = case_metrics(cube_prediction, np.asarray(prepared.label), edition, hd95=config.evaluate.hd95)
            rows.append({"case": case_id, **metrics})
            bar.advance(task)
    title = f"{config.name} fold {fold} ({checkpoint} checkpoint, {config.evaluate.grid} grid)"
    return write_metrics_report(rows, folder.root, title)


def evaluate_predictions(pred_dir: Path, data_root: Path, out_dir: Path, edition: str = "auto",
                         *, hd95: bool = True, progress: bool = True) -> dict:
    """Score `<case id>.nii.gz` segmentations from any tool against the dataset's ground truth.

    Cases of the dataset without a prediction are reported (warning) and skipped; a prediction whose
    grid differs from the ground truth, or with label values outside the edition, is a DataError.
    """
    pred_dir, out_dir = Path(pred_dir), Path(out_dir)
    if not pred_dir.is_dir():
        raise DataError(f"{pred_dir}: predictions folder not found")
    predictions = {}
    for path in sorted(pred_dir.iterdir()):
        for extension in (".nii.gz", ".nii"):
            if path.name.endswith(extension):
                predictions[path.name[: -len(extension)]] = path
                break
    cases = [c for c in discover_cases(data_root, edition) if c.seg is not None]
    if not cases:
        raise DataError(f"{data_root}: no case has a segmentation file to score against")
    scored = [c for c in cases if c.case_id in predictions]
    if not scored:
        raise DataError(f"{pred_dir}: no <case id>.nii.gz matches a case of {data_root} "
                        f"(e.g. expected {cases[0].case_id}.nii.gz)")
    unscored = [c.case_id for c in cases if c.case_id not in predictions]
    if unscored:
        warn(f"{pred_dir}: no prediction for {len(unscored)} of {len(cases)} cases (e.g. {unscored[0]}); "
              "they are left out of the scores")

    rows = []
    with _progress(progress) as bar:
        task = bar.add_task("score predictions", total=len(scored))
        for case in scored:
            truth, _, truth_header = _read_label(case.case_id, case.seg, case.edition)
            prediction, _, _ = _read_label(case.case_id, predictions[case.case_id], case.edition)
            if prediction.shape != truth.shape:
                raise DataError(f"case {case.case_id}: file {predictions[case.case_id].name}: shape {prediction.shape} "
                                f"differs from the ground truth {truth.shape}")
            metrics = case_metrics(prediction, truth, case.edition, spacing=_spacing(truth_header), hd95=hd95)
            rows.append({"case": case.case_id, **metrics})
            bar.advance(task)
    return write_metrics_report(rows, out_dir, f"{pred_dir.name} vs {Path(data_root).name}")


def predict(run_dir: Path | RunFolder, input_path: Path, out_dir: Path, fold: int = 0, checkpoint: str = "best",
            *, progress: bool = True) -> list[Path]:
    """Segment new cases with a trained fold; returns the written `<out_dir>/<case id>.nii.gz` paths.

    `input_path` is one case folder or a dataset folder; images are preprocessed on the fly with the
    run's data config (crop, normalisation, fit to the cube), no cache is needed.
    """
    from brats_swap.data.nifti import load_case
    from brats_swap.data.preprocess import preprocess_case, preprocess_settings

    config = load_run_config(run_dir)
    model, predict_config, device = load_for_inference(run_dir, fold, checkpoint, config)
    cases = discover_cases(input_path, config.data.edition, config.data.modalities)
    out_dir = Path(out_dir)
    written = []
    with _progress(progress) as bar:
        task = bar.add_task("predict", total=len(cases))
        for case in cases:
            loaded = load_case(case, config.data.modalities)
            cube_image, _, meta = preprocess_case(loaded, preprocess_settings(config.data))
            _, label = _segment(model, cube_image, meta, loaded.edition, predict_config, device)
            written.append(save_label_nifti(label, loaded.affine, out_dir / f"{case.case_id}.nii.gz",
                                            header=loaded.header))
            bar.advance(task)
    return written
