"""Two backward passes through one graph (`loss.backward(retain_graph=True)`, then `loss.backward()`), as
gradient-penalty and multi-loss code does: every policy gives plain PyTorch's gradients after each pass
(`torch.equal`), and the next step is unaffected. norm_act rebuilds a recomputed tensor as often as a
retained graph unpacks it (its recipe lives as long as the saved tensor); swap reloads it again."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from brats_swap.config import load_config
from brats_swap.memory import MemoryEngine
from brats_swap.memory.frontend import tensors_in
from brats_swap.model import build_model

POLICIES = {
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"min_bytes": 0}, "recompute": {"norm_act": True}},
    "swap_all": {"mode": "swap", "swap": {"tensors": -1, "min_bytes": 0, "max_inflight_bytes": 1}},
}


def plain_conv_unet() -> nn.Module:
    """nnU-Net's PlainConvUNet (dynamic-network-architectures), 3 stages of 2-8 channels, deep supervision."""
    config = load_config(None, ["model.name=nnunet", "data.cube=[16,16,16]", "model.features=[2,4,8]"])
    return build_model(config.model)


class ConvNormActChain(nn.Module):
    """Not one of the repository's networks: BatchNorm (running statistics), GroupNorm + GELU, a residual
    add and dropout, in 2D."""

    def __init__(self):
        super().__init__()
        self.conv1, self.norm1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.norm2, self.act2 = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.act1(self.norm1(self.conv1(x)))
        return self.head(self.drop(self.act2(self.norm2(self.conv2(a)))) + a)


def instance_norm_leaky() -> nn.Module:
    """Conv3d -> InstanceNorm3d -> in-place LeakyReLU twice (the nnU-Net block, written out)."""
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True),
                         nn.LeakyReLU(0.01, inplace=True), nn.Conv3d(4, 4, 3, padding=1),
                         nn.InstanceNorm3d(4, affine=True), nn.LeakyReLU(0.01, inplace=True), nn.Conv3d(4, 1, 1))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "PlainConvUNet": (plain_conv_unet, (1, 4, 16, 16, 16)),
    "conv2d_bn_gn_dropout": (ConvNormActChain, (2, 3, 12, 12)),
    "conv3d_in_leaky": (instance_norm_leaky, (1, 2, 8, 8, 8)),
}


def _gradients_of_two_passes(make_model, shape, policy: dict | None):
    """Gradients after the first and after the second backward of step 1, and after step 2 (one backward);
    the engine's stats of step 1 (None in plain PyTorch)."""
    torch.manual_seed(0)
    model = make_model()
    engine = MemoryEngine(model, policy) if policy is not None else None
    grads, first_stats = [], None
    for step in range(2):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(10 + step)  # the same dropout masks with and without the engine
        with engine.step() if engine is not None else contextlib.nullcontext():
            loss = sum(out.float().square().mean() for out in tensors_in(model(x)))
        passes = 2 if step == 0 else 1
        for backward in range(passes):
            loss.backward(retain_graph=backward < passes - 1)
            grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        if engine is not None and step == 0:
            first_stats = engine.last_stats()
    if engine is not None:
        engine.close()
    return grads, first_stats


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_a_retained_graph_backpropagates_twice_to_plain_pytorchs_gradients(model, policy):
    make_model, shape = MODELS[model]
    expected, _ = _gradients_of_two_passes(make_model, shape, None)
    got, stats = _gradients_of_two_passes(make_model, shape, POLICIES[policy])
    # The policy did act on this model: the second pass had something to rebuild or reload.
    if "norm_act" in POLICIES[policy].get("recompute", {}):
        assert stats.recomputed_tensors > 0
    if policy != "norm_act":
        assert stats.swapped_in_bytes > stats.swapped_out_bytes > 0  # every swapped tensor came back twice
    for when, (want, have) in enumerate(zip(expected, got, strict=True)):
        label = ("first backward", "second backward", "next step")[when]
        assert len(want) == len(have)
        for i, (a, b) in enumerate(zip(want, have, strict=True)):
            assert torch.equal(a, b), f"{model} {policy}: gradient {i} differs after the {label}"
