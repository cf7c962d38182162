"""Inference on prepared cubes: the whole cube in one pass (full models) or MONAI's sliding window (patch models).

Training validates with it and evaluation predicts with it, so it sits under both. Both paths return
sigmoid probabilities of shape (B, 3, D, H, W) as float32 on the CPU, so the caller can map them back to
the original grid without holding device memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.inferers import sliding_window_inference
from torch import nn

from brats_swap.config import Config
from brats_swap.run.device import autocast_context


@torch.no_grad()
def predict_full(model: nn.Module, images: torch.Tensor, *, device: torch.device, amp: str = "none") -> torch.Tensor:
    """Whole-cube inference: (B, C, D, H, W) -> (B, 3, D, H, W) probabilities, float32 on the CPU."""
    with autocast_context(device, amp):
        probs = model(images.to(device, non_blocking=True))
    return probs.float().cpu()


@torch.no_grad()
def predict_sliding_window(
    model: nn.Module, images: torch.Tensor, *, roi_size: Sequence[int], device: torch.device, overlap: float = 0.5,
    blend: str = "gaussian", sw_batch_size: int = 1, amp: str = "none",
) -> torch.Tensor:
    """MONAI sliding-window inference with overlap and Gaussian (or constant) blending.

    Windows run on `device`; the stitched output stays on the CPU (`sw_device` vs `device`), so a
    large volume never needs its full probability map in device memory (MONAI issue #4425).
    """
    with autocast_context(device, amp):
        probs = sliding_window_inference(
            images, roi_size=tuple(roi_size), sw_batch_size=sw_batch_size, predictor=model, overlap=overlap,
            mode=blend, sw_device=device, device=torch.device("cpu"),
        )
    return torch.as_tensor(probs).float()


def predict_cube(model: nn.Module, images: torch.Tensor, config: Config, device: torch.device) -> torch.Tensor:
    """Inference as the config's training mode implies: whole cube for `full`, sliding window for `patch`."""
    model.eval()
    if config.train.mode == "patch":
        return predict_sliding_window(
            model, images, roi_size=config.train.patch, device=device, overlap=config.evaluate.sw_overlap,
            blend=config.evaluate.sw_blend, sw_batch_size=config.evaluate.sw_batch_size, amp=config.train.amp,
        )
    return predict_full(model, images, device=device, amp=config.train.amp)
