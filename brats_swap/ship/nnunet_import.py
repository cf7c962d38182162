"""An nnU-Net v2 model as a brats-swap run folder (`brats-swap import-nnunet`).

nnU-Net's results folder `Dataset<NNN>_<Name>/<Trainer>__<Plans>__<configuration>/` holds `plans.json`,
`dataset.json` and `fold_<k>/checkpoint_final.pth` (its `network_weights`). What carries over:

- the network: the plans' `architecture` (dynamic-network-architectures' `PlainConvUNet` or
  `ResidualEncoderUNet`, 3D, cubic kernels) becomes `model.name: nnunet | resenc_*` with the same stages,
  features, kernels, strides and blocks; brats-swap builds it with the same library and the same norm,
  activation and bias, so the weights load unchanged (apart from the axis order below);
- the outputs, as nnU-Net's `LabelManager` decides them: a dataset.json whose labels hold regions (lists of
  values, with `regions_class_order`; nnU-Net's BraTS models) trained sigmoid heads, which are `model.outputs:
  regions` with `model.regions` the table's groups in the model's head order and nnU-Net's Dice + BCE;
  one value per label (nnU-Net's default) trained a softmax over a background channel and one channel per
  label, which is `model.outputs: softmax` with `model.label_order` the table's labels in the model's
  channel order (`_label_order`) and nnU-Net's Dice + CE;
- the preprocessing: crop to the non-zero box, z-score per channel inside it without clipping
  (`ZScoreNormalization` with `use_mask_for_norm`, i.e. `data.clip_percentiles: [0, 100]`), the channel
  order of `channel_names` as `data.modalities`, the data's voxels kept in training (`data.fit: pad_crop`),
  patch training and sliding-window inference with the plans' patch size (`train.mode: patch`);
- the spacing: the plans' `spacing` on brats-swap's axes (`evaluate.resample_spacing`), to which `predict`
  resamples each case and from which it resamples the logits back, as nnU-Net does
  (brats_swap.evaluate.nnunet_resampling; nnU-Net's default resampling functions only, any other is refused);
- the axis order: nnU-Net reads a NIfTI as SimpleITK does, (z, y, x) of the file's voxel axes, then applies
  the plans' `transpose_forward`; brats-swap keeps the file's (x, y, z). Every convolution kernel (and
  each per-axis stride, patch and size) is permuted to match, which gives exactly the same network on
  brats-swap's input: the logits equal nnU-Net's, transposed.

Each fold becomes `fold_<k>/checkpoint_best.pt` (what `predict` and `evaluate` load) and
`fold_<k>/checkpoint_nnunet.pt`, the weights `train.init_from` starts fine-tuning from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from brats_swap.atomic import atomic_write_text
from brats_swap.config import Config, config_to_dict, config_to_yaml, load_config
from brats_swap.config.networks import architecture_record, input_divisor
from brats_swap.data.challenges import get_challenge, label_map_from_names
from brats_swap.data.layouts import (
    channel_modalities,
    declared_labels,
    modern_channel_names,
    read_json_object,
)
from brats_swap.errors import CheckpointError, ConfigError
from brats_swap.foreign_files import open_regular
from brats_swap.run.checkpoint import save_checkpoint
from brats_swap.run.folder import RunFolder
from brats_swap.run.trained import trained_model

NETWORK_CLASSES = {"PlainConvUNet": "nnunet", "ResidualEncoderUNet": "resenc"}
READERS = ("SimpleITKIO", "NibabelIO")  # both hand nnU-Net the file's voxels as (z, y, x)
# What brats-swap's nnU-Net builder passes (brats_swap.model.networks): an architecture asking for
# anything else is refused rather than built differently.
EXPECTED_KWARGS = {"conv_op": "torch.nn.modules.conv.Conv3d", "conv_bias": True,
                   "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
                   "norm_op_kwargs": {"eps": 1e-05, "affine": True}, "dropout_op": None,
                   "nonlin": "torch.nn.LeakyReLU"}
# nnU-Net's training recipe (nnUNetTrainer), which fine-tuning continues with (configs/resenc_l.yaml has it too);
# the loss follows the outputs (`_outputs`).
NNUNET_RECIPE = ("train.optimizer=sgd", "train.lr=0.01", "train.momentum=0.99", "train.weight_decay=3e-5",
                 "train.schedule=poly", "train.poly_exponent=0.9", "train.grad_clip=12",
                 "train.patch_foreground=0.33")
# The resampling nnU-Net's planner writes (ExperimentPlanner.determine_resampling and
# determine_segmentation_softmax_export_fn), the only one brats_swap.evaluate.nnunet_resampling reproduces.
RESAMPLING_FUNCTION = "resample_data_or_seg_to_shape"
RESAMPLING = {"resampling_fn_data": {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None},
              "resampling_fn_probabilities": {"is_seg": False, "order": 1, "order_z": 0, "force_separate_z": None}}
CUBE_MARGIN = 1.15  # the cube holds the plans' median image size with this much room, for larger heads


@dataclass
class NnUNetImport:
    run: RunFolder
    config: Config
    folds: list[int]
    notes: list[str] = field(default_factory=list)


def import_nnunet(results_dir: Path, out: Path, checkpoint_name: str = "checkpoint_final.pth",
                  edition: str = "auto", challenge: str = "auto") -> NnUNetImport:
    """Write the run folder `out` from nnU-Net's results folder (see the module docstring)."""
    results_dir, run = Path(results_dir), RunFolder.of(out)
    plans, dataset = (read_json_object(results_dir / name, ConfigError) for name in ("plans.json", "dataset.json"))
    configuration = _configuration(results_dir, plans)
    folds = sorted(int(p.name.split("_")[1]) for p in results_dir.glob("fold_*")
                   if p.name.split("_")[1].isdigit() and (p / checkpoint_name).is_file())
    if not folds:
        raise CheckpointError(f"{results_dir}: no fold_<k>/{checkpoint_name}")
    if run.config.exists():
        raise ConfigError(f"{run.root}: already a run folder; choose another --out")
    order = _axis_order(results_dir, plans)
    key = _table_key(results_dir / "dataset.json", dataset, edition, challenge)
    notes: list[str] = []
    first_checkpoint = results_dir / f"fold_{folds[0]}" / checkpoint_name
    outputs = _outputs(results_dir / "dataset.json", dataset, key)
    overrides = [*_model_overrides(results_dir, configuration, dataset, order), *outputs,
                 *_data_overrides(results_dir, configuration, dataset, key, order),
                 *_inference_overrides(first_checkpoint, order),
                 *_resampling_overrides(results_dir, plans, configuration, order)]
    # The cube is chosen below from this config's network; until then the patch itself stands for it, so that a
    # patch larger than the default cube (a whole-case patch) passes the config's patch <= cube check.
    first = load_config(None, [*overrides, f"name={run.root.name}", f"data.cube={_list(_patch(configuration, order))}"])
    # Fine-tuning (train --run OUT --fold k) starts from the imported weights of the fold.
    config = load_config(None, [*overrides, f"name={run.root.name}", f"train.init_from={run.fold(folds[0]).imported}",
                                f"data.cube={_cube(configuration, order, input_divisor(first.model), first)}"])
    # The plans' network must take each fold's weights as they are: each fold is loaded as predict will load it
    # (priced first, its weights compared on the meta device) before anything is written (a channel count of
    # dataset.json that the weights contradict would otherwise fail only at predict).
    weights_of = {}
    for fold in folds:
        checkpoint = results_dir / f"fold_{fold}" / checkpoint_name
        weights_of[fold] = _nnunet_weights(checkpoint, order)
        trained_model(config.model, key, weights_of[fold], weights_source=f"{checkpoint}: network_weights",
                      config_source=f"{results_dir / 'plans.json'} and dataset.json")
    for fold, weights in weights_of.items():
        state = {"model": weights, "config": config_to_dict(config), "edition": key, "fold": fold, "epoch": 0,
                 "architecture": architecture_record(config.model),
                 "imported_from": str(results_dir / f"fold_{fold}" / checkpoint_name)}
        folder = run.fold(fold)
        folder.root.mkdir(parents=True, exist_ok=True)
        save_checkpoint(state, folder.best)
        save_checkpoint(state, folder.imported)
    atomic_write_text(run.config, config_to_yaml(config))
    return NnUNetImport(run, config, folds, notes)




# ---- the plans file, checked before anything is read from it -------------------------------------------------
# nnU-Net writes plans.json; one made or edited by someone else may hold anything. Each value the import reads is
# checked here for its type and shape, so a wrong one is one line naming the key, never a traceback later.

def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_ints(where: str, key: str, value: object, length: int | None = None) -> list[int]:
    """`value` when it is a list of positive integers (of `length` when given); else one line."""
    if (not isinstance(value, list) or not value or (length is not None and len(value) != length)
            or not all(_is_int(v) and v > 0 for v in value)):
        raise ConfigError(f"{where}: {key} is {_shown(value)}; expected a list of {length or 'one or more'} "
                          "positive integers")
    return value


def _positive_numbers(where: str, key: str, value: object, length: int) -> list[float]:
    if (not isinstance(value, list) or len(value) != length
            or not all((_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0 for v in value)):
        raise ConfigError(f"{where}: {key} is {_shown(value)}; expected a list of {length} positive numbers")
    return value


def _per_stage(where: str, key: str, value: object, stages: int) -> list[list[int]]:
    """A [z, y, x] triple of positive integers per stage (nnU-Net's kernel_sizes and strides)."""
    if not isinstance(value, list) or len(value) != stages:
        raise ConfigError(f"{where}: {key} is {_shown(value)}; expected {stages} [z, y, x] entries, one per stage "
                          "of features_per_stage")
    for stage, triple in enumerate(value):
        _positive_ints(where, f"{key}[{stage}]", triple, 3)
    return value


def _configuration(results_dir: Path, plans: dict) -> dict:
    """The plans' entry of the folder's configuration (`Trainer__Plans__3d_fullres`), parents merged in, with
    every value the import reads checked (`_check_configuration`)."""
    parts = results_dir.name.split("__")
    if len(parts) != 3:
        raise ConfigError(f"{results_dir}: expected a folder named <Trainer>__<Plans>__<configuration>")
    where, name, configurations = f"{results_dir}/plans.json", parts[2], plans.get("configurations")
    if not isinstance(configurations, dict):
        raise ConfigError(f"{where}: configurations is {_shown(configurations)}; expected a mapping of "
                          "configuration names to their plans")
    if name not in configurations:
        raise ConfigError(f"{where}: no configuration {name!r} (has {', '.join(map(str, configurations))})")
    chain, entry = [name], {}
    while True:
        plan = configurations[chain[-1]]
        if not isinstance(plan, dict):
            raise ConfigError(f"{where}: configuration {chain[-1]!r} is {_shown(plan)}; expected a mapping")
        entry = {**plan, **entry}
        parent = entry.pop("inherits_from", None)
        if parent is None:
            break
        if not isinstance(parent, str) or parent not in configurations:
            raise ConfigError(f"{where}: configuration {chain[-1]!r} inherits_from {_shown(parent)}, which is not "
                              f"a configuration (has {', '.join(map(str, configurations))})")
        if parent in chain:
            raise ConfigError(f"{where}: inherits_from loops: {' -> '.join([*chain, parent])}")
        chain.append(parent)
    _check_configuration(where, entry)
    return entry


def _check_configuration(where: str, entry: dict) -> None:
    """The types and shapes of the configuration's values the import reads."""
    architecture = entry.get("architecture")
    if not isinstance(architecture, dict) or not isinstance(architecture.get("arch_kwargs"), dict):
        raise ConfigError(f"{where}: architecture is {_shown(architecture)}; expected a mapping with "
                          "network_class_name and arch_kwargs")
    kwargs = architecture["arch_kwargs"]
    stages = len(_positive_ints(where, "arch_kwargs.features_per_stage", kwargs.get("features_per_stage")))
    if "n_stages" in kwargs and kwargs["n_stages"] != stages:
        raise ConfigError(f"{where}: arch_kwargs.n_stages is {_shown(kwargs['n_stages'])}, but features_per_stage "
                          f"has {stages} stages")
    for key in ("kernel_sizes", "strides"):
        _per_stage(where, f"arch_kwargs.{key}", kwargs.get(key), stages)
    plain = str(architecture.get("network_class_name", "")).endswith("PlainConvUNet")
    blocks = "n_conv_per_stage" if plain else "n_blocks_per_stage"
    _positive_ints(where, f"arch_kwargs.{blocks}", kwargs.get(blocks), stages)
    _positive_ints(where, "arch_kwargs.n_conv_per_stage_decoder", kwargs.get("n_conv_per_stage_decoder"), stages - 1)
    _positive_ints(where, "patch_size", entry.get("patch_size"), 3)
    _positive_numbers(where, "spacing", entry.get("spacing", [1, 1, 1]), 3)
    if "median_image_size_in_voxels" in entry:
        _positive_numbers(where, "median_image_size_in_voxels", entry["median_image_size_in_voxels"], 3)
    if "batch_size" in entry:
        _positive_ints(where, "batch_size", [entry["batch_size"]], 1)
    for key, kind in (("normalization_schemes", str), ("use_mask_for_norm", bool)):
        value = entry.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
            raise ConfigError(f"{where}: {key} is {_shown(value)}; expected a list of {kind.__name__}, one per "
                              "channel")


def _axis_order(results_dir: Path, plans: dict) -> list[int]:
    """For each brats-swap axis (the file's x, y, z), the nnU-Net network axis that sees it."""
    where = f"{results_dir}/plans.json"
    reader = plans.get("image_reader_writer", "SimpleITKIO")
    if reader not in READERS:
        raise ConfigError(f"{where}: image_reader_writer {_shown(reader)} reorients the images; only "
                          f"{', '.join(READERS)} (the file's own voxel grid) can be imported")
    forward = plans.get("transpose_forward", [0, 1, 2])
    if not isinstance(forward, list) or not all(_is_int(a) for a in forward) or sorted(forward) != [0, 1, 2]:
        raise ConfigError(f"{where}: transpose_forward is {_shown(forward)}; expected an order of the axes 0, 1, 2 "
                          "such as [0, 1, 2]")
    return [forward.index(2 - axis) for axis in range(3)]


def _table_key(description: Path, dataset: dict, edition: str, challenge: str) -> str:
    """The label table: forced, else by the channel names (the 2023+ spellings: gli; else 2021)."""
    if challenge != "auto":
        return get_challenge(challenge).key
    if edition != "auto":
        return get_challenge(edition).key
    return "gli" if modern_channel_names(dataset.get("channel_names", dataset.get("modality", {}))) else "2021"


def _model_overrides(results_dir: Path, configuration: dict, dataset: dict, order: list[int]) -> list[str]:
    architecture = configuration.get("architecture", {})
    kwargs = architecture.get("arch_kwargs", {})
    class_name = str(architecture.get("network_class_name", "")).rsplit(".", 1)[-1]
    where = f"{results_dir}/plans.json"
    if class_name not in NETWORK_CLASSES:
        raise ConfigError(f"{where}: network {class_name or '?'} is not one brats-swap builds "
                          f"({', '.join(NETWORK_CLASSES)})")
    for name, expected in EXPECTED_KWARGS.items():
        if kwargs.get(name) != expected:
            raise ConfigError(f"{where}: arch_kwargs.{name} is {kwargs.get(name)!r}; brats-swap builds {expected!r}")
    kernels = kwargs["kernel_sizes"]
    if any(len(set(k)) != 1 for k in kernels):
        raise ConfigError(f"{where}: anisotropic kernel sizes {kernels}; brats-swap builds cubic kernels only")
    strides = [[int(stage[order[axis]]) for axis in range(3)] for stage in kwargs["strides"]]
    plain = class_name == "PlainConvUNet"
    name = "nnunet" if plain else _resenc_preset(results_dir.name)
    blocks = kwargs["n_conv_per_stage"] if plain else kwargs["n_blocks_per_stage"]
    return [f"model.name={name}", f"model.features={_list(kwargs['features_per_stage'])}",
            f"model.kernels={_list(k[0] for k in kernels)}", f"model.strides={json.dumps(strides)}",
            f"model.blocks={_list(blocks)}", f"model.decoder_convs={_list(kwargs['n_conv_per_stage_decoder'])}",
            "model.deep_supervision=true", f"model.in_channels={len(dataset.get('channel_names', dataset.get('modality', {})))}"]


def _inference_overrides(checkpoint: Path, order: list[int]) -> list[str]:
    """nnU-Net's inference rules (brats_swap.evaluate.nnunet_inference) with nnUNetv2_predict's defaults (step
    size 0.5, Gaussian), mirroring the axes the checkpoint allows (`inference_allowed_mirroring_axes`, nnU-Net's
    network axes, here in brats-swap's axis order; absent: all three, as nnU-Net assumes)."""
    state = _load_nnunet_checkpoint(checkpoint)
    allowed = state.get("inference_allowed_mirroring_axes", (0, 1, 2)) if isinstance(state, dict) else (0, 1, 2)
    allowed = [] if allowed is None else allowed
    if not isinstance(allowed, list | tuple) or not all(_is_int(a) and 0 <= a <= 2 for a in allowed):
        raise CheckpointError(f"{checkpoint}: inference_allowed_mirroring_axes is {_shown(allowed)}; expected "
                              "axes among 0, 1, 2")
    axes = sorted(order.index(int(a)) for a in set(allowed))
    return ["evaluate.inference=nnunet", "evaluate.sw_overlap=0.5", "evaluate.sw_blend=gaussian",
            f"evaluate.mirror_axes=[{','.join(map(str, axes))}]"]


def _resenc_preset(folder_name: str) -> str:
    plans_name = folder_name.split("__")[1] if "__" in folder_name else ""
    for size in ("XL", "L", "M"):
        if f"ResEncUNet{size}Plans" in plans_name:
            return f"resenc_{size.lower()}"
    return "resenc_m"  # the presets share one network; they differ only in patch and batch


def _outputs(description: Path, dataset: dict, key: str) -> list[str]:
    """The outputs' overrides (kind, regions or label order, loss): regions or labels as nnU-Net's
    `LabelManager` decides (regions when a label holds several values)."""
    declared = declared_labels(description, dataset.get("labels"))
    if "ignore" in declared:
        raise ConfigError(f"{description}: the model was trained with an ignore label (partial annotations), "
                          "which brats-swap's outputs and losses do not have")
    if any(len(values) > 1 for values in declared.values()):
        regions = _regions(description, dataset, key, declared)
        return ["model.outputs=regions", f"model.regions=[{','.join(regions)}]", "train.loss=dice_bce"]
    return ["model.outputs=softmax", f"model.label_order={_list(_label_order(description, key, declared))}",
            "train.loss=dice_ce"]


def _label_order(description: Path, key: str, declared: dict[str, tuple[int, ...]]) -> list[int]:
    """The table's label value of each of the model's channels after the background (`model.label_order`).
    nnU-Net's channel k is the dataset's label value k (its labels are 0..K, and its export writes the argmax
    channel as the label); each value must name exactly one label of the table, and every label of the table
    must be one, so that the channels are the table's. The channels keep nnU-Net's order (not the table's):
    the weights load as they are, and an exact tie of two channels goes to the same label as in nnU-Net."""
    spec = get_challenge(key)
    values = sorted(v for entry in declared.values() for v in entry)
    if values != list(range(len(values))) or len(values) < 2:
        raise ConfigError(f"{description}: labels {_shown(values)}; a label-trained nnU-Net model has the "
                          "consecutive values 0 (background), 1, ..., K, one per label")
    mapping = label_map_from_names(spec, declared, f"{description}: labels")
    channel_of: dict[int, int] = {}
    for value in values[1:]:
        table_value = mapping.get(value)
        if table_value is None or table_value in channel_of:
            what = "a tissue" if table_value is None else f"the same label ({spec.labels[table_value]}) as another"
            raise ConfigError(f"{description}: label value {value} names {what} of the {key} table "
                              f"({spec.describe_labels()}); each value must be one label of the table")
        channel_of[table_value] = value
    missing = [spec.labels[u] for u in spec.label_values if u not in channel_of]
    if missing:
        raise ConfigError(f"{description}: the model has no channel for {', '.join(missing)} of the {key} table "
                          f"({spec.describe_labels()}); brats-swap's softmax outputs are the whole table")
    return [mapping[value] for value in values[1:]]


def _regions(description: Path, dataset: dict, key: str, declared: dict[str, tuple[int, ...]]) -> list[str]:
    """The table groups of nnU-Net's region heads, in head order (the labels' region entries)."""
    if not dataset.get("regions_class_order"):
        raise ConfigError(f"{description}: labels hold regions (lists of values) but there is no "
                          "regions_class_order, which nnU-Net needs to train or predict them")
    spec = get_challenge(key)
    mapping = label_map_from_names(spec, declared, f"{description}: labels")
    groups = {frozenset(values): name for name, values in spec.groups.items()}
    regions = []
    for name, values in declared.items():
        if values == (0,):
            continue
        table_values = frozenset(mapping[v] for v in values)
        if table_values not in groups:
            raise ConfigError(f"{description}: region {name!r} is no evaluation group of the {key} table "
                              f"({spec.describe_groups()})")
        regions.append(groups[table_values])
    _check_class_order(description, dataset.get("regions_class_order"), regions, mapping, spec)
    return regions


def _check_class_order(description: Path, class_order: object, regions: list[str], mapping: dict, spec) -> None:
    """nnU-Net paints head k's `regions_class_order[k]` (a dataset label) where it fires, later heads over earlier
    ones; brats-swap's nnU-Net rule paints each region's own label (the one no region inside it holds). They
    agree when each head's class is its region's own label: anything else is refused, not predicted differently."""
    from brats_swap.model.targets import region_tree

    if not isinstance(class_order, list) or len(class_order) != len(regions):
        raise ConfigError(f"{description}: regions_class_order is {_shown(class_order)}; expected one label per "
                          f"region ({len(regions)})")
    tree = region_tree(spec.key, regions)
    for value, name in zip(class_order, regions, strict=True):
        if not _is_int(value) or mapping.get(value) != tree[name].own_label:
            raise ConfigError(f"{description}: regions_class_order gives region {name} the label {_shown(value)}; "
                              f"brats-swap paints its own label ({tree[name].own_label} in the {spec.key} table)")


def _data_overrides(results_dir: Path, configuration: dict, dataset: dict, key: str, order: list[int]) -> list[str]:
    where = f"{results_dir}/plans.json"
    schemes = configuration.get("normalization_schemes", [])
    if any(s != "ZScoreNormalization" for s in schemes) or not all(configuration.get("use_mask_for_norm", [])):
        raise ConfigError(f"{where}: normalization {schemes}; brats-swap's is nnU-Net's ZScoreNormalization inside "
                          "the non-zero mask (use_mask_for_norm), as nnU-Net plans for BraTS")
    description = results_dir / "dataset.json"
    modalities = channel_modalities(description, dataset.get("channel_names", dataset.get("modality", {})))
    patch = _patch(configuration, order)
    table = f"data.challenge={key}" if not get_challenge(key).legacy else f"data.edition={key}"
    return [f"data.modalities=[{','.join(modalities[i] for i in sorted(modalities))}]", "data.fit=pad_crop",
            "data.clip_percentiles=[0,100]", table, "train.mode=patch", f"train.patch={_list(patch)}",
            f"train.batch_size={int(configuration.get('batch_size', 2))}", *NNUNET_RECIPE]


def _patch(configuration: dict, order: list[int]) -> list[int]:
    """The plans' patch in brats-swap's axes."""
    return [int(configuration["patch_size"][order[axis]]) for axis in range(3)]


def _resampling_overrides(results_dir: Path, plans: dict, configuration: dict, order: list[int]) -> list[str]:
    """The plans' spacing in brats-swap's axes as `evaluate.resample_spacing` (nnU-Net resamples each case to it,
    brats_swap.evaluate.nnunet_resampling) and nnU-Net's axis order as `evaluate.nnunet_axes` (for each of its
    axes, brats-swap's), once the plans' resampling is the one reproduced there: nnU-Net's
    default functions and arguments (any other is refused, never looked up by the name the file gives), and a
    spacing that resamples the plans' own median image to 1 to MAX_AXIS voxels per axis."""
    from brats_swap.evaluate.nnunet_resampling import compute_new_shape

    where = f"{results_dir}/plans.json"
    for name, kwargs in RESAMPLING.items():
        function, given = configuration.get(name), configuration.get(f"{name}_kwargs")
        if function != RESAMPLING_FUNCTION:
            raise ConfigError(f"{where}: {name} is {_shown(function)}; brats-swap reproduces nnU-Net's "
                              f"{RESAMPLING_FUNCTION} only")
        expected = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        if not isinstance(given, dict):
            raise ConfigError(f"{where}: {name}_kwargs is {_shown(given)}; expected {expected}")
        differing = [f"{k}={_shown(given[k])}" if k in given else f"no {k}" for k in sorted(set(given) | set(kwargs))
                     if k not in given or k not in kwargs or type(given[k]) is not type(kwargs[k]) or given[k] != kwargs[k]]
        if differing:
            raise ConfigError(f"{where}: {name}_kwargs has {', '.join(differing)}; brats-swap reproduces "
                              f"{RESAMPLING_FUNCTION} with {expected} only")
    spacing = [float(s) for s in configuration.get("spacing", [1, 1, 1])]
    keys = ("original_median_shape_after_transp", "original_median_spacing_after_transp")
    if all(k in plans for k in keys):
        median, median_spacing = (_positive_numbers(where, k, plans[k], 3) for k in keys)
        try:
            compute_new_shape(median, median_spacing, spacing)
        except ValueError as exc:
            raise ConfigError(f"{where}: spacing {_shown(spacing)} resampling the plans' median image ({median} "
                              f"voxels of {median_spacing} mm) {exc}") from None
    return [f"evaluate.resample_spacing=[{','.join(repr(spacing[order[axis]]) for axis in range(3))}]",
            f"evaluate.nnunet_axes=[{','.join(str(order.index(axis)) for axis in range(3))}]"]


def _cube(configuration: dict, order: list[int], divisor: list[int], config: Config) -> str:
    """A cube that holds the plans' median image (with `CUBE_MARGIN`) and the patch, on the network's grid."""
    median = configuration.get("median_image_size_in_voxels", config.train.patch)
    edges = []
    for axis in range(3):
        need = max(float(median[order[axis]]) * CUBE_MARGIN, float(config.train.patch[axis]))
        edges.append(int(math.ceil(need / divisor[axis]) * divisor[axis]))
    return _list(edges)


def _nnunet_weights(path: Path, order: list[int]) -> dict[str, torch.Tensor]:
    """`network_weights` of an nnU-Net checkpoint, every convolution kernel permuted to brats-swap's axes."""
    checkpoint = _load_nnunet_checkpoint(path)
    weights = checkpoint.get("network_weights") if isinstance(checkpoint, dict) else None
    if not isinstance(weights, dict):
        raise CheckpointError(f"{path}: no network_weights; not an nnU-Net v2 checkpoint")
    permuted = {}
    for name, tensor in weights.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: network_weights[{_shown(name)}] is a {type(tensor).__name__}, not a "
                                  "tensor; not an nnU-Net v2 checkpoint")
        name = name.removeprefix("module.").removeprefix("_orig_mod.")
        if tensor.dim() == 5:  # (out, in, k, k, k) of Conv3d, (in, out, k, k, k) of ConvTranspose3d
            tensor = tensor.permute(0, 1, *(2 + a for a in order)).contiguous()
        permuted[name] = tensor
    return permuted


def _load_nnunet_checkpoint(path: Path) -> dict[str, Any]:
    # nnU-Net stores numpy scalars in its training log; allow just those (never arbitrary pickle).
    multiarray = (np._core if hasattr(np, "_core") else np.core).multiarray
    allowed = [np.dtype, multiarray.scalar, *{type(np.dtype(t)) for t in ("float64", "float32", "int64")}]
    try:
        # A regular file only (a FIFO would block the import, /dev/zero never end: foreign_files.open_regular).
        with torch.serialization.safe_globals(allowed), open_regular(path, str(path), CheckpointError, "file") as file:
            return torch.load(file, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:  # torch raises many types for unreadable or foreign files
        lines = str(exc).strip().splitlines()  # an empty file's error has no message at all
        raise CheckpointError(f"{path}: unreadable nnU-Net checkpoint ({lines[0][:200] if lines else type(exc).__name__})"
                              ) from exc


def _list(values) -> str:
    return "[" + ",".join(str(int(v)) for v in values) + "]"
