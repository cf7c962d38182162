"""brats_swap/run/device.py: training under AMP on a CPU takes every convolution's weight and bias gradients
from fp32, because oneDNN's bf16 backward-weights kernel returns wrong (partly never written) ones for small
depths. The NaN-poisoned heap below is what a long test session leaves: freed tensors full of NaN (under
deterministic algorithms every `torch.empty` is NaN-filled), which such a kernel then reads back.

On an AVX-512 CPU (oneDNN's `jit_bf16` kernels) the gradient tests fail without the fix; elsewhere the kernel
may be right and they pass either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from brats_swap.config import load_config
from brats_swap.config.schema import ModelConfig
from brats_swap.model import build_model
from brats_swap.run.device import (
    Fp32ConvolutionWeightGradients,
    autocast_context,
    computes_in_reduced_precision_on_cpu,
    torch_settings,
)

CPU = torch.device("cpu")


def _fill_the_heap_with(value: float) -> None:
    """Allocate and free buffers of many sizes holding `value`: memory handed out next holds it."""
    junk = [torch.full((2**k,), value) for k in range(4, 22)]
    del junk


def _bf16_config():
    return load_config(None, ["train.amp=bf16", "train.device=cpu"])


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _float64_gradients(conv: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """(input, weight, bias) gradients of `conv` in float64 from the bf16-rounded input, parameters and output
    gradient: what a bf16 step computes, without its rounding."""
    x = x.bfloat16().double().requires_grad_()
    weight = conv.weight.detach().bfloat16().double().requires_grad_()
    bias = conv.bias.detach().bfloat16().double().requires_grad_()
    functional = F.conv_transpose3d if isinstance(conv, nn.ConvTranspose3d) else F.conv3d
    out = functional(x, weight, bias, conv.stride, conv.padding, groups=conv.groups)
    return torch.autograd.grad(out, (x, weight, bias), grad.double())


@pytest.mark.parametrize(("conv", "spatial"), [
    (nn.Conv3d(32, 32, 3, padding=1), (2, 2, 2)),  # the 2³ bottleneck of a 16³ cube at model.depth 4
    (nn.Conv3d(32, 32, 3, stride=2, padding=1), (3, 3, 1)),  # stride 2 to an output width of 1
    (nn.Conv3d(16, 16, 5, padding=2), (4, 4, 4)),  # a 5³ kernel over a depth of 4
    (nn.Conv3d(32, 32, 3, padding=1), (8, 8, 8)),  # a shape the bf16 kernel gets right: unchanged too
    (nn.Conv3d(32, 32, 5, padding=2, groups=32), (2, 4, 4)),  # depthwise (MedNeXt)
    (nn.ConvTranspose3d(32, 16, 2, stride=2), (2, 2, 2)),  # transposed (nnU-Net's decoder)
], ids=["3x3x3-depth-2", "stride-2-width-1", "5x5x5-depth-4", "3x3x3-8cubed", "depthwise", "transposed"])
def test_cpu_bf16_convolution_gradients_are_the_fp32_ones_whatever_the_heap_held(conv, spatial):
    torch.manual_seed(0)
    x = torch.randn(1, conv.in_channels, *spatial)
    with torch.no_grad():
        conv.bias.normal_()
        with autocast_context(CPU, "bf16"):
            plain_out = conv(x)
    grad = torch.randn(plain_out.shape).bfloat16()
    leaf = x.clone().requires_grad_()
    with torch_settings(_bf16_config(), CPU):
        with autocast_context(CPU, "bf16"):
            out = conv(leaf)
        _fill_the_heap_with(float("nan"))
        out.backward(grad)
    assert torch.equal(out, plain_out)  # the forward is the plain bf16 one
    want_x, want_weight, want_bias = _float64_gradients(conv, x, grad)
    # bf16 rounding of the result (2**-8) and of the sums' terms; the kernel this replaces was off by ~100%
    # or NaN at the first three shapes.
    assert _relative_error(conv.weight.grad, want_weight) < 2e-2
    assert _relative_error(conv.bias.grad, want_bias) < 2e-2
    # The input gradient is the bf16 kernel's own: which oneDNN kernel runs depends on the threads and on
    # torch's deterministic mode (`train.deterministic`, off by default), and one of them sums in bf16 blocks:
    # 2.7% at the 5³ kernel over a depth of 4 on one thread (2% elsewhere); the broken kernel was off by ~100%.
    assert _relative_error(leaf.grad, want_x) < 4e-2
    # The input gradient is still the bf16 kernel's, bit for bit: autograd computes only it when the
    # parameters need no gradient, and the mode leaves that call alone.
    input_only = x.clone().requires_grad_()
    with autocast_context(CPU, "bf16"):
        out = F.conv_transpose3d if isinstance(conv, nn.ConvTranspose3d) else F.conv3d
        out = out(input_only, conv.weight.detach(), conv.bias.detach(), conv.stride, conv.padding,
                  groups=conv.groups)
    out.backward(grad)
    assert torch.equal(leaf.grad, input_only.grad)


def _unet_gradients(heap_value: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(base_filters=4, depth=4))  # at 16³ a 2³ bottleneck (train_helpers.SMALL)
    x = torch.randn(1, 4, 16, 16, 16)
    with torch_settings(_bf16_config(), CPU):
        with autocast_context(CPU, "bf16"):
            loss = model(x).float().square().mean()
        _fill_the_heap_with(heap_value)
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_a_bf16_unet_steps_gradients_do_not_depend_on_what_the_heap_held():
    """The symptom: a tiny bf16 training step's gradients were NaN after a long session and merely wrong
    alone, different from run to run. Now they are finite and the same, bit for bit, whatever the heap
    held."""
    after_nan, after_zeros = _unet_gradients(float("nan")), _unet_gradients(0.0)
    bottleneck = "encoder.level3.context.block1.conv.weight"
    assert torch.isfinite(after_nan[bottleneck]).all()
    for name, grad in after_nan.items():
        assert torch.isfinite(grad).all(), name
        assert torch.equal(grad, after_zeros[name]), name


@pytest.mark.parametrize(("amp", "device", "needed"), [
    ("bf16", "cpu", True), ("fp16", "cpu", True),  # fp16 runs as bf16 on a CPU
    ("none", "cpu", False), ("bf16", "cuda", False), ("fp16", "cuda", False),
])
def test_the_fp32_weight_gradients_are_for_amp_on_a_cpu_only(amp, device, needed):
    assert computes_in_reduced_precision_on_cpu(amp, torch.device(device)) is needed


def test_torch_settings_enters_the_mode_for_bf16_on_a_cpu_and_leaves_it():
    assert _get_current_dispatch_mode() is None
    with torch_settings(_bf16_config(), CPU):
        assert isinstance(_get_current_dispatch_mode(), Fp32ConvolutionWeightGradients)
    assert _get_current_dispatch_mode() is None
    with torch_settings(load_config(None, ["train.amp=none", "train.device=cpu"]), CPU):
        assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize(("capability", "runs"), [((7, 5), "fp16"), ((7, 0), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_bf16_on_a_card_before_ampere_trains_in_fp16_said_in_one_line_and_recorded(capability, runs, monkeypatch,
                                                                                  capsys):
    """A card's capability is torch's answer, here a fake one (no GPU in CI): before Ampere (8.0) `train.amp:
    bf16` runs fp16, said once; the config the run records (config.yaml, checkpoints, env.json's "amp", the
    train.log start line) is the one `_amp_that_runs` returns."""
    from types import SimpleNamespace

    from brats_swap.run.device import amp_on_device
    from brats_swap.train import loop

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    card = torch.device("cuda", 0)
    amp, reason = amp_on_device("bf16", card)
    assert amp == runs and asked == [card]
    assert (reason is None) == (runs == "bf16")
    assert amp_on_device("fp16", card) == ("fp16", None)  # fp16 runs everywhere on CUDA
    assert amp_on_device("none", card) == ("none", None)

    ran = loop._amp_that_runs(load_config(None, ["train.amp=bf16"]), SimpleNamespace(device=card, is_main=True))
    assert ran.train.amp == runs
    said = [line for line in capsys.readouterr().err.splitlines() if "train.amp" in line]
    if runs == "bf16":
        assert said == []
    else:
        assert len(said) == 1, said
        assert f"{capability[0]}.{capability[1]}" in said[0] and "fp16" in said[0] and "records fp16" in said[0]


def test_the_rehearsed_card_answers_its_capability():
    from brats_swap.memory import cuda_device

    with cuda_device.rehearsal(16 << 30) as card:
        assert cuda_device.capability(torch.device("cuda")) == (8, 6)
        assert card.calls[-1] == ("get_device_capability", 0, None)
    assert cuda_device.capability(CPU) is None
