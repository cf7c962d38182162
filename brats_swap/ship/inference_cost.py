"""What segmenting one case with a bundle costs, priced from its configs before any case is read.

A bundle's networks are priced before they are built (`model/pricing.py`); what they are run on is priced
here: a bundle of a few kilobytes may set `data.cube: [1024, 1024, 1024]` (a 4-channel float32 input of
16 GiB, its probabilities more), or a patch of 8³ with `evaluate.sw_overlap: 0.999` (about 185,000 windows per
pass, times 8 mirrors, times the folds), and neither would fail before it had taken the machine or the
challenge's time.

- Memory: per case, the input cube (and its mirrored copy), each pass's probabilities and MONAI's stitching
  buffers, the float64 sums of the mirrors and of the folds, and the window batch, counted in bytes on the host
  (where the cube and the stitched outputs live, `run/inference.py`), against the host's available memory. The
  networks' own activations are not counted here (a whole-cube network's are the planner's business).
- Time: the network calls of one case (windows per pass x mirrors x folds) against MAX_NETWORK_CALLS_PER_CASE:
  a call takes milliseconds on a GPU for a small window and more for a large one, so the bound holds any
  sensible recipe (nnU-Net's 128³ patch on a 192³ cube with half-window overlap: 8 windows, 320 calls with TTA
  and 5 folds) and refuses one that could not finish a case in hours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from brats_swap.config.host import available_host_bytes
from brats_swap.errors import ConfigError

MAX_NETWORK_CALLS_PER_CASE = 100_000
MIRRORS = 8  # test-time augmentation: every subset of the three spatial flips
_FLOAT32, _FLOAT64 = 4, 8


@dataclass(frozen=True)
class CaseCost:
    host_bytes: int
    network_calls: int


def windows_per_pass(size: Sequence[int], patch: Sequence[int], overlap: float) -> int:
    """The windows MONAI's `sliding_window_inference` slides over `size` (its scan rule: a step of
    int(patch x (1 - overlap)), at least 1; one window along an axis the patch covers)."""
    count = 1
    for extent, window in zip(size, patch, strict=True):
        step = max(int(window * (1 - overlap)), 1)
        count *= math.ceil((extent - window) / step) + 1 if extent > window else 1
    return count


def case_cost(cube: Sequence[int], channels: int, members: Sequence[tuple[object, object]],
              tta: bool) -> CaseCost:
    """The host bytes and network calls of one case on `cube`, `channels` input channels, for the folds'
    `(model, config)` members (each predicting as its own config says)."""
    voxels = math.prod(cube)
    mirrors = MIRRORS if tta else 1
    host = channels * voxels * _FLOAT32 * (2 if tta else 1)  # the cube, and its flipped copy
    calls, widest, widest_pass = 0, 0, 0
    for model, config in members:
        outputs = _output_channels(model)
        widest = max(widest, outputs)
        pass_bytes = outputs * voxels * _FLOAT32 * 2  # a pass's probabilities, flipped back
        if config.train.mode == "patch":
            patch = config.train.patch
            windows = windows_per_pass(cube, patch, config.evaluate.sw_overlap)
            pass_bytes += voxels * _FLOAT32  # MONAI's count map
            window_batch = config.evaluate.sw_batch_size * (channels + outputs) * math.prod(patch) * _FLOAT32 * 2
        else:
            windows, window_batch = 1, 0
        calls += windows * mirrors
        widest_pass = max(widest_pass, pass_bytes + window_batch)  # the folds run one after another
    host += widest_pass + widest * voxels * _FLOAT64 * 3  # and a pass in float64, the mirrors' and folds' sums
    return CaseCost(host, calls)


def check_case_cost(predictor, tta: bool, where: str, available: int | None = None) -> CaseCost:
    """ConfigError (exit 2, one line naming `where`) when one case of `predictor` (`evaluate.predicting.Predictor`)
    needs more host memory than is available or more than MAX_NETWORK_CALLS_PER_CASE network calls."""
    data = predictor.config.data
    cost = case_cost(data.cube, len(data.modalities), predictor.members, tta)
    settings = _settings(predictor, tta)
    if cost.network_calls > MAX_NETWORK_CALLS_PER_CASE:
        raise ConfigError(f"{where}: {settings} make {cost.network_calls:,} network calls per case, more than the "
                          f"{MAX_NETWORK_CALLS_PER_CASE:,} one case may take; refused before any case is read")
    available = available_host_bytes() if available is None else available
    if available is not None and cost.host_bytes > available:
        raise ConfigError(f"{where}: {settings} need {cost.host_bytes / 2**30:.3g} GiB of host memory per case, "
                          f"{available / 2**30:.3g} GiB is available; refused before any case is read")
    return cost


def _settings(predictor, tta: bool) -> str:
    parts = [f"data.cube {list(predictor.config.data.cube)}"]
    for _, config in predictor.members[:1]:
        if config.train.mode == "patch":
            parts.append(f"train.patch {list(config.train.patch)}, evaluate.sw_overlap {config.evaluate.sw_overlap}, "
                         f"evaluate.sw_batch_size {config.evaluate.sw_batch_size}")
    parts.append(f"{len(predictor.members)} fold(s){', 8-mirror TTA' if tta else ''}")
    return ", ".join(parts)


def _output_channels(model) -> int:
    """The output channels of a network: an onnxruntime network's (`ship/onnx_runtime.py`), else its last 3D
    convolution's (every torch network here ends in one)."""
    if not hasattr(model, "modules"):  # not a torch module: torch is not imported (predicting without it)
        return int(model.out_channels)
    import torch

    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv3d)]
    return convolutions[-1].out_channels if convolutions else 4


__all__ = ["MAX_NETWORK_CALLS_PER_CASE", "CaseCost", "case_cost", "check_case_cost", "windows_per_pass"]
