"""A trained model for everyone but its trainer: one zip holding what prediction needs, and nothing else.

Layout (MONAI's bundle convention, `configs/metadata.json` and `models/`, with nnU-Net's one folder per fold):

```
model.zip  configs/metadata.json        format version, versions, task, architecture, folds, sha256 of every file
           configs/config.yaml          the run's resolved config (preprocessing, evaluation settings)
           configs/labels.json          the label table, evaluation groups, modalities and their file suffixes
           configs/postprocessing.json  the run's cv-tuned postprocessing (when it has one)
           configs/cv_summary.json      the run's cross-validation summary (when it has one)
           configs/training_plan.json   the card, plan and schedule `train-challenge` chose (when it made the run)
           models/fold_<k>/model.pt     the fold's weights: a state dict, loadable with weights_only=True
           models/fold_<k>/config.yaml  the config the fold was trained with (its architecture)
           models/fold_<k>/train.log    the fold's training log (when the run has it)
           figures/<name>.png           the run's figures (when it has them)
```

`fold_all/` is the all-cases model (`--folds all-cases`).

Optimizer state, RNG states and splits stay in the run folder. Opening a bundle reads every member and checks
it against the sha256 that metadata.json records (and refuses members it does not list), so a changed,
truncated or padded bundle is one error naming the file, before any model is built. Nothing is extracted:
members are read from the zip into memory, so a bundle works from a read-only location.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from brats_swap.atomic import atomic_path
from brats_swap.config import Config, config_from_saved
from brats_swap.config.loader import config_to_yaml
from brats_swap.config.networks import architecture_record
from brats_swap.data.challenges import get_challenge
from brats_swap.errors import CheckpointError, ConfigError
from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan
from brats_swap.evaluate.predictions import Predictor, select_folds
from brats_swap.model import build_model
from brats_swap.model.targets import output_names, run_output_count
from brats_swap.run.device import resolve_device
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection, parse_fold_selection
from brats_swap.run.folder import RunFolder, fold_name
from brats_swap.run.trained import inference_config, load_run_config, load_trained_model

BUNDLE_FORMAT = "brats-swap-bundle"
BUNDLE_FORMAT_VERSION = 1
METADATA = "configs/metadata.json"
CONFIG = "configs/config.yaml"
LABELS = "configs/labels.json"
POSTPROCESSING = "configs/postprocessing.json"
CV_SUMMARY = "configs/cv_summary.json"
TRAINING_PLAN = "configs/training_plan.json"
CHECKPOINTS = ("best", "latest")
# Zip entries get one fixed time, so two exports of the same run differ only in metadata's `created`.
_ENTRY_TIME = (1980, 1, 1, 0, 0, 0)


def fold_weights(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/model.pt"


def fold_config(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/config.yaml"


def fold_log(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/train.log"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_bytes(record) -> bytes:
    return (json.dumps(record, indent=2) + "\n").encode("utf-8")


def _versions() -> dict[str, str]:
    """MONAI's metadata names for the versions a bundle was made with, plus ours."""
    import monai
    import nibabel
    import numpy

    from brats_swap import __version__

    return {"brats_swap_version": __version__, "pytorch_version": torch.__version__,
            "monai_version": monai.__version__, "numpy_version": numpy.__version__,
            "optional_packages_version": {"nibabel": nibabel.__version__}, "python_version": platform.python_version()}


def label_record(challenge: str, config: Config) -> dict:
    """configs/labels.json: the table the folds were trained on, and the images the network reads, in order."""
    spec = get_challenge(challenge)
    return {"challenge": spec.key, "title": spec.title,
            "labels": {str(value): name for value, name in sorted(spec.labels.items())},
            "groups": {name: list(values) for name, values in spec.groups.items()},
            "outputs": config.model.outputs,
            "channels": output_names(spec.key, config.model.outputs, config.model.regions),
            "modalities": list(config.data.modalities),
            "modality_suffixes": {m: spec.modality_suffixes[m] for m in config.data.modalities
                                  if m in spec.modality_suffixes},
            "separator": spec.separator}


def _network_data_format(config: Config, labels: dict) -> dict:
    """MONAI's `network_data_format` entry: what goes in, what comes out."""
    patch = config.train.mode == "patch"
    return {
        "inputs": {"image": {"type": "image", "format": "magnitude", "modality": "MR", "dtype": "float32",
                             "num_channels": len(labels["modalities"]), "is_patch_data": patch,
                             "spatial_shape": list(config.train.patch if patch else config.data.cube),
                             "channel_def": dict(enumerate(labels["modalities"]))}},
        "outputs": {"pred": {"type": "probabilities", "format": config.model.outputs, "dtype": "float32",
                             "num_channels": len(labels["channels"]), "is_patch_data": patch,
                             "channel_def": dict(enumerate(labels["channels"]))}},
    }


@dataclass
class ExportedBundle:
    path: Path
    folds: list[int]
    challenge: str
    files: dict[str, str]  # member -> sha256
    size_bytes: int


def export_bundle(run_dir: Path | RunFolder, out: Path, folds: FoldSelection = ALL_FOLDS,
                  checkpoint: str = "best") -> ExportedBundle:
    """Write the bundle of a run's folds (see the module docstring) to `out`, atomically."""
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"--checkpoint {checkpoint!r}: expected one of {', '.join(CHECKPOINTS)}")
    run = RunFolder.of(run_dir)
    config = load_run_config(run)
    chosen = select_folds(run, folds, checkpoint)
    files: dict[str, bytes] = {CONFIG: config_to_yaml(config).encode("utf-8")}
    records, editions, trained_configs = [], {}, {}
    for k in chosen:
        model, trained, state = load_trained_model(run, k, checkpoint)
        trained_configs[k] = trained
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        files[fold_weights(k)] = buffer.getvalue()
        files[fold_config(k)] = config_to_yaml(trained).encode("utf-8")
        if run.fold(k).train_log.is_file():
            files[fold_log(k)] = run.fold(k).train_log.read_bytes()
        editions[k] = state["edition"]
        records.append({"fold": k, "checkpoint": checkpoint, "epoch": state.get("epoch"),
                        "weights": fold_weights(k), "config": fold_config(k),
                        "architecture": architecture_record(trained.model)})
    if len(set(editions.values())) > 1:
        raise ConfigError(f"{run.root}: folds {', '.join(map(str, chosen))} were trained on different label tables "
                          f"({', '.join(f'fold {k}: {e}' for k, e in editions.items())}); export one (--folds K)")
    challenge = editions[chosen[0]]
    first = trained_configs[chosen[0]]
    labels = label_record(challenge, replace(config, model=first.model))
    files[LABELS] = _json_bytes(labels)
    for member, source in ((POSTPROCESSING, run.postprocessing), (CV_SUMMARY, run.cv_summary_json),
                           (TRAINING_PLAN, run.training_plan)):
        if source.is_file():
            files[member] = source.read_bytes()
    for figure in sorted(run.figures.glob("*.png")) if run.figures.is_dir() else []:
        files[f"figures/{figure.name}"] = figure.read_bytes()
    metadata = {
        "format": BUNDLE_FORMAT, "format_version": BUNDLE_FORMAT_VERSION, "name": config.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **_versions(),
        "task": f"BraTS {get_challenge(challenge).title} segmentation", "challenge": challenge,
        "description": f"brats-swap run {config.name}: {len(chosen)} fold(s), {checkpoint} checkpoint",
        "network_data_format": _network_data_format(first, labels), "architecture": architecture_record(first.model),
        "folds": records, "files": {member: _sha256(data) for member, data in sorted(files.items())},
    }
    files[METADATA] = _json_bytes(metadata)
    out = Path(out)
    with atomic_path(out) as tmp, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for member in [METADATA, *sorted(m for m in files if m != METADATA)]:
            archive.writestr(zipfile.ZipInfo(member, date_time=_ENTRY_TIME), files[member],
                             compress_type=zipfile.ZIP_DEFLATED)
    return ExportedBundle(out, chosen, challenge, metadata["files"], out.stat().st_size)


@dataclass
class Bundle:
    """An opened, verified bundle: its metadata and every member's bytes."""

    path: Path
    metadata: dict
    members: dict[str, bytes]

    @property
    def challenge(self) -> str:
        return self.metadata["challenge"]

    @property
    def folds(self) -> list[int]:
        return [int(record["fold"]) for record in self.metadata["folds"]]

    @property
    def checkpoint(self) -> str:
        return str(self.metadata["folds"][0]["checkpoint"])

    def config(self) -> Config:
        return config_from_saved(yaml.safe_load(self.members[CONFIG]) or {})

    def labels(self) -> dict:
        return json.loads(self.members[LABELS])

    def fold_config(self, fold: int) -> Config:
        return config_from_saved(yaml.safe_load(self.members[fold_config(fold)]) or {})

    def state_dict(self, fold: int) -> dict:
        return torch.load(io.BytesIO(self.members[fold_weights(fold)]), map_location="cpu", weights_only=True)

    def postprocessing(self) -> PostprocessingPlan | None:
        if POSTPROCESSING not in self.members:
            return None
        return PostprocessingPlan.from_dict(json.loads(self.members[POSTPROCESSING]),
                                            where=f"{self.path}: {POSTPROCESSING}")


def open_bundle(path: Path) -> Bundle:
    """Read and verify a bundle; CheckpointError (one line naming the bundle and the member) when it is not
    a zip, is truncated, lacks or adds a member, or a member's sha256 differs from metadata.json's."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: bundle not found")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            metadata = _read_metadata(path, archive, names)
            listed = metadata["files"]
            extra = sorted(set(names) - set(listed) - {METADATA})
            if extra:
                raise CheckpointError(f"{path}: {extra[0]}: not listed in {METADATA} (the bundle was changed)")
            members = {name: _read_member(path, archive, name, digest) for name, digest in listed.items()}
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{path}: not a readable bundle zip ({exc}); truncated or not made by "
                              "brats-swap export") from None
    for name in (CONFIG, LABELS, *(fold_weights(k) for k in _fold_numbers(path, metadata))):
        if name not in members:
            raise CheckpointError(f"{path}: {name}: missing from the bundle")
    return Bundle(path, metadata, members)


def _read_metadata(path: Path, archive: zipfile.ZipFile, names: Sequence[str]) -> dict:
    if METADATA not in names:
        raise CheckpointError(f"{path}: {METADATA}: missing; not a brats-swap bundle")
    try:
        metadata = json.loads(archive.read(METADATA))
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: {METADATA}: unreadable ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != BUNDLE_FORMAT:
        raise CheckpointError(f"{path}: {METADATA}: not a brats-swap bundle")
    if metadata.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise CheckpointError(f"{path}: {METADATA}: bundle format version {metadata.get('format_version')!r}; this "
                              f"brats-swap reads version {BUNDLE_FORMAT_VERSION}")
    if not isinstance(metadata.get("files"), dict) or not isinstance(metadata.get("folds"), list):
        raise CheckpointError(f"{path}: {METADATA}: no 'files' or 'folds' entry")
    return metadata


def _read_member(path: Path, archive: zipfile.ZipFile, name: str, digest: str) -> bytes:
    try:
        data = archive.read(name)
    except KeyError:
        raise CheckpointError(f"{path}: {name}: missing from the bundle (listed in {METADATA})") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: {name}: unreadable, the bundle is damaged or truncated ({exc})") from None
    if _sha256(data) != digest:
        raise CheckpointError(f"{path}: {name}: sha256 differs from {METADATA}; the bundle was changed or damaged")
    return data


def _fold_numbers(path: Path, metadata: dict) -> list[int]:
    try:
        return [int(record["fold"]) for record in metadata["folds"]]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: {METADATA}: malformed 'folds' entry") from None


def choose_folds(bundle: Bundle, folds: FoldSelection = ALL_FOLDS) -> list[int]:
    """`--folds` among the bundle's folds; ConfigError naming the ones it has."""
    selection = parse_fold_selection(folds)
    if selection == ALL_FOLDS:
        return bundle.folds
    absent = [k for k in selection if k not in bundle.folds]
    if absent:
        raise ConfigError(f"--folds: {bundle.path} has no fold {absent[0]} (it has {', '.join(map(str, bundle.folds))})")
    return list(selection)


def bundle_predictor(bundle: Bundle, folds: FoldSelection = ALL_FOLDS, *, postprocess: bool = True,
                     device: str | None = None, challenge: str | None = None) -> Predictor:
    """The models of a bundle, as `evaluate.predictions.run_predictor` loads a run's: each fold built from its own
    config, its weights loaded, on the device of the bundle's config (or `device`), predicting with the
    bundle's evaluation settings. `challenge` forces the label table the cases are read with (as
    `data.challenge`)."""
    config = bundle.config()
    if device is not None:
        config = replace(config, train=replace(config.train, device=device))
    if challenge is not None:
        config = replace(config, data=replace(config.data, challenge=challenge, edition="auto"))
    target = resolve_device(config.train.device)
    chosen, members = choose_folds(bundle, folds), []
    for k in chosen:
        trained = bundle.fold_config(k)
        model = build_model(trained.model, out_channels=run_output_count(bundle.challenge, trained.model))
        try:
            model.load_state_dict(bundle.state_dict(k))
        except RuntimeError as exc:
            raise CheckpointError(f"{bundle.path}: {fold_weights(k)}: weights do not match model "
                                  f"{trained.model.name} ({str(exc).splitlines()[0]})") from exc
        members.append((model.to(target).eval(), inference_config(trained, config)))
    plan = bundle.postprocessing() if postprocess else None
    return Predictor(config, members, target, plan, Path(f"{bundle.path}:{POSTPROCESSING}"),
                     f"{bundle.path.name}: fold(s) {', '.join(map(str, chosen))} ({bundle.checkpoint} checkpoint)")
