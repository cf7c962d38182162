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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from brats_swap.atomic import atomic_path
from brats_swap.config import Config
from brats_swap.data.challenges import evaluation_groups
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import from_table_values, save_label_nifti
from brats_swap.data.preprocess import probabilities_to_original_grid
from brats_swap.errors import ConfigError, DataError
from brats_swap.evaluate import nnunet_inference
from brats_swap.evaluate.failures import CaseFailures
from brats_swap.evaluate.nnunet_inference import NNUNET
from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan, describe_label_changes, load_plan
from brats_swap.evaluate.postprocessing_rules import apply as apply_postprocessing
from brats_swap.model.targets import (
    SOFTMAX,
    background_probabilities,
    labels_from_probs,
    output_names,
    region_tree,
)
from brats_swap.names import path_inside
from brats_swap.progress import progress_bar
from brats_swap.run.compiling import compile_for_inference
from brats_swap.run.console import console, warn
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection, parse_fold_selection
from brats_swap.run.folder import BEST, LATEST, RunFolder
from brats_swap.run.inference import predict_cube, predict_ensemble
from brats_swap.run.trained import load_for_inference, load_run_config


def segment_cube(model: torch.nn.Module, image, meta: dict, edition: str, config: Config,
                 device: torch.device, tta: bool = False, case_id: str = "") -> tuple[np.ndarray, np.ndarray]:
    """One case: the probabilities in the network's cube, and the labels (uint8, the edition's convention)
    on the original grid described by `meta`."""
    cube = torch.from_numpy(np.asarray(image, dtype=np.float32))[None]
    probs = predict_cube(model, cube, config, device, tta=tta)[0].numpy()
    return probs, case_labels(probabilities_to_original_grid(probs, meta), edition, config, case_id)


def case_labels(probs: np.ndarray, edition: str, config: Config, case_id: str = "") -> np.ndarray:
    """uint8 labels in the edition's values from (C, ...) probabilities, as the model's outputs and the
    evaluation threshold say; DataError when the model's channels do not fit the case's label table."""
    expected = output_names(edition, config.model.outputs, config.model.regions, config.model.label_order)
    if probs.shape[0] != len(expected):
        raise DataError(f"case {case_id}: the model predicts {probs.shape[0]} channels, but its {config.model.outputs} "
                        f"for the {edition} label table are {len(expected)} ({', '.join(expected)}); was the run "
                        "trained on another table? (data.challenge / data.edition force one)")
    labels = labels_from_probs(probs, edition, config.model.outputs, config.evaluate.threshold,
                               regions=config.model.regions, label_order=config.model.label_order)
    return np.asarray(labels, dtype=np.uint8)

def nnunet_case_prediction(members: list, loaded, device: torch.device, *, tta: bool,
                           probabilities: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """One loaded case (`data.nifti.LoadedCase`) under nnU-Net's rules (an imported nnU-Net run): the labels on
    the case's grid and, on request, the probabilities there. The loaded float32 image, no cube, no cache;
    labels made in the non-zero crop, the case-sized probabilities only when asked for."""
    first = members[0][1]
    try:
        crop, bbox = nnunet_inference.crop_probabilities(members, loaded.image, device, tta=tta,
                                                         spacing=loaded.spacing)
    except DataError as exc:
        raise DataError(f"case {loaded.case_id}: {exc}") from exc
    label = nnunet_inference.on_case_grid(nnunet_case_labels(crop, loaded.edition, first, loaded.case_id), bbox,
                                          loaded.shape)
    if not probabilities:
        return label, None
    outside = background_probabilities(first.model.outputs, crop.shape[0])
    return label, nnunet_inference.on_case_grid(crop, bbox, loaded.shape, outside)


def nnunet_case_labels(probs: np.ndarray, edition: str, config: Config, case_id: str = "") -> np.ndarray:
    """`case_labels` under nnU-Net's rules: region heads paint their own label in head order
    (`nnunet_inference.region_labels`), no nesting enforced, as nnU-Net exports region models; softmax outputs
    decode by their argmax (`case_labels`), as nnU-Net exports label models."""
    if config.model.outputs == SOFTMAX:
        return case_labels(probs, edition, config, case_id)
    if config.model.outputs != "regions":
        raise ConfigError(f"evaluate.inference={NNUNET}: model.outputs is {config.model.outputs}; nnU-Net's rules "
                          "are those of region-trained (regions) and label-trained (softmax) models")
    expected = output_names(edition, "regions", config.model.regions)
    if probs.shape[0] != len(expected):
        return case_labels(probs, edition, config, case_id)  # its one-line DataError names the mismatch
    tree = region_tree(edition, config.model.regions)
    return nnunet_inference.region_labels(probs, [region.own_label for region in tree.values()],
                                          config.evaluate.threshold)


def select_folds(run_dir: Path | RunFolder, folds: FoldSelection = ALL_FOLDS, checkpoint: str = "best",
                 option: str = "--folds") -> list[int]:
    """The folds to predict or evaluate with (`parse_fold_selection`: "all", a fold number, "K,K" or a
    sequence of numbers); "all" is every fold folder holding the checkpoint (`checkpoint_best.pt`, or
    `checkpoint_latest.pt` for "latest"). ConfigError naming `option` for a fold without that checkpoint.
    With a checkpoint file path there is one model: fold 0 (or the first fold given) only names it."""
    run = RunFolder.of(run_dir)
    selection = parse_fold_selection(folds, option)
    if checkpoint not in ("best", "latest"):
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


def check_one_output_kind(where: Path, folds: Sequence[int], members: Sequence[tuple[torch.nn.Module, Config]]) -> None:
    """ConfigError naming `where` when the folds' models predict different outputs (model.outputs/model.regions):
    their probabilities could not be averaged."""
    kinds = {(c.model.outputs, tuple(c.model.regions), tuple(c.model.label_order)) for _, c in members}
    if len(kinds) > 1:
        raise ConfigError(f"{where}: folds {', '.join(map(str, folds))} were trained with different model.outputs/"
                          "model.regions/model.label_order; predict with one of them (--folds K)")


def _run_postprocessing(run: RunFolder, enabled: bool) -> PostprocessingPlan | None:
    """The plan of the run's postprocessing.json when enabled and present."""
    return load_plan(run.postprocessing) if enabled and run.postprocessing.is_file() else None


def _check_plan_fits(plan: PostprocessingPlan, cases: Sequence, where: Path) -> None:
    """DataError (one line) when a case's evaluation groups are not the ones the plan was tuned for."""
    for case in cases:
        groups = evaluation_groups(case.edition)
        if plan.groups != groups:
            raise DataError(f"{where}: tuned for the groups {_describe(plan.groups)}, but case {case.case_id} "
                            f"({case.edition}) has {_describe(groups)}; predict with --no-postprocessing")


def _describe(groups: dict) -> str:
    return ", ".join(f"{name} {list(labels)}" for name, labels in groups.items())


def save_probabilities(path: Path, probabilities: np.ndarray, channels: Sequence[str], outputs: str) -> Path:
    """Write `<case>.npz` (atomically, compressed): `probabilities` float32 (C, X, Y, Z) on the original grid,
    `channels` their names (regions, labels for label outputs, background + labels for softmax) and `outputs`
    ("regions", "labels" or "softmax")."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, probabilities=np.asarray(probabilities, dtype=np.float32),
                            channels=np.asarray(list(channels)), outputs=np.asarray(outputs))
    return path


def _case_progress(show: bool) -> Progress:
    from rich.progress import TextColumn

    return progress_bar("{task.description}", TextColumn("{task.fields[case]}"), console=console,
                        transient=True, disable=not show)


@dataclass
class Predictor:
    """What `predict_with` segments with: the config the cases are preprocessed with, each fold's model with
    the config it predicts with, the device, the postprocessing plan (and the file it came from, for messages),
    and what to say about the models ("fold(s) 0, 1 (best checkpoint)")."""

    config: Config
    members: list[tuple[torch.nn.Module, Config]]
    device: torch.device
    plan: PostprocessingPlan | None
    plan_source: Path | None
    description: str


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


def with_overrides(config: Config, overrides: Sequence[str], allowed: Sequence[str], option: str = "--set") -> Config:
    """`config` with `key=value` overrides of the keys (or sections, "evaluate.") in `allowed`, checked as the
    loader checks a config; ConfigError naming `option` for any other key."""
    from brats_swap.config import config_from_saved, config_to_dict
    from brats_swap.config.loader import parse_override

    raw = config_to_dict(config)
    for item in overrides:
        key, value = parse_override(item)
        if not any(key == a or (a.endswith(".") and key.startswith(a)) for a in allowed):
            raise ConfigError(f"{option} {key}: predict takes only {', '.join(a + '*' if a.endswith('.') else a for a in allowed)}"
                              " (the run's inference settings)")
        section, _, name = key.partition(".")
        if "." in name or name not in raw[section]:
            raise ConfigError(f"{option} {key}: unknown key (known: {', '.join(f'{section}.{k}' for k in raw[section])})")
        raw[section][name] = value
    return config_from_saved(raw)


def with_evaluate_settings(predictor: Predictor, overrides: Sequence[str]) -> Predictor:
    """`predictor` predicting with `evaluate.key=value` overrides (--set, --step-size, ...), for the cases'
    config and every fold's."""
    if not overrides:
        return predictor
    config = with_overrides(predictor.config, overrides, ("evaluate.",))
    members = [(model, replace(member, evaluate=config.evaluate)) for model, member in predictor.members]
    for model, _member in members:  # `--set evaluate.compile=...` after the models were loaded
        compile_for_inference(model, config.evaluate.compile, predictor.device)
    return replace(predictor, config=config, members=members)


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


def predict_with(predictor: Predictor, input_path: Path, out_dir: Path, *, tta: bool = False,
                 probabilities: bool = False, postprocess: bool = True, progress: bool = True,
                 failures: CaseFailures | None = None, dataset_labels: bool = False) -> list[Path]:
    """`predict` with models already loaded (from a run folder, or from a bundle: `brats_swap.ship`)."""
    config, plan = predictor.config, predictor.plan
    cases = discover_cases(input_path, config.data.edition, config.data.modalities, config.data.challenge)
    if plan is not None:
        _check_plan_fits(plan, cases, predictor.plan_source)
    say = (lambda line: console.print(line)) if progress else None
    if say is not None:
        rules = ", nnU-Net's inference rules" if config.evaluate.inference == NNUNET else ""
        say(f"predict: {predictor.description}{rules}{', mirroring TTA' if tta else ''}"
            f"; postprocessing: {plan.describe() if plan is not None else 'off' if not postprocess else 'none tuned'}")
    failed = failures if failures is not None else CaseFailures(say=warn)
    already_failed = len(failed)
    written = []
    with _case_progress(progress) as bar:
        task = bar.add_task("predict", total=len(cases), case="")
        for case in cases:
            bar.update(task, case=case.case_id)
            with failed.case(case.case_id):
                written.append(predict_case(case, config, predictor.members, predictor.device, Path(out_dir),
                                            tta=tta, plan=plan, probabilities=probabilities, say=say, dataset_labels=dataset_labels))
            bar.advance(task)
    if failures is None and len(failed) > already_failed:
        failed.raise_if_any(f"predict {input_path}", len(cases))
    return written


def predict_case(case, config: Config, members: list, device: torch.device, out_dir: Path, *, tta: bool,
                  plan: PostprocessingPlan | None, probabilities: bool,
                  say: Callable[[str], None] | None, dataset_labels: bool = False) -> Path:
    """One case of `predict`: its labels (postprocessed) and, on request, its probabilities, written;
    returns the labels' path."""
    from brats_swap.data.nifti import load_case
    from brats_swap.data.preprocess import preprocess_case, preprocess_settings

    first = members[0][1]
    loaded = load_case(case, config.data.modalities, label=False)  # a ground truth beside the images is not read
    if first.evaluate.inference == NNUNET:
        label, probs = nnunet_case_prediction(members, loaded, device, tta=tta, probabilities=probabilities)
    else:
        cube_image, _, meta = preprocess_case(loaded, preprocess_settings(config.data))
        cube = torch.from_numpy(np.asarray(cube_image, dtype=np.float32))[None]
        cube_probs = predict_ensemble(members, cube, device, tta=tta)[0].numpy()
        probs = probabilities_to_original_grid(cube_probs, meta, background_probabilities(first.model.outputs,
                                                                                         cube_probs.shape[0]))
        label = case_labels(probs, loaded.edition, first, case.case_id)
    if plan is not None and plan.active:  # a plan of no rule: "no postprocessing" is said once, not per case
        processed = apply_postprocessing(plan, label)
        if say is not None:
            say(f"{case.case_id}: postprocessing {describe_label_changes(label, processed)}")
        label = processed
    written = from_table_values(label, case.label_map) if dataset_labels else label
    # The case id comes from someone else's files: the outputs are checked to land inside `out_dir`.
    named = case.description or out_dir
    path = save_label_nifti(written, loaded.affine, path_inside(out_dir, case.case_id, "case id", named, ".nii.gz"),
                            header=loaded.header)
    if probabilities:
        save_probabilities(path_inside(out_dir, case.case_id, "case id", named, ".npz"), probs,
                           output_names(loaded.edition, first.model.outputs, first.model.regions, first.model.label_order),
                           first.model.outputs)
    return path
