"""The planner's autocast emulation traces the target device's policy (memory/recorder.py: `AUTOCAST_OPS`).

CUDA's fp32 ops (GroupNorm, LayerNorm, softmax, ...) save float32 copies of their half-precision inputs,
which CPU autocast keeps in bf16: pinned here per network (MedNeXt, SwinUNETR, the U-Net) by the dtype of
what each kind of module saves. The CPU policy is checked against the real CPU autocast: the dtype every
listed op returns under `torch.autocast("cpu")` is the one the emulation gives it."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from brats_swap.config import load_config
from brats_swap.memory.recorder import AUTOCAST_OPS, trace_step
from brats_swap.model import build_model
from brats_swap.train.losses import training_loss

NETWORKS = {
    "mednext_l": (32, ["model.features=[2]", "model.blocks=[1,1,1,1,1,1,1,1,1]"]),
    "swinunetr": (64, ["model.features=[12]", "model.blocks=[1,1,1,1]"]),
    "isensee2017": (32, ["model.base_filters=2"]),
    "resenc_m": (32, ["model.features=[2,4,8]"]),
}


def _saved_dtypes(name: str, autocast: str) -> dict[str, set[str]]:
    """{module kind (the last part of its name): dtypes of what it saves} of one fp16 step of `name`."""
    cube, overrides = NETWORKS[name]
    config = load_config(None, [f"model.name={name}", f"data.cube=[{cube},{cube},{cube}]", *overrides])
    model = build_model(config.model)
    trace = trace_step(model, (1, 4, cube, cube, cube), dtype=torch.float16, autocast=autocast,
                       loss_fn=training_loss(config.train.loss, model))
    kinds: dict[str, set[str]] = collections.defaultdict(set)
    for record in trace.saved_records():
        if not record.is_param:
            kinds[record.module.rsplit(".", 1)[-1]].add(record.dtype)
    return dict(kinds)


def test_mednext_group_norms_save_fp32_inputs_under_cuda_autocast():
    cuda, cpu = _saved_dtypes("mednext_l", "cuda"), _saved_dtypes("mednext_l", "cpu")
    assert cuda["norm"] == {"float32"} and cpu["norm"] == {"float16"}  # GroupNorm: fp32 on CUDA
    # The convolutions save half precision either way: after a norm, a new fp16 cast of its fp32 output.
    for kind in ("conv1", "conv2", "conv3", "act"):
        assert cuda[kind] == cpu[kind] == {"float16"}, kind


def test_swinunetr_norms_and_attention_probabilities_under_cuda_autocast():
    cuda, cpu = _saved_dtypes("swinunetr", "cuda"), _saved_dtypes("swinunetr", "cpu")
    assert cuda["softmax"] == {"float32"}  # attention probabilities (fp32 on CUDA; promoted by the bias on a CPU)
    for kind in ("norm1", "norm2"):  # LayerNorms before attention and MLP: every one saves fp32 on CUDA
        assert "float32" in cuda[kind] and "float16" in cpu[kind], kind
    assert cuda["qkv"] == cpu["qkv"] == {"float16"} and cuda["attn"] >= {"float16"}


def test_the_unet_and_resenc_save_half_precision_activations_under_cuda_autocast():
    # Instance norms, LeakyReLU and average pooling are not on CUDA's list: they run in the dtype they get (the
    # norms' fp32 records are their per-channel statistics); the losses compute in float32 already. So the U-Net
    # and ResEnc plan for a GPU as before the policy was traced.
    unet = _saved_dtypes("isensee2017", "cuda")
    assert unet == _saved_dtypes("isensee2017", "cpu")
    assert unet["conv"] == unet["act"] == {"float16"}
    cuda, cpu = _saved_dtypes("resenc_m", "cuda"), _saved_dtypes("resenc_m", "cpu")
    assert "0" not in cuda and cpu.pop("0") == {"float32"}  # the residual skip's AvgPool3d: fp32 on a CPU only
    assert cuda == cpu and cuda["conv"] == cuda["nonlin"] == {"float16"}


OPS = {  # one call per op our networks and losses use, by its policy name
    "conv3d": lambda x: F.conv3d(x, torch.randn(2, 2, 3, 3, 3)),
    "conv_transpose3d": lambda x: F.conv_transpose3d(x, torch.randn(2, 2, 2, 2, 2), stride=2),
    "linear": lambda x: F.linear(x, torch.randn(4, 4)),
    "matmul": lambda x: x @ torch.randn(4, 4),
    "max_pool3d": lambda x: F.max_pool3d(x, 2),
    "avg_pool3d": lambda x: F.avg_pool3d(x, 2),
    "group_norm": lambda x: F.group_norm(x, 2),
    "layer_norm": lambda x: F.layer_norm(x, (4,)),
    "softmax": lambda x: x.softmax(-1),
    "exp": lambda x: x.exp(),
    "sum": lambda x: x.sum(),
    "pow": lambda x: x ** 2,
    "mse_loss": lambda x: F.mse_loss(x, x.detach()),
    "instance_norm": lambda x: F.instance_norm(x),
}


@pytest.mark.parametrize("op", list(OPS))
def test_the_cpu_policy_is_what_cpu_autocast_does(op):
    lower, fp32 = AUTOCAST_OPS["cpu"]
    x = torch.randn(1, 2, 4, 4, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = OPS[op](x).dtype
    expected = torch.float32 if op in fp32 else torch.bfloat16  # lower and unlisted ops keep bf16 here
    assert real == expected, (op, real)
    assert op not in lower or real == torch.bfloat16


def test_recomputation_in_backward_runs_under_the_cuda_policy():
    """Checkpointed modules and norm_act recipes recompute inside backward: the emulation is on there too (else
    torch's checkpoint finds the recomputed GroupNorm inputs in fp16 where the forward saved fp32)."""
    from brats_swap.config.schema import MemoryConfig
    from brats_swap.memory.cost import default_cost_model
    from brats_swap.memory.planner import Planner
    from brats_swap.memory.presets import named_policies

    cube, overrides = NETWORKS["mednext_l"]
    config = load_config(None, ["model.name=mednext_l", f"data.cube=[{cube},{cube},{cube}]", *overrides])
    model = build_model(config.model)
    planner = Planner(model, (1, 4, cube, cube, cube), dtype=torch.float16, cost=default_cost_model("gpu", torch.float16),
                      loss_fn=training_loss(config.train.loss, model))
    assert planner.autocast == "cuda"
    peaks = {name: planner.memory(cfg).peak_bytes for name, cfg in named_policies(MemoryConfig(), planner.presets).items()}
    assert peaks["recompute"] < peaks["norm_act"] < peaks["none"]
