"""One case from its files to its written segmentation, with the network run by torch or by onnxruntime: what
`predict` (a run's folds or a bundle's) and `serve-challenge` do per case.

- brats-swap's own rules: the case cropped, normalised and fitted to the cube (`data.preprocess`), the
  network's probabilities by `run/array_inference.py` (whole cube or sliding window, mirrors, fold mean), mapped
  back to the case's grid, labels by the model's outputs and threshold;
- nnU-Net's rules for an imported nnU-Net run (`evaluate.inference: nnunet`, `evaluate/nnunet_inference.py`);
- then the run's postprocessing, and the labels written on the case's grid and header.

Every rule is in numpy; only the network differs: a torch model (`run/inference.torch_network`, on its device)
or a network that already runs on arrays (`runs_on_arrays`: `ship/onnx_runtime.py`). This module imports
neither torch nor MONAI, so a process without them (`--runtime onnxruntime`) predicts with the same code.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
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
from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan, describe_label_changes
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
from brats_swap.run import array_inference
from brats_swap.run.console import console, warn


def array_network(model, device, config: Config) -> array_inference.ArrayNetwork:
    """A member's network as the array rules call it: an onnxruntime network as it is, a torch model on `device`
    under the config's AMP (`run/inference.torch_network`, imported only then)."""
    if getattr(model, "runs_on_arrays", False):
        return model
    from brats_swap.run.inference import torch_network

    return torch_network(model, device, config.train.amp)


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


def nnunet_case_prediction(members: list, loaded, device, *, tta: bool,
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



def check_one_output_kind(where: Path, folds: Sequence[int], members: Sequence[tuple[object, Config]]) -> None:
    """ConfigError naming `where` when the folds' models predict different outputs (model.outputs/model.regions):
    their probabilities could not be averaged."""
    kinds = {(c.model.outputs, tuple(c.model.regions), tuple(c.model.label_order)) for _, c in members}
    if len(kinds) > 1:
        raise ConfigError(f"{where}: folds {', '.join(map(str, folds))} were trained with different model.outputs/"
                          "model.regions/model.label_order; predict with one of them (--folds K)")



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
    members: list[tuple[object, Config]]
    device: object
    plan: PostprocessingPlan | None
    plan_source: Path | None
    description: str



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
            close = difflib.get_close_matches(name, list(raw[section]), n=1)
            guess = f"did you mean {section}.{close[0]}? " if close else ""
            raise ConfigError(f"{option} {key}: unknown key ({guess}known: "
                              f"{', '.join(f'{section}.{k}' for k in raw[section])})")
        raw[section][name] = value
    return config_from_saved(raw)



def with_evaluate_settings(predictor: Predictor, overrides: Sequence[str]) -> Predictor:
    """`predictor` predicting with `evaluate.key=value` overrides (--set, --step-size, ...), for the cases'
    config and every fold's."""
    if not overrides:
        return predictor
    config = with_overrides(predictor.config, overrides, ("evaluate.",))
    members = [(model, replace(member, evaluate=config.evaluate)) for model, member in predictor.members]
    torch_models = [model for model, _member in members if not getattr(model, "runs_on_arrays", False)]
    if torch_models:  # `--set evaluate.compile=...` after the models were loaded (torch imported only then)
        from brats_swap.run.compiling import compile_for_inference

        for model in torch_models:
            compile_for_inference(model, config.evaluate.compile, predictor.device)
    return replace(predictor, config=config, members=members)



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



def predict_case(case, config: Config, members: list, device, out_dir: Path, *, tta: bool,
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
        cube = np.asarray(cube_image, dtype=np.float32)[None]
        networks = [(array_network(model, device, member), member) for model, member in members]
        cube_probs = array_inference.ensemble(networks, cube, tta=tta)[0]
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

