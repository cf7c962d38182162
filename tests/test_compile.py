"""Compiled steps under the memory engine (`brats_swap.memory.compiled`, `brats_swap.run.compiling`).

Every policy gives bitwise the weights of `none`, both compiled; a known shape never compiles again; a failed
compilation runs eager with one line. Compiling is expensive on a CPU: the networks are tiny (16³, 2-4
filters), each is compiled once per test process (dynamo caches per code object, so a new instance of the same
network reuses the graphs: which is also what the no-recompilation assertions check), and the fallback tests
use backends that fail at once.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from memory_helpers import assert_same_history, batch, dice_loss, sgd_history
from torch import nn
from torch._dynamo.utils import counters

from brats_swap.config import ModelConfig
from brats_swap.memory import CompiledRegions, MemoryEngine, compile_wanted, compiled_regions, is_compile_failure
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
}


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (a recompilation adds one)."""
    return counters["stats"]["unique_graphs"]


def compiled_history(make_model, policy, make_batch, loss_fn, steps: int = STEPS):
    """`sgd_history` of a fresh model with its blocks compiled, under `policy` (None: no engine)."""
    model = make_model()
    regions = CompiledRegions(model)
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
        # Inside a compiled block the norm and activation are fused: kept (as the compiled graph saves them),
        # said per module, never replayed eagerly.
        assert last.recomputed_tensors == 0
        assert any("compiled region" in reason for reason in last.norm_act_skipped.values())
    # The same network again (a new instance, another policy): no graph compiled again.
    assert graphs_compiled() == graphs, f"{name}: {graphs_compiled() - graphs} recompilation(s)"


def test_compiled_differs_from_eager_by_little(unet_none):
    """Eager and compiled are different kernels: the weights after the steps differ by rounding only."""
    reference, _ = unet_none
    model = make_unet()
    eager, _ = sgd_history(model, None, lambda step: batch(step, CUBE), dice_loss, STEPS)
    largest = max(float((a - b).abs().max()) for a, b in zip(eager[-1][2], reference[-1][2], strict=True))
    assert largest < 1e-3, largest
