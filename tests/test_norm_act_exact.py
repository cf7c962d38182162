"""`recompute.norm_act` only where replaying the norm and the activation is exact.

Every case trains 3 SGD steps (momentum, so a wrong gradient shows in later steps' parameters too) with
plain PyTorch and with the engine, under `mode: recompute` + `norm_act` and under `hybrid` (everything
else swapped), and compares losses, gradients, parameters and buffers with `torch.equal`. Cases the
engine must not replay also have to say why in `StepStats.norm_act_skipped`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from memory_helpers import assert_same_history, backward_op_counts, train_steps
from torch import nn

from brats_swap.memory import MemoryEngine, register_norm
from brats_swap.memory.recompute import is_replayable_norm
from brats_swap.model import KerasInstanceNorm

POLICIES = {
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"min_bytes": 0}, "recompute": {"norm_act": True}},
}


# ------------------------------------------------------------------------------------------------ runner


def _history(make_model: Callable[[], nn.Module], policy: dict | None, shape: tuple[int, ...],
             after_engine: Callable[[nn.Module], None] | None = None, steps: int = 3):
    """Per step: (loss, grads, params, buffers) and the engine's stats; `policy=None` is plain PyTorch.

    `after_engine(model)` runs where the engine has just been built (also in the plain run, so both
    models are the same), e.g. to add a hook after the engine.
    """
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = MemoryEngine(model, policy) if policy is not None else None
    if after_engine is not None:
        after_engine(model)
    history, stats = [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        x = torch.randn(*shape, generator=generator)
        torch.manual_seed(step)
        with engine.step() if engine is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        history.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()],
                        [p.detach().clone() for p in model.parameters()],
                        [b.clone() for b in model.buffers()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if engine is not None:
            stats.append(engine.last_stats())
    return history, stats, engine


def _assert_bitwise(plain, tested) -> None:
    assert len(plain) == len(tested)
    for step, (expected, got) in enumerate(zip(plain, tested, strict=True)):
        assert torch.equal(expected[0], got[0]), f"loss differs at step {step}"
        for kind, index in (("grad", 1), ("param", 2), ("buffer", 3)):
            assert len(expected[index]) == len(got[index])
            for i, (a, b) in enumerate(zip(expected[index], got[index], strict=True)):
                assert torch.equal(a, b), f"{kind} {i} differs at step {step}"


def _check_case(make_model, policy_name: str, shape: tuple[int, ...], skipped: dict[str, str],
                after_engine=None):
    """Exact against plain PyTorch, and every step reports exactly `skipped` (module -> reason fragment)."""
    plain, _, _ = _history(make_model, None, shape, after_engine)
    tested, stats, engine = _history(make_model, POLICIES[policy_name], shape, after_engine)
    _assert_bitwise(plain, tested)
    for step_stats in stats:
        assert set(step_stats.norm_act_skipped) == set(skipped), step_stats.norm_act_skipped
        for name, fragment in skipped.items():
            assert fragment in step_stats.norm_act_skipped[name], step_stats.norm_act_skipped[name]
        assert step_stats.as_dict()["memory/norm_act_skipped"] == len(skipped)
    return stats, engine


def _recomputed_modules(engine: MemoryEngine) -> set[str]:
    return {record.module for record in engine.last_records() if record.recompute}


# ------------------------------------------------------------------------------------------------ models


class PermutedLayerNormNet(nn.Module):
    """Channels-last LayerNorm in a conv net: permute -> LayerNorm -> permute back -> GELU."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        h = self.norm(self.conv1(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.conv2(self.act(h))


class ChunkedActivation(nn.Module):
    """GroupNorm, then a gated unit: LeakyReLU on one channel half, times the other half."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.LeakyReLU(0.2, inplace=inplace)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = self.norm(self.conv1(x))
        # torch forbids in-place changes of `chunk` outputs; basic slices are views that allow them.
        first, second = (h[:, :4], h[:, 4:]) if self.act.inplace else h.chunk(2, dim=1)
        return self.conv2(self.act(first) * second)  # mul saves the activation's output


def _conditional_norm(x: torch.Tensor, gamma: torch.Tensor | None) -> torch.Tensor:
    out = F.group_norm(x, 2)
    return out if gamma is None else out * gamma


class CondNorm(nn.Module):
    """A conditional norm: `norm(x, gamma)`; replaying `forward(x)` alone would silently use gamma = 1."""

    def forward(self, x, gamma=None):
        return _conditional_norm(x, gamma)


@register_norm
class RegisteredCondNorm(nn.Module):
    """The same conditional norm, registered as replayable: its two-argument calls must still be refused."""

    def forward(self, x, gamma=None):
        return _conditional_norm(x, gamma)


class Conditioned(nn.Module):
    def __init__(self, norm_type: type[nn.Module]):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gamma = nn.Conv2d(3, 8, 1)
        self.norm = norm_type()
        self.act = nn.LeakyReLU(0.2)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.act(self.norm(self.conv1(x), torch.sigmoid(self.gamma(x)))))


class FakeNorm(nn.Module):
    """Named like a norm, but adds noise: a replay would draw other noise (and flip LeakyReLU signs)."""

    def forward(self, x):
        return F.silu(x) + torch.randn_like(x)  # silu saves x: a stored input, as a real norm's


class ConvNormAct(nn.Module):
    def __init__(self, norm: nn.Module, dims: int = 2):
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.conv1 = conv(3, 4, 3, padding=1)
        self.norm = norm
        self.act = nn.LeakyReLU(0.1)  # saves its input, the norm output (ReLU saves its own output)
        self.conv2 = conv(4, 2, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.act(self.norm(self.conv1(x))))


def _scale_output(module, args, out):
    return out * module.weight.view(1, -1, 1, 1)  # saves the norm's own output for backward


def _hook_output(model: nn.Module) -> None:
    model.norm.register_forward_hook(_scale_output)


IMAGE = (2, 3, 8, 8)
VOLUME = (2, 3, 6, 6, 6)


# ------------------------------------------------------------------------------------------------ (a)


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_unet_norms_are_still_recomputed_exactly(policy_name):
    plain, _, _ = train_steps(None, steps=3, cube=32)
    tested, stats, engine = train_steps(POLICIES[policy_name], steps=3, cube=32)
    assert_same_history(plain, tested, policy_name)
    for step_stats in stats:
        assert step_stats.recomputed_bytes > 0
        assert step_stats.norm_act_skipped == {}
    assert all(kind in engine.recipes.recognised.values() for kind in ("norm", "act", "dropout"))
    assert any(record.recompute and record.module.endswith(".act") for record in engine.last_records())


class UpsampleNet(nn.Module):
    """conv -> norm -> act -> nearest x2 -> conv: the upsampled tensor (saved by conv2) is a resize recipe."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(3, 4, 3, padding=1)
        self.norm = KerasInstanceNorm(4)
        self.act = nn.LeakyReLU(0.3)
        self.resize = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv2 = nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.resize(self.act(self.norm(self.conv1(x)))))


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_upsampled_tensor_is_rebuilt_exactly(policy_name):
    stats, engine = _check_case(UpsampleNet, policy_name, VOLUME, {})
    assert {"norm", "act", "resize"} <= set(engine.recipes.recognised.values())
    assert "conv2" in _recomputed_modules(engine)  # conv2 saved the upsampled tensor: rebuilt, not stored


def test_unet_norm_act_reruns_no_convolution():
    engine, counts = backward_op_counts(POLICIES["norm_act"])
    assert counts.get("convolution", 0) == 0
    assert counts.get("convolution_backward", 0) > 0
    assert engine.last_stats().recomputed_tensors > 0


# ------------------------------------------------------------------------------------------------ (b) - (g)


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_activation_of_a_permuted_view_is_kept(policy_name):
    _, engine = _check_case(PermutedLayerNormNet, policy_name, IMAGE,
                            {"act": "its input is a view of the output of 'norm'"})
    # The norm's output, saved by GELU through the view, is still rebuilt exactly; GELU's output is not.
    assert "conv2" not in _recomputed_modules(engine)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_activation_of_one_chunk_is_kept(policy_name, inplace):
    _, engine = _check_case(lambda: ChunkedActivation(inplace), policy_name, IMAGE,
                            {"act": "its input is a view of the output of 'norm'"})
    assert "conv2" not in _recomputed_modules(engine)


@pytest.mark.parametrize(("norm_type", "reason"), [
    (CondNorm, "CondNorm is not a registered norm"),
    (RegisteredCondNorm, "called with 2 positional"),
])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_conditional_norm_is_kept(policy_name, norm_type, reason):
    _, engine = _check_case(lambda: Conditioned(norm_type), policy_name, IMAGE, {"norm": reason})
    assert _recomputed_modules(engine) == set()


@pytest.mark.parametrize(("before_engine", "reason"), [
    (True, "a forward hook replaced or modified its output"),
    (False, "hooks were added to it after the memory engine was built"),
])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_forward_hook_replacing_the_norm_output_is_kept(policy_name, before_engine, reason):
    def make():
        model = ConvNormAct(nn.GroupNorm(2, 4))
        if before_engine:
            _hook_output(model)
        return model

    _, engine = _check_case(make, policy_name, IMAGE, {"norm": reason},
                            after_engine=None if before_engine else _hook_output)
    assert _recomputed_modules(engine) == set()


def _double_input(module, args):
    return (args[0] * 2,)


def _double_input_in_place(module, args):
    args[0].mul_(2)


@pytest.mark.parametrize("pre_hook", [_double_input, _double_input_in_place])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_pre_hook_changing_the_norm_input_is_kept(policy_name, pre_hook):
    def make():
        model = ConvNormAct(nn.GroupNorm(2, 4))
        model.norm.register_forward_pre_hook(pre_hook)
        return model

    _, engine = _check_case(make, policy_name, IMAGE, {"norm": "a forward pre-hook changed its input"})
    assert _recomputed_modules(engine) == set()


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_class_merely_named_norm_is_kept(policy_name):
    _, engine = _check_case(lambda: ConvNormAct(FakeNorm()), policy_name, IMAGE,
                            {"norm": "FakeNorm is not a registered norm"})
    assert _recomputed_modules(engine) == set()


# ------------------------------------------------------------------------------------------------ (h)


@pytest.mark.parametrize("make_norm", [
    lambda: nn.BatchNorm3d(4),
    lambda: nn.BatchNorm3d(4, momentum=None),  # cumulative average: reads num_batches_tracked
    lambda: nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
], ids=["batchnorm", "batchnorm_cumulative", "instancenorm_running"])
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
def test_train_mode_running_stats_norm_is_recomputed_exactly(policy_name, make_norm):
    stats, engine = _check_case(lambda: ConvNormAct(make_norm(), dims=3), policy_name, VOLUME, {})
    assert all(step_stats.recomputed_bytes > 0 for step_stats in stats)
    assert "act" in _recomputed_modules(engine)  # the norm output, saved by ReLU, is rebuilt
    norm = engine.model.norm
    assert norm.training
    if isinstance(norm, nn.BatchNorm3d):  # (InstanceNorm does not count batches)
        assert int(norm.num_batches_tracked) == 3  # updated once per step, not again by the replays


def test_eval_mode_batchnorm_is_recomputed_exactly():
    def make():
        return ConvNormAct(nn.BatchNorm3d(4), dims=3).eval()

    stats, _ = _check_case(make, "norm_act", VOLUME, {})
    assert stats[-1].recomputed_bytes > 0


# ------------------------------------------------------------------------------------------------ registry


def test_registration_follows_the_forward_that_runs():
    class Renamed(nn.GroupNorm):  # inherits GroupNorm.forward: registered
        pass

    class Overridden(nn.LayerNorm):  # its own forward: not registered by its parent
        def forward(self, x):
            return super().forward(x) * 2

    class OverriddenKeras(KerasInstanceNorm):  # `replayable_norm` is not inherited by a new forward
        def forward(self, x):
            return super().forward(x) + 1

    assert is_replayable_norm(Renamed(1, 2)) and is_replayable_norm(KerasInstanceNorm(2))
    assert is_replayable_norm(nn.BatchNorm2d(2)) and is_replayable_norm(nn.InstanceNorm1d(2))
    assert not is_replayable_norm(Overridden(2)) and not is_replayable_norm(OverriddenKeras(2))
    assert not is_replayable_norm(nn.SyncBatchNorm(2)) and not is_replayable_norm(FakeNorm())
    with pytest.raises(TypeError, match="register_norm"):
        register_norm(FakeNorm())
