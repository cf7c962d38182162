"""The registry of networks `model.name` builds: the Isensee 2017 U-Net, nnU-Net's plain and residual-encoder
U-Nets (built by dynamic-network-architectures, the package nnU-Net itself builds them with), and MONAI's
SegResNet (Auto3DSeg's deep-supervised SegResNetDS), SwinUNETR and MedNeXt (MONAI's, the MICCAI 2023 paper's
S/B/M/L).

One output contract for all: in eval mode the forward returns probabilities (B, C, D, H, W), what
validation, evaluation and prediction read: sigmoid, or softmax across the channels for `model.outputs:
softmax` (`brats_swap.model.targets.probabilities_from_logits`; the Isensee U-Net has sigmoid outputs
only). In training mode the Isensee U-Net returns the same probabilities (the paper's network ends in a
sigmoid); the others return logits, with deep supervision a list of them, full resolution first (nnU-Net's
order), for the losses of `brats_swap.train.losses` (`emits_logits` tells them apart). Module names are
the libraries' own (`encoder.stages.0`, `decoder.stages.0`, ...): the classes below subclass the library
networks rather than wrap them.

The `model.*` keys each network reads, their defaults (nnU-Net's BraTS plans) and how the stages adapt to
the cube or patch live in `brats_swap.config.networks`; the loader fills them in, so a checkpoint's config
holds the exact architecture.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from brats_swap.config import ConfigError, ModelConfig
from brats_swap.config.networks import (
    MEDNEXT_NAMES,
    MEDNEXT_VARIANTS,
    NETWORK_NAMES,
    NNUNET_NAMES,
    input_divisor,
)
from brats_swap.model.targets import probabilities_from_logits
from brats_swap.model.unet import Isensee2017UNet, ModelInputError


class SigmoidInEval:
    """Mixin over a network that returns logits (or a list of them): probabilities of the full-resolution
    output in eval mode (sigmoid, or softmax when `output_kind` is "softmax"), the raw outputs in training
    mode. Checks the input's edges first."""

    emits_logits = True
    output_kind = "labels"  # model.outputs, set by build_model
    out_channels: int
    size_divisor: list[int]

    def check_input(self, x: torch.Tensor) -> None:
        spatial = list(x.shape[2:])
        if x.dim() != 5 or any(s % d for s, d in zip(spatial, self.size_divisor, strict=True)):
            raise ModelInputError(
                f"model input {list(x.shape)}: {type(self).__name__} needs (B, C, D, H, W) with edges divisible by "
                f"{self.size_divisor}; change data.cube or train.patch")

    def forward(self, x: torch.Tensor):
        self.check_input(x)
        outputs = super().forward(x)
        if self.training:
            return outputs
        return probabilities_from_logits(outputs[0] if isinstance(outputs, list | tuple) else outputs, self.output_kind)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The full-resolution logits whatever the mode (nnU-Net's inference blends these, not probabilities)."""
        self.check_input(x)
        outputs = super().forward(x)
        return outputs[0] if isinstance(outputs, list | tuple) else outputs


class LeakyReLUOnBase(nn.LeakyReLU):
    """nnU-Net's `LeakyReLU(inplace=True)`, written into the storage under its input when that input is a
    view of all of it, as an instance norm's output is.

    `F.instance_norm` normalises a (1, B*C, ...) reshape of its input and returns a view of that result.
    An in-place operation on a view makes autograd wrap its backward in `CopySlices`, which allocates the
    base's size three more times (a zeroed base, a strided copy of the gradient and a clone of it) beside
    the gradient itself. At full resolution those buffers are the peak of nnU-Net's backward: 4.4 GiB of
    ResEnc XL's 33.5 at its plan. Applied to the base, the same elementwise operation writes the same
    values into the same storage, and its backward is a plain `LeakyReluBackward`: bitwise the same
    outputs and gradients with one gradient buffer (`model.inplace_act: view` builds nnU-Net's own way).
    """

    norm_act_follower = "act"  # forward(x) is elementwise in x alone: memory's norm_act may replay it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # A compiled graph has no views to save memory on (it is functional), and an output returned as a
            # view of a base mutated in place gets a version counter that goes back to 0 after the graph, which a
            # saved-tensor check then takes for a modification: nnU-Net's own in-place call on the view.
            return super().forward(x)
        base = x._base
        if self.inplace and base is not None and _whole_view(x, base):
            return F.leaky_relu_(base, self.negative_slope).view(x.shape)
        return super().forward(x)


def _whole_view(view: torch.Tensor, base: torch.Tensor) -> bool:
    """`view` shows every element of `base` in the same order (a reshape of a contiguous tensor)."""
    return (view.dtype == base.dtype and view.numel() == base.numel() and view.is_contiguous()
            and base.is_contiguous() and view.storage_offset() == base.storage_offset())


@functools.cache
def _with_outputs(mixin: type, base: type) -> type:
    """`base` (a library network) with the output contract `mixin`; one class per pair, so that every model
    of a network has the same type."""
    return type(f"{base.__name__}BraTS", (mixin, base), {"__module__": __name__})


def _nnunet_kwargs(cfg: ModelConfig, out_channels: int) -> dict:
    """The arguments nnU-Net v2 passes for a 3D U-Net of these plans (instance norm with affine, eps 1e-5;
    LeakyReLU 0.01 in place, on the norm's base unless `inplace_act: view`; convolution bias; no dropout)."""
    return {
        "input_channels": cfg.in_channels, "n_stages": len(cfg.features), "features_per_stage": list(cfg.features),
        "conv_op": nn.Conv3d, "kernel_sizes": [[k] * 3 for k in cfg.kernels],
        "strides": [list(s) for s in cfg.strides], "num_classes": out_channels,
        "n_conv_per_stage_decoder": list(cfg.decoder_convs), "conv_bias": True, "norm_op": nn.InstanceNorm3d,
        "norm_op_kwargs": {"eps": 1e-5, "affine": True}, "dropout_op": None, "dropout_op_kwargs": None,
        "nonlin": LeakyReLUOnBase if cfg.inplace_act == "base" else nn.LeakyReLU, "nonlin_kwargs": {"inplace": True},
        "deep_supervision": cfg.deep_supervision,
    }


class _NnUNetOutputs(SigmoidInEval):
    """nnU-Net's decoder computes its deep-supervision heads only while training (in eval the full-resolution
    head alone, as nnU-Net predicts)."""

    deep_supervision: bool

    def train(self, mode: bool = True):
        super().train(mode)
        self.decoder.deep_supervision = self.deep_supervision and mode
        return self


def _build_nnunet(cfg: ModelConfig, out_channels: int) -> nn.Module:
    # Imported here: dynamic-network-architectures is needed only by the networks it builds.
    try:
        from dynamic_network_architectures.architectures.unet import PlainConvUNet, ResidualEncoderUNet
    except ImportError as exc:
        raise ConfigError(f"model.name={cfg.name} needs dynamic-network-architectures: `make install`, or pip "
                          "install --no-deps dynamic-network-architectures==0.4.4 einops (its declared "
                          "dependencies would replace torch)") from exc

    base = PlainConvUNet if cfg.name == "nnunet" else ResidualEncoderUNet
    blocks_key = "n_conv_per_stage" if cfg.name == "nnunet" else "n_blocks_per_stage"
    network_class = _with_outputs(_NnUNetOutputs, base)
    network = network_class(**_nnunet_kwargs(cfg, out_channels), **{blocks_key: list(cfg.blocks)})
    network.apply(base.initialize)  # nnU-Net's He initialisation (and zeroed last norm per residual block)
    network.deep_supervision = cfg.deep_supervision
    if not cfg.deep_supervision:
        # The decoder builds a segmentation head per stage whatever the setting (so that nnU-Net's checkpoints
        # always load); without deep supervision only the last one runs. The others are frozen: they get no
        # gradient either way, and DDP's reducer (find_unused_parameters=False) only waits for parameters that
        # require one, so every rank's step completes (the others would stall its second step).
        for head in network.decoder.seg_layers[:-1]:
            head.requires_grad_(False)
    network.train()
    return network


def _build_segresnet(cfg: ModelConfig, out_channels: int) -> nn.Module:
    from monai.networks.nets import SegResNetDS

    network_class = _with_outputs(SigmoidInEval, SegResNetDS)
    levels = len(cfg.blocks)
    return network_class(spatial_dims=3, init_filters=cfg.features[0], in_channels=cfg.in_channels,
                         out_channels=out_channels, norm="instance", blocks_down=tuple(cfg.blocks),
                         dsdepth=max(levels - 1, 1) if cfg.deep_supervision else 1)


def _build_swinunetr(cfg: ModelConfig, out_channels: int) -> nn.Module:
    from monai.networks.nets import SwinUNETR

    network_class = _with_outputs(SigmoidInEval, SwinUNETR)
    return network_class(in_channels=cfg.in_channels, out_channels=out_channels, feature_size=cfg.features[0],
                         depths=tuple(cfg.blocks), spatial_dims=3)


class _MedNeXtOutputs(SigmoidInEval):
    """MONAI's MedNeXt computes its deep-supervision heads whenever it was built with them and returns them
    in training mode only; in eval mode they are skipped (the full-resolution head alone, as its authors
    predict)."""

    deep_supervision: bool
    # MedNeXt's nnU-Net trainer weighs all 5 outputs (1, 1/2, ..., 1/16, normalised), nnU-Net's the lowest off.
    weighs_lowest_output = True

    def train(self, mode: bool = True):
        super().train(mode)
        self.do_ds = self.deep_supervision and mode
        return self


def _build_mednext(cfg: ModelConfig, out_channels: int) -> nn.Module:
    """MONAI's MedNeXt with the arguments its `create_mednext` passes for the variant (residual blocks and
    resampling, GroupNorm with one group per channel, no GRN), at `model.features[0]` initial filters and
    `model.blocks` blocks per stage. With deep supervision it returns 5 outputs in training, full resolution
    first (1, 1/2, ..., 1/16), as the MedNeXt nnU-Net trainer takes them."""
    from monai.networks.nets import MedNeXt

    variant = MEDNEXT_VARIANTS[cfg.name]
    network_class = _with_outputs(_MedNeXtOutputs, MedNeXt)
    network = network_class(
        spatial_dims=3, init_filters=cfg.features[0], in_channels=cfg.in_channels, out_channels=out_channels,
        encoder_expansion_ratio=variant.encoder_expansion, decoder_expansion_ratio=variant.decoder_expansion,
        bottleneck_expansion_ratio=variant.bottleneck_expansion, kernel_size=cfg.kernel_size,
        deep_supervision=cfg.deep_supervision, use_residual_connection=True, blocks_down=tuple(cfg.blocks[:4]),
        blocks_bottleneck=cfg.blocks[4], blocks_up=tuple(cfg.blocks[5:]), norm_type="group",
        global_resp_norm=False)
    network.deep_supervision = cfg.deep_supervision
    network.train()
    return network


def build_model(model_cfg: ModelConfig, out_channels: int = 3) -> nn.Module:
    """The network described by the `model` config section (as the loader resolved it), freshly initialised."""
    name = model_cfg.name
    if name not in NETWORK_NAMES:
        raise ConfigError(f"model.name {name!r} is unknown (known: {', '.join(NETWORK_NAMES)})")
    if name == "isensee2017":
        return Isensee2017UNet(model_cfg, out_channels)
    if not model_cfg.features:
        raise ConfigError(f"model.features: empty for model.name={name}; load the config with load_config, "
                          "which fills in the network's plan")
    if name in NNUNET_NAMES:
        network = _build_nnunet(model_cfg, out_channels)
    elif name == "segresnet":
        network = _build_segresnet(model_cfg, out_channels)
    elif name in MEDNEXT_NAMES:
        network = _build_mednext(model_cfg, out_channels)
    else:
        network = _build_swinunetr(model_cfg, out_channels)
    network.out_channels = out_channels
    network.output_kind = model_cfg.outputs
    network.size_divisor = input_divisor(model_cfg)
    return network


def emits_logits(model: nn.Module) -> bool:
    """Whether the network's training-mode outputs are logits (else sigmoid probabilities)."""
    return bool(getattr(model, "emits_logits", False))
