"""The planner on any network: structured outputs, presets in the model's own names, globs that match
nothing refused, the optimizer's state, the device overhead, and nnU-Net's published memory figures."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from brats_swap.config import MemoryConfig
from brats_swap.errors import ConfigError
from brats_swap.memory.planner import Planner
from brats_swap.memory.presets import PRESETS, named_policies, resolve_presets
from brats_swap.memory.recorder import trace_step
from brats_swap.memory.simulate import GIB
from brats_swap.memory.stages import check_globs, model_stages, unmatched_globs
from brats_swap.train.losses import SegmentationLoss


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


def _dice_over(outputs, target):
    """A deep-supervision loss for any output structure: each output against the target at its size."""
    loss = SegmentationLoss("dice", from_logits=False)
    return loss(list(outputs.values()) if isinstance(outputs, dict) else outputs, target)


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_the_tracer_takes_a_structure_of_outputs(kind):
    """A network without `out_channels` whose output is a list, tuple or dict: the target is shaped as its
    first (full-resolution) output, and every output's loss is part of the step."""
    shape = (1, 2, 16, 16, 16)
    trace = trace_step(_TwoHeads(kind), shape, loss_fn=_dice_over)
    assert trace.input_bytes == 2 * 16**3 * 4 + 3 * 16**3 * 4  # the batch and one fp32 target
    heads = {trace.ops[i].module for i in range(trace.fwd_end)} & {"head_low", "head_high"}
    assert heads == {"head_low", "head_high"}



@pytest.mark.parametrize("kind", ["list", "dict"])
def test_the_device_profile_times_a_structure_of_outputs(kind):
    """`profile_device` (a CUDA device's measured time model) on a deep-supervision network; the CPU runs the
    same code path without the link measurement."""
    from brats_swap.memory.device_profile import profile_device

    cost = profile_device(_TwoHeads(kind), torch.device("cpu"), loss_fn=_dice_over, cube=8, steps=1)
    assert cost.fwd_scale > 0 and cost.bwd_scale > 0
    assert cost.name == "measured on cpu at 8³ batch 1"


def _config(*overrides: str):
    from brats_swap.config import load_config

    return load_config(None, list(overrides))


def _resenc(cube: int = 32) -> nn.Module:
    """nnU-Net's residual-encoder U-Net at a phantom cube: its plan adapted to `cube`³ (32: 4 stages, blocks
    1-3-4-6; 16: 3 stages), with a quarter of the features (cheap on 2 CPU cores; the structure is what
    these tests are about)."""
    from brats_swap.model import build_model

    torch.manual_seed(0)
    stages = 4 if cube == 32 else 3
    features = ",".join(str(f) for f in [8, 16, 32, 64][:stages])
    return build_model(_config("model.name=resenc_l", f"data.cube=[{cube},{cube},{cube}]",
                               f"model.features=[{features}]").model)


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
                                          r"ResidualEncoderUNetBraTS .*top-level modules are: encoder, decoder$"):
        check_globs(model, unet_recompute)


def test_every_preset_does_something_on_a_residual_encoder():
    """Priced on the model's own stages, checkpointing and swapping lower the peak below keeping everything."""
    model = _resenc()
    planner = Planner(model, (1, 4, 32, 32, 32), loss_fn=SegmentationLoss("dice", from_logits=True))
    base = MemoryConfig()
    base.swap.min_bytes = 1 << 16
    predictions = {name: planner.predict(name, cfg) for name, cfg in named_policies(base, planner.presets).items()}
    none = predictions.pop("none")
    for name, prediction in predictions.items():
        assert prediction.peak_bytes < none.peak_bytes, name
    assert predictions["recompute"].recompute_flops > 0 and predictions["hybrid"].swapped_bytes > 0


def _step_grads(model: nn.Module, engine, x, y, loss_fn) -> tuple[torch.Tensor, list]:
    with engine.step() if engine is not None else contextlib.nullcontext():
        loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]  # the lowest output's head has none


def test_no_prefetch_misses_on_a_residual_encoder_planned_and_run():
    """Every swappable storage of nnU-Net's residual encoder swapped, norm and activation outputs rebuilt:
    the planner predicts no use without a reload issued ahead at any lookahead (its blocks are the
    ConvDropoutNormReLU units, one marker each), the engine runs it so with no norm left out, and the
    gradients are bitwise plain PyTorch's."""
    from brats_swap.memory import MemoryEngine

    policy = MemoryConfig(mode="hybrid")
    policy.swap.min_bytes, policy.recompute.norm_act = 0, True
    loss = SegmentationLoss("dice", from_logits=True)
    shape = (1, 4, 16, 16, 16)
    planner = Planner(_resenc(16), shape, loss_fn=loss)
    for lookahead in (0, 1, 2, 4):
        policy.swap.lookahead = lookahead
        predicted = planner.predict("hybrid", policy)
        assert predicted.swapped_bytes > 0 and predicted.prefetch_misses == 0, lookahead

    policy.swap.lookahead = 1
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(shape, generator=generator), (torch.rand((1, 3, 16, 16, 16), generator=generator) > 0.7).float()
    plain_loss, plain_grads = _step_grads(_resenc(16), None, x, y, loss)
    model = _resenc(16)
    engine = MemoryEngine(model, policy)
    try:
        engine_loss, engine_grads = _step_grads(model, engine, x, y, loss)
        stats = engine.last_stats()
    finally:
        engine.close()
    assert torch.equal(plain_loss, engine_loss)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(plain_grads, engine_grads, strict=True))
    assert sum(g is not None for g in engine_grads) > 0
    assert stats.swapped_out_bytes > 0 and stats.prefetch_misses == 0
    # norm_act rebuilds every norm of it: each norm's input (a convolution's output) is a stored tensor.
    assert stats.recomputed_bytes > 0 and stats.norm_act_skipped == {}


def test_the_optimizer_state_is_the_configured_optimizers():
    from brats_swap.config import load_config
    from brats_swap.train import planning

    model = _TwoHeads("list")
    adam = Planner(model, (1, 2, 16, 16, 16), loss_fn=_dice_over, optimizer_state_factor=2)
    sgd = Planner(model, (1, 2, 16, 16, 16), loss_fn=_dice_over, optimizer_state_factor=1)
    assert adam.floor_bytes() - sgd.floor_bytes() == adam.trace().param_bytes
    assert planning.optimizer_state_factor(load_config(None, [])) == 2  # Adam's two moments, the default
    # SGD with momentum keeps one buffer per parameter
    assert planning.optimizer_state_factor(load_config(None, ["train.optimizer=sgd"])) == 1


def test_plan_cli_sizes_overhead_and_globs(tmp_path):
    from brats_swap.cli.main import app

    runner = CliRunner()
    # Priced eager: what is checked here does not depend on the step priced, and tracing the compiled step (the
    # default on a GPU) compiles its blocks, 10 s of CPU (the compiled step's price, and `plan` saying which step
    # it priced: tests/test_planner_compiled.py::test_the_planner_prices_the_step_the_run_compiles).
    base = ["plan", "--set", "model.base_filters=2", "--set", "train.compile=false", "--batch", "1", "--device", "gpu"]
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


@pytest.mark.parametrize("network", ["nnunet", "resenc_m", "resenc_l", "resenc_xl"])
def test_no_policy_peak_is_within_15_percent_of_nnunets_published_memory(network):
    """Meta-device traces at nnU-Net's BraTS 2021 plans (its patch, batch, fp16 AMP, SGD, Dice + BCE on
    regions; seconds each): the no-policy peak on the card (tensors plus a GPU's default device overhead)
    within 15% of the GPU memory nnU-Net reports for the same plan, for the network built as nnU-Net builds
    it (`model.inplace_act=view`; the default build's backward is leaner, `tests/test_inplace_act.py`)."""
    from brats_swap.config.networks import NNUNET_PRESETS
    from brats_swap.train import planning

    preset = NNUNET_PRESETS[network]
    config = _config(f"model.name={network}", "data.cube=[{},{},{}]".format(*preset.patch),
                     f"train.batch_size={preset.batch_size}", "train.amp=fp16", "train.optimizer=sgd",
                     "train.loss=dice_bce", "model.outputs=regions", "model.inplace_act=view")
    model = planning.config_model(config)
    planner = Planner(model, planning.training_input_shape(config), dtype=torch.float16,
                      loss_fn=planning.training_loss(config.train.loss, model),
                      optimizer_state_factor=planning.optimizer_state_factor(config))
    none = planner.predict("none", MemoryConfig(device_overhead_gib=2.0))
    published = preset.published_vram_gb
    assert abs(none.peak_bytes / GIB - published) <= 0.15 * published, none.peak_bytes / GIB
