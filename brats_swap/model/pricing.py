"""The price of a network described by someone else's file, before it is built.

A bundle's fold config or an nnU-Net plans file sizes a network: `model.base_filters: 4096` in a 7.7 MB
bundle asks for tens of gigabytes of weights. `priced_network` builds the network on PyTorch's `meta` device
(every parameter a shape without storage: no memory, whatever the size), counts its parameters and refuses a
network above `MAX_NETWORK_PARAMETERS` in one line naming the file and the number. The meta network's state
dict also says what weights it expects, so a file's weights can be compared to it (`weights_mismatch`) before
the real network is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from brats_swap.config import ModelConfig
from brats_swap.errors import DataError
from brats_swap.model.networks import build_model

# The largest networks trained for BraTS have well under 10^9 parameters (nnU-Net's ResEnc XL, MedNeXt L and
# Primus L: 10^7 to a few 10^8); 10^9 float32 parameters are 4 GB of weights before gradients and optimizer
# state. Above it, a network from a file is refused rather than built.
MAX_NETWORK_PARAMETERS = 1_000_000_000
WEIGHT_BYTES_PER_PARAMETER = 4  # float32, as networks are built and bundles store them


class NetworkTooLargeError(DataError):
    """A network described by a file has more parameters than `MAX_NETWORK_PARAMETERS` (exit 1)."""


# The factory functions modules create their parameters and buffers with. Only these go to the meta device:
# `torch.device("meta")` would move every factory, and a network that computes a setting with one (MONAI's
# SwinUNETR: `torch.linspace(...)[i].item()` for its drop-path rates) could not be built.
_PARAMETER_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
                                  torch.empty_strided})


class _ParametersOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _PARAMETER_FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def meta_network(model_cfg: ModelConfig, out_channels: int) -> nn.Module:
    """The network `build_model` would build, its parameters and buffers on the `meta` device (shapes without
    storage: nothing is allocated, whatever the size)."""
    with _ParametersOnMeta():
        return build_model(model_cfg, out_channels=out_channels)


def parameter_count(network: nn.Module) -> int:
    """Parameters of `network`, each shared tensor once."""
    return sum(p.numel() for p in {id(p): p for p in network.parameters()}.values())


def priced_network(model_cfg: ModelConfig, out_channels: int, source: str | Path) -> nn.Module:
    """The meta network of `model_cfg` when it has at most `MAX_NETWORK_PARAMETERS` parameters; else one line
    naming `source` (the file that described it), the count and the weight bytes."""
    network = meta_network(model_cfg, out_channels)
    count = parameter_count(network)
    if count > MAX_NETWORK_PARAMETERS:
        raise NetworkTooLargeError(
            f"{source}: network {model_cfg.name} has {count:,} parameters "
            f"({count * WEIGHT_BYTES_PER_PARAMETER / 2**30:.1f} GiB of float32 weights), above the "
            f"{MAX_NETWORK_PARAMETERS:,} brats-swap builds from a file; not built")
    return network


def weights_mismatch(network: nn.Module, weights: Mapping[str, object]) -> str | None:
    """Why `weights` (a state dict read from a file) cannot load into `network` (a meta network), or None:
    a non-tensor value, a missing or unexpected key, or a shape that differs. Checked before the real network
    is allocated."""
    for key, value in weights.items():
        if not isinstance(value, torch.Tensor):
            return f"{key!s} is a {type(value).__name__}, not a tensor"
    expected = network.state_dict()
    missing = [key for key in expected if key not in weights]
    if missing:
        return f"no weights for {missing[0]} ({len(missing)} missing)"
    unexpected = [key for key in weights if key not in expected]
    if unexpected:
        return f"unexpected weights {unexpected[0]} ({len(unexpected)} not in the network)"
    for key, tensor in expected.items():
        if tuple(weights[key].shape) != tuple(tensor.shape):
            return f"{key} has shape {list(weights[key].shape)}, the network's is {list(tensor.shape)}"
    return None
