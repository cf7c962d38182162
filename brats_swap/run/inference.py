"""Inference on prepared cubes: the whole cube in one pass (full models) or MONAI's sliding window (patch models),
optionally with test-time mirroring, and the average of several models (a fold ensemble).

Training validates with it and evaluation predicts with it, so it sits under both. Every path returns
sigmoid probabilities of shape (B, C, D, H, W) (C = the model's output channels) as float32 on the CPU,
so the caller can map them back to the original grid without holding device memory.

Test-time augmentation (`tta=True`) is nnU-Net's mirroring: the network sees the cube under each of the
8 subsets of the 3 spatial flips (none, D, H, W, DH, DW, HW, DHW), each output is flipped back, and the 8
probability maps are averaged. The average is flip-equivariant by construction: mirroring the input only
permutes which subset produces which (identical) term. The terms are summed in float64, so the sum does not
depend on their order in practice, and rounded to float32 once at the end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from brats_swap.config import Config
from brats_swap.run.device import autocast_context


@torch.no_grad()
def predict_full(model: nn.Module, images: torch.Tensor, *, device: torch.device, amp: str = "none") -> torch.Tensor:
    """Whole-cube inference: (B, C_in, D, H, W) -> (B, C, D, H, W) probabilities, float32 on the CPU. Images
    of another dtype (the cache's float16) are converted to float32 after the copy to the device: half the
    bytes on the link, and no float32 copy on the host."""
    with autocast_context(device, amp):
        probs = model(images.to(device, non_blocking=True).float())
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
    # Imported here, as the other MONAI imports of the package: `import monai` takes seconds, and most
    # processes that import this module (whole-cube validation, planning) never slide a window.
    from monai.inferers import sliding_window_inference

    with autocast_context(device, amp):
        probs = sliding_window_inference(
            images.float(),  # MONAI stitches in the input's dtype: float32, never the cache's float16
            roi_size=tuple(roi_size), sw_batch_size=sw_batch_size, predictor=model, overlap=overlap,
            mode=blend, sw_device=device, device=torch.device("cpu"),
        )
    return torch.as_tensor(probs).float()


# The spatial axes of a (B, C, D, H, W) batch, mirrored by test-time augmentation.
MIRROR_AXES: tuple[int, ...] = (2, 3, 4)


def mirror_subsets(axes: Sequence[int] = MIRROR_AXES) -> list[tuple[int, ...]]:
    """Every subset of `axes`, the empty one first: 8 for the 3 spatial axes."""
    return [subset for size in range(len(axes) + 1) for subset in itertools.combinations(tuple(axes), size)]


def _flip(tensor: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    return tensor.flip(axes) if axes else tensor


@torch.no_grad()
def predict_mirrored(predict: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                     axes: Sequence[int] = MIRROR_AXES) -> torch.Tensor:
    """The mean of `flip_S(predict(flip_S(images)))` over every subset S of `axes` (see the module docstring).

    `predict` maps a (B, C_in, D, H, W) batch to CPU probabilities of the same spatial shape.
    """
    subsets = mirror_subsets(axes)
    total: torch.Tensor | None = None
    for subset in subsets:
        probs = _flip(predict(_flip(images, subset)), subset).to(torch.float64)
        total = probs if total is None else total.add_(probs)
    return (total / len(subsets)).to(torch.float32)


def predict_cube(model: nn.Module, images: torch.Tensor, config: Config, device: torch.device, *,
                 tta: bool = False) -> torch.Tensor:
    """Inference as the config's training mode implies: whole cube for `full`, sliding window for `patch`;
    with `tta`, averaged over the mirrorings of `evaluate.mirror_axes` (8 for all three)."""
    model.eval()

    def once(batch: torch.Tensor) -> torch.Tensor:
        if config.train.mode == "patch":
            return predict_sliding_window(
                model, batch, roi_size=config.train.patch, device=device, overlap=config.evaluate.sw_overlap,
                blend=config.evaluate.sw_blend, sw_batch_size=config.evaluate.sw_batch_size, amp=config.train.amp,
            )
        return predict_full(model, batch, device=device, amp=config.train.amp)

    axes = tuple(2 + a for a in config.evaluate.mirror_axes)  # the spatial axes of the (B, C, D, H, W) batch
    return predict_mirrored(once, images, axes) if tta else once(images)


def predict_ensemble(members: Sequence[tuple[nn.Module, Config]], images: torch.Tensor, device: torch.device, *,
                     tta: bool = False) -> torch.Tensor:
    """The mean probabilities of several models (e.g. the folds of a cross-validation), each predicting as
    its own config says (`predict_cube`); summed in float64 like the mirrorings."""
    if not members:
        raise ValueError("predict_ensemble: no model to predict with")
    total: torch.Tensor | None = None
    for model, config in members:
        probs = predict_cube(model, images, config, device, tta=tta).to(torch.float64)
        total = probs if total is None else total.add_(probs)
    return (total / len(members)).to(torch.float32)
