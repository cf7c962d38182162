"""An nnU-Net v2 model as a brats-swap run folder (`brats-swap import-nnunet`).

nnU-Net's results folder `Dataset<NNN>_<Name>/<Trainer>__<Plans>__<configuration>/` holds `plans.json`,
`dataset.json` and `fold_<k>/checkpoint_final.pth` (its `network_weights`). What carries over:

- the network: the plans' `architecture` (dynamic-network-architectures' `PlainConvUNet` or
  `ResidualEncoderUNet`, 3D, cubic kernels) becomes `model.name: nnunet | resenc_*` with the same stages,
  features, kernels, strides and blocks; brats-swap builds it with the same library and the same norm,
  activation and bias, so the weights load unchanged (apart from the axis order below);
- the outputs: nnU-Net's BraTS models train regions (`regions_class_order`, sigmoid heads), which are
  `model.outputs: regions` with `model.regions` the table's groups in the model's head order (label-trained,
  softmax models have a background head brats-swap's outputs lack, and are refused);
- the preprocessing: crop to the non-zero box, z-score per channel inside it without clipping
  (`ZScoreNormalization` with `use_mask_for_norm`, i.e. `data.clip_percentiles: [0, 100]`), the channel
  order of `channel_names` as `data.modalities`, 1 mm voxels kept (`data.fit: pad_crop`), patch training
  and sliding-window inference with the plans' patch size (`train.mode: patch`);
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
from brats_swap.data.layouts import channel_modalities, declared_labels, modern_channel_names
from brats_swap.errors import CheckpointError, ConfigError
from brats_swap.run.checkpoint import save_checkpoint
from brats_swap.run.folder import RunFolder

NETWORK_CLASSES = {"PlainConvUNet": "nnunet", "ResidualEncoderUNet": "resenc"}
READERS = ("SimpleITKIO", "NibabelIO")  # both hand nnU-Net the file's voxels as (z, y, x)
# What brats-swap's nnU-Net builder passes (brats_swap.model.networks): an architecture asking for
# anything else is refused rather than built differently.
EXPECTED_KWARGS = {"conv_op": "torch.nn.modules.conv.Conv3d", "conv_bias": True,
                   "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
                   "norm_op_kwargs": {"eps": 1e-05, "affine": True}, "dropout_op": None,
                   "nonlin": "torch.nn.LeakyReLU"}
# nnU-Net's training recipe (nnUNetTrainer), which fine-tuning continues with (configs/resenc_l.yaml has it too).
NNUNET_RECIPE = ("train.optimizer=sgd", "train.lr=0.01", "train.momentum=0.99", "train.weight_decay=3e-5",
                 "train.schedule=poly", "train.poly_exponent=0.9", "train.loss=dice_bce", "train.grad_clip=12",
                 "train.patch_foreground=0.33")
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
    plans, dataset = (_read_json(results_dir / name) for name in ("plans.json", "dataset.json"))
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
    overrides = [*_model_overrides(results_dir, configuration, dataset, key, order),
                 *_data_overrides(results_dir, configuration, dataset, key, order, notes)]
    first = load_config(None, [*overrides, f"name={run.root.name}"])
    # Fine-tuning (train --run OUT --fold k) starts from the imported weights of the fold.
    config = load_config(None, [*overrides, f"name={run.root.name}", f"train.init_from={run.fold(folds[0]).imported}",
                                f"data.cube={_cube(configuration, order, input_divisor(first.model), first)}"])
    for fold in folds:
        weights = _nnunet_weights(results_dir / f"fold_{fold}" / checkpoint_name, order)
        state = {"model": weights, "config": config_to_dict(config), "edition": key, "fold": fold, "epoch": 0,
                 "architecture": architecture_record(config.model),
                 "imported_from": str(results_dir / f"fold_{fold}" / checkpoint_name)}
        folder = run.fold(fold)
        folder.root.mkdir(parents=True, exist_ok=True)
        save_checkpoint(state, folder.best)
        save_checkpoint(state, folder.imported)
    atomic_write_text(run.config, config_to_yaml(config))
    return NnUNetImport(run, config, folds, notes)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc


def _configuration(results_dir: Path, plans: dict) -> dict:
    """The plans' entry of the folder's configuration (`Trainer__Plans__3d_fullres`), parents merged in."""
    parts = results_dir.name.split("__")
    if len(parts) != 3:
        raise ConfigError(f"{results_dir}: expected a folder named <Trainer>__<Plans>__<configuration>")
    name, configurations = parts[2], plans.get("configurations", {})
    if name not in configurations:
        raise ConfigError(f"{results_dir}/plans.json: no configuration {name!r} (has {', '.join(configurations)})")
    entry = dict(configurations[name])
    while "inherits_from" in entry:
        parent = configurations[entry.pop("inherits_from")]
        entry = {**parent, **entry}
    return entry


def _axis_order(results_dir: Path, plans: dict) -> list[int]:
    """For each brats-swap axis (the file's x, y, z), the nnU-Net network axis that sees it."""
    reader = plans.get("image_reader_writer", "SimpleITKIO")
    if reader not in READERS:
        raise ConfigError(f"{results_dir}/plans.json: image_reader_writer {reader} reorients the images; only "
                          f"{', '.join(READERS)} (the file's own voxel grid) can be imported")
    forward = [int(a) for a in plans.get("transpose_forward", [0, 1, 2])]
    return [forward.index(2 - axis) for axis in range(3)]


def _table_key(description: Path, dataset: dict, edition: str, challenge: str) -> str:
    """The label table: forced, else by the channel names (the 2023+ spellings: gli; else 2021)."""
    if challenge != "auto":
        return get_challenge(challenge).key
    if edition != "auto":
        return get_challenge(edition).key
    return "gli" if modern_channel_names(dataset.get("channel_names", dataset.get("modality", {}))) else "2021"


def _model_overrides(results_dir: Path, configuration: dict, dataset: dict, key: str, order: list[int]) -> list[str]:
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
    regions = _regions(results_dir / "dataset.json", dataset, key)
    return [f"model.name={name}", f"model.features={_list(kwargs['features_per_stage'])}",
            f"model.kernels={_list(k[0] for k in kernels)}", f"model.strides={json.dumps(strides)}",
            f"model.blocks={_list(blocks)}", f"model.decoder_convs={_list(kwargs['n_conv_per_stage_decoder'])}",
            "model.deep_supervision=true", "model.outputs=regions", f"model.regions=[{','.join(regions)}]",
            f"model.in_channels={len(dataset.get('channel_names', dataset.get('modality', {})))}"]


def _resenc_preset(folder_name: str) -> str:
    plans_name = folder_name.split("__")[1] if "__" in folder_name else ""
    for size in ("XL", "L", "M"):
        if f"ResEncUNet{size}Plans" in plans_name:
            return f"resenc_{size.lower()}"
    return "resenc_m"  # the presets share one network; they differ only in patch and batch


def _regions(description: Path, dataset: dict, key: str) -> list[str]:
    """The table groups of nnU-Net's region heads, in head order (the labels' region entries)."""
    if not dataset.get("regions_class_order"):
        raise ConfigError(f"{description}: the model was trained on labels (softmax with a background head); "
                          "brats-swap imports region-trained nnU-Net models (regions_class_order) only")
    spec = get_challenge(key)
    declared = declared_labels(description, dataset.get("labels"))
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
    return regions


def _data_overrides(results_dir: Path, configuration: dict, dataset: dict, key: str, order: list[int],
                    notes: list[str]) -> list[str]:
    where = f"{results_dir}/plans.json"
    schemes = configuration.get("normalization_schemes", [])
    if any(s != "ZScoreNormalization" for s in schemes) or not all(configuration.get("use_mask_for_norm", [])):
        raise ConfigError(f"{where}: normalization {schemes}; brats-swap's is nnU-Net's ZScoreNormalization inside "
                          "the non-zero mask (use_mask_for_norm), as nnU-Net plans for BraTS")
    spacing = [float(s) for s in configuration.get("spacing", [1, 1, 1])]
    if any(abs(s - 1.0) > 1e-3 for s in spacing):
        notes.append(f"the plans resample to {spacing} mm; brats-swap keeps the data's voxels (BraTS: 1 mm)")
    description = results_dir / "dataset.json"
    modalities = channel_modalities(description, dataset.get("channel_names", dataset.get("modality", {})))
    patch = [int(configuration["patch_size"][order[axis]]) for axis in range(3)]
    table = f"data.challenge={key}" if not get_challenge(key).legacy else f"data.edition={key}"
    return [f"data.modalities=[{','.join(modalities[i] for i in sorted(modalities))}]", "data.fit=pad_crop",
            "data.clip_percentiles=[0,100]", table, "train.mode=patch", f"train.patch={_list(patch)}",
            f"train.batch_size={int(configuration.get('batch_size', 2))}", *NNUNET_RECIPE]


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
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for unreadable or foreign files
        raise CheckpointError(f"{path}: unreadable nnU-Net checkpoint ({str(exc).splitlines()[0][:200]})") from exc


def _list(values) -> str:
    return "[" + ",".join(str(int(v)) for v in values) + "]"
