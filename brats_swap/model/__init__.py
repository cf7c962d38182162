"""The Isensee 2017 3D U-Net (two faithful variants) and the label <-> target conversions it trains on."""

from brats_swap.model.unet import (
    ConvNormAct,
    Isensee2017UNet,
    KerasInstanceNorm,
    ModelInputError,
    block_modules,
    build_model,
)

__all__ = [
    "ConvNormAct",
    "Isensee2017UNet",
    "KerasInstanceNorm",
    "ModelInputError",
    "block_modules",
    "build_model",
]
