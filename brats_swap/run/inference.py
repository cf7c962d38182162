"""Inference on prepared cubes with a torch network: the whole cube in one pass (full models) or the sliding
window (patch models), optionally with test-time mirroring, and the average of several models (a fold ensemble).

Training validates with it and evaluation predicts with it, so it sits under both. The rules themselves (MONAI's
sliding window, the 8 mirrorings summed in float64, the fold mean) are `run/array_inference.py`'s, on numpy
arrays, shared with the torch-free onnxruntime predictor; this module runs them with a torch network on its
device (`torch_network`). Every path returns probabilities of shape (B, C, D, H, W) (C = the model's output
channels) as float32 on the CPU, so the caller can map them back to the original grid without holding device
memory.

Test-time augmentation (`tta=True`) is nnU-Net's mirroring: the network sees the cube under each of the
8 subsets of the 3 spatial flips (none, D, H, W, DH, DW, HW, DHW), each output is flipped back, and the 8
probability maps are averaged (`array_inference.mirrored`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from brats_swap.config import Config
from brats_swap.run import array_inference
from brats_swap.run.array_inference import MIRROR_AXES, mirror_subsets
from brats_swap.run.device import autocast_context

__all__ = ["MIRROR_AXES", "mirror_subsets", "predict_cube", "predict_ensemble", "predict_full", "predict_mirrored",
           "predict_sliding_window", "torch_network"]


@torch.no_grad()
def predict_full(model: nn.Module, images: torch.Tensor, *, device: torch.device, amp: str = "none") -> torch.Tensor:
    """Whole-cube inference: (B, C_in, D, H, W) -> (B, C, D, H, W) probabilities, float32 on the CPU. Images
    of another dtype (the cache's float16) are converted to float32 after the copy to the device: half the
    bytes on the link, and no float32 copy on the host."""
    with autocast_context(device, amp):
        probs = model(images.to(device, non_blocking=True).float())
    return probs.float().cpu()


def torch_network(model: nn.Module, device: torch.device, amp: str = "none") -> array_inference.ArrayNetwork:
    """`model` as the array rules call a network: a numpy batch to float32 numpy probabilities, run on `device`
    under the run's AMP (`predict_full`)."""
    model.eval()

    def predict(batch: np.ndarray) -> np.ndarray:
        return predict_full(model, torch.from_numpy(batch), device=device, amp=amp).numpy()

    return predict


def predict_sliding_window(
    model: nn.Module, images: torch.Tensor, *, roi_size: Sequence[int], device: torch.device, overlap: float = 0.5,
    blend: str = "gaussian", sw_batch_size: int = 1, amp: str = "none",
) -> torch.Tensor:
    """MONAI's sliding window with overlap and Gaussian (or constant) blending (`array_inference.sliding_window`):
    windows run on `device`, the stitched output stays on the CPU, so a large volume never needs its full
    probability map in device memory."""
    probs = array_inference.sliding_window(torch_network(model, device, amp), images.float().numpy(), roi_size,
                                           overlap=overlap, blend=blend, batch_size=sw_batch_size)
    return torch.from_numpy(probs)


def predict_mirrored(predict: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                     axes: Sequence[int] = MIRROR_AXES) -> torch.Tensor:
    """The mean of `flip_S(predict(flip_S(images)))` over every subset S of `axes` (`array_inference.mirrored`).

    `predict` maps a (B, C_in, D, H, W) batch to CPU probabilities of the same spatial shape.
    """
    def on_arrays(batch: np.ndarray) -> np.ndarray:
        return predict(torch.from_numpy(batch)).numpy()

    return torch.from_numpy(array_inference.mirrored(on_arrays, images.numpy(), axes))


def predict_cube(model: nn.Module, images: torch.Tensor, config: Config, device: torch.device, *,
                 tta: bool = False) -> torch.Tensor:
    """Inference as the config's training mode implies: whole cube for `full`, sliding window for `patch`;
    with `tta`, averaged over the mirrorings of `evaluate.mirror_axes` (8 for all three)."""
    network = torch_network(model, device, config.train.amp)
    return torch.from_numpy(array_inference.probabilities(network, images.numpy(), config, tta=tta))


def predict_ensemble(members: Sequence[tuple[nn.Module, Config]], images: torch.Tensor, device: torch.device, *,
                     tta: bool = False) -> torch.Tensor:
    """The mean probabilities of several models (e.g. the folds of a cross-validation), each predicting as
    its own config says (`predict_cube`); summed in float64 like the mirrorings."""
    if not members:
        raise ValueError("predict_ensemble: no model to predict with")
    networks = [(torch_network(model, device, config.train.amp), config) for model, config in members]
    return torch.from_numpy(array_inference.ensemble(networks, images.numpy(), tta=tta))
