"""The planner's search on a residual encoder: which recompute variants `auto` tries."""

from __future__ import annotations

import torch

from brats_swap.config import MemoryConfig, load_config
from brats_swap.memory.planner import Planner
from brats_swap.memory.simulate import resident_records
from brats_swap.memory.swap_search import checkpoint_ranking, recompute_variants
from brats_swap.model import build_model
from brats_swap.train.losses import SegmentationLoss

SHAPE = (1, 4, 16, 16, 16)


def _planner() -> Planner:
    """nnU-Net's residual-encoder U-Net at 16³ (3 stages) with a quarter of the features."""
    torch.manual_seed(0)
    model = build_model(load_config(None, ["model.name=resenc_l", "data.cube=[16,16,16]",
                                           "model.features=[8,16,32]"]).model)
    return Planner(model, SHAPE, loss_fn=SegmentationLoss("dice", from_logits=True))


def test_checkpoint_ranking_counts_blocks_that_run_modules_named_elsewhere():
    """nnU-Net's convolution blocks (`ConvDropoutNormReLU.all_modules`) run the `conv`, `norm` and
    `nonlin` registered beside them: what a block frees is counted by op range, so they rank."""
    planner = _planner()
    plain = MemoryConfig()
    keep_all = planner.memory(plain)
    trace = planner.trace(plain)
    ranking = checkpoint_ranking(trace, planner.durations(plain),
                                 resident_records(trace, planner.schedule(plain), keep_all.peak_op))
    names = [name for name, _, _ in ranking]
    assert "encoder.stem.convs.0.all_modules" in names
    assert sum(name.endswith(".all_modules") for name in names) >= 10
    assert all(seconds > 0 and freed > 0 for _, seconds, freed in ranking)


def test_auto_tries_checkpointing_on_top_of_norm_act():
    """Under a limit norm_act alone cannot meet, the variants include norm_act with checkpointed blocks."""
    planner = _planner()
    norm_act = MemoryConfig(mode="recompute")
    norm_act.recompute.norm_act = True
    limit = 0.7 * planner.memory(norm_act).peak_bytes
    variants = [cfg.recompute for cfg, _ in recompute_variants(planner, MemoryConfig(), limit)]
    assert any(recompute.norm_act and recompute.modules for recompute in variants)
    assert any(not recompute.norm_act and recompute.modules for recompute in variants)
