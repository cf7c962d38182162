"""Scoring segmentations: a trained fold's validation cases, or any tool's NIfTI predictions.

- `evaluate_fold`: the fold's validation cases from the cache -> inference in the cube (whole cube, or
  sliding window for patch models; `evaluate.predicting.segment_cube`) -> probabilities mapped back to the
  original grid -> labels in the edition's convention, saved as `fold_<k>/predictions/<case>.nii.gz` with
  the original affine -> BraTS metrics against the original segmentation file -> `fold_<k>/{metrics.csv,
  summary.json, ...}`. A run imported from nnU-Net (`evaluate.inference: nnunet`) is segmented as `predict`
  segments it instead: nnU-Net's rules on the case's own files (`predicting.nnunet_case_prediction`), scored
  on the original grid.
- `evaluate_predictions`: `<case id>.nii.gz` files from any tool (nnU-Net names them so) against every
  reference case of a dataset, one for one as the challenge's submission check demands (a missing
  prediction is an error, or scored as empty on request), with the same metrics and report.

A bad case (a missing or unreadable file, a wrong shape, foreign labels) never stops the others: each
entry point records it (`evaluate.failures.CaseFailures`), finishes every other case, and then fails
with one error naming every failed case.

Both evaluations score every case twice: the legacy BraTS 2017-2021 metrics (`evaluate.metrics`: Dice,
sensitivity, specificity, HD95 of WT/TC/ET) and the official 2023+ lesion-wise metrics of the case's
challenge groups (`evaluate.official`, written to official.csv / official_summary.json).
"""


from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.progress import Progress

from brats_swap.config import Config
from brats_swap.data.cache import load_prepared
from brats_swap.data.challenges import MODERN_CHALLENGES, evaluation_groups, get_challenge
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case, present_values, read_volume, save_label_nifti, to_table_values
from brats_swap.data.preprocess import header_from_meta
from brats_swap.errors import ConfigError, DataError
from brats_swap.evaluate.failures import CaseFailures
from brats_swap.evaluate.metrics import case_metrics, write_metrics_report
from brats_swap.evaluate.nnunet_inference import NNUNET
from brats_swap.evaluate.official import case_official_metrics, merge_groups
from brats_swap.evaluate.predicting import case_labels, nnunet_case_prediction, segment_cube
from brats_swap.progress import progress_bar
from brats_swap.run.console import console, warn
from brats_swap.run.evaluation_record import record_evaluated_state
from brats_swap.run.folder import RunFolder
from brats_swap.run.trained import load_for_inference
from brats_swap.splits import fold_cases, read_splits


def _progress(show: bool) -> Progress:
    return progress_bar(console=console, transient=True, disable=not show)

@dataclass
class _Scores:
    """The per-case rows of one evaluation: legacy metrics, official metrics, and the groups they used."""

    hd95: bool
    regions: Sequence[str] = ()  # the run's model.regions (empty: the table's default regions)
    rows: list[dict] = field(default_factory=list)
    official_rows: list[dict] = field(default_factory=list)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def add(self, case_id: str, prediction: np.ndarray, truth: np.ndarray, edition: str,
            spacing: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        groups = evaluation_groups(edition)
        self.rows.append({"case": case_id, **case_metrics(prediction, truth, edition, spacing=spacing,
                                                          hd95=self.hd95, regions=self.regions)})
        self.official_rows.append({"case": case_id, **case_official_metrics(prediction, truth, groups, spacing,
                                                                             what=f"case {case_id}", hd95=self.hd95)})
        self.groups = merge_groups(self.groups, groups)

    def write(self, out_dir: Path, title: str, notes: Sequence[str] = ()) -> dict:
        return write_metrics_report(self.rows, out_dir, title, official_rows=self.official_rows, groups=self.groups,
                                    notes=notes)


def _read_label(case_id: str, path: Path, edition: str, case=None) -> tuple[np.ndarray, np.ndarray, object]:
    """A label NIfTI as uint8, checked against the edition's label values; a ground truth of a dataset.json
    layout (`case.label_map`) is first read in the table's values."""
    data, affine, header = read_volume(case_id, path, as_float=False)
    if case is not None and case.label_map is not None:
        data = to_table_values(f"case {case_id}: file {path.name}", data, case.label_map, get_challenge(edition),
                               case.description)
    values = present_values(data)
    allowed = {0, *get_challenge(edition).label_values}
    unknown = [v for v in values.tolist() if v not in allowed]
    if unknown:
        raise DataError(f"case {case_id}: file {path.name}: label value {unknown[0]} is not one of "
                        f"{sorted(allowed)} (edition {edition})")
    return data.astype(np.uint8), affine, header


def _spacing(header) -> tuple[float, float, float]:
    return tuple(float(z) for z in header.get_zooms()[:3])  # type: ignore[return-value]


def evaluate_fold(config: Config, run_dir: Path | RunFolder, fold: int, *, checkpoint: str = "best",
                  data_root: Path | None = None, progress: bool = True, tta: bool = False,
                  failures: CaseFailures | None = None) -> dict:
    """Predict and score the validation cases of one fold (see the module docstring).

    Args:
        config: the run's config (cache, data root, evaluation settings; the architecture comes
            from the checkpoint).
        run_dir: run folder holding `splits.json` and `fold_<k>/`.
        fold: fold number.
        checkpoint: "best", "latest" or a path to a checkpoint file.
        data_root: dataset folder with the original segmentations (default `data.root`).
        progress: show a progress bar.
        tta: average the 8 mirrorings (`brats_swap.run.inference`); the saved predictions are then the
            mirrored ones too.
        failures: where a bad case (unreadable cache entry or ground truth, wrong shape, foreign labels) is
            recorded while the others go on; without it such cases end in one DataError naming them all,
            after the report of the good cases is written.

    Returns:
        The legacy summary written to `fold_<k>/summary.json` by `write_metrics_report` (the official one is
        in `fold_<k>/official_summary.json`); {} when no case could be scored.
    """
    run = RunFolder.of(run_dir)
    folder = run.fold(fold)
    _, val_ids = fold_cases(read_splits(run.splits), fold)
    model, predict_config, device = load_for_inference(run, fold, checkpoint, config)
    root = Path(data_root) if data_root is not None else Path(config.data.root)
    cases = {c.case_id: c for c in discover_cases(root, config.data.edition, config.data.modalities,
                                                  config.data.challenge)}
    missing = [c for c in val_ids if c not in cases or cases[c].seg is None]
    if missing:
        raise DataError(f"{root}: case {missing[0]} of fold {fold} has no segmentation file there "
                        "(pass --data with the dataset the run was prepared from)")

    failed = failures if failures is not None else CaseFailures(say=warn)
    already_failed = len(failed)
    scores = _Scores(hd95=config.evaluate.hd95, regions=predict_config.model.regions)
    # An imported nnU-Net run (evaluate.inference: nnunet) is scored as `predict` segments it: nnU-Net's rules on
    # the case's own files, not the cache's float16 cube.
    nnunet_rules = predict_config.evaluate.inference == NNUNET
    evaluate_case = _evaluate_nnunet_case if nnunet_rules else _evaluate_cached_case
    with _progress(progress) as bar:
        task = bar.add_task(f"evaluate fold {fold}", total=len(val_ids))
        for case_id in val_ids:
            with failed.case(case_id):
                evaluate_case(case_id, cases[case_id], (model, predict_config, device), config, folder, scores, tta)
            bar.advance(task)
    grid = "nnU-Net's inference rules, original grid" if nnunet_rules else f"{config.evaluate.grid} grid"
    title = f"{config.name} fold {fold} ({checkpoint} checkpoint, {grid}{', 8-mirror TTA' if tta else ''})"
    fold_failures = list(failed.reasons.values())[already_failed:]
    summary = scores.write(folder.root, title, notes=[f"not scored: {line}" for line in fold_failures]) \
        if scores.rows else {}
    if scores.rows:
        record_evaluated_state(folder)  # a fold trained further later is then no longer "evaluated"
    if failures is None:
        failed.raise_if_any(f"evaluate fold {fold}", len(val_ids))
    return summary


def _evaluate_cached_case(case_id: str, case, predictor: tuple, config: Config, folder, scores: _Scores,
                          tta: bool) -> None:
    """One validation case of `evaluate_fold`: segment it from the cache, save and score the prediction."""
    model, predict_config, device = predictor
    prepared = load_prepared(Path(config.data.cache), case_id, mmap=True)
    edition = prepared.meta["edition"]
    probs, prediction = segment_cube(model, prepared.image, prepared.meta, edition, predict_config, device, tta, case_id)
    seg = case.seg
    truth, truth_affine, truth_header = _read_label(case_id, seg, edition, case)
    # The prediction takes the image's grid (affine and header of the first modality, as prepared).
    if prediction.shape != truth.shape:
        raise DataError(f"case {case_id}: prediction mapped back to {prediction.shape} but {seg.name} is {truth.shape}")
    affine = np.asarray(prepared.meta.get("affine", truth_affine), dtype=np.float64)
    if config.evaluate.save_predictions:
        header = header_from_meta(prepared.meta) if "header" in prepared.meta else truth_header
        save_label_nifti(prediction, affine, folder.prediction(case_id), header=header)
    if config.evaluate.grid == "original":
        scores.add(case_id, prediction, truth, edition, _spacing(truth_header))
    else:  # in the network's cube, against the cached (resampled) label
        scores.add(case_id, case_labels(probs, edition, predict_config, case_id), np.asarray(prepared.label), edition)


def _evaluate_nnunet_case(case_id: str, case, predictor: tuple, config: Config, folder, scores: _Scores,
                          tta: bool) -> None:
    """One validation case of `evaluate_fold` for an imported nnU-Net run: read from its files, segmented with
    nnU-Net's rules (`predict`'s `nnunet_case_prediction`), saved and scored on its own grid."""
    model, predict_config, device = predictor
    loaded = load_case(case, config.data.modalities)
    if loaded.seg is None:
        raise DataError(f"case {case_id}: no segmentation file to score against")
    prediction, _ = nnunet_case_prediction([(model, predict_config)], loaded, device, tta=tta)
    if config.evaluate.save_predictions:
        save_label_nifti(prediction, loaded.affine, folder.prediction(case_id), header=loaded.header)
    scores.add(case_id, prediction, loaded.seg, loaded.edition, _spacing(loaded.header))


def _forced_convention(edition: str, challenge: str) -> tuple[str, str]:
    """(edition, challenge) to discover the cases with: a 2023+ challenge named as the edition ("ped") forces
    that challenge, as `data.challenge` would; ConfigError when it contradicts `challenge`."""
    if edition not in MODERN_CHALLENGES:
        return edition, challenge
    if challenge not in ("auto", edition):
        raise ConfigError(f"evaluate: edition {edition!r} and challenge {challenge!r} name two different label tables")
    return "auto", edition


MISSING_POLICIES = ("error", "empty")


@dataclass
class PredictionsReport:
    """What `evaluate_predictions` scored: the legacy summary (summary.json), the reference cases without a
    prediction (scored as empty with `missing="empty"`), the prediction files without a reference case
    (not scored), and the cases that failed (an unreadable file, a wrong shape, foreign labels: scored as
    empty too, so that every reference case has its row)."""

    summary: dict
    references: int = 0  # the reference cases: each has a row in the report unless its own file is bad
    missing: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    failures: CaseFailures = field(default_factory=CaseFailures)


def _prediction_files(pred_dir: Path) -> dict[str, Path]:
    """case id -> `<case id>.nii.gz` (or .nii) in `pred_dir`."""
    if not pred_dir.is_dir():
        raise DataError(f"{pred_dir}: predictions folder not found")
    predictions = {}
    for path in sorted(pred_dir.iterdir()):
        for extension in (".nii.gz", ".nii"):
            if path.name.endswith(extension):
                predictions[path.name[: -len(extension)]] = path
                break
    return predictions


def _name_cases(case_ids: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(case_ids[:limit])
    return shown + (f" and {len(case_ids) - limit} more" if len(case_ids) > limit else "")


def evaluate_predictions(pred_dir: Path, data_root: Path, out_dir: Path, edition: str = "auto",
                         *, challenge: str = "auto", hd95: bool = True, progress: bool = True,
                         missing: str = "error", failures: CaseFailures | None = None,
                         dataset_labels: bool = False) -> PredictionsReport:
    """Score `<case id>.nii.gz` segmentations from any tool against the dataset's ground truth.
    `dataset_labels`: predictions for an nnU-Net or Decathlon folder's cases hold its dataset.json's values
    (nnU-Net's own predictions do), not the label table's.

    `edition` (2017 ... 2021, 2023) and `challenge` (gli, gli-post, met, men, men-rt, ped, ssa, goat) force
    the label table as `data.edition` / `data.challenge` do (default: each case's own, from its id); a
    challenge given as `edition` is taken as the challenge.

    Every reference case (a case of `data_root` with a segmentation) is scored, as the challenge's own
    submission check demands predictions that match the reference cases one for one. `missing`: "error"
    (default) refuses a folder that lacks a reference case's prediction with a DataError naming them, before
    anything is written; "empty" scores each missing case as an empty prediction (the worst case: Dice 0
    where the reference has tumour, the HD95 penalty) and lists it in the report. Prediction files without
    a reference case are named (warning and report), not scored. A bad prediction file (unreadable, another
    grid, label values outside the table) is recorded in `failures`, scored as empty so its row exists, and
    the others go on; without `failures` it ends in one DataError after the report is written.
    """
    if missing not in MISSING_POLICIES:
        raise ConfigError(f"--missing {missing!r}: expected one of {', '.join(MISSING_POLICIES)}")
    edition, challenge = _forced_convention(edition, challenge)
    pred_dir, out_dir = Path(pred_dir), Path(out_dir)
    predictions = _prediction_files(pred_dir)
    cases = [c for c in discover_cases(data_root, edition, challenge=challenge) if c.seg is not None]
    if not cases:
        raise DataError(f"{data_root}: no case has a segmentation file to score against")
    references = {c.case_id for c in cases}
    report = PredictionsReport(summary={}, references=len(cases), missing=[c.case_id for c in cases if c.case_id not in predictions],
                               unmatched=[case_id for case_id in predictions if case_id not in references],
                               failures=failures if failures is not None else CaseFailures(say=warn))
    if not predictions:
        raise DataError(f"{pred_dir}: no prediction file (<case id>.nii.gz) to score against the {len(cases)} "
                        f"reference case(s) of {data_root}")
    if len(report.unmatched) == len(predictions):
        # Not cases to score as empty: the two folders are of different datasets (a wrong --data or --predictions).
        raise DataError(f"none of the {len(predictions)} prediction(s) in {pred_dir} (e.g. "
                        f"{next(iter(predictions.values())).name}) is a reference case of {data_root} ({len(cases)} case(s), e.g. "
                        f"{cases[0].case_id}): are --predictions and --data folders of the same dataset?")
    if report.missing and missing == "error":
        raise DataError(f"{pred_dir}: no prediction for {len(report.missing)} of {len(cases)} reference cases of "
                        f"{data_root}: {_name_cases(report.missing)} (score them as empty with --missing empty)")
    if report.unmatched:
        warn(f"{pred_dir}: {len(report.unmatched)} prediction(s) without a reference case in {data_root}, not "
             f"scored: {_name_cases(report.unmatched)}")
    if report.missing:
        warn(f"{pred_dir}: no prediction for {len(report.missing)} of {len(cases)} cases, scored as empty "
             f"(--missing empty): {_name_cases(report.missing)}")
    scores = _Scores(hd95=hd95)
    with _progress(progress) as bar:
        task = bar.add_task("score predictions", total=len(cases))
        for case in cases:
            _score_prediction_file(case, predictions.get(case.case_id), scores, report.failures, dataset_labels)
            bar.advance(task)
    notes = ([f"no prediction, scored as empty: {case_id}" for case_id in report.missing]
             + [f"failed: {line}" for line in report.failures.reasons.values()]
             + [f"prediction without a reference case, not scored: {case_id}" for case_id in report.unmatched])
    if scores.rows:
        report.summary = scores.write(out_dir, f"{pred_dir.name} vs {Path(data_root).name}", notes=notes)
    if failures is None:
        report.failures.raise_if_any(f"evaluate {pred_dir}", len(cases))
    return report


def _score_prediction_file(case, path: Path | None, scores: _Scores, failures: CaseFailures,
                           dataset_labels: bool = False) -> None:
    """Score one reference case: its prediction file, or an empty prediction when there is none or it is bad.
    An unreadable reference is a failure without a row (there is nothing to score against)."""
    with failures.case(case.case_id):
        truth, _, truth_header = _read_label(case.case_id, case.seg, case.edition, case)
        prediction = np.zeros_like(truth)
        if path is not None:
            with failures.case(case.case_id):
                read, _, _ = _read_label(case.case_id, path, case.edition, case if dataset_labels else None)
                if read.shape != truth.shape:
                    raise DataError(f"case {case.case_id}: file {path.name}: shape {read.shape} differs from the "
                                    f"ground truth {truth.shape}")
                prediction = read
        scores.add(case.case_id, prediction, truth, case.edition, _spacing(truth_header))
