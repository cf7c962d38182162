"""The networks `model.name` names, as data: which `model.*` keys each one reads, its defaults, and how its
topology adapts to the training input (the cube, or the patch in `train.mode: patch`).

The nnU-Net networks default to what nnU-Net v2's own planners (2.8.1) plan on BraTS 2021 geometry (median
crop 140x171x136 at 1 mm, 4 channels): 6 stages of 32-64-128-256-320-320 features, 3³ kernels, stride 2 from
the second stage on, 2 convolutions per encoder and decoder stage for the plain U-Net, residual blocks
1-3-4-6-6-6 and 1 decoder convolution per stage for the residual-encoder presets. M, L and XL are the same
network (nnU-Net's presets differ in patch and batch size, hence GPU memory: `NNUNET_PRESETS`). SegResNet
takes Auto3DSeg's BraTS setting, SwinUNETR MONAI's BraTS tutorial one. MedNeXt S/B/M/L are MONAI's
`create_mednext` variants (the MICCAI 2023 paper's: 32 initial filters, 4 halvings, the expansion ratios and
blocks per stage of `MEDNEXT_VARIANTS`), with the depthwise kernel `model.kernel_size` (3 or 5, the paper's).

As nnU-Net's planner does, an axis is halved only while it has at least 8 voxels (no stage below 4 voxels)
and stages that no axis can pool any more are dropped, so phantom cubes (32³-48³) train the same family
of network with fewer stages. Keys set in the config are taken as given; only unset ones are derived.
"""

from __future__ import annotations

from dataclasses import dataclass

# Keys every network reads.
COMMON_MODEL_KEYS = ("name", "in_channels", "outputs", "regions")
ISENSEE_KEYS = ("base_filters", "depth", "dropout", "segmentation_levels", "leaky_slope", "seg_layer", "norm_eps")
NNUNET_KEYS = ("features", "kernels", "strides", "blocks", "decoder_convs", "deep_supervision", "inplace_act")
NNUNET_NAMES = ("nnunet", "resenc_m", "resenc_l", "resenc_xl")
MEDNEXT_NAMES = ("mednext_s", "mednext_b", "mednext_m", "mednext_l")
MEDNEXT_KEYS = ("features", "blocks", "kernel_size", "deep_supervision")
NETWORK_NAMES = ("isensee2017", *NNUNET_NAMES, "segresnet", "swinunetr", *MEDNEXT_NAMES)

MODEL_KEYS: dict[str, tuple[str, ...]] = {
    "isensee2017": ISENSEE_KEYS,
    **{name: NNUNET_KEYS for name in NNUNET_NAMES},
    "segresnet": ("features", "blocks", "deep_supervision"),
    "swinunetr": ("features", "blocks"),
    **{name: MEDNEXT_KEYS for name in MEDNEXT_NAMES},
}


@dataclass(frozen=True)
class MedNeXtVariant:
    """One of the paper's MedNeXt sizes as MONAI 1.6.1's `create_mednext` builds it: expansion ratios of the
    4 encoder stages, the bottleneck and the 4 decoder stages, and blocks in those 9 stages (the default of
    `model.blocks`)."""

    encoder_expansion: tuple[int, ...]
    bottleneck_expansion: int
    decoder_expansion: tuple[int, ...]
    blocks: tuple[int, ...]


MEDNEXT_VARIANTS: dict[str, MedNeXtVariant] = {
    "mednext_s": MedNeXtVariant((2, 2, 2, 2), 2, (2, 2, 2, 2), (2,) * 9),
    "mednext_b": MedNeXtVariant((2, 3, 4, 4), 4, (4, 4, 3, 2), (2,) * 9),
    "mednext_m": MedNeXtVariant((2, 3, 4, 4), 4, (4, 4, 3, 2), (3, 4, 4, 4, 4, 4, 4, 4, 3)),
    "mednext_l": MedNeXtVariant((3, 4, 8, 8), 8, (8, 8, 4, 3), (3, 4, 8, 8, 8, 8, 8, 4, 3)),
}
# MedNeXt halves every edge 4 times (stride-2 down blocks): its input edges divide by 16.
MEDNEXT_DIVISOR = 16
MEDNEXT_KERNELS = (3, 5)  # the depthwise kernel edges the paper trains (5 through UpKern from a 3)

_NNUNET_PLAN = {"features": [32, 64, 128, 256, 320, 320], "kernels": [3] * 6,
                "strides": [[1, 1, 1]] + [[2, 2, 2]] * 5}
# Unset keys of each network; lists are per stage (strides per stage and axis).
NETWORK_DEFAULTS: dict[str, dict] = {
    "nnunet": {**_NNUNET_PLAN, "blocks": [2] * 6, "decoder_convs": [2] * 5},
    **{name: {**_NNUNET_PLAN, "blocks": [1, 3, 4, 6, 6, 6], "decoder_convs": [1] * 5}
       for name in ("resenc_m", "resenc_l", "resenc_xl")},
    # Auto3DSeg's SegResNetDS for BraTS: 32 initial filters doubling per level, 1-2-2-4-4 blocks.
    "segresnet": {"features": [32, 64, 128, 256, 512], "blocks": [1, 2, 2, 4, 4]},
    # MONAI's SwinUNETR BraTS tutorial: feature size 48 (its stages carry 48, 96, 192, 384, 768 channels), and
    # MONAI's 2 transformer blocks in each of its 4 stages.
    "swinunetr": {"features": [48], "blocks": [2, 2, 2, 2]},
    # MedNeXt: 32 initial filters (doubling per stage), the variant's blocks per stage.
    **{name: {"features": [32], "blocks": list(variant.blocks)} for name, variant in MEDNEXT_VARIANTS.items()},
}


@dataclass(frozen=True)
class NnUNetPreset:
    """What nnU-Net plans for a preset on BraTS 2021 and what it reports (resenc_presets.md, arXiv 2404.09556):
    the patch and batch size, and the GPU memory nvidia-smi showed while training with AMP."""

    patch: tuple[int, int, int]
    batch_size: int
    published_vram_gb: float
    published_dice: float


NNUNET_PRESETS: dict[str, NnUNetPreset] = {
    "nnunet": NnUNetPreset((128, 160, 112), 2, 7.7, 91.24),
    "resenc_m": NnUNetPreset((128, 160, 112), 2, 9.1, 91.26),
    "resenc_l": NnUNetPreset((160, 192, 160), 3, 22.7, 91.13),
    "resenc_xl": NnUNetPreset((160, 192, 160), 5, 36.6, 91.18),
}

# nnU-Net's planner: an axis is pooled while it holds at least this many voxels (4 after pooling).
MIN_POOLED_EDGE = 8
# SwinUNETR embeds 2³ patches and merges them 4 times: every edge must divide by 2^5.
SWIN_DIVISOR = 32


def architecture_record(model) -> dict:
    """What a checkpoint records of its network (a ModelConfig's keys that shape it; dropout does not, nor
    does `inplace_act`, which changes where an activation writes, not what it computes)."""
    keys = COMMON_MODEL_KEYS + tuple(key for key in MODEL_KEYS[model.name] if key not in ("dropout", "inplace_act"))
    return {key: getattr(model, key) for key in keys}


def adapted_strides(strides: list[list[int]], size: list[int]) -> list[list[int]]:
    """`strides` (per stage and axis) with every pooling that would take an axis below 4 voxels (or split an
    odd edge) set to 1, and the stages that pool no axis after the last pooling one dropped."""
    current = list(size)
    adapted = []
    for stage in strides:
        kept = []
        for axis, stride in enumerate(stage):
            pool = stride > 1 and current[axis] >= MIN_POOLED_EDGE and current[axis] % stride == 0
            kept.append(stride if pool else 1)
            current[axis] //= kept[-1]
        adapted.append(kept)
    while len(adapted) > 1 and all(s == 1 for s in adapted[-1]):
        adapted.pop()
    return adapted


def segresnet_levels(levels: int, size: list[int]) -> int:
    """The levels SegResNet keeps at `size`: each level halves every axis, none below 4 voxels."""
    kept = 1
    while kept < levels and all(s % 2 ** kept == 0 and s // 2 ** (kept - 1) >= MIN_POOLED_EDGE for s in size):
        kept += 1
    return kept


def derived_model_keys(name: str, unset: set[str], size: list[int], stages: int | None = None) -> dict:
    """Values of the keys of network `name` that the config leaves unset (`unset`), at input `size`.

    `stages`: the number of stages (levels) the config's own `model.features` asks for; at most what the rule
    allows at `size` (more fails the config check), by default all of those.
    """
    defaults = NETWORK_DEFAULTS.get(name)
    if defaults is None:
        return {}
    if name in NNUNET_NAMES:
        strides = adapted_strides(defaults["strides"], size)
        count = min(stages or len(strides), len(strides))
        derived = {"features": defaults["features"][:count], "kernels": defaults["kernels"][:count],
                   "strides": strides[:count], "blocks": defaults["blocks"][:count],
                   "decoder_convs": defaults["decoder_convs"][:count - 1]}
    elif name == "segresnet":
        levels = segresnet_levels(len(defaults["blocks"]), size)
        count = min(stages or levels, levels)
        derived = {"features": defaults["features"][:count], "blocks": defaults["blocks"][:count]}
    else:
        derived = dict(defaults)
    return {key: value for key, value in derived.items() if key in unset}


def foreign_model_keys(name: str, set_keys: set[str]) -> list[str]:
    """The `model.*` keys among `set_keys` that network `name` does not read, in schema order."""
    own = set(COMMON_MODEL_KEYS) | set(MODEL_KEYS[name])
    every = COMMON_MODEL_KEYS + ISENSEE_KEYS + NNUNET_KEYS + ("kernel_size",)
    return [key for key in every if key in set_keys and key not in own]


def input_divisor(model) -> list[int]:
    """Per axis, what the network's input edges (data.cube, or train.patch in patch mode) must divide by."""
    if model.name == "isensee2017":
        return [2 ** (model.depth - 1)] * 3
    if model.name in NNUNET_NAMES:
        divisor = [1, 1, 1]
        for stage in model.strides:
            divisor = [d * s for d, s in zip(divisor, stage, strict=True)]
        return divisor
    if model.name == "segresnet":
        return [2 ** (len(model.blocks) - 1)] * 3
    if model.name in MEDNEXT_NAMES:
        return [MEDNEXT_DIVISOR] * 3
    return [SWIN_DIVISOR] * 3


def input_size_problem(model, size: list[int]) -> str | None:
    """Why the network of `model` cannot take input edges `size`, or None."""
    divisor = input_divisor(model)
    if any(s % d for s, d in zip(size, divisor, strict=True)):
        edges = str(divisor[0]) if len(set(divisor)) == 1 else "x".join(map(str, divisor))
        why = "2^(model.depth-1)" if model.name == "isensee2017" else f"the strides of {model.name}"
        return f"each size must be divisible by {edges} ({why}), got {list(size)}"
    if model.name in MEDNEXT_NAMES and all(s == MEDNEXT_DIVISOR for s in size):
        # A one-voxel bottleneck: GroupNorm (one group per channel) has one value per group at batch 1.
        return f"MedNeXt needs an edge of at least {2 * MEDNEXT_DIVISOR} (a bottleneck of more than one voxel), got {list(size)}"
    if model.name == "swinunetr" and all(s == SWIN_DIVISOR for s in size):
        # Its bottleneck (edges / 32) would be one voxel, where instance norm cannot train.
        return f"SwinUNETR needs an edge of at least {2 * SWIN_DIVISOR} (a bottleneck of more than one voxel), got {list(size)}"
    return None


def check_network_keys(model, require) -> None:
    """The network keys of `model` (a ModelConfig) agree with each other; `require(ok, key, message)`."""
    if model.name in NNUNET_NAMES:
        stages = len(model.features)
        require(stages >= 2, "model.features", f"needs at least 2 stages, got {model.features}")
        for key in ("kernels", "strides", "blocks"):
            require(len(getattr(model, key)) == stages, f"model.{key}",
                    f"needs one entry per stage ({stages}, as model.features), got {getattr(model, key)}")
        require(len(model.decoder_convs) == stages - 1, "model.decoder_convs",
                f"needs one entry per decoder stage ({stages - 1}), got {model.decoder_convs}")
        require(all(len(s) == 3 and all(v >= 1 for v in s) for s in model.strides), "model.strides",
                f"expected [d, h, w] positive strides per stage, got {model.strides}")
        require(all(k % 2 == 1 for k in model.kernels), "model.kernels", f"expected odd edges, got {model.kernels}")
    if model.name == "segresnet":
        require(len(model.blocks) >= 1 and len(model.features) == len(model.blocks), "model.features",
                f"needs one entry per level ({len(model.blocks)}, as model.blocks), got {model.features}")
        require(all(f == model.features[0] * 2 ** i for i, f in enumerate(model.features)), "model.features",
                f"SegResNet doubles its features per level, got {model.features}")
    if model.name == "swinunetr":
        require(len(model.features) == 1 and model.features[0] % 12 == 0, "model.features",
                f"SwinUNETR takes one feature size divisible by 12, got {model.features}")
        require(len(model.blocks) == 4, "model.blocks",
                f"SwinUNETR has 4 transformer stages (blocks per stage), got {model.blocks}")
    if model.name in MEDNEXT_NAMES:
        require(len(model.features) == 1, "model.features",
                f"MedNeXt takes one initial filter count (doubled per stage), got {model.features}")
        require(len(model.blocks) == 9, "model.blocks",
                f"MedNeXt has 9 stages (4 encoder, bottleneck, 4 decoder): one block count each, got {model.blocks}")
        require(model.kernel_size in MEDNEXT_KERNELS, "model.kernel_size",
                f"MedNeXt's depthwise kernel is 3 or 5 (the paper's), got {model.kernel_size}")
    if model.name != "isensee2017":
        values = [*model.features, *model.kernels, *model.blocks, *model.decoder_convs]
        require(all(v >= 1 for v in values), "model", "features, kernels, blocks and decoder_convs must be positive")
