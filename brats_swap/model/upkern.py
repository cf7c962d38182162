"""`train.init_from` weights for a network: the checkpoint's state as it is, or with MedNeXt's UpKern.

UpKern (Roy et al., MICCAI 2023; MIC-DKFZ/MedNeXt `nnunet_mednext/run/load_weights.py: upkern_load_weights`)
starts a large-kernel MedNeXt (5³ depthwise kernels) from a trained small-kernel one (3³) of the same
configuration: every tensor of equal shape is copied, and every convolution weight whose only difference is
its kernel is resampled to the new kernel by trilinear interpolation (`F.interpolate`, align_corners off, as
the repository calls it). With align_corners off, the new kernel's centre tap and its corner taps sample the
old kernel exactly at its own centre and corners, so those values carry over unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brats_swap.errors import ConfigError


def initial_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """`state` (a checkpoint's model weights, from file `source`) fitted to `model`: unchanged where every
    shape agrees; else each 3D convolution weight that differs only in its kernel resampled trilinearly
    (UpKern). Any other difference is a one-line ConfigError naming the first tensor that does not fit."""
    own = model.state_dict()
    missing = [key for key in own if key not in state]
    extra = [key for key in state if key not in own]
    if missing or extra:
        key = (missing or extra)[0]
        where = "missing from" if missing else "not in the network, but in"
        raise ConfigError(f"train.init_from: {source}: weight {key!r} is {where} the checkpoint; it was trained "
                          "with another network (model.name and its keys must match, model.kernel_size aside)")
    fitted = {}
    for key, target in own.items():
        value = state[key]
        if value.shape == target.shape:
            fitted[key] = value
        elif value.dim() == 5 and value.shape[:2] == target.shape[:2]:
            fitted[key] = upkern(value, tuple(target.shape[2:])).to(target.dtype)
        else:
            raise ConfigError(f"train.init_from: {source}: weight {key!r} has shape {list(value.shape)}, the "
                              f"network needs {list(target.shape)}; only convolution kernels can be resampled")
    return fitted


def upkern(weight: torch.Tensor, kernel: tuple[int, int, int]) -> torch.Tensor:
    """A (out, in/groups, k, k, k) convolution weight resampled to `kernel` by trilinear interpolation."""
    return F.interpolate(weight.float(), size=kernel, mode="trilinear")
