"""The networks `model.name` builds (`build_model`: the Isensee 2017 U-Net, nnU-Net's plain and
residual-encoder U-Nets, MONAI's SegResNet and SwinUNETR) and the label <-> target conversions they train on."""

from brats_swap.model.networks import build_model, emits_logits
from brats_swap.model.unet import (
    ConvNormAct,
    Isensee2017UNet,
    KerasInstanceNorm,
    ModelInputError,
    block_modules,
)

__all__ = [
    "ConvNormAct",
    "Isensee2017UNet",
    "KerasInstanceNorm",
    "ModelInputError",
    "block_modules",
    "build_model",
    "emits_logits",
]
