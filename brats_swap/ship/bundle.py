"""A trained model for everyone but its trainer: one zip holding what prediction needs, and nothing else.

Layout (MONAI's bundle convention, `configs/metadata.json` and `models/`, with nnU-Net's one folder per fold):

```
model.zip  configs/metadata.json        format version, versions, task, architecture, folds, sha256 of every file
           configs/config.yaml          the run's resolved config (preprocessing, evaluation settings)
           configs/labels.json          the label table, evaluation groups, modalities and their file suffixes
           configs/postprocessing.json  the run's cv-tuned postprocessing (when it has one)
           configs/cv_summary.json      the run's cross-validation summary (when it has one), made again at export
                                        from the run's folds, so it says where each fold stands now
           configs/training_plan.json   the card, plan and schedule `train-challenge` chose (when it made the run)
           models/fold_<k>/model.pt     the fold's weights: a state dict, loadable with weights_only=True
           models/fold_<k>/model.onnx   the fold's network as ONNX (`export --onnx`: ship/onnx_export.py)
           models/fold_<k>/model.fp16.onnx  the same in float16 (`export --onnx`, where the network allows it)
           models/fold_<k>/config.yaml  the config the fold was trained with (its architecture)
           models/fold_<k>/train.log    the fold's training log (when the run has it)
           figures/<name>.png           the run's figures (when it has them)
```

`fold_all/` is the all-cases model (`--folds all-cases`).

Optimizer state, RNG states and splits stay in the run folder. Opening a bundle reads every member and checks
it against the sha256 that metadata.json records (and refuses members it does not list), so a changed,
truncated or padded bundle is one error naming the file, before any model is built. Nothing is extracted:
members are read from the zip into memory, so a bundle works from a read-only location.

A bundle may come from anyone, so opening one trusts nothing in it: each member is read with a cap on its
declared and its actual size (`MAX_METADATA_BYTES`, `MAX_CONFIG_BYTES`, `MAX_WEIGHTS_BYTES`, and
`MAX_BUNDLE_BYTES` for all together), duplicate and symlink members are refused, metadata.json's entries are
checked (a name by `brats_swap.names`, a known label table, at least one fold), a weights member must be a
state dict of tensors readable with `weights_only=True`, and each fold's network is priced on the meta device
(`brats_swap.model.pricing`) and compared to its weights before it is built. Each refusal is one line.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import platform
import stat
import zipfile
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from brats_swap.atomic import atomic_path
from brats_swap.config import Config, config_from_saved
from brats_swap.config.loader import config_to_yaml
from brats_swap.config.networks import architecture_record
from brats_swap.data.challenges import get_challenge
from brats_swap.errors import CheckpointError, ConfigError
from brats_swap.evaluate.case_prediction import Predictor, check_one_output_kind
from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan
from brats_swap.foreign_files import decode_utf8, parse_json, parse_yaml
from brats_swap.model.targets import output_names
from brats_swap.names import checked_name
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection, parse_fold_selection
from brats_swap.run.folder import ALL_CASES_FOLD, RunFolder, fold_name
from brats_swap.timestamps import utc_now

# torch, and the modules that import it, are imported by the functions that build or save a network: opening
# and verifying a bundle, and predicting with its ONNX networks (`ship/onnx_runtime.py`), need no torch.

BUNDLE_FORMAT = "brats-swap-bundle"
BUNDLE_FORMAT_VERSION = 1
METADATA = "configs/metadata.json"
CONFIG = "configs/config.yaml"
LABELS = "configs/labels.json"
POSTPROCESSING = "configs/postprocessing.json"
CV_SUMMARY = "configs/cv_summary.json"
TRAINING_PLAN = "configs/training_plan.json"
CHECKPOINTS = ("best", "latest")
# Caps on what opening a bundle reads into memory, by the size the zip declares and by the bytes it really
# inflates to (a zip can claim a small size). metadata.json and the configs are a few kilobytes (a large
# cross-validation summary a few hundred); a fold's weights are at most the largest network built from a file
# (`brats_swap.model.pricing.MAX_NETWORK_PARAMETERS` float32 parameters) plus the state dict's own framing.
MAX_METADATA_BYTES = 1 * 2**20
MAX_CONFIG_BYTES = 16 * 2**20
MAX_WEIGHTS_BYTES = 4 * 2**30
MAX_BUNDLE_BYTES = 16 * 2**30
_READ_CHUNK = 2**20
# Zip entries get one fixed time, so two exports of the same run differ only in metadata's `created`.
_ENTRY_TIME = (1980, 1, 1, 0, 0, 0)


def fold_weights(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/model.pt"


def fold_config(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/config.yaml"


def fold_onnx(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/model.onnx"


def fold_onnx_half(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/model.fp16.onnx"


def fold_log(fold: int) -> str:
    return f"models/fold_{fold_name(fold)}/train.log"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_bytes(record) -> bytes:
    return (json.dumps(record, indent=2) + "\n").encode("utf-8")


def _versions() -> dict[str, str]:
    """MONAI's metadata names for the versions a bundle was made with, plus ours (MONAI's read from its installed
    metadata: importing it costs a process seconds of CPU, run/environment.py)."""
    import nibabel
    import numpy
    import torch

    from brats_swap import __version__
    from brats_swap.run.environment import installed_version

    return {"brats_swap_version": __version__, "pytorch_version": torch.__version__,
            "monai_version": installed_version("monai"), "numpy_version": numpy.__version__,
            "optional_packages_version": {"nibabel": nibabel.__version__}, "python_version": platform.python_version()}


def label_record(challenge: str, config: Config) -> dict:
    """configs/labels.json: the table the folds were trained on, and the images the network reads, in order."""
    spec = get_challenge(challenge)
    return {"challenge": spec.key, "title": spec.title,
            "labels": {str(value): name for value, name in sorted(spec.labels.items())},
            "groups": {name: list(values) for name, values in spec.groups.items()},
            "outputs": config.model.outputs,
            "channels": output_names(spec.key, config.model.outputs, config.model.regions, config.model.label_order),
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
    notes: list[str] = field(default_factory=list)  # what a user of the bundle should know: `fold_notes`


def export_bundle(run_dir: Path | RunFolder, out: Path, folds: FoldSelection = ALL_FOLDS,
                  checkpoint: str = "best", *, onnx: bool = False) -> ExportedBundle:
    """Write the bundle of a run's folds (see the module docstring) to `out`, atomically; `onnx` adds each
    fold's network as ONNX, checked against torch (ship/onnx_export.py)."""
    import torch

    from brats_swap.evaluate.predicting import select_folds
    from brats_swap.run.trained import inference_config, load_run_config, load_trained_model

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
        if onnx:
            records[-1]["onnx"] = _onnx_members(files, k, model, inference_config(trained, config), config,
                                                f"{run.root}: fold {fold_name(k)}")
    if len(set(editions.values())) > 1:
        raise ConfigError(f"{run.root}: folds {', '.join(map(str, chosen))} were trained on different label tables "
                          f"({', '.join(f'fold {k}: {e}' for k, e in editions.items())}); export one (--folds K)")
    challenge = editions[chosen[0]]
    first = trained_configs[chosen[0]]
    labels = label_record(challenge, replace(config, model=first.model))
    files[LABELS] = _json_bytes(labels)
    for member, source in ((POSTPROCESSING, run.postprocessing), (TRAINING_PLAN, run.training_plan)):
        if source.is_file():
            files[member] = source.read_bytes()
    summary = current_cv_summary(run, config.name)
    if summary is not None:
        files[CV_SUMMARY] = _json_bytes(summary)
    for figure in sorted(run.figures.glob("*.png")) if run.figures.is_dir() else []:
        files[f"figures/{figure.name}"] = figure.read_bytes()
    metadata = {
        "format": BUNDLE_FORMAT, "format_version": BUNDLE_FORMAT_VERSION, "name": config.name,
        "created": utc_now(), **_versions(),
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
    return ExportedBundle(out, chosen, challenge, metadata["files"], out.stat().st_size,
                          fold_notes(run, chosen, trained_configs))


def current_cv_summary(run: RunFolder, name: str) -> dict | None:
    """The run's cross-validation summary as its folds stand now (`build_cv_summary`), when it has one: the
    cv_summary.json on disk is as old as the last `cv` call and may call a fold trained by `train` since
    "not started". The reason postprocessing was not tuned is the file's (only tuning knows it)."""
    from brats_swap.cv.summary import build_cv_summary
    from brats_swap.evaluate.official import json_safe
    from brats_swap.splits import read_splits

    if not run.cv_summary_json.is_file() or not run.splits.is_file():
        return None
    try:
        written = json.loads(run.cv_summary_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        written = {}
    not_tuned = written.get("postprocessing_not_tuned") if isinstance(written, dict) else None
    summary, _ = build_cv_summary(name, run, read_splits(run.splits), not_tuned if isinstance(not_tuned, str) else None)
    return json_safe(summary)


def fold_notes(run: RunFolder, folds: list[int], trained_configs: dict[int, Config]) -> list[str]:
    """One line per exported fold that is not evaluated (its quality is unknown; the all-cases model has no
    validation cases, so never), and per fold trained with settings other than the first fold's, naming them."""
    from brats_swap.config import diff_configs
    from brats_swap.cv.fold_progress import DONE, fold_standing

    notes = []
    for k in folds:
        standing = fold_standing(run, k)
        if k != ALL_CASES_FOLD and standing.stage != DONE:
            notes.append(f"fold {k} is {standing.label}: no validation score of it is in the bundle")
    first = folds[0]
    for k in folds[1:]:
        changed = diff_configs(trained_configs[first], trained_configs[k])
        if changed:
            shown = "; ".join(f"{key} {_dotted(trained_configs[k], key)!r} ({_fold_label(first)}: "
                              f"{_dotted(trained_configs[first], key)!r})" for key in changed)
            notes.append(f"{_fold_label(k)} was trained with other settings than {_fold_label(first)}: {shown}")
    return notes


def _fold_label(fold: int) -> str:
    return "the all-cases model" if fold == ALL_CASES_FOLD else f"fold {fold}"


def _dotted(config: Config, key: str):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _onnx_members(files: dict[str, bytes], fold: int, model, predict_config: Config, run_config: Config,
                  where: str) -> dict:
    """Add the fold's ONNX networks to `files` (float32, and float16 where the network allows it); their record
    for metadata.json (ship/onnx_export.py)."""
    from brats_swap.ship.onnx_export import checked_export, half_export

    files[fold_onnx(fold)], record = checked_export(model, predict_config, run_config, where)
    half, half_record = half_export(model, predict_config, run_config, where)
    if half is not None:
        files[fold_onnx_half(fold)] = half
        half_record["file"] = fold_onnx_half(fold)
    return {"file": fold_onnx(fold), **record, "fp16": half_record}


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
        return self._config(CONFIG)

    def labels(self) -> dict:
        return self._json(LABELS)

    def fold_config(self, fold: int) -> Config:
        return self._config(fold_config(fold))

    def state_dict(self, fold: int) -> dict:
        """The fold's weights: a state dict of tensors (one line for a pickle, a foreign file or other values)."""
        import torch

        member = fold_weights(fold)
        try:
            state = torch.load(io.BytesIO(self.members[member]), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{self.path}: {member}: holds objects torch.load(weights_only=True) refuses "
                                  f"({_first_line(exc)}); a bundle's weights are a plain state dict") from None
        except Exception as exc:  # torch raises many types for unreadable or foreign files
            raise CheckpointError(f"{self.path}: {member}: not a torch state dict ({_first_line(exc)})") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise CheckpointError(f"{self.path}: {member}: holds a {type(state).__name__}, not a state dict")
        return state

    def postprocessing(self) -> PostprocessingPlan | None:
        if POSTPROCESSING not in self.members:
            return None
        return PostprocessingPlan.from_dict(self._json(POSTPROCESSING), where=f"{self.path}: {POSTPROCESSING}")

    def _json(self, member: str) -> dict:
        where = f"{self.path}: {member}"
        record = parse_json(decode_utf8(self.members[member], where, CheckpointError), where, CheckpointError)
        if not isinstance(record, dict):
            raise CheckpointError(f"{self.path}: {member}: expected a JSON object, got {type(record).__name__}")
        return record

    def _config(self, member: str) -> Config:
        where = f"{self.path}: {member}"
        raw = parse_yaml(decode_utf8(self.members[member], where, CheckpointError), where, CheckpointError)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}: expected a mapping of config sections, got {type(raw).__name__}")
        try:
            return config_from_saved(raw)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def member_cap(name: str) -> int:
    """The most bytes a bundle member called `name` may inflate to."""
    if name == METADATA:
        return MAX_METADATA_BYTES
    if name.startswith("models/") and name.endswith((".pt", ".onnx")):
        return MAX_WEIGHTS_BYTES
    return MAX_CONFIG_BYTES


def open_bundle(path: Path) -> Bundle:
    """Read and verify a bundle; CheckpointError (one line naming the bundle and the member) when it is not
    a zip, is truncated, lacks or adds a member, or a member's sha256 differs from metadata.json's, and for
    every check of the module docstring."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: bundle not found")
    try:
        with zipfile.ZipFile(path) as archive:
            entries = _entries(path, archive)
            metadata = _read_metadata(path, archive, entries)
            listed = metadata["files"]
            extra = sorted(set(entries) - set(listed) - {METADATA})
            if extra:
                raise CheckpointError(f"{path}: {extra[0]}: not listed in {METADATA} (the bundle was changed)")
            members = {name: _read_member(path, archive, entries, name, digest) for name, digest in listed.items()}
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{path}: not a readable bundle zip ({exc}); truncated or not made by "
                              "brats-swap export") from None
    for name in (CONFIG, LABELS, *(fold_weights(k) for k in _fold_numbers(path, metadata))):
        if name not in members:
            raise CheckpointError(f"{path}: {name}: missing from the bundle")
    return Bundle(path, metadata, members)


def _entries(path: Path, archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The zip's members by name: no name twice (the last would win, unzip shows the first), no symlink,
    each member's and all members' declared sizes under their caps."""
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        if info.filename in entries:
            raise CheckpointError(f"{path}: {info.filename}: appears twice in the zip; a bundle holds each member once")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise CheckpointError(f"{path}: {info.filename}: a symlink member; a bundle holds plain files only")
        cap = member_cap(info.filename)
        if info.file_size > cap:
            raise CheckpointError(f"{path}: {info.filename}: declares {info.file_size:,} bytes, above the {cap:,} a "
                                  "bundle member of its kind may hold")
        entries[info.filename] = info
    declared = sum(info.file_size for info in entries.values())
    if declared > MAX_BUNDLE_BYTES:
        raise CheckpointError(f"{path}: its members declare {declared:,} bytes together, above the "
                              f"{MAX_BUNDLE_BYTES:,} a bundle may hold")
    return entries


def _inflate(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """The member's bytes, reading at most its cap plus one byte whatever size the zip declares."""
    cap = member_cap(info.filename)
    with archive.open(info) as stream:
        data = stream.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"{path}: {info.filename}: inflates past {cap:,} bytes, the most a bundle member of "
                              "its kind may hold")
    return data


def _read_metadata(path: Path, archive: zipfile.ZipFile, entries: dict[str, zipfile.ZipInfo]) -> dict:
    if METADATA not in entries:
        raise CheckpointError(f"{path}: {METADATA}: missing; not a brats-swap bundle")
    where = f"{path}: {METADATA}"
    try:
        metadata = parse_json(decode_utf8(_inflate(path, archive, entries[METADATA]), where, CheckpointError), where,
                              CheckpointError)
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: {METADATA}: unreadable ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != BUNDLE_FORMAT:
        raise CheckpointError(f"{path}: {METADATA}: not a brats-swap bundle")
    if metadata.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise CheckpointError(f"{path}: {METADATA}: bundle format version {metadata.get('format_version')!r}; this "
                              f"brats-swap reads version {BUNDLE_FORMAT_VERSION}")
    files = metadata.get("files")
    if not isinstance(files, dict) or not isinstance(metadata.get("folds"), list):
        raise CheckpointError(f"{path}: {METADATA}: no 'files' or 'folds' entry")
    if not all(isinstance(name, str) and isinstance(digest, str) for name, digest in files.items()):
        raise CheckpointError(f"{path}: {METADATA}: 'files' must map member names to sha256 strings")
    where = f"{path}: {METADATA}"
    checked_name(metadata.get("name"), "bundle name", where)
    challenge = metadata.get("challenge")
    if challenge is None:
        raise CheckpointError(f"{where}: no 'challenge' entry (the label table the folds were trained on)")
    try:
        get_challenge(checked_name(challenge, "challenge", where))
    except KeyError as exc:
        raise CheckpointError(f"{where}: challenge: {exc.args[0]}") from None
    return metadata


def _read_member(path: Path, archive: zipfile.ZipFile, entries: dict[str, zipfile.ZipInfo], name: str,
                 digest: str) -> bytes:
    if name not in entries:
        raise CheckpointError(f"{path}: {name}: missing from the bundle (listed in {METADATA})")
    try:
        data = _inflate(path, archive, entries[name])
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: {name}: unreadable, the bundle is damaged or truncated ({exc})") from None
    if _sha256(data) != digest:
        raise CheckpointError(f"{path}: {name}: sha256 differs from {METADATA}; the bundle was changed or damaged")
    return data


def _fold_numbers(path: Path, metadata: dict) -> list[int]:
    """metadata.json's folds: at least one, each a record with a fold number (once) and a checkpoint name."""
    records = metadata["folds"]
    if not records:
        raise CheckpointError(f"{path}: {METADATA}: 'folds' is empty; a bundle holds at least one fold")
    try:
        folds = [int(record["fold"]) for record in records]
        checkpoints = {str(record["checkpoint"]) for record in records}
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: {METADATA}: malformed 'folds' entry (each needs 'fold' and "
                              "'checkpoint')") from None
    numbered = [k for k in folds if k != ALL_CASES_FOLD]  # the all-cases model (fold_all) is the one exception
    if len(set(folds)) != len(folds) or min(numbered, default=0) < 0 or not checkpoints <= set(CHECKPOINTS):
        raise CheckpointError(f"{path}: {METADATA}: 'folds' must name each fold once, numbers 0 or more (or "
                              f"{ALL_CASES_FOLD}, the all-cases model), with a checkpoint of {', '.join(CHECKPOINTS)}")
    return folds


def choose_folds(bundle: Bundle, folds: FoldSelection = ALL_FOLDS) -> list[int]:
    """`--folds` among the bundle's folds; ConfigError naming the ones it has."""
    selection = parse_fold_selection(folds)
    if selection == ALL_FOLDS:
        return bundle.folds
    absent = [k for k in selection if k not in bundle.folds]
    if absent:
        raise ConfigError(f"--folds: {bundle.path} has no fold {absent[0]} (it has {', '.join(map(str, bundle.folds))})")
    return list(selection)


def bundle_config(bundle: Bundle, device: str | None = None, challenge: str | None = None,
                  evaluate_compile: bool | None = None) -> Config:
    """The bundle's config as a predictor reads cases with it: on `device` when given, with the label table
    `challenge` forced when given (as `data.challenge`), and `evaluate.compile` set to `evaluate_compile` when
    given."""
    config = bundle.config()
    if device is not None:
        config = replace(config, train=replace(config.train, device=device))
    if challenge is not None:
        config = replace(config, data=replace(config.data, challenge=challenge, edition="auto"))
    if evaluate_compile is not None:
        config = replace(config, evaluate=replace(config.evaluate, compile=evaluate_compile))
    return config


def bundle_predictor(bundle: Bundle, folds: FoldSelection = ALL_FOLDS, *, postprocess: bool = True,
                     device: str | None = None, challenge: str | None = None,
                     evaluate_compile: bool | None = None) -> Predictor:
    """The models of a bundle, as `evaluate.predicting.run_predictor` loads a run's: each fold built from its own
    config, its weights loaded, on the device of the bundle's config (or `device`), predicting with the
    bundle's evaluation settings (`evaluate.compile` replaced by `evaluate_compile` when given).
    `challenge` forces the label table the cases are read with (as `data.challenge`)."""
    from brats_swap.run.compiling import compile_for_inference
    from brats_swap.run.device import resolve_device
    from brats_swap.run.trained import inference_config, trained_model

    config = bundle_config(bundle, device, challenge, evaluate_compile)
    target = resolve_device(config.train.device)
    chosen, members = choose_folds(bundle, folds), []
    for k in chosen:
        trained = bundle.fold_config(k)
        model = trained_model(trained.model, bundle.challenge, bundle.state_dict(k),
                              weights_source=f"{bundle.path}: {fold_weights(k)}",
                              config_source=f"{bundle.path}: {fold_config(k)}", device=target)
        compile_for_inference(model, config.evaluate.compile, target)
        members.append((model, inference_config(trained, config)))
    check_one_output_kind(bundle.path, chosen, members)
    plan = bundle.postprocessing() if postprocess else None
    return Predictor(config, members, target, plan, Path(f"{bundle.path}:{POSTPROCESSING}"),
                     f"{bundle.path.name}: fold(s) {', '.join(map(str, chosen))} ({bundle.checkpoint} checkpoint)")
