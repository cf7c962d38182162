"""The networks `model.name` builds (`build_model`: the Isensee 2017 U-Net, nnU-Net's plain and
residual-encoder U-Nets, MONAI's SegResNet and SwinUNETR) and the label <-> target conversions they train on."""

from __future__ import annotations

import importlib

# Loaded on first use (PEP 562): `brats_swap.model.targets`, the label <-> target conversions, is read by the
# torch-free predictor (`predict --runtime onnxruntime`), and importing a submodule runs this file first.
_FROM = {"build_model": "networks", "emits_logits": "networks", "ConvNormAct": "unet", "Isensee2017UNet": "unet",
         "KerasInstanceNorm": "unet", "ModelInputError": "unet", "block_modules": "unet"}

__all__ = [
    "ConvNormAct",
    "Isensee2017UNet",
    "KerasInstanceNorm",
    "ModelInputError",
    "block_modules",
    "build_model",
    "emits_logits",
]


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
