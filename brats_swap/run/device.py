"""Device and mixed-precision resolution: one answer for training, evaluation and the planner."""

from __future__ import annotations

import contextlib

import torch

from brats_swap.errors import ConfigError

# `train.amp` -> the dtype autocast computes in; `none` trains in float32.
_AMP_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(amp: str) -> torch.dtype:
    """The dtype activations are computed (and saved for backward) in under `train.amp`.

    The planner prices saved tensors in this dtype, so it must be the one place that answers it.
    """
    try:
        return _AMP_DTYPES[amp]
    except KeyError:
        raise ConfigError(f"train.amp: {amp!r} is not one of {sorted(_AMP_DTYPES)}") from None


def autocast_context(device: torch.device, amp: str):
    """`torch.autocast` for `train.amp` (bf16 / fp16), or a no-op context when AMP is off."""
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype(amp))


def resolve_device(name: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU; an explicit CUDA device without CUDA is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name!r} requested but CUDA is not available")
    return device
