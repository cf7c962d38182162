"""brats_swap/run/inference.py: the sliding window's copies. The volume moves to the device once when it fits
(`sliding_window_placement`, priced against the card's free memory), otherwise each window is copied over
with the next one staged ahead (`_WindowFeeder`). Either way the output is MONAI's `sliding_window_inference`
as brats-swap called it before (input and stitching on the host, windows on the device): bit for bit on the
CPU, which stands in for the device here."""

from __future__ import annotations

import pytest
import torch
from monai.inferers import sliding_window_inference
from torch import nn

from brats_swap.memory import cuda_device
from brats_swap.run import inference
from brats_swap.run.device import autocast_context
from brats_swap.run.inference import VOLUME, WINDOWS, predict_sliding_window, sliding_window_placement

CPU = torch.device("cpu")


def _network(out_channels: int = 3) -> nn.Module:
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.LeakyReLU(), nn.Conv3d(4, out_channels, 3, padding=1),
                            nn.Sigmoid()).eval()
    network.out_channels = out_channels
    return network


@torch.no_grad()
def _before(network, images, roi, sw_batch_size, blend, amp):
    """predict_sliding_window as it was: the float32 volume on the host, MONAI copying each window over."""
    with autocast_context(CPU, amp):
        probs = sliding_window_inference(images.float(), roi_size=roi, sw_batch_size=sw_batch_size, predictor=network,
                                         overlap=0.5, mode=blend, sw_device=CPU, device=CPU)
    return torch.as_tensor(probs).float()


@pytest.fixture
def feeders(monkeypatch):
    """Every `_WindowFeeder` made, to read how many windows were staged ahead."""
    made = []

    class Recorded(inference._WindowFeeder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(inference, "_WindowFeeder", Recorded)
    return made


@pytest.mark.parametrize(("shape", "roi", "sw_batch_size", "blend", "dtype", "amp"), [
    ((1, 4, 24, 16, 20), (16, 8, 16), 1, "gaussian", torch.float32, "none"),
    ((2, 4, 20, 16, 16), (8, 8, 8), 3, "gaussian", torch.float16, "none"),  # the cache's float16, two images
    ((1, 4, 16, 16, 16), (8, 16, 8), 2, "constant", torch.float32, "bf16"),
    ((1, 4, 12, 16, 16), (16, 8, 8), 2, "gaussian", torch.float32, "none"),  # MONAI pads the first axis
], ids=["one-by-one", "batched-two-images-float16", "constant-bf16", "padded"])
def test_both_placements_give_the_output_of_before_bit_for_bit(shape, roi, sw_batch_size, blend, dtype, amp,
                                                                feeders):
    network = _network()
    images = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = _before(network, images, roi, sw_batch_size, blend, amp)
    for placement in (VOLUME, WINDOWS):
        probs = predict_sliding_window(network, images, roi_size=roi, device=CPU, blend=blend,
                                       sw_batch_size=sw_batch_size, amp=amp, placement=placement)
        assert probs.dtype == torch.float32 and probs.device == CPU
        assert torch.equal(probs, before), placement
    (feeder,) = feeders
    if any(size < r for size, r in zip(shape[2:], roi, strict=True)):
        # A padded volume's windows come from MONAI's padded copy: each is copied as it arrives.
        assert feeder.prefetched == 0 and feeder.calls > 1
    else:  # every call's windows but the first call's were on their way before the call
        calls = inference.window_schedule(tuple(shape[2:]), roi, 0.5, shape[0], sw_batch_size)
        assert feeder.calls == len(calls) > 1
        assert feeder.prefetched == sum(len(call) for call in calls[1:])


def test_windows_in_an_order_not_expected_are_copied_as_they_arrive(monkeypatch, feeders):
    shape, roi = (1, 4, 16, 16, 16), (8, 8, 8)
    schedule = inference.window_schedule
    monkeypatch.setattr(inference, "window_schedule", lambda *args: list(reversed(schedule(*args))))
    network, images = _network(), torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    probs = predict_sliding_window(network, images, roi_size=roi, device=CPU, placement=WINDOWS)
    assert torch.equal(probs, _before(network, images, roi, 1, "gaussian", "none"))
    assert feeders[0].prefetched == 0 and feeders[0].schedule is None


def test_the_volume_moves_once_where_it_fits_half_the_free_memory():
    images = torch.zeros(1, 4, 64, 64, 64, dtype=torch.float16)
    # float32 input (4 channels) + 3 probabilities + the count map, and the float16 copy before its conversion
    needed = 4 * 64**3 * (4 + 3 + 1) + images.numel() * 2
    card = torch.device("cuda")
    with cuda_device.rehearsal(2 * needed):  # a card holding nothing: all of it is free
        assert sliding_window_placement(images, 3, card) == VOLUME
        assert sliding_window_placement(images, None, card) == WINDOWS  # its output cannot be priced
    with cuda_device.rehearsal(2 * needed - 1):
        assert sliding_window_placement(images, 3, card) == WINDOWS
    assert sliding_window_placement(images, 3, CPU) == VOLUME  # on a CPU the volume is where the windows run
