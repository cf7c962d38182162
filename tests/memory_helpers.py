"""Shared helpers for the memory-engine tests: a tiny real U-Net and a plain-vs-engine step runner."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from brats_swap.config import ModelConfig
from brats_swap.memory import MemoryEngine
from brats_swap.model import build_model

# The real architecture (depth 5, deep supervision, dropout 0.3) with 2 base filters: fast on 2 cores.
TINY_UNET = ModelConfig(base_filters=2, dropout=0.3)


def make_unet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(TINY_UNET)


def batch(step: int, cube: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(1, 4, cube, cube, cube, generator=generator)
    y = (torch.rand(1, 3, cube, cube, cube, generator=generator) > 0.7).float()
    return x, y


def dice_loss(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    dims = (0, 2, 3, 4)
    intersection = (probs * target).sum(dims)
    return 1 - (2 * intersection + 1e-5).div(probs.sum(dims) + target.sum(dims) + 1e-5).mean()


def sgd_history(model: torch.nn.Module, engine: MemoryEngine | None, make_batch, loss_fn, steps: int):
    """Losses, gradients and parameters after each of `steps` SGD steps (momentum, so a wrong gradient shows
    in later parameters too), and the engine's stats per step; `engine=None` is plain PyTorch. The RNG is
    seeded identically before every step so dropout draws the same masks with and without the engine."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history, stats = [], []
    for step in range(steps):
        x, y = make_batch(step)
        torch.manual_seed(step)
        with engine.step() if engine is not None else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
        loss.backward()
        # An unused parameter (a deep-supervision head left out) has no gradient: zeros, for both sides alike.
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append((loss.detach().clone(), grads, [p.detach().clone() for p in model.parameters()]))
        if engine is not None:
            stats.append(engine.last_stats())
    return history, stats


def train_steps(policy, steps: int = 3, cube: int = 32, **engine_kwargs):
    """`sgd_history` of the tiny U-Net at `cube`³ under `policy` (None: plain PyTorch), and the engine."""
    model = make_unet()
    engine = MemoryEngine(model, policy, **engine_kwargs) if policy is not None else None
    history, stats = sgd_history(model, engine, lambda step: batch(step, cube), dice_loss, steps)
    return history, stats, engine


def assert_same_history(expected_history, tested_history, label: str = "") -> None:
    """`train_steps` histories bitwise equal (`torch.equal`): losses, gradients and parameters per step."""
    assert len(expected_history) == len(tested_history)
    for step, (expected, got) in enumerate(zip(expected_history, tested_history, strict=True)):
        assert torch.equal(expected[0], got[0]), f"{label}: loss differs at step {step}"
        for i, (a, b) in enumerate(zip(expected[1], got[1], strict=True)):
            assert torch.equal(a, b), f"{label}: gradient {i} differs at step {step}"
        for i, (a, b) in enumerate(zip(expected[2], got[2], strict=True)):
            assert torch.equal(a, b), f"{label}: parameter {i} differs after step {step}"


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name (e.g. convolutions run in forward and in backward)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_op_counts(policy, cube: int = 16) -> tuple[MemoryEngine, dict[str, int]]:
    """One U-Net step under `policy`; the engine and the aten ops its backward ran, by name."""
    model = make_unet()
    engine = MemoryEngine(model, policy)
    x, y = batch(0, cube)
    with engine.step():
        loss = dice_loss(model(x), y)
    counter = OpCounter()
    with counter:
        loss.backward()
    return engine, counter.counts
