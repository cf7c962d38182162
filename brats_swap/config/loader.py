"""YAML loading, dotted `--set a.b=c` overrides and strict type checking against the schema.

Written by hand rather than with OmegaConf/Hydra to keep the dependency list to the mission's packages;
the whole job is ~150 lines: walk the dataclasses, coerce each value to the annotated type, and name the
dotted key in every error.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from brats_swap.augment.registry import RECIPE_NAMES
from brats_swap.config.networks import (
    check_network_keys,
    derived_model_keys,
    foreign_model_keys,
    input_size_problem,
)
from brats_swap.config.schema import (
    INTEGER_LIMITS,
    INTEGER_MAGNITUDE,
    Config,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    TrainConfig,
)
from brats_swap.errors import ConfigError
from brats_swap.foreign_files import parse_yaml, read_text
from brats_swap.names import name_problem

# A config is a few kilobytes; a file far larger is not one.
MAX_CONFIG_BYTES = 2**20
# Keys that older configs used, with what replaced them (a config that still sets one is told how to move).
RETIRED_KEYS = {
    "train.monai_augment": "replaced by train.augment: the MONAI set is train.augment: mild (it no longer adds to "
                           f"cube48); the recipes are {', '.join(RECIPE_NAMES)}",
}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                warn: typing.Callable[[str], None] | None = None,
                images_of: typing.Callable[[DataConfig], list[str] | None] | None = None) -> Config:
    """Resolve a config: schema defaults <- YAML file <- `section.key=value` overrides, then validate.

    `warn` receives one line naming the `model.*` keys set for another network than `model.name` (ignored).
    `images_of(data)`: the modalities of the data's challenge (or None), which `data.modalities` takes when
    neither the file nor an override sets it (the CLI passes the data layer's `challenge_images`).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml_mapping(path)
        raw.setdefault("name", Path(path).stem)
    file_network = _network_of(raw)
    named = False
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
        named = named or key == "name"
    if not named:
        raw["name"] = name_for_network(str(raw.get("name", Config.name)), file_network, _network_of(raw))
    config = from_dict(Config, raw)
    _take_challenge_images(config, raw, images_of)
    _derive_unset(config, raw)
    validate_config(config)
    model_raw = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    # Keys left at their schema defaults change nothing: only the ones that would have mattered are named.
    defaults = ModelConfig()
    changed = {key for key in model_raw if getattr(config.model, key, None) != getattr(defaults, key, None)}
    ignored = foreign_model_keys(config.model.name, changed)
    if ignored and warn is not None:
        warn(f"{', '.join('model.' + k for k in ignored)}: not read by model.name={config.model.name}; ignored")
    return config


def _network_of(raw: dict[str, Any]) -> Any:
    model_raw = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    return model_raw.get("name", ModelConfig.name)


def name_for_network(name: str, file_network: Any, network: Any) -> str:
    """The config's name (its titles and default run folder, runs/<name>) when `--set model.name` trains
    another network than the file's: the file's network in the name becomes the one trained
    (resenc_l_whole -> resenc_m_whole), else the network is appended (quickstart -> quickstart-segresnet),
    so the run folder and the titles never name a network that was not trained. An explicit `name` wins."""
    if network == file_network or not isinstance(network, str) or not isinstance(file_network, str):
        return name
    if file_network in name:
        return name.replace(file_network, network, 1)
    return f"{name}-{network}"


def _take_challenge_images(config: Config, raw: dict[str, Any],
                           images_of: typing.Callable[[DataConfig], list[str] | None] | None) -> None:
    """`data.modalities`, when unset, is the challenge's images (a MEN-RT folder: t1ce only)."""
    data_raw = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    if images_of is None or "modalities" in data_raw:
        return
    images = images_of(config.data)
    if images:
        config.data.modalities = images


def _derive_unset(config: Config, raw: dict[str, Any]) -> None:
    """Values that follow others unless set explicitly: the model's input channels are the modalities, the
    network's stages follow its plan at the training input's size (brats_swap/config/networks.py)."""
    model_raw = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    if "in_channels" not in model_raw:
        config.model.in_channels = len(config.data.modalities)
    size = config.train.patch if config.train.mode == "patch" else config.data.cube
    unset = {key for key in ("features", "kernels", "strides", "blocks", "decoder_convs") if key not in model_raw}
    stages = len(config.model.features) if "features" in model_raw else None
    derived = derived_model_keys(config.model.name, unset, list(size), stages)
    for key, value in derived.items():
        setattr(config.model, key, value)
    allowed = len(derived.get("blocks", derived.get("strides", [])))
    if stages is not None and unset and derived and stages > allowed:
        raise ConfigError(f"model.features: {stages} stages, but {config.model.name} at {list(size)} has at most "
                          f"{allowed} (no stage below 4 voxels); give fewer features or a larger input")


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A config file's mapping: a regular UTF-8 file, YAML nested at most MAX_NESTING levels, no key twice
    (`brats_swap.foreign_files`); ConfigError in one line naming the file otherwise."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{file}: config file not found")
    loaded = parse_yaml(read_text(file, ConfigError, MAX_CONFIG_BYTES, "config file"), str(file), ConfigError)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file}: a config must be a mapping of sections, got {type(loaded).__name__}")
    return loaded


def parse_override(item: str) -> tuple[str, Any]:
    """`train.lr=1e-3` -> ("train.lr", 0.001); the value is parsed as YAML (lists: `[96,96,96]`)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.key=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = parse_yaml(text, f"override {key}", ConfigError) if text.strip() else ""
    except ConfigError as exc:
        shown = text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
        raise ConfigError(f"override {key}: cannot parse value {shown!r} ({str(exc).split(': ', 1)[-1]})") from exc
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, coercing and checking every field; unknown keys are errors."""
    where = prefix or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    for name in unknown:
        dotted = f"{prefix}.{name}" if prefix else name
        if dotted in RETIRED_KEYS:
            raise ConfigError(f"{dotted}: {RETIRED_KEYS[dotted]}")
    if unknown:
        name = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        guess = f"did you mean {f'{prefix}.{close[0]}' if prefix else close[0]!r}? " if close else ""
        raise ConfigError(f"unknown config key {name!r} ({guess}known: {', '.join(sorted(fields))})")
    values = {name: _coerce(raw[name], hints[name], f"{prefix}.{name}" if prefix else name) for name in raw}
    return cls(**values)


def _accepted(annotation: Any) -> list[str]:
    """The forms a value of `annotation` takes in a config, as the errors below name them."""
    if get_origin(annotation) is Literal:
        return [str(choice) for choice in get_args(annotation)]
    return {bool: ["true", "false"], int: ["an integer"], float: ["a number"], str: ["a string"]}.get(
        annotation, [getattr(annotation, "__name__", str(annotation))])


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    origin = get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value if value is not None else {}, key)
    if origin in (typing.Union, types.UnionType):
        options = get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) > 1:  # name every form the key takes ("expected an integer or auto"), not the first's
            forms = [form for option in options if option is not type(None) for form in _accepted(option)]
            accepted = f"{', '.join(forms[:-1])} or {forms[-1]}"
            raise ConfigError(f"{key}: expected {accepted}, got {_describe(value)}")
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        choices = get_args(annotation)
        # YAML reads 2021 as an int; editions are declared as strings.
        candidate = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if candidate not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")
        return candidate
    if origin is list:
        (item_type,) = get_args(annotation)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {_describe(value)}; {_list_syntax(key, value)}")
        return [_coerce(item, item_type, f"{key}[{i}]") for i, item in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
    if annotation is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INTEGER_MAGNITUDE:
                raise ConfigError(f"{key}: {_digits(value)} is beyond any value this key can take "
                                  f"(at most {INTEGER_MAGNITUDE:.3g} in size)")
            return value
        raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads "5e-4" (no dot) as a string
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {_describe(value)}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
    raise ConfigError(f"{key}: unsupported type {annotation!r}")  # a schema bug, not a user error


def _digits(value: int) -> str:
    text = str(value)
    return text if len(text) <= 20 else f"a {len(text)}-digit integer"


def _check_integer_limits(config: Config) -> None:
    """Each key of INTEGER_LIMITS at most its limit (each item of a list key); the seed 0 or more."""
    _require(config.seed >= 0, "seed", f"must be 0 or more, got {config.seed}")
    for key, limit in INTEGER_LIMITS.items():
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item > limit:
                raise ConfigError(f"{key}: {item} is more than {limit:,}, the most this key takes "
                                  "(docs/configs.md#limits)")


def _list_syntax(key: str, value: Any) -> str:
    """How to write `key` as a list, from the scalar `value` given for it: a number repeated to the length of the
    key's default (`data.cube=64` -> `--set data.cube=[64,64,64]`), anything else once (`[t1]`)."""
    default: Any = Config()
    for part in key.split("."):
        default = getattr(default, part, None)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    count = len(default) if number and isinstance(default, list) and default else 1
    shown = value if number or isinstance(value, str) else "..."
    items = [str(shown)] * count
    return (f"write a list: --set {key}=[{','.join(items)}] (in a YAML file: {key.rsplit('.', 1)[-1]}: "
            f"[{', '.join(items)}])")


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def validate_memory_config(memory: MemoryConfig) -> None:
    """The `memory:` section's impossible values, each named by its dotted key: the one check of a memory
    policy, for a whole config and for a policy given to `brats_swap.memory` as a dict or mode name."""
    require = _require
    require(memory.budget_gib is None or (memory.budget_gib > 0 and math.isfinite(memory.budget_gib)),
            "memory.budget_gib", f"must be a positive finite number, got {memory.budget_gib}")
    require(memory.mode != "auto" or memory.budget_gib is not None, "memory.budget_gib",
            "memory.mode=auto needs a budget (e.g. --set memory.budget_gib=16)")
    require(memory.bandwidth_gbs is None or memory.bandwidth_gbs > 0, "memory.bandwidth_gbs", "must be positive")
    overhead = memory.device_overhead_gib
    require(overhead is None or (overhead >= 0 and math.isfinite(overhead)), "memory.device_overhead_gib",
            f"must be 0 or more GiB, or null for the device's default; got {overhead}")
    require(overhead is None or memory.budget_gib is None or overhead < memory.budget_gib,
            "memory.device_overhead_gib", f"{overhead} GiB leaves nothing of memory.budget_gib={memory.budget_gib}")
    require(memory.swap.tensors == -1 or memory.swap.tensors >= 0, "memory.swap.tensors", "must be -1 (all) or >= 0")
    require(memory.swap.lookahead >= 0, "memory.swap.lookahead", "must be 0 or more")
    require(memory.swap.mid_lookahead == -1 or memory.swap.mid_lookahead >= 1, "memory.swap.mid_lookahead",
            "must be -1 (off) or 1 or more")
    require(memory.swap.mid_from_marker >= 0, "memory.swap.mid_from_marker", "must be 0 or more")
    require(memory.swap.mid_until_block >= 0, "memory.swap.mid_until_block", "must be 0 or more")
    require(memory.swap.min_bytes >= 0, "memory.swap.min_bytes", "must be 0 or more")
    require(memory.swap.max_inflight_bytes is None or memory.swap.max_inflight_bytes > 0,
            "memory.swap.max_inflight_bytes", "must be positive, or null for a share of the budget or card")
    gbs = memory.swap.emulate_gbs
    require(gbs is None or (gbs > 0 and math.isfinite(gbs)), "memory.swap.emulate_gbs",
            f"must be a positive finite GB/s or null, got {gbs}")
    require(0 <= memory.swap.copy_delay_s <= 10, "memory.swap.copy_delay_s",
            f"must be between 0 and 10 seconds, got {memory.swap.copy_delay_s}")


def _validate_mirror_axes(axes: list[int]) -> None:
    _require(all(a in (0, 1, 2) for a in axes) and len(set(axes)) == len(axes), "evaluate.mirror_axes",
             f"expected distinct axes among 0, 1, 2, got {axes}")


def validate_config(config: Config) -> None:
    """Impossible values, each named by its dotted key."""
    require = _require
    data, train, model = config.data, config.train, config.model
    _check_integer_limits(config)
    require(len(data.cube) == 3 and all(s > 0 for s in data.cube), "data.cube", f"expected 3 positive sizes, got {data.cube}")
    check_network_keys(model, require)
    # A patch-trained network sees the cube through a sliding window of patches: only isensee2017 (whose
    # check predates the other networks) needs a divisible cube in patch mode too.
    if train.mode == "full" or model.name == "isensee2017":
        cube_problem = input_size_problem(model, data.cube)
        require(cube_problem is None, "data.cube", cube_problem or "")
    require(len(data.modalities) == model.in_channels, "data.modalities",
            f"{len(data.modalities)} modalities but model.in_channels is {model.in_channels}")
    require(len(data.clip_percentiles) == 2 and 0 <= data.clip_percentiles[0] < data.clip_percentiles[1] <= 100,
            "data.clip_percentiles", f"expected [low, high] within 0..100, got {data.clip_percentiles}")
    require(data.prepare_workers == "auto" or data.prepare_workers >= 1, "data.prepare_workers",
            "must be at least 1, or auto")
    require(data.loader_workers == "auto" or data.loader_workers >= 0, "data.loader_workers", "must be 0 or more, or auto")
    require(data.synth.cases >= 1, "data.synth.cases", "must be at least 1")
    require(len(data.synth.shape) == 3 and all(s >= 16 for s in data.synth.shape), "data.synth.shape",
            f"expected 3 sizes of at least 16, got {data.synth.shape}")
    require(train.augment in RECIPE_NAMES, "train.augment", f"{train.augment!r} is not one of {', '.join(RECIPE_NAMES)}")
    require(len(train.patch) == 3 and all(p > 0 for p in train.patch), "train.patch", f"expected 3 positive sizes, got {train.patch}")
    if train.mode == "patch":
        require(all(p <= c for p, c in zip(train.patch, data.cube, strict=True)), "train.patch",
                f"patch {train.patch} is larger than the cube {data.cube}")
        patch_problem = input_size_problem(model, train.patch)
        require(patch_problem is None, "train.patch", patch_problem or "")
    require(train.lr > 0, "train.lr", f"must be positive, got {train.lr}")
    require(train.max_epochs >= 1, "train.max_epochs", "must be at least 1")
    require(train.batch_size >= 1, "train.batch_size", "must be at least 1")
    require(train.val_batch_size >= 1, "train.val_batch_size", "must be at least 1")
    require(train.patches_per_case >= 1, "train.patches_per_case", "must be at least 1")
    require(train.steps_per_epoch is None or train.steps_per_epoch >= 1, "train.steps_per_epoch", "must be at least 1")
    require(0 < train.val_fraction < 1, "train.val_fraction", f"must be between 0 and 1, got {train.val_fraction}")
    require(0 < train.plateau_factor < 1, "train.plateau_factor", "must be between 0 and 1")
    require(train.weight_decay >= 0, "train.weight_decay", "must be 0 or more")
    require(train.val_every >= 1, "train.val_every", "must be at least 1")
    require(0 <= train.momentum < 1, "train.momentum", f"must be in [0, 1), got {train.momentum}")
    require(train.poly_exponent > 0, "train.poly_exponent", "must be positive")
    require(train.grad_clip is None or train.grad_clip > 0, "train.grad_clip", "must be positive or null")
    _validate_outputs(model, train)
    require(model.depth >= 2, "model.depth", "must be at least 2")
    require(model.base_filters >= 1, "model.base_filters", "must be at least 1")
    require(0 <= model.dropout < 1, "model.dropout", "must be in [0, 1)")
    require(1 <= model.segmentation_levels <= model.depth - 1, "model.segmentation_levels",
            f"must be between 1 and model.depth-1 ({model.depth - 1})")
    validate_memory_config(config.memory)
    _validate_evaluate(config.evaluate)
    require(config.cv.folds >= 2, "cv.folds", "must be at least 2")
    # Values that otherwise fail late, deep inside torch/numpy, with a traceback instead of the key.
    bad_name = name_problem(config.name)  # it names runs/<name>, SLURM jobs and bundles: brats_swap.names decides
    require(bad_name is None, "name", f"{config.name!r} {bad_name}")
    known = ("t1", "t1ce", "t2", "flair")  # brats_swap.data.challenges.CANONICAL_MODALITIES
    unknown = [m for m in data.modalities if m not in known]
    require(not unknown, "data.modalities", f"unknown modality {unknown[0]!r} (known: {', '.join(known)})"
            if unknown else "")
    require(len(set(data.modalities)) == len(data.modalities), "data.modalities",
            f"each modality at most once, got {data.modalities}")
    require(bool(data.modalities), "data.modalities", "needs at least one modality")
    require(data.challenge == "auto" or data.edition in ("auto", "2023"), "data.challenge",
            f"the 2023+ challenge {data.challenge} contradicts data.edition={data.edition}; set data.edition=auto")
    require(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", train.device) is not None, "train.device",
            f"expected auto, cpu, cuda or cuda:N, got {train.device!r}")
    require(train.threads is None or train.threads >= 1, "train.threads", "must be at least 1")
    require(train.patch_foreground == "nnunet" or 0 <= train.patch_foreground <= 1, "train.patch_foreground",
            "must be between 0 and 1, or nnunet")
    require(train.early_stop_patience >= 1, "train.early_stop_patience", "must be at least 1")
    require(train.plateau_patience >= 0, "train.plateau_patience", "must be 0 or more")
    require(train.adam_eps > 0, "train.adam_eps", "must be positive")
    require(model.norm_eps > 0, "model.norm_eps", "must be positive")
    require(model.leaky_slope >= 0, "model.leaky_slope", "must be 0 or more")
    for key, value in (("train.lr", train.lr), ("train.weight_decay", train.weight_decay),
                       ("cv.max_hours", config.cv.max_hours)):
        require(value is None or math.isfinite(value), key, f"must be a finite number, got {value}")
    require(config.cv.max_hours is None or config.cv.max_hours > 0, "cv.max_hours", "must be positive")


def _validate_outputs(model: ModelConfig, train: TrainConfig) -> None:
    """The output kind against the network and the loss (brats_swap.model.targets, brats_swap.train.losses)."""
    _require(model.outputs != "softmax" or model.name != "isensee2017", "model.outputs",
             "softmax needs a network that returns logits; isensee2017 ends in a sigmoid")
    _require(train.loss != "dice_ce" or (model.outputs != "regions" and model.name != "isensee2017"), "train.loss",
             "dice_ce (cross-entropy across the channels) needs mutually exclusive label outputs "
             "(model.outputs=labels or softmax) and a network with logits (not isensee2017); use dice_bce for regions")
    _require(model.outputs != "softmax" or train.loss == "dice_ce", "model.outputs",
             f"softmax outputs train with train.loss=dice_ce (nnU-Net's Dice + cross-entropy), not {train.loss}")
    _require(not model.label_order or model.outputs == "softmax", "model.label_order",
             f"orders softmax outputs only (model.outputs is {model.outputs})")


def _validate_evaluate(evaluate) -> None:
    _require(0 <= evaluate.sw_overlap < 1, "evaluate.sw_overlap", "must be in [0, 1)")
    _require(0 < evaluate.threshold < 1, "evaluate.threshold", "must be between 0 and 1")
    _require(evaluate.sw_batch_size >= 1, "evaluate.sw_batch_size", "must be at least 1")
    _validate_mirror_axes(evaluate.mirror_axes)
    spacing = evaluate.resample_spacing
    _require(spacing is None or (len(spacing) == 3 and all(math.isfinite(s) and s > 0 for s in spacing)),
             "evaluate.resample_spacing", f"expected 3 positive voxel sizes in mm, or null, got {spacing}")
    _require(sorted(evaluate.nnunet_axes) == [0, 1, 2], "evaluate.nnunet_axes",
             f"expected an order of the axes 0, 1, 2, got {evaluate.nnunet_axes}")


def config_to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def config_from_saved(raw: dict[str, Any]) -> Config:
    """Rebuild a config saved in a run folder or checkpoint (same strict checks). A run saved before
    `train.augment` named recipes stored `train.monai_augment`: true reads as the MONAI recipe (mild)."""
    train = raw.get("train")
    if isinstance(train, dict) and "monai_augment" in train:
        train = dict(train)
        if train.pop("monai_augment"):
            train["augment"] = "mild"
        raw = {**raw, "train": train}
    config = from_dict(Config, raw)
    validate_config(config)
    return config


def diff_configs(old: Config, new: Config, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ (used to warn when --resume changes the config)."""
    changed: list[str] = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(a):
            changed += diff_configs(a, b, key + ".")
        elif a != b:
            changed.append(key)
    return changed
