"""Inference on prepared cubes with a torch network: the whole cube in one pass (full models) or the sliding
window (patch models), optionally with test-time mirroring, and the average of several models (a fold ensemble).

Training validates with it and evaluation predicts with it, so it sits under both. The rules themselves (MONAI's
sliding window, the 8 mirrorings summed in float64, the fold mean) are `run/array_inference.py`'s, on numpy
arrays, shared with the torch-free onnxruntime predictor; this module runs them with a torch network on its
device (`torch_network`), whose sliding window is MONAI's own with the volume placed on the device once when it
fits (`predict_sliding_window`). Every path returns probabilities of shape (B, C, D, H, W) (C = the model's output
channels) as float32 on the CPU, so the caller can map them back to the original grid without holding device
memory.

Test-time augmentation (`tta=True`) is nnU-Net's mirroring: the network sees the cube under each of the
8 subsets of the 3 spatial flips (none, D, H, W, DH, DW, HW, DHW), each output is flipped back, and the 8
probability maps are averaged (`array_inference.mirrored`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from brats_swap.config import Config
from brats_swap.memory import cuda_device
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


class TorchNetwork:
    """`model` as the array rules call a network (`array_inference.ArrayNetwork`): a numpy batch to float32 numpy
    probabilities, run on `device` under the run's AMP (`predict_full`). It also runs MONAI's sliding window
    itself (`array_inference.sliding_window` hands it over): MONAI's own windows, weights and sums, with the
    volume moved to the device once or each window's copy overlapped (`predict_sliding_window`), instead of a
    synchronous copy each way per window."""

    def __init__(self, model: nn.Module, device: torch.device, amp: str = "none") -> None:
        self.model, self.device, self.amp = model, device, amp
        model.eval()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        return predict_full(self.model, torch.from_numpy(batch), device=self.device, amp=self.amp).numpy()

    def sliding_window(self, images: np.ndarray, window: Sequence[int], *, overlap: float, blend: str = "gaussian",
                       batch_size: int = 1) -> np.ndarray:
        return predict_sliding_window(self.model, torch.from_numpy(images), roi_size=window, device=self.device,
                                      overlap=overlap, blend=blend, sw_batch_size=batch_size, amp=self.amp).numpy()


def torch_network(model: nn.Module, device: torch.device, amp: str = "none") -> TorchNetwork:
    """`model` on `device` as the array rules call a network (`TorchNetwork`)."""
    return TorchNetwork(model, device, amp)


# Of the memory free on the card, the share the whole volume may take when it moves there once (its float32
# input, the stitched probabilities and MONAI's count map); the rest is left to the windows' own forward
# (`evaluate.sw_batch_size` windows of the patch, without gradients) and the allocator's slack, which are not
# priced. Where the volume does not fit that share, each window is copied as it is needed, overlapped.
VOLUME_SHARE = 0.5
VOLUME, WINDOWS = "volume", "windows"  # `sliding_window_placement`'s answers


def sliding_window_placement(images: torch.Tensor, out_channels: int | None, device: torch.device) -> str:
    """Where `predict_sliding_window` keeps the volume of `images` (B, C_in, D, H, W): `VOLUME`, moved to `device`
    once (the windows are slices of it, stitched there, copied back once), when its bytes fit `VOLUME_SHARE` of
    what the card has free; else `WINDOWS`, each window copied over on its own. On a CPU the volume is already
    where the windows run. A network that does not say its `out_channels` cannot be priced: `WINDOWS`."""
    if device.type != "cuda":
        return VOLUME
    if out_channels is None:
        return WINDOWS
    batch, channels, *spatial = images.shape
    voxels = math.prod(spatial)
    needed = 4 * voxels * (batch * (channels + out_channels) + 1)  # float32 input, probabilities, count map
    if images.dtype != torch.float32:
        needed += images.numel() * images.element_size()  # the copy as it arrives, before its conversion
    free = (cuda_device.free_bytes(device) + cuda_device.reserved_bytes(device)
            - cuda_device.allocated_bytes(device))  # what the allocator holds unused is free to it too
    return VOLUME if needed <= VOLUME_SHARE * free else WINDOWS


@torch.no_grad()
def predict_sliding_window(
    model: nn.Module, images: torch.Tensor, *, roi_size: Sequence[int], device: torch.device, overlap: float = 0.5,
    blend: str = "gaussian", sw_batch_size: int = 1, amp: str = "none", placement: str | None = None,
) -> torch.Tensor:
    """MONAI sliding-window inference with overlap and Gaussian (or constant) blending: (B, C_in, D, H, W) ->
    (B, C, D, H, W) probabilities, float32 on the CPU.

    `placement` (default: `sliding_window_placement`, priced on the card) says where the volume lives:
    `VOLUME` moves it to `device` once and stitches there (one copy each way); `WINDOWS` keeps the volume and
    the stitched output on the host (MONAI issue #4425: a large volume never needs its full probability map in
    device memory) and copies each window over, the next one staged in pinned memory and sent on a side stream
    while the network runs on this one (`_WindowFeeder`). Either way the windows, their weights and the sums
    are MONAI's, in its order, so the output is the same (bitwise on the CPU, tests/test_evaluate.py).
    """
    # Imported here, as the other MONAI imports of the package: `import monai` takes seconds, and most
    # processes that import this module (whole-cube validation, planning) never slide a window.
    from monai.inferers import sliding_window_inference

    placement = placement or sliding_window_placement(images, getattr(model, "out_channels", None), device)
    roi = tuple(int(r) for r in roi_size)
    with autocast_context(device, amp):
        if placement == VOLUME:
            # float32 after the copy (the cache's float16 travels as it is); MONAI stitches in the input's dtype.
            volume = images.to(device, non_blocking=True).float()
            probs = sliding_window_inference(volume, roi_size=roi, sw_batch_size=sw_batch_size, predictor=model,
                                             overlap=overlap, mode=blend, sw_device=device, device=device)
        else:
            volume = images.float()  # float32 on the host, where MONAI stitches
            feeder = _WindowFeeder(model, volume, roi, overlap, sw_batch_size, device)
            try:
                probs = sliding_window_inference(
                    volume, roi_size=roi, sw_batch_size=sw_batch_size, predictor=feeder, overlap=overlap, mode=blend,
                    sw_device=torch.device("cpu"), device=torch.device("cpu"), with_coord=True,
                    roi_weight_map=feeder.weights(blend))
            finally:
                feeder.close()
    return torch.as_tensor(probs).float().cpu()


def _window_key(window: Sequence[Sequence[slice]]) -> tuple:
    """A window list as MONAI passes it with `with_coord` (per window: batch, channel and spatial slices), hashable."""
    return tuple(tuple((s.start, s.stop) for s in coords) for coords in window)


class _WindowFeeder:
    """MONAI's predictor for `WINDOWS` placement (called with `with_coord=True` and `sw_device` the CPU): each
    window's input copied to the device, the network run there, its output copied back.

    MONAI calls the predictor window after window in an order fixed by the geometry (`window_schedule`), so while
    the network runs on one window the next is copied into a pinned staging buffer (two, alternating) and sent
    on a side stream (CUDA); the call for it waits on that copy's event. A call for a window the schedule did not
    expect (or a volume MONAI pads, whose windows come from its padded copy) is copied as it arrives. Outputs
    come back through pinned memory (`non_blocking`), the wait for them being the wait for the network. On a CPU
    the same path runs with plain copies (no streams, nothing pinned): what the tests exercise."""

    def __init__(self, model: nn.Module, volume: torch.Tensor, roi: tuple[int, ...], overlap: float,
                 sw_batch_size: int, device: torch.device) -> None:
        self.model, self.volume, self.roi, self.device = model, volume, roi, device
        self.cuda = device.type == "cuda"
        batch, channels, *spatial = volume.shape
        padded = any(size < r for size, r in zip(spatial, roi, strict=True))
        self.schedule = None if padded else window_schedule(tuple(spatial), roi, overlap, batch, sw_batch_size)
        self.calls = 0
        self.prefetched = 0  # windows whose copy was started before their call (the tests read it)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        rows = max((len(windows) for windows in self.schedule or []), default=0)
        self.staging = [torch.empty((rows, channels, *roi), pin_memory=self.cuda) for _ in range(2)] if rows else []
        self.staged: list = [None, None]  # per buffer: the event of its last copy (CUDA)
        self.next: tuple[int, torch.Tensor, object] | None = None  # (call index, device tensor, copy event)

    def weights(self, blend: str) -> torch.Tensor:
        """The windows' blending weights, computed as MONAI computes them (`compute_importance_map`, sigma 0.125 of
        the window) on the device the network runs on, as when MONAI ran the windows there; then brought to the
        host, where MONAI weighs each window's output with them here."""
        from monai.data.utils import compute_importance_map

        return compute_importance_map(self.roi, mode=blend, sigma_scale=0.125, device=self.device,
                                      dtype=torch.float32).cpu()

    def __call__(self, window: torch.Tensor, coords: Sequence[Sequence[slice]]) -> torch.Tensor:
        index, self.calls = self.calls, self.calls + 1
        inputs = self._take(index, coords, window)
        outputs = self.model(inputs)  # queued on the device: the next window's copy overlaps it
        self._stage(index + 1)
        host = outputs.to("cpu", non_blocking=self.cuda)  # into pinned memory on CUDA
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the network and the copy back are done
        return host

    def _take(self, index: int, coords: Sequence[Sequence[slice]], window: torch.Tensor) -> torch.Tensor:
        """Call `index`'s input on the device: the staged copy when MONAI asks for the windows the schedule said,
        else (and from then on: the schedule no longer holds) `window`, copied now."""
        staged, self.next = self.next, None
        expected = (self.schedule is not None and index < len(self.schedule)
                    and _window_key(self.schedule[index]) == _window_key(coords))
        if not expected:
            self.schedule = None
        elif staged is not None and staged[0] == index:
            _, inputs, event = staged
            if self.cuda:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                inputs.record_stream(stream)  # made on the side stream, used (and freed) on this one
            self.prefetched += len(coords)
            return inputs
        return window.to(self.device, copy=True)

    def _stage(self, index: int) -> None:
        """Copy the windows of call `index` into a staging buffer and start sending them to the device."""
        if self.schedule is None or index >= len(self.schedule):
            return
        windows, slot = self.schedule[index], index % 2
        buffer = self.staging[slot][:len(windows)]
        if self.staged[slot] is not None:
            self.staged[slot].synchronize()  # its copy of two calls ago has left the buffer
        for row, coords in enumerate(windows):
            buffer[row].copy_(self.volume[tuple(coords)][0])
        if self.cuda:
            with torch.cuda.stream(self.stream):
                inputs = buffer.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.staged[slot] = event
        else:
            inputs, event = buffer.clone(), None
        self.next = (index, inputs, event)

    def close(self) -> None:
        if self.cuda:
            self.stream.synchronize()  # no copy may still read a staging buffer when it is freed
        self.staging, self.next = [], None


def window_schedule(spatial: tuple[int, ...], roi: tuple[int, ...], overlap: float, batch: int,
                    sw_batch_size: int) -> list[list[tuple[slice, ...]]]:
    """The windows of each predictor call of MONAI's `sliding_window_inference` over a (batch, C, *spatial) volume
    at least `roi` on every axis, in its order: its scan interval and `dense_patch_slices`, windows numbered
    over the batch's images and taken `sw_batch_size` at a time."""
    from monai.data.utils import dense_patch_slices
    from monai.inferers.utils import _get_scan_interval  # MONAI's own rule: the order cannot drift from it

    scan = _get_scan_interval(spatial, roi, len(spatial), (overlap,) * len(spatial))
    slices = dense_patch_slices(spatial, roi, scan, return_slice=True)
    count = len(slices) * batch
    windows = [(slice(i // len(slices), i // len(slices) + 1), slice(None), *slices[i % len(slices)])
               for i in range(count)]
    return [windows[first:first + sw_batch_size] for first in range(0, count, sw_batch_size)]


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
