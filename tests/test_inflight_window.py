"""The default in-flight window (`memory.swap.max_inflight_bytes` unset): derived from the budget or the card,
so `mode: swap` by hand frees memory on a network that saves less than a fixed window would hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from brats_swap.config import MemoryConfig, load_config
from brats_swap.memory import memory_policy
from brats_swap.memory.budget import (
    CPU_INFLIGHT_BYTES,
    GIB,
    INFLIGHT_SHARE,
    inflight_window_bytes,
    tensor_limit,
    with_inflight_window,
    with_overhead,
)


def _three_layer_net() -> nn.Module:
    torch.manual_seed(0)

    def layer(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True),
                             nn.LeakyReLU(0.01))

    return nn.Sequential(layer(2, 16), layer(16, 16), layer(16, 2))


def _step(model: nn.Module, x: torch.Tensor, policy, device=None):
    with memory_policy(model, policy, device) as engine:
        with engine.step():
            loss = model(x).square().mean()
        loss.backward()
        return engine.last_stats(), engine.cfg, [p.grad.clone() for p in model.parameters()]


def _check_swaps(device: str, policy: dict) -> None:
    net = _three_layer_net().to(device)
    x = torch.randn(1, 2, 40, 40, 40, device=device)
    reference = copy.deepcopy(net)
    reference(x).square().mean().backward()  # plain PyTorch
    # The no-policy peak, measured by the same counter: the same engine with nothing large enough to swap.
    none_stats, _, _ = _step(copy.deepcopy(net), x, {"mode": "swap", "swap": {"min_bytes": 1 << 50}}, device)
    stats, cfg, grads = _step(net, x, policy, device)
    assert cfg.swap.max_inflight_bytes is not None  # the engine runs a concrete window
    assert stats.swapped_out_bytes > 0 and stats.swapped_in_bytes > 0
    # Nothing swapped = every saved byte resident at once: the no-policy peak; swapping must go below it.
    assert none_stats.peak_resident_saved_bytes == none_stats.saved_bytes
    assert stats.peak_resident_saved_bytes < none_stats.peak_resident_saved_bytes
    for got, want in zip(grads, [p.grad for p in reference.parameters()], strict=True):
        assert torch.equal(got, want)


def test_swap_by_hand_frees_memory_through_an_asynchronous_link():
    """On 06237a0 the fixed 4 GiB window held every swapped storage on the device until backward read it:
    swapped-in bytes 0 (or only the ones rule 8 releases) and the no-policy peak. The emulated link copies
    asynchronously, as a card's copy engines do."""
    _check_swaps("cpu", {"mode": "swap", "swap": {"emulate_gbs": 4.0}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_by_hand_frees_memory_on_a_card_with_a_budget():
    _check_swaps("cuda", {"mode": "swap", "budget_gib": 2.5})


def test_default_window_follows_the_budget_the_card_and_the_cpu():
    assert MemoryConfig().swap.max_inflight_bytes is None
    assert load_config(None, []).memory.swap.max_inflight_bytes is None
    assert inflight_window_bytes(MemoryConfig()) == CPU_INFLIGHT_BYTES
    assert inflight_window_bytes(MemoryConfig(), "cpu") == CPU_INFLIGHT_BYTES
    budgeted = with_overhead(MemoryConfig(budget_gib=10.0), "gpu")
    assert inflight_window_bytes(budgeted) == int(tensor_limit(10 * GIB, budgeted) * INFLIGHT_SHARE)
    assert inflight_window_bytes(MemoryConfig(budget_gib=10.0), "gpu") == inflight_window_bytes(budgeted)
    assert inflight_window_bytes(MemoryConfig(budget_gib=24.0), "gpu") > inflight_window_bytes(budgeted)
    # The planner's assumed card (an H200) without a budget: a share of 141 GB.
    assert inflight_window_bytes(MemoryConfig(), "gpu") == int(
        tensor_limit(141e9, with_overhead(MemoryConfig(), "gpu")) * INFLIGHT_SHARE)
    explicit = MemoryConfig()
    explicit.swap.max_inflight_bytes = 123
    assert with_inflight_window(explicit, "gpu") is explicit
    assert with_inflight_window(MemoryConfig(), "cpu").swap.max_inflight_bytes == CPU_INFLIGHT_BYTES


def test_the_planner_prices_the_window_the_engine_runs():
    """With the window unset, the planner (no device: a CPU) predicts the engine's peak on the emulated link
    exactly, and `auto` prices the presets with the window of the card it plans for."""
    from brats_swap.memory.cost import default_cost_model
    from brats_swap.memory.planner import Planner

    net = _three_layer_net()
    x = torch.randn(1, 2, 40, 40, 40)
    policy = MemoryConfig()
    policy.mode = "swap"
    policy.swap.emulate_gbs = 4.0
    cost = default_cost_model("cpu")
    cost.sync_copies = False  # the emulated link copies asynchronously, as the engine's does
    planner = Planner(net, x.shape, loss_fn=lambda out, _: out.square().mean(), cost=cost)
    stats, cfg, _ = _step(copy.deepcopy(net), x, policy)
    predicted = planner.predict("swap", policy)
    assert predicted.inflight_bytes == cfg.swap.max_inflight_bytes == CPU_INFLIGHT_BYTES
    assert predicted.peak_resident_saved_bytes == stats.peak_resident_saved_bytes
    _, fitting = planner.auto(0.5 * GIB, MemoryConfig())
    budget = MemoryConfig(budget_gib=0.5)
    presets = [p for p in fitting if p.name in ("swap_all", "hybrid")]
    assert presets and all(p.inflight_bytes == inflight_window_bytes(budget) for p in presets)
