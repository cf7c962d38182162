"""The planner on any network: structured outputs, presets in the model's own names, globs that match
nothing refused, the optimizer's state, the device overhead, and nnU-Net's published memory figures."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from brats_swap.config import MemoryConfig
from brats_swap.errors import ConfigError
from brats_swap.memory.planner import Planner, default_cost_model
from brats_swap.memory.presets import PRESETS, named_policies, resolve_presets
from brats_swap.memory.simulate import GIB
from brats_swap.memory.stages import check_globs, model_stages, unmatched_globs
from brats_swap.memory.trace import trace_step
from brats_swap.train.planning import traced_loss


class _TwoHeads(nn.Module):
    """A small encoder-decoder whose output is a structure of tensors: `kind` list, tuple or dict."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.down = nn.Conv3d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.head_low = nn.Conv3d(4, 3, 1)
        self.head_high = nn.Conv3d(4, 3, 1)

    def forward(self, x):
        low = torch.relu(self.down(x))
        outputs = [self.head_high(self.up(low)).sigmoid(), self.head_low(low).sigmoid()]
        if self.kind == "dict":
            return {"full": outputs[0], "half": outputs[1]}
        return outputs if self.kind == "list" else tuple(outputs)


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_the_tracer_gives_each_output_of_a_structure_its_own_target(kind):
    shape = (1, 2, 16, 16, 16)
    trace = trace_step(_TwoHeads(kind), shape, loss_fn=traced_loss)
    full, half = 3 * 16**3 * 4, 3 * 8**3 * 4  # one fp32 target per output, at that output's size
    assert trace.input_bytes == 2 * 16**3 * 4 + full + half
    assert trace.saved_bytes > 0


def _nnunet(residual: bool, strides: list, stages: int = 6) -> nn.Module:
    """nnU-Net's plain or residual-encoder U-Net as its planners build it for BraTS 2021: `stages` stages of
    32-64-128-256-320-320 features, 3³ kernels, ResEnc blocks 1,3,4,6,6,6 with one decoder convolution per
    stage (plain: two everywhere), instance norm, LeakyReLU, deep supervision."""
    unet = pytest.importorskip("dynamic_network_architectures.architectures.unet")
    common = dict(input_channels=4, n_stages=stages, features_per_stage=[32, 64, 128, 256, 320, 320][:stages],
                  conv_op=nn.Conv3d, kernel_sizes=3, strides=strides, num_classes=3, conv_bias=True,
                  norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU,
                  nonlin_kwargs={"inplace": True}, deep_supervision=True)
    if residual:
        return unet.ResidualEncoderUNet(n_blocks_per_stage=[1, 3, 4, 6, 6, 6][:stages], n_conv_per_stage_decoder=1,
                                        **common)
    return unet.PlainConvUNet(n_conv_per_stage=2, n_conv_per_stage_decoder=2, **common)


def _resenc() -> nn.Module:
    """A 4-stage residual encoder: phantom sizes (32³) keep every stage at 4 voxels or more."""
    return _nnunet(True, [1, 2, 2, 2], stages=4)


def test_presets_resolve_to_the_residual_encoders_own_stages():
    model = _resenc()
    shape = (1, 4, 32, 32, 32)
    stages = model_stages(model, shape)
    assert [(s.side, s.level) for s in stages] == [("encoder", i) for i in range(4)] + \
        [("decoder", i) for i in (2, 1, 0)]
    assert stages[0].modules == ["encoder.stem", "encoder.stages.0"]  # the decoder's reference to it is not a name
    policies = named_policies(sections=resolve_presets(model, shape))
    assert policies["hybrid"].swap.include == ["encoder.stem", "encoder.stages.0", "encoder.stages.1"]
    assert set(policies["swap_no_decoder"].swap.exclude) == {
        f"decoder.{part}.{i}" for part in ("stages", "transpconvs", "seg_layers") for i in range(3)}
    assert len(policies["recompute"].recompute.modules) == 4 + 1 + 9  # every stage, the stem with stage 0
    for name, cfg in policies.items():
        assert unmatched_globs(model, cfg) == [], name

    # The U-Net's own spelling names nothing here: a one-line error, never a silent no-op.
    unet_recompute = named_policies(sections=PRESETS)["recompute"]
    assert unmatched_globs(model, unet_recompute) == [("memory.recompute.modules", "encoder.level*"),
                                                      ("memory.recompute.modules", "decoder.level*")]
    with pytest.raises(ConfigError, match=r"^memory.recompute.modules: 'encoder.level\*' matches no module of "
                                          r"ResidualEncoderUNet .*top-level modules are: encoder, decoder$"):
        check_globs(model, unet_recompute)


def test_every_preset_does_something_on_a_residual_encoder():
    """Priced on the model's own stages, checkpointing and swapping lower the peak below keeping everything."""
    planner = Planner(_resenc(), (1, 4, 32, 32, 32), loss_fn=traced_loss)
    base = MemoryConfig()
    base.swap.min_bytes = 1 << 16
    predictions = {name: planner.predict(name, cfg) for name, cfg in named_policies(base, planner.presets).items()}
    none = predictions.pop("none")
    for name, prediction in predictions.items():
        assert prediction.peak_bytes < none.peak_bytes, name
    assert predictions["recompute"].recompute_flops > 0 and predictions["hybrid"].swapped_bytes > 0


def test_the_optimizer_state_is_the_configured_optimizers():
    from brats_swap.config import load_config
    from brats_swap.train import planning

    model = _TwoHeads("list")
    adam = Planner(model, (1, 2, 16, 16, 16), loss_fn=traced_loss, optimizer_state_factor=2)
    sgd = Planner(model, (1, 2, 16, 16, 16), loss_fn=traced_loss, optimizer_state_factor=1)
    assert adam.floor_bytes() - sgd.floor_bytes() == adam.trace().param_bytes
    config = load_config(None, [])
    assert planning.optimizer_state_factor(config) == 2  # Adam, the default
    config.train.optimizer = "sgd"  # `train.optimizer`: SGD with momentum keeps one buffer per parameter
    assert planning.optimizer_state_factor(config) == 1


def test_plan_cli_sizes_overhead_and_globs(tmp_path):
    from brats_swap.cli.main import app

    runner = CliRunner()
    base = ["plan", "--set", "model.base_filters=2", "--batch", "1", "--device", "gpu"]
    out = tmp_path / "plan.json"
    result = runner.invoke(app, [*base, "--size", "32", "48", "16", "--budget", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["input_shape"] == [1, 4, 32, 48, 16]
    assert report["device_overhead_gib"] == 2.0  # a GPU's default: the card holds it before the first tensor
    none = next(row for row in report["policies"] if row["name"] == "none")
    assert 2.0 < none["predicted_peak_gib"] < 2.5 and report["floor_gib"] > 2.0

    result = runner.invoke(app, [*base, "--size", "32", "48"])
    assert result.exit_code == 2 and "plan --size: expected one edge or three" in result.output  # a usage error
    result = runner.invoke(app, [*base, "--size", "32", "--set", "memory.mode=recompute",
                                 "--set", "memory.recompute.modules=[encoder.stages.*]"])
    assert result.exit_code == 2
    assert "memory.recompute.modules: 'encoder.stages.*' matches no module of Isensee2017UNet" in result.output
    assert len(result.output.strip().splitlines()) == 1


# nnU-Net's BraTS 2021 plans (its planners, 2.8.1) and the GPU memory it reports for them under fp16 AMP
# (resenc_presets.md): (network, input shape, published GB).
_STRIDES_128_160_112 = [1, 2, 2, 2, 2, (2, 2, 1)]  # the 112 axis stops halving at 7 voxels
_NNUNET = {
    "default": (lambda: _nnunet(False, _STRIDES_128_160_112), (2, 4, 128, 160, 112), 7.7),
    "resenc_m": (lambda: _nnunet(True, _STRIDES_128_160_112), (2, 4, 128, 160, 112), 9.1),
    "resenc_l": (lambda: _nnunet(True, [1, 2, 2, 2, 2, 2]), (3, 4, 160, 192, 160), 22.7),
    "resenc_xl": (lambda: _nnunet(True, [1, 2, 2, 2, 2, 2]), (5, 4, 160, 192, 160), 36.6),
}


@pytest.mark.parametrize("network", list(_NNUNET))
def test_no_policy_peak_is_within_15_percent_of_nnunets_published_memory(network):
    """Meta-device traces at nnU-Net's plans (seconds each): the no-policy peak on the card (tensors plus
    the GPU's default device overhead) within 15% of the GPU memory nnU-Net reports for the same plan."""
    build, shape, published = _NNUNET[network]
    planner = Planner(build(), shape, dtype=torch.float16, loss_fn=traced_loss,
                      cost=default_cost_model("gpu", torch.float16))
    none = planner.predict("none", MemoryConfig(device_overhead_gib=2.0))
    assert abs(none.peak_bytes / GIB - published) <= 0.15 * published, none.peak_bytes / GIB
