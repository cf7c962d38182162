"""The Isensee 2017 U-Net: parameter counts, shapes, module names, init, and the Keras instance norm."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brats_swap.config.schema import ModelConfig
from brats_swap.errors import ConfigError
from brats_swap.model import ConvNormAct, KerasInstanceNorm, ModelInputError, block_modules, build_model
from brats_swap.model.unet import keras_instance_norm_reference


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{"base_filters": 4, **overrides})


# -- parameter counts (Keras model.summary() of both published models) --------------------------------


def test_parameter_count_ibm_variant_with_norm_act_segmentation():
    assert n_params(build_model(ModelConfig(seg_layer="norm_act"))) == 8_269_579


def test_parameter_count_plain_conv_segmentation():
    assert n_params(build_model(ModelConfig(seg_layer="conv"))) == 8_269_561


def test_parameter_count_base_8():
    assert n_params(build_model(ModelConfig(base_filters=8, seg_layer="conv"))) == 2_069_569


# -- shapes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spatial", [(16, 16, 16), (32, 32, 32), (48, 32, 16)])
@pytest.mark.parametrize("seg_layer", ["norm_act", "conv"])
def test_output_shape_and_range(spatial, seg_layer):
    model = build_model(tiny(seg_layer=seg_layer)).eval()
    x = torch.randn(2, 4, *spatial)
    with torch.no_grad():
        y = model(x)
    assert y.shape == (2, 3, *spatial)
    assert y.dtype == torch.float32
    assert bool(((y >= 0) & (y <= 1)).all())


def test_other_depth_and_channels():
    model = build_model(tiny(depth=3, in_channels=2, segmentation_levels=2), out_channels=4).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 2, 12, 8, 4)).shape == (1, 4, 12, 8, 4)


@pytest.mark.parametrize("shape", [(1, 4, 24, 16, 16), (1, 4, 16, 16, 8), (1, 3, 16, 16, 16), (4, 16, 16, 16)])
def test_bad_input_raises_a_clear_error(shape):
    model = build_model(tiny())
    with pytest.raises(ValueError, match="model input"):
        model(torch.randn(*shape))
    with pytest.raises(ConfigError):  # the CLI maps it to exit 2
        model(torch.randn(*shape))
    assert issubclass(ModelInputError, ValueError)


@pytest.mark.parametrize("overrides", [{"depth": 1}, {"segmentation_levels": 5}, {"segmentation_levels": 0},
                                       {"dropout": 1.0}, {"norm_eps": 0.0}])
def test_bad_config_raises_config_error(overrides):
    with pytest.raises(ConfigError):
        build_model(tiny(**overrides))


def test_meta_device_forward_for_the_planner():
    model = build_model(ModelConfig()).to("meta")
    y = model(torch.empty(1, 4, 192, 192, 192, device="meta"))
    assert y.shape == (1, 3, 192, 192, 192) and y.device.type == "meta"


# -- module names (memory policies select by these) --------------------------------------------------------


def test_stable_module_names():
    model = build_model(ModelConfig())
    modules = dict(model.named_modules())
    for level in range(5):
        prefix = f"encoder.level{level}"
        for name in ("in_conv", "context.block1", "context.block2"):
            block = modules[f"{prefix}.{name}"]
            assert isinstance(block, ConvNormAct)
            assert [child for child, _ in block.named_children()] == ["conv", "norm", "act"]
        assert isinstance(modules[f"{prefix}.context.dropout"], nn.Dropout3d)
        assert modules[f"{prefix}.in_conv.conv"].stride == ((1, 1, 1) if level == 0 else (2, 2, 2))
    for level in range(4):
        prefix = f"decoder.level{level}"
        for name in ("upsample.block", "localization.block1", "localization.block2"):
            assert isinstance(modules[f"{prefix}.{name}"], ConvNormAct)
        assert modules[f"{prefix}.localization.block2.conv"].kernel_size == (1, 1, 1)
        has_seg = f"{prefix}.segmentation" in modules
        assert has_seg == (level < 3)
    assert isinstance(modules["decoder.level0.segmentation"], ConvNormAct)
    plain = dict(build_model(ModelConfig(seg_layer="conv")).named_modules())
    assert isinstance(plain["decoder.level2.segmentation"], nn.Conv3d)


def test_block_modules_in_forward_order():
    model = build_model(tiny())
    blocks = block_modules(model)
    assert [name for name, _ in blocks] == [f"encoder.level{i}" for i in range(5)] + [
        f"decoder.level{i}" for i in (3, 2, 1, 0)]
    modules = dict(model.named_modules())
    assert all(modules[name] is module for name, module in blocks)

    # Forward hooks fire in exactly this order.
    fired = []
    for name, module in blocks:
        module.register_forward_hook(lambda m, i, o, name=name: fired.append(name))
    model(torch.randn(1, 4, 16, 16, 16))
    assert fired == [name for name, _ in blocks]


def test_no_inplace_activations():
    model = build_model(tiny())
    acts = [m for m in model.modules() if isinstance(m, nn.LeakyReLU)]
    assert acts and all(not m.inplace and m.negative_slope == 0.3 for m in acts)
    assert all(m.negative_slope == 0.01 for m in build_model(tiny(leaky_slope=0.01)).modules()
               if isinstance(m, nn.LeakyReLU))


# -- forward semantics -------------------------------------------------------------------------------------


def test_deep_supervision_sums_coarse_to_fine():
    model = build_model(tiny(seg_layer="conv")).eval()
    seg = {}
    for level in range(3):
        model.decoder[f"level{level}"].segmentation.register_forward_hook(
            lambda m, i, o, level=level: seg.__setitem__(level, o))
    with torch.no_grad():
        y = model(torch.randn(1, 4, 32, 32, 32))
    up = lambda t: F.interpolate(t, scale_factor=2, mode="nearest")  # noqa: E731
    expected = torch.sigmoid(up(up(seg[2]) + seg[1]) + seg[0])
    assert torch.equal(y, expected)


def test_context_module_is_residual():
    level = build_model(tiny()).encoder["level1"].eval()
    x = torch.randn(1, 4, 16, 16, 16)
    with torch.no_grad():
        h = level.in_conv(x)
        assert torch.equal(level(x), h + level.context(h))
        assert h.shape == (1, 8, 8, 8, 8)


def test_dropout_only_in_training():
    model = build_model(tiny())
    x = torch.randn(1, 4, 16, 16, 16)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_keras_initialization():
    model = build_model(tiny()).requires_grad_(False)
    for module in model.modules():
        if isinstance(module, nn.Conv3d):
            fan_in = module.in_channels * math.prod(module.kernel_size)
            fan_out = module.out_channels * math.prod(module.kernel_size)
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            assert float(module.weight.abs().max()) <= bound
            assert float(module.weight.abs().max()) > 0.5 * bound
            assert torch.equal(module.bias, torch.zeros_like(module.bias))
        if isinstance(module, KerasInstanceNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
            assert torch.equal(module.bias, torch.zeros_like(module.bias))


# -- the keras_contrib instance norm -----------------------------------------------------------------------


def _random_norm(channels=3, eps=1e-3, dtype=torch.float64):
    norm = KerasInstanceNorm(channels, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm


def test_instance_norm_matches_the_keras_formula():
    norm = _random_norm(dtype=torch.float32)
    x = torch.randn(2, 3, 4, 5, 6) * 3 + 1
    expected = keras_instance_norm_reference(x, norm.weight, norm.bias, 1e-3)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    # eps is added to the std: at unit variance the output scale is 1 / (1 + eps), not 1 / sqrt(1 + eps).
    unit = torch.tensor([-1.0, 1.0]).view(1, 1, 2, 1, 1)
    out = KerasInstanceNorm(1, eps=0.1)(unit)
    torch.testing.assert_close(out.flatten(), torch.tensor([-1 / 1.1, 1 / 1.1]))


def test_instance_norm_backward_gradcheck():
    norm = _random_norm()
    x = torch.randn(2, 3, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: norm_fn(x, w, b), (x, norm.weight, norm.bias))


def norm_fn(x, w, b):
    from brats_swap.model.unet import _KerasInstanceNormFunction

    return _KerasInstanceNormFunction.apply(x, w, b, 1e-3)


def test_instance_norm_backward_matches_autograd_of_the_formula():
    norm = _random_norm(dtype=torch.float32)
    x = (torch.randn(2, 3, 6, 5, 4) * 2).requires_grad_()
    grad = torch.randn(2, 3, 6, 5, 4)
    ours = torch.autograd.grad(norm(x), (x, norm.weight, norm.bias), grad)
    ref = torch.autograd.grad(keras_instance_norm_reference(x, norm.weight, norm.bias, 1e-3),
                              (x, norm.weight, norm.bias), grad)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_instance_norm_constant_channel_has_finite_gradient():
    x = torch.ones(1, 2, 4, 4, 4, requires_grad=True)
    KerasInstanceNorm(2)(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad, torch.zeros_like(x.grad))


def test_instance_norm_keeps_dtype_under_bf16():
    x = torch.randn(1, 2, 4, 4, 4, dtype=torch.bfloat16, requires_grad=True)
    out = KerasInstanceNorm(2)(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_conv_norm_act_saves_one_full_size_tensor_per_op():
    """conv saves its input, the norm its input (conv output), the activation its input: 3 full tensors."""
    block = ConvNormAct(2, 2)
    x = torch.randn(1, 2, 8, 8, 8, requires_grad=True)
    full = []

    def pack(t):
        if t.numel() == x.numel():
            full.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    assert len(full) == 3


# -- the norm works through channel slices: exact, and smaller temporaries ------------------------------------


def _norm_step(x: torch.Tensor, norm: KerasInstanceNorm, grad: torch.Tensor):
    x = x.detach().requires_grad_()
    out = norm(x)
    return (out, *torch.autograd.grad(out, (x, norm.weight, norm.bias), grad))


@pytest.mark.parametrize("channels", [2, 5, 16])
def test_channel_sliced_norm_is_bitwise_the_unsliced_one(monkeypatch, channels):
    from brats_swap.model import unet

    torch.manual_seed(0)
    norm = KerasInstanceNorm(channels)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, channels, 12, 10, 8) * 3 + 1
    grad = torch.randn(2, channels, 12, 10, 8)
    assert len(unet._channel_chunks(x)) == 1  # small tensors are one slice
    whole = _norm_step(x, norm, grad)
    monkeypatch.setattr(unet, "_NORM_CHUNK_BYTES", 1)  # every tensor now takes the most slices
    chunks = unet._channel_chunks(x)
    assert len(chunks) == min(8, channels // 2) and all(c.stop - c.start >= 2 for c in chunks)
    assert chunks[0].start == 0 and chunks[-1].stop == channels
    sliced = _norm_step(x, norm, grad)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True))


def test_large_norm_backward_temporaries_are_a_fraction_of_the_input():
    # On the meta device (no memory used) a 192³ x 16-channel norm at batch 2 would be ~0.9 GB a tensor:
    # the slices keep each temporary of the backward to 1/8 of that.
    from brats_swap.model import unet

    x = torch.empty(2, 16, 192, 192, 192, device="meta")
    chunks = unet._channel_chunks(x)
    assert len(chunks) == 8 and all(c.stop - c.start == 2 for c in chunks)


# -- the decoder's convolutions over an upsampled or concatenated input save their parts -----------------


def _conv_grads(conv, inputs, grad, reference):
    """Output and gradients (inputs, weight, bias) of `conv(*inputs)`, or of `reference(conv, *inputs)`."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = reference(conv, *inputs) if reference else conv(*inputs)
    return (out, *torch.autograd.grad(out, (*inputs, conv.weight, conv.bias), grad))


def _upsample_then_conv(conv, x):
    return F.conv3d(F.interpolate(x, scale_factor=2, mode="nearest"), conv.weight, conv.bias, conv.stride, conv.padding)


def _cat_then_conv(conv, *parts):
    return F.conv3d(torch.cat(parts, dim=1), conv.weight, conv.bias, conv.stride, conv.padding)


@pytest.mark.parametrize("batch", [1, 2])
def test_prepared_input_convs_are_bitwise_the_plain_layers(monkeypatch, batch):
    from brats_swap.model import unet

    torch.manual_seed(0)
    upsample_conv = unet.NearestUpsampleConv3d(6, 4, 3, padding=1)
    concat_conv = unet.ConcatConv3d(8, 4, 3, padding=1)
    coarse = torch.randn(batch, 6, 5, 4, 3)
    skip, up = torch.randn(batch, 4, 10, 8, 6), torch.randn(batch, 4, 10, 8, 6)
    cases = [(upsample_conv, [coarse], _upsample_then_conv), (concat_conv, [skip, up], _cat_then_conv)]
    for conv, inputs, reference in cases:
        grad = torch.randn(batch, 4, 10, 8, 6)
        fused, plain = _conv_grads(conv, inputs, grad, None), _conv_grads(conv, inputs, grad, reference)
        assert all(torch.equal(a, b) for a, b in zip(fused, plain, strict=True))  # small: one backward call
        monkeypatch.setattr(unet, "_NORM_CHUNK_BYTES", 1)  # large: part by part, channel slice by slice
        sliced = _conv_grads(conv, inputs, grad, None)
        monkeypatch.undo()
        assert torch.equal(sliced[0], plain[0])  # the forward never slices
        for a, b in zip(sliced[1:], plain[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # sums over ~10³ products, other order


def test_decoder_saves_parts_not_the_upsampled_or_concatenated_tensor():
    """What autograd saves in a decoder level at 64³: the coarse input (1/8 of its upsampled copy) and the
    skip and upsampled tensors, never a 2F-channel tensor at the fine resolution."""
    from torch.autograd.graph import saved_tensors_hooks

    model = build_model(ModelConfig(base_filters=4, depth=3, segmentation_levels=2))
    fine_2f = 2 * 4 * 64**3  # elements of a 2F-channel tensor at level 0's resolution (batch 1)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(1, 4, 64, 64, 64)).sum().backward()
    assert max(saved) < fine_2f
    assert 4 * 64**3 in saved  # the level-0 skip (F channels), saved by the concatenating convolution
