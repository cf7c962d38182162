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
import yaml
from rich.console import Console
from rich.progress import Progress

from brats_swap.config import Config, config_from_saved
from brats_swap.data.cache import load_prepared
from brats_swap.data.discovery import discover_cases
from brats_swap.data.editions import get_edition
from brats_swap.data.nifti import read_volume, save_label_nifti
from brats_swap.data.preprocess import header_from_meta, probabilities_to_original_grid
from brats_swap.errors import CheckpointError, ConfigError, DataError
from brats_swap.evaluate.inference import predict_cube
from brats_swap.evaluate.metrics import case_metrics, write_metrics_report
from brats_swap.model import build_model
from brats_swap.model.targets import labels_from_probs
from brats_swap.progress import progress_bar
from brats_swap.splits import SPLITS_FILE, fold_cases, read_splits
from brats_swap.train.checkpoint import BEST, LATEST, load_checkpoint, load_latest

console = Console(stderr=True, highlight=False)

PREDICTIONS = "predictions"


def _progress(show: bool) -> Progress:
    return progress_bar(console=console, transient=True, disable=not show)


def _warn(message: str) -> None:
    console.print(f"[bold yellow]warning:[/] {message}", markup=True, highlight=False, soft_wrap=True)


def _device(config: Config) -> torch.device:
    from brats_swap.train.loop import resolve_device

    return resolve_device(config.train.device)


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run was trained with (`run_dir/config.yaml`)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; is {run_dir} a brats-swap run folder?")
    return config_from_saved(yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def load_trained_model(run_dir: Path, fold: int, checkpoint: str = "best",
                       device: torch.device | None = None) -> tuple[torch.nn.Module, Config, dict]:
    """The model of `fold_<k>/checkpoint_<best|latest>.pt` (or a checkpoint file path), in eval mode.

    The architecture comes from the checkpoint's own config, so a run whose config.yaml was edited
    afterwards still loads. Returns (model, checkpoint config, checkpoint state).
    """
    fold_dir = Path(run_dir) / f"fold_{fold}"
    if checkpoint == "best":
        state = load_checkpoint(fold_dir / BEST)
    elif checkpoint == "latest":
        loaded = load_latest(fold_dir, warn=_warn)
        if loaded is None:
            raise CheckpointError(f"{fold_dir / LATEST}: checkpoint not found; train the fold first")
        state = loaded[0]
    else:
        state = load_checkpoint(Path(checkpoint))
    trained_config = config_from_saved(state["config"])
    model = build_model(trained_config.model, out_channels=3)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"{fold_dir}: checkpoint weights do not match model {trained_config.model.name} "
                              f"({str(exc).splitlines()[0]})") from exc
    model.to(device or torch.device("cpu")).eval()
    return model, trained_config, state


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


def evaluate_fold(config: Config, run_dir: Path, fold: int, *, checkpoint: str = "best",
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
    run_dir = Path(run_dir)
    fold_dir = run_dir / f"fold_{fold}"
    _, val_ids = fold_cases(read_splits(run_dir / SPLITS_FILE), fold)
    device = _device(config)
    model, trained_config, _ = load_trained_model(run_dir, fold, checkpoint, device)
    outputs = trained_config.model.outputs
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
            image = torch.from_numpy(np.asarray(prepared.image, dtype=np.float32))[None]
            probs = predict_cube(model, image, trained_config_with_eval(trained_config, config), device)[0].numpy()
            original_probs = probabilities_to_original_grid(probs, prepared.meta)
            prediction = np.asarray(labels_from_probs(original_probs, edition, outputs, config.evaluate.threshold),
                                    dtype=np.uint8)
            truth, truth_affine, truth_header = _read_label(case_id, cases[case_id].seg, edition)
            # The prediction takes the image's grid (affine and header of the first modality, as prepared).
            if prediction.shape != truth.shape:
                raise DataError(f"case {case_id}: prediction mapped back to {prediction.shape} but "
                                f"{cases[case_id].seg.name} is {truth.shape}")
            affine = np.asarray(prepared.meta.get("affine", truth_affine), dtype=np.float64)
            if config.evaluate.save_predictions:
                header = header_from_meta(prepared.meta) if "header" in prepared.meta else truth_header
                save_label_nifti(prediction, affine, fold_dir / PREDICTIONS / f"{case_id}.nii.gz", header=header)
            if on_original_grid:
                metrics = case_metrics(prediction, truth, edition, spacing=_spacing(truth_header),
                                       hd95=config.evaluate.hd95)
            else:  # in the network's cube, against the cached (resampled) label
                cube_prediction = np.asarray(labels_from_probs(probs, edition, outputs, config.evaluate.threshold))
                metrics = case_metrics(cube_prediction, np.asarray(prepared.label), edition, hd95=config.evaluate.hd95)
            rows.append({"case": case_id, **metrics})
            bar.advance(task)
    title = f"{config.name} fold {fold} ({checkpoint} checkpoint, {config.evaluate.grid} grid)"
    return write_metrics_report(rows, fold_dir, title)


def trained_config_with_eval(trained: Config, current: Config) -> Config:
    """Inference settings: the trained model's mode/patch/amp, the current evaluate.* section and device."""
    from dataclasses import replace

    return replace(trained, evaluate=current.evaluate,
                   train=replace(trained.train, device=current.train.device, amp=current.train.amp))


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
        _warn(f"{pred_dir}: no prediction for {len(unscored)} of {len(cases)} cases (e.g. {unscored[0]}); "
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


def predict(run_dir: Path, input_path: Path, out_dir: Path, fold: int = 0, checkpoint: str = "best",
            *, progress: bool = True) -> list[Path]:
    """Segment new cases with a trained fold; returns the written `<out_dir>/<case id>.nii.gz` paths.

    `input_path` is one case folder or a dataset folder; images are preprocessed on the fly with the
    run's data config (crop, normalisation, fit to the cube), no cache is needed.
    """
    from brats_swap.data.nifti import load_case
    from brats_swap.data.preprocess import preprocess_case, preprocess_settings

    config = load_run_config(run_dir)
    device = _device(config)
    model, trained_config, _ = load_trained_model(run_dir, fold, checkpoint, device)
    inference_config = trained_config_with_eval(trained_config, config)
    cases = discover_cases(input_path, config.data.edition, config.data.modalities)
    out_dir = Path(out_dir)
    written = []
    with _progress(progress) as bar:
        task = bar.add_task("predict", total=len(cases))
        for case in cases:
            loaded = load_case(case, config.data.modalities)
            cube_image, _, meta = preprocess_case(loaded, preprocess_settings(config.data))
            image = torch.from_numpy(np.asarray(cube_image, dtype=np.float32))[None]
            probs = predict_cube(model, image, inference_config, device)[0].numpy()
            original_probs = probabilities_to_original_grid(probs, meta)
            label = np.asarray(labels_from_probs(original_probs, loaded.edition, trained_config.model.outputs,
                                                 config.evaluate.threshold), dtype=np.uint8)
            written.append(save_label_nifti(label, loaded.affine, out_dir / f"{case.case_id}.nii.gz",
                                            header=loaded.header))
            bar.advance(task)
    return written
