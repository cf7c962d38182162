"""MedNeXt (MONAI's, the MICCAI 2023 paper's S/B/M/L) as `model.name` builds it, and under the memory engine.

The variants are `create_mednext`'s, parameter for parameter; a tiny MedNeXt-L (4 initial filters, one block
per stage, 16³-32³) trains bitwise equal to plain PyTorch under every policy, and `recompute.norm_act` replays
each block's GroupNorm and the GELU after its 1x1x1 expansion from the stored convolution outputs.
"""

from __future__ import annotations

import pytest
import torch
from memory_helpers import assert_same_history, sgd_history
from monai.networks.nets.mednext import create_mednext

from brats_swap.config import ConfigError, load_config
from brats_swap.memory import MemoryEngine
from brats_swap.model import build_model

TINY = ("model.features=[4]", "model.blocks=[1,1,1,1,1,1,1,1,1]")
POLICIES = {
    "swap": {"mode": "swap", "swap": {"min_bytes": 0}},
    "recompute": {"mode": "recompute", "recompute": {"modules": ["enc_stages.*", "dec_stages.3"]}},
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    # what auto plans for whole volumes: blocks checkpointed, norm_act in the others
    "recompute_norm_act": {"mode": "recompute", "recompute": {"modules": ["enc_stages.0", "up_blocks.*"],
                                                              "norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"min_bytes": 0}, "recompute": {"norm_act": True}},
}


def tiny_mednext(name: str = "mednext_l", *extra: str, seed: int = 0) -> torch.nn.Module:
    config = load_config(None, [f"model.name={name}", *TINY, "data.cube=[16,16,32]", *extra])
    torch.manual_seed(seed)
    return build_model(config.model, 3)


@pytest.mark.parametrize("variant", "SBML")
def test_each_variant_is_monais_create_mednext_with_deep_supervision(variant):
    config = load_config(None, [f"model.name=mednext_{variant.lower()}", "model.kernel_size=5"])
    network = build_model(config.model, 3)
    reference = create_mednext(variant, in_channels=4, out_channels=3, kernel_size=5, deep_supervision=True)
    assert {k: v.shape for k, v in network.state_dict().items()} == \
        {k: v.shape for k, v in reference.state_dict().items()}
    if variant == "L":
        assert sum(p.numel() for p in network.parameters()) == 62_943_407  # the paper's 61.8 M + 4-channel heads


def test_training_returns_five_outputs_full_resolution_first_and_eval_probabilities():
    network = tiny_mednext("mednext_l", "data.cube=[32,32,32]")
    x = torch.randn(1, 4, 32, 32, 32)
    outputs = network(x)
    assert [tuple(o.shape[2:]) for o in outputs] == [(32,) * 3, (16,) * 3, (8,) * 3, (4,) * 3, (2,) * 3]
    network.eval()
    with torch.no_grad():
        probs = network(x)
    assert probs.shape == (1, 3, 32, 32, 32) and 0 <= probs.min() and probs.max() <= 1
    assert not network.do_ds  # the heads are not computed in eval


def test_a_kernel_other_than_3_or_5_and_a_wrong_stage_count_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"^model\.kernel_size: MedNeXt's depthwise kernel is 3 or 5"):
        load_config(None, ["model.name=mednext_s", "model.kernel_size=7"])
    with pytest.raises(ConfigError, match=r"^model\.blocks: MedNeXt has 9 stages"):
        load_config(None, ["model.name=mednext_s", "model.blocks=[1,1]"])
    with pytest.raises(ConfigError, match=r"^data\.cube: each size must be divisible by 16"):
        load_config(None, ["model.name=mednext_s", "data.cube=[24,24,24]"])
    with pytest.raises(ConfigError, match=r"^data\.cube: MedNeXt needs an edge of at least 32"):
        load_config(None, ["model.name=mednext_s", "data.cube=[16,16,16]"])


def _loss(outputs, target):
    return sum(o.square().mean() / 2**i for i, o in enumerate(outputs))


def _history(policy, steps: int = 2):
    model = tiny_mednext()
    engine = MemoryEngine(model, policy) if policy is not None else None
    history, stats = sgd_history(model, engine, lambda step: (torch.randn(1, 4, 16, 16, 32,
                                 generator=torch.Generator().manual_seed(step)), None), _loss, steps)
    return history, stats, engine


@pytest.fixture(scope="module")
def plain():
    return _history(None)[0]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_trains_mednext_bitwise_equal_to_plain_pytorch(plain, policy):
    tested, stats, engine = _history(POLICIES[policy])
    assert_same_history(plain, tested, policy)
    if policy in ("norm_act", "recompute_norm_act", "hybrid"):
        for step in stats:
            # Inside a checkpointed block the norms' inputs are the checkpoint's to rebuild: said, not replayed.
            assert step.recomputed_bytes > 0
            if policy != "recompute_norm_act":
                assert step.norm_act_skipped == {}
                continue
            inside = {name for name in step.norm_act_skipped if name.startswith(("enc_stages.0.", "up_blocks."))}
            assert inside and set(step.norm_act_skipped) == inside
            assert all("not a tensor the engine stores" in step.norm_act_skipped[name] for name in inside)
        kinds = {name.rsplit(".", 1)[-1]: kind for name, kind in engine.recipes.recognised.items()}
        assert kinds["norm"] == "norm" and kinds["act"] == "act"


def test_norm_act_recomputes_the_groupnorm_and_the_gelu_after_the_expansion():
    """Per MedNeXt block, norm_act rebuilds the GroupNorm output (conv2's input) and the GELU output
    (conv3's input, the expansion's width): the bytes it recomputes are those tensors' bytes."""
    model = tiny_mednext()
    sizes = {}

    def record(name):
        def hook(module, args, output):
            sizes[name] = output.untyped_storage().nbytes()
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.GroupNorm | torch.nn.GELU):
            module.register_forward_hook(record(name))
    engine = MemoryEngine(model, POLICIES["norm_act"])
    x = torch.randn(1, 4, 16, 16, 32, generator=torch.Generator().manual_seed(0))
    with engine.step():
        loss = _loss(model(x), None)
    loss.backward()
    stats = engine.last_stats()
    assert stats.norm_act_skipped == {}
    assert any(name.endswith(".act") for name in sizes)
    assert stats.recomputed_bytes == sum(sizes.values())


def test_the_loss_weighs_all_five_outputs_as_mednexts_trainer():
    """MedNeXt's trainer plans 6 deep-supervision levels for its 5 outputs: weights 1/2^i of all five, the
    sixth (absent) off, normalised by 1.9375 (nnU-Net's own rule would drop the 1/16 output)."""
    from brats_swap.train.losses import training_loss

    network = tiny_mednext()
    loss = training_loss("dice_ce", network)
    outputs = [torch.zeros(1, 3, *(32 // 2**i,) * 3) for i in range(5)]
    outputs[4] = outputs[4].requires_grad_()
    target = torch.zeros(1, 3, 32, 32, 32)
    loss(outputs, target).backward()
    assert outputs[4].grad.abs().sum() > 0  # the 1/16 output trains
    import brats_swap.train.losses as losses
    weights = losses.deep_supervision_weights(5, lowest_on=True)
    assert weights == pytest.approx([1 / 1.9375, 0.5 / 1.9375, 0.25 / 1.9375, 0.125 / 1.9375, 0.0625 / 1.9375])


def test_the_planner_predicts_the_engines_bytes_under_norm_act_and_hybrid():
    """The planner's trace sees the same recipes as the engine (the GELU of each expansion included): the
    peak resident saved bytes it predicts are the engine's, byte for byte."""
    from brats_swap.memory.cost import INSTANT
    from brats_swap.memory.engine import memory_config_from
    from brats_swap.memory.planner import Planner
    from brats_swap.train.losses import weighted_dice_loss

    shape = (1, 4, 16, 16, 32)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(*shape, generator=generator), (torch.rand(1, 3, *shape[2:], generator=generator) > 0.8).float()
    single = ("model.deep_supervision=false",)  # one output: the loss the planner traces takes (output, target)
    planner = Planner(tiny_mednext("mednext_l", *single), shape, loss_fn=weighted_dice_loss, cost=INSTANT)
    for name in ("norm_act", "hybrid"):
        cfg = memory_config_from(POLICIES[name])
        predicted = planner.predict(name, cfg)
        model = tiny_mednext("mednext_l", *single)
        engine = MemoryEngine(model, cfg)
        with engine.step():
            loss = weighted_dice_loss(model(x), y)
        loss.backward()
        stats = engine.last_stats()
        assert stats.recomputed_bytes > 0
        assert (predicted.saved_bytes, predicted.peak_resident_saved_bytes) == \
            (stats.saved_bytes, stats.peak_resident_saved_bytes), name


def test_the_gpu_time_model_prices_depthwise_convolutions_at_a_tenth_of_the_dense_rate():
    from brats_swap.memory.cost import GPU_GROUPED_EFFICIENCY, default_cost_model
    from brats_swap.memory.recorder import trace_step

    network = torch.nn.Sequential(torch.nn.Conv3d(8, 8, 5, padding=2, groups=8), torch.nn.Conv3d(8, 8, 1))
    trace = trace_step(network, (1, 8, 16, 16, 16), loss_fn=lambda out, target: out.square().mean())
    grouped = [i for i, op in enumerate(trace.ops) if op.grouped]
    assert {trace.ops[i].name for i in grouped} == {"convolution", "convolution_backward"}  # forward and backward
    assert not any(op.grouped for op in trace.ops if op.name == "convolution" and op.flops < trace.ops[grouped[0]].flops / 2)
    cost = default_cost_model("gpu", torch.float16)
    dense = default_cost_model("gpu", torch.float16)
    dense.grouped_efficiency = 1.0
    for i in grouped:
        op = trace.ops[i]
        assert cost.durations(trace)[i] - dense.durations(trace)[i] == pytest.approx(
            op.flops / cost.flops_per_s * (1 / GPU_GROUPED_EFFICIENCY - 1))
