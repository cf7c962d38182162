"""Compiled steps under the memory engine (`brats_swap.memory.compiled`, `brats_swap.run.compiling`).

Every policy gives bitwise the weights of `none`, both compiled; a known shape never compiles again; a failed
compilation runs eager with one line. Compiling is expensive on a CPU: the networks are tiny (16³, 2-4
filters), each is compiled once per test process (dynamo caches per code object, so a new instance of the same
network reuses the graphs: which is also what the no-recompilation assertions check), and the fallback tests
use backends that fail at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from memory_helpers import assert_same_history, batch, dice_loss, sgd_history
from torch import nn
from torch._dynamo.utils import counters

from brats_swap.config import ModelConfig
from brats_swap.memory import (
    CompiledRegions,
    MemoryEngine,
    compile_wanted,
    compiled_regions,
    is_compile_failure,
)
from brats_swap.memory.compiled import compile_cause
from brats_swap.memory.engine import memory_config_from
from brats_swap.model import build_model
from brats_swap.run.compiling import StepCompilation, minutes_seconds

# The project's U-Net, as small as it compiles in seconds: depth 3, 2 base filters, dropout on.
UNET = ModelConfig(base_filters=2, depth=3, segmentation_levels=2, dropout=0.3)
CUBE = 16
STEPS = 2

# The presets (`memory.presets.PRESETS`) with min_bytes 0, so a 16³ volume swaps its activations.
UNET_POLICIES = {
    "swap_all": {"mode": "swap", "swap": {"min_bytes": 0}},
    "swap_first_n": {"mode": "swap", "swap": {"tensors": 18, "min_bytes": 0}},
    "swap_no_decoder": {"mode": "swap", "swap": {"exclude": ["decoder.*"], "min_bytes": 0}},
    "swap_no_decoder_lookahead": {"mode": "swap", "swap": {"exclude": ["decoder.*"], "lookahead": 3, "min_bytes": 0}},
    "recompute": {"mode": "recompute", "recompute": {"modules": ["encoder.level*", "decoder.level*"]}},
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"include": ["encoder.level0", "encoder.level1"], "lookahead": 2,
                                          "min_bytes": 0}, "recompute": {"norm_act": True}},
    # As the planner writes its choices (module by module, from the eager trace): inside the compiled blocks.
    "swap_inner_globs": {"mode": "swap", "swap": {"include": ["encoder.level0.in_conv.act", "decoder.*.norm"],
                                                  "exclude": ["encoder.level0.context.block1.conv"], "min_bytes": 0}},
}


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (a recompilation adds one)."""
    return counters["stats"]["unique_graphs"]


def compiled_history(make_model, policy, make_batch, loss_fn, steps: int = STEPS, granularity: str = "chains"):
    """`sgd_history` of a fresh model with its regions compiled, under `policy` (None: no engine)."""
    model = make_model()
    regions = CompiledRegions(model, granularity=granularity)
    engine = MemoryEngine(model, policy) if policy is not None else None
    try:
        history, stats = sgd_history(model, engine, make_batch, loss_fn, steps)
    finally:
        if engine is not None:
            engine.close()
        regions.remove()
    return history, stats


def make_unet() -> nn.Module:
    torch.manual_seed(0)
    return build_model(UNET)


@pytest.fixture(scope="module")
def unet_none():
    """`none` compiled: the reference, and the number of graphs it compiled."""
    history, _ = compiled_history(make_unet, None, lambda step: batch(step, CUBE), dice_loss)
    return history, graphs_compiled()


@pytest.mark.parametrize("name", list(UNET_POLICIES))
def test_unet_policies_compiled_are_bitwise_none_compiled(unet_none, name):
    reference, graphs = unet_none
    history, stats = compiled_history(make_unet, UNET_POLICIES[name], lambda step: batch(step, CUBE), dice_loss)
    assert_same_history(reference, history, f"{name} compiled")
    last = stats[-1]
    assert last.saved_bytes > 0
    if "swap" in name or name == "hybrid":
        assert last.swapped_out_bytes > 0 and last.swapped_in_bytes > 0
    if name == "recompute":
        assert last.recomputed_modules > 0
    if name in ("norm_act", "hybrid"):
        # Each block's norm -> activation chain is one compiled region: its output is rebuilt by replaying that
        # compiled graph (bitwise, asserted above), so no module is left out.
        assert last.recomputed_tensors > 0 and last.recomputed_bytes > 0
        assert last.norm_act_skipped == {}
    if name == "swap_inner_globs":  # the globs name the blocks around the chains' layers
        model = make_unet()
        regions = CompiledRegions(model)
        cfg = regions.at_block_granularity(memory_config_from(UNET_POLICIES[name]))
        regions.remove()
        assert cfg.swap.include[0] == "encoder.level0.in_conv" and "decoder.level0.upsample.block" in cfg.swap.include
        # The convolution runs eager, outside its block's compiled chain: its exclusion holds as written.
        assert cfg.swap.exclude == ["encoder.level0.context.block1.conv"]
    # The same network again (a new instance, another policy): no graph compiled again.
    assert graphs_compiled() == graphs, f"{name}: {graphs_compiled() - graphs} recompilation(s)"


def test_compiled_differs_from_eager_by_little(unet_none):
    """Eager and compiled are different kernels: the weights after the steps differ by rounding only."""
    reference, _ = unet_none
    model = make_unet()
    eager, _ = sgd_history(model, None, lambda step: batch(step, CUBE), dice_loss, STEPS)
    largest = max(float((a - b).abs().max()) for a, b in zip(eager[-1][2], reference[-1][2], strict=True))
    print(f"largest weight difference, eager against compiled: {largest:.2g}")
    assert largest < 1e-3, largest


def test_nnunet_swap_all_compiled_is_bitwise_none_compiled():
    """nnU-Net's plain U-Net (its in-place LeakyReLU written on the norm's base when eager), deep supervision off:
    swap_all compiled raised a false in-place modification before the network traced nnU-Net's own call."""
    from brats_swap.config import load_config

    cfg = load_config(None, ["model.name=nnunet", f"data.cube=[{CUBE},{CUBE},{CUBE}]", "model.features=[2,4,8]",
                             "model.deep_supervision=false"]).model

    def make():
        torch.manual_seed(0)
        return build_model(cfg)

    def loss_fn(logits, target):
        return dice_loss(torch.sigmoid(logits), target)

    reference, _ = compiled_history(make, None, lambda step: batch(step, CUBE), loss_fn)
    graphs = graphs_compiled()
    history, stats = compiled_history(make, UNET_POLICIES["swap_all"], lambda step: batch(step, CUBE), loss_fn)
    assert_same_history(reference, history, "nnunet swap_all compiled")
    assert stats[-1].swapped_out_bytes > 0
    # norm_act replays each compiled InstanceNorm -> in-place LeakyReLU chain from the convolution's output.
    history, stats = compiled_history(make, UNET_POLICIES["norm_act"], lambda step: batch(step, CUBE), loss_fn)
    assert_same_history(reference, history, "nnunet norm_act compiled")
    assert stats[-1].recomputed_tensors > 0 and stats[-1].norm_act_skipped == {}
    assert graphs_compiled() == graphs, "a policy compiled again"


# ---------------------------------------------------------------------------------------------- regions


def test_regions_are_chains_after_eager_convolutions_unless_blocks_are_asked_for():
    """One place decides the regions: a block whose forward is conv -> pointwise chain (a Sequential, or a class
    declaring it, as the U-Net's ConvNormAct) compiles only its chain; a bare convolution stays eager; any other
    block (a norm with running statistics, a Linear between norms) compiles whole; `blocks` compiles each
    block whole. Nothing compiles before a call."""
    from brats_swap.memory.compiled import split_block

    model = make_unet()
    block = dict(model.named_modules())["encoder.level0.in_conv"]
    compute, chain = split_block(block)
    assert compute is block.conv and [name for name, _layer in chain] == ["norm", "act"]
    regions = CompiledRegions(model)
    names = dict(regions.regions)
    assert "encoder.level0.in_conv" in names and all(not isinstance(m, nn.Conv3d) for m in names.values())
    assert regions.region_around(block.norm) == "encoder.level0.in_conv" and regions.region_around(block.conv) is None
    assert [name for name, _chain in regions.chains][0] == "encoder.level0.in_conv.norm+act"
    # The chains' 3-D convolutions run oneDNN's kernel (3x3x3 here); the 1x1x1 heads keep torch's.
    assert "encoder.level0.in_conv" in regions.onednn and "forward" in vars(block.conv)
    assert set(regions.onednn) <= set(names)
    regions.remove()
    assert "forward" not in vars(block) and "forward" not in vars(block.conv)
    regions = CompiledRegions(model, convolutions="torch")
    assert regions.onednn == [] and "forward" not in vars(block.conv)
    regions.remove()
    regions = CompiledRegions(model, granularity="blocks")
    assert regions.region_around(block.conv) == "encoder.level0.in_conv" and regions.chains == []
    regions.remove()

    resnet = BatchNormResNet()
    assert split_block(resnet.stem) is None  # BatchNorm3d keeps running statistics: a replay would update them twice
    regions = CompiledRegions(resnet)
    assert [name for name, _module in regions.regions] == ["stem", "stage"] and regions.chains == []
    regions.remove()
    with pytest.raises(ValueError, match="granularity"):
        CompiledRegions(resnet, granularity="layers")


def test_a_chains_convolution_runs_onednn_on_the_cpu_in_float32_and_torchs_choice_elsewhere():
    """torch runs a 4-channel 16³ convolution of a batch of 1 with its own im2col kernel, forward and backward; a
    compiled chain's convolution runs oneDNN's forward convolutions for its forward and, at stride 1, its
    backward (`OneDNNConvolution`); at stride 2 the forward only, from 24³. Outputs and gradients are those of a float64
    convolution up to float32 rounding. A 1x1x1 kernel, an input under 8³ voxels, a batch of 2, autocast and
    float64 keep torch's choice."""
    from brats_swap.memory.compiled import onednn_convolution, takes_onednn

    def kernels(run, *args) -> set[str]:
        with torch.profiler.profile() as profile:
            run(*args).sum().backward()
        return {event.name for event in profile.events() if event.name in (
            "aten::mkldnn_convolution", "aten::slow_conv3d_forward", "aten::convolution_backward")}

    def against_float64(conv, x) -> float:
        """The largest error of output and gradients relative to the float64 convolution's."""
        conv.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        out = onednn_convolution(conv, x)
        grad = torch.randn_like(out)
        out.backward(grad)
        double = copy.deepcopy(conv).double()
        x64 = x.detach().double().requires_grad_()
        out64 = double(x64)
        out64.backward(grad.double())
        pairs = [(out, out64), (x.grad, x64.grad), (conv.weight.grad, double.weight.grad),
                 (conv.bias.grad, double.bias.grad)]
        conv.zero_grad(set_to_none=True)
        return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in pairs)

    torch.manual_seed(0)
    x = torch.randn(1, 4, CUBE, CUBE, CUBE)
    x24 = torch.randn(1, 4, 24, 24, 24)  # oneDNN's forward alone gains from 24³ up
    for conv, inp in ((nn.Conv3d(4, 6, 3, padding=1), x), (nn.Conv3d(4, 6, (3, 1, 2), padding=(0, 0, 1)), x),
                      (nn.Conv3d(4, 6, 3, stride=2, padding=1), x24)):
        assert takes_onednn(conv)
        assert kernels(conv, inp) == {"aten::slow_conv3d_forward", "aten::convolution_backward"}
        backward = set() if conv.stride == (1, 1, 1) else {"aten::convolution_backward"}
        assert kernels(onednn_convolution, conv, inp) == {"aten::mkldnn_convolution", *backward}
        assert against_float64(conv, inp) < 1e-5
        assert not torch.equal(onednn_convolution(conv, inp), conv(inp))  # another kernel: not the same rounding
    stride2 = nn.Conv3d(4, 6, 3, stride=2, padding=1)
    assert kernels(onednn_convolution, stride2, x) == kernels(stride2, x)  # its forward alone: not under 24³
    conv = nn.Conv3d(4, 4, 3, padding=1)
    for other in (torch.randn(1, 4, 4, 4, 4), torch.randn(2, 4, CUBE, CUBE, CUBE)):  # under 8³; a batch of 2
        assert kernels(onednn_convolution, conv, other) == kernels(conv, other)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's own cast and kernel, as eager
        out = onednn_convolution(conv, x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, conv(x))
    conv64 = nn.Conv3d(4, 4, 3, padding=1).double()
    assert kernels(onednn_convolution, conv64, x.double()) == kernels(conv64, x.double())
    assert not takes_onednn(nn.Conv3d(4, 3, 1)) and not takes_onednn(nn.Conv3d(4, 4, 3, groups=2))
    assert not takes_onednn(nn.Conv3d(4, 4, 3, padding="same")) and not takes_onednn(nn.ConvTranspose3d(4, 4, 2))
    with pytest.raises(ValueError, match="convolutions"):
        CompiledRegions(make_unet(), convolutions="mkl")


def _chain_net() -> nn.Module:
    """A conv -> InstanceNorm -> LeakyReLU -> channel dropout chain, then a 1x1 head: the dropout runs inside the
    compiled chain, so norm_act's replay must draw the forward's mask again."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True), nn.LeakyReLU(0.1),
                      nn.Dropout3d(0.5)),
        nn.Conv3d(4, 3, 1), nn.Sigmoid())


def test_norm_act_replays_a_compiled_chain_with_dropout_bitwise_and_without_recompiling():
    make_batch = lambda step: batch(step, OTHER_CUBE)  # noqa: E731
    reference, _ = compiled_history(_chain_net, None, make_batch, dice_loss)
    graphs = graphs_compiled()
    history, stats = compiled_history(_chain_net, UNET_POLICIES["norm_act"], make_batch, dice_loss)
    assert_same_history(reference, history, "norm_act with dropout compiled")
    # The chain's output (after dropout) is rebuilt, not stored: what the head saves is recomputed.
    assert stats[-1].recomputed_tensors == 1 and stats[-1].norm_act_skipped == {}
    assert graphs_compiled() == graphs, "the replay compiled another graph"


def test_blocks_granularity_keeps_norm_act_tensors_with_a_reason():
    """Compiled whole, a block fuses its norm and activation with the convolution: norm_act keeps them (a replay
    of the eager modules would not be the fused kernel's bits) and says so per module; bitwise all the same."""
    make_batch = lambda step: batch(step, OTHER_CUBE)  # noqa: E731
    reference, _ = compiled_history(_chain_net, None, make_batch, dice_loss, granularity="blocks")
    history, stats = compiled_history(_chain_net, UNET_POLICIES["norm_act"], make_batch, dice_loss,
                                      granularity="blocks")
    assert_same_history(reference, history, "norm_act blocks compiled")
    assert stats[-1].recomputed_tensors == 0
    assert any("compiled region" in reason for reason in stats[-1].norm_act_skipped.values())


# ---------------------------------------------------------------------------------------------- networks unlike ours


class BatchNormResNet(nn.Module):
    """A 3D residual net with BatchNorm (running statistics), ReLU (which saves its output), channel dropout and
    a residual sum: none of the U-Net's modules."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU())
        self.stage = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.Dropout3d(0.2))
        self.head = nn.Conv3d(4, 3, 1)

    def forward(self, x):
        h = self.stem(x)
        return torch.sigmoid(self.head(h + self.stage(h)))


class TokenMixer(nn.Module):
    """A transformer-like net over the voxels as tokens: Linear, LayerNorm, GELU, dropout, attention by matmul."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.attend = nn.ModuleDict({"norm": nn.LayerNorm(width), "qkv": nn.Linear(width, 3 * width)})
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(2 * width, width))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        tokens = self.embed(x.flatten(2).transpose(1, 2))  # (B, voxels, width)
        q, k, v = self.attend["qkv"](self.attend["norm"](tokens)).chunk(3, dim=-1)
        tokens = tokens + torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1) @ v
        tokens = tokens + self.mlp(tokens)
        return torch.sigmoid(self.out(tokens)).transpose(1, 2).reshape(x.shape[0], 3, *x.shape[2:])


OTHER_CUBE = 8
OTHER_POLICIES = {
    "swap_all": {"mode": "swap", "swap": {"min_bytes": 0}},
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"min_bytes": 0, "exclude": ["head", "out"]}, "recompute": {"norm_act": True}},
}
OTHER_NETWORKS = {
    "batchnorm_resnet": (BatchNormResNet, {"recompute": {"mode": "recompute", "recompute": {"modules": ["stage"]}}}),
    "token_mixer": (TokenMixer, {"recompute": {"mode": "recompute", "recompute": {"modules": ["mlp"]}}}),
}


@pytest.mark.parametrize("network", list(OTHER_NETWORKS))
def test_other_networks_policies_compiled_are_bitwise_none_compiled(network):
    cls, extra = OTHER_NETWORKS[network]

    def make():
        torch.manual_seed(0)
        return cls()

    def make_batch(step):
        return batch(step, OTHER_CUBE)

    reference, _ = compiled_history(make, None, make_batch, dice_loss)
    graphs = graphs_compiled()
    for name, policy in {**OTHER_POLICIES, **extra}.items():
        history, stats = compiled_history(make, policy, make_batch, dice_loss)
        assert_same_history(reference, history, f"{network} {name} compiled")
        assert stats[-1].saved_bytes > 0
        assert graphs_compiled() == graphs, f"{network} {name}: recompiled"


# ---------------------------------------------------------------------------------------------- the eager fallback


def _no_compiler(*args, **kwargs):
    from torch._inductor.exc import InvalidCxxCompiler

    raise InvalidCxxCompiler()


def _tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(4, 2, 3, padding=1), nn.InstanceNorm3d(2, affine=True), nn.LeakyReLU(0.1),
                         nn.Conv3d(2, 3, 1), nn.Sigmoid())


def _fallback_run(backend):
    """Two SGD steps of `_tiny_net` under swap with its blocks compiled by `backend`, through `StepCompilation`;
    the history, the warnings said and the compilation."""
    model = _tiny_net()
    said: list[str] = []
    compilation = StepCompilation(model, True, torch.device("cpu"), backend=backend, say=said.append)
    engine = MemoryEngine(model, {"mode": "swap", "swap": {"min_bytes": 0}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(STEPS):
        x, y = batch(step, OTHER_CUBE)
        torch.manual_seed(step)

        def forward_backward(x=x, y=y):
            optimizer.zero_grad(set_to_none=True)
            with engine.step():
                loss = dice_loss(model(x), y)
            loss.backward()
            return loss

        loss = compilation.run(forward_backward, module=model)
        optimizer.step()
        history.append((loss.detach().clone(), [], [p.detach().clone() for p in model.parameters()]))
    engine.close()
    return history, said, compilation


@pytest.fixture(scope="module")
def tiny_eager():
    model = _tiny_net()
    history, _ = sgd_history(model, None, lambda step: batch(step, OTHER_CUBE), dice_loss, STEPS)
    return [(loss, [], params) for loss, _grads, params in history]


def test_a_forward_that_cannot_compile_runs_eager_with_one_line(tiny_eager):
    history, said, compilation = _fallback_run(_no_compiler)
    assert len(said) == 1 and "train.compile: compilation failed" in said[0] and "InvalidCxxCompiler" in said[0]
    assert not compilation.compiled and compilation.record()["fallback"]
    assert_same_history(tiny_eager, history, "fallback")


def test_a_backward_that_cannot_compile_reruns_the_step_eager(tiny_eager):
    from torch._dynamo.backends.common import aot_autograd

    forward_only = aot_autograd(fw_compiler=lambda gm, example: gm, bw_compiler=_no_compiler)
    history, said, compilation = _fallback_run(forward_only)
    assert len(said) == 1 and "InvalidCxxCompiler" in said[0]
    assert not compilation.compiled
    assert_same_history(tiny_eager, history, "backward fallback")


def test_the_failing_backend_does_fail_and_is_told_from_other_errors():
    """Without the fallback the tests above would raise: the backend fails as a missing C compiler does, and
    only the compiler's failures are taken for one (an error of the step itself is raised as it is)."""
    compiled = torch.compile(nn.Linear(2, 2), backend=_no_compiler)
    with pytest.raises(Exception) as caught:
        compiled(torch.ones(1, 2))
    assert is_compile_failure(caught.value)
    assert "InvalidCxxCompiler" in compile_cause(caught.value)
    assert not is_compile_failure(RuntimeError("CUDA out of memory")) and not is_compile_failure(ValueError("x"))


def test_compile_setting_per_device_and_duration_text():
    assert compile_wanted("auto", torch.device("cuda")) and not compile_wanted("auto", torch.device("cpu"))
    assert compile_wanted(True, torch.device("cpu")) and not compile_wanted(False, torch.device("cuda"))
    assert minutes_seconds(102.4) == "1 min 42 s" and minutes_seconds(42) == "42 s"
    model = _tiny_net()
    eager = StepCompilation(model, "auto", torch.device("cpu"))
    assert not eager.compiled and compiled_regions(model) is None and eager.describe() == "eager (train.compile auto)"
    assert eager.run(lambda: 7) == 7


def test_the_compile_cache_is_per_user_unless_set(monkeypatch, tmp_path):
    from brats_swap.run.compiling import compile_cache_dir, use_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert compile_cache_dir() == tmp_path / "cache" / "brats-swap" / "inductor"
    assert use_compile_cache().is_dir()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "brats-swap" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == tmp_path / "mine"


def test_checkpointing_inside_a_compiled_block_is_refused():
    from brats_swap.errors import ConfigError

    model = make_unet()
    regions = CompiledRegions(model)
    with pytest.raises(ConfigError, match="inside the compiled region"):
        MemoryEngine(model, {"mode": "recompute", "recompute": {"modules": ["encoder.level0.in_conv.norm"]}})
    regions.remove()
    assert "forward" not in vars(dict(model.named_modules())["encoder.level0.in_conv"])  # the model is eager again


# ---------------------------------------------------------------------------------------------- training runs compiled


def test_training_compiled_says_so_and_never_recompiles_a_known_shape(tmp_path_factory):
    """train.compile in a run: train.log, TensorBoard and env.json say the steps ran compiled and how long
    compiling took; after the first epoch (train steps and validation, deep supervision summed in the network)
    nothing compiles again: not the second epoch, not a --resume, not a second fold."""
    import json

    from train_helpers import SMALL, small_dataset, tensorboard_scalars, tiny_config

    from brats_swap.train.loop import train_fold

    # This run's "compiling:" line needs a step that compiles for at least 0.5 s: with its graphs already made
    # in this process by an earlier test, and inductor's disk cache warm from an earlier session, none would.
    torch._dynamo.reset()
    root, cache = small_dataset(tmp_path_factory)
    overrides = (*SMALL, "model.depth=3", "model.segmentation_levels=2", "model.base_filters=2",
                 "train.compile=true", "memory.mode=swap", "memory.swap.min_bytes=0")
    run = tmp_path_factory.mktemp("compiled") / "run"
    marks: list[int] = []

    def mark() -> bool:  # polled at every epoch boundary
        marks.append(graphs_compiled())
        return False

    result = train_fold(tiny_config(root, cache, *overrides, "train.max_epochs=2"), run, 0, progress=False,
                        stop_requested=mark)
    assert result.epochs_completed == 2 and len(marks) == 2
    assert graphs_compiled() == marks[1], "the second epoch compiled again"
    resumed = train_fold(tiny_config(root, cache, *overrides, "train.max_epochs=3"), run, 0, resume=True,
                         progress=False)
    assert resumed.epochs_completed == 3
    train_fold(tiny_config(root, cache, *overrides), run, 1, progress=False)
    assert graphs_compiled() == marks[1], "a --resume or a second fold compiled again"

    log = (run / "fold_0" / "train.log").read_text()
    assert "compiled (train.compile true)" in log and "compiling: " in log
    env = json.loads((run / "env.json").read_text())
    assert env["compile"]["compiled"] is True and env["compile"]["setting"] is True
    assert env["compile"]["fallback"] is None
    scalars = tensorboard_scalars(run / "fold_0" / "tb")
    assert scalars["compile/compiled"] == [1.0, 1.0, 1.0]

    # predict / evaluate follow evaluate.compile; validation compiled this shape in eval mode already.
    from brats_swap.run.inference import predict_cube
    from brats_swap.run.trained import load_for_inference

    image = torch.randn(1, 4, CUBE, CUBE, CUBE)
    config = tiny_config(root, cache, *overrides)
    probabilities = {}
    for setting in ("true", "false"):
        current = tiny_config(root, cache, *overrides, f"evaluate.compile={setting}")
        model, predict_config, device = load_for_inference(run, 0, "best", current)
        assert (compiled_regions(model) is not None) == (setting == "true")
        probabilities[setting] = predict_cube(model, image, predict_config, device)
    assert graphs_compiled() == marks[1], "prediction compiled a shape validation had compiled"
    assert torch.allclose(probabilities["true"], probabilities["false"], atol=1e-4)
    assert config.evaluate.compile == "auto"
    # `predict --set evaluate.compile=...` changes the setting after the models were loaded.
    from brats_swap.evaluate.predicting import run_predictor, with_evaluate_settings

    predictor = run_predictor(run)  # the run's evaluate.compile: auto, eager on the CPU
    assert all(compiled_regions(model) is None for model, _ in predictor.members)
    compiled = with_evaluate_settings(predictor, ["evaluate.compile=true"])
    assert all(compiled_regions(model) is not None for model, _ in compiled.members)
    eager = with_evaluate_settings(compiled, ["evaluate.compile=false"])
    assert all(compiled_regions(model) is None for model, _ in eager.members)


# ---------------------------------------------------------------------------------------------- DDP


def _ddp_compiled(ctx, out: str) -> None:
    """Each policy compiled under DDP (2 gloo ranks, each its own batches): the final weights, per policy."""
    from torch.nn.parallel import DistributedDataParallel

    finals = {}
    for name in ("none", "swap_all", "recompute", "hybrid"):
        model = make_unet()
        regions = CompiledRegions(model)
        engine = MemoryEngine(model, UNET_POLICIES[name]) if name != "none" else None
        ddp = DistributedDataParallel(model)
        history, _ = sgd_history(ddp, engine, lambda step: batch(step + 10 * ctx.rank, CUBE), dice_loss, STEPS)
        finals[name] = history[-1][2]
        if engine is not None:
            engine.close()
        regions.remove()
    torch.save(finals, f"{out}/rank{ctx.rank}.pt")


def test_ddp_compiled_policies_are_bitwise_none_compiled(unet_none, tmp_path):
    from dist_helpers import spawn_ranks

    _, graphs = unet_none  # the ranks are forked from here: they reuse these compiled graphs
    spawn_ranks(_ddp_compiled, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for name in ("swap_all", "recompute", "hybrid"):
        for rank in ranks:
            for a, b in zip(rank["none"], rank[name], strict=True):
                assert torch.equal(a, b), f"DDP {name} compiled differs from none compiled"
    for a, b in zip(ranks[0]["hybrid"], ranks[1]["hybrid"], strict=True):
        assert torch.equal(a, b), "the ranks' weights differ"
