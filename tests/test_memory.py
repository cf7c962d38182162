"""Memory engine on the real U-Net: bitwise-equal training under every policy, and the memory it saves."""

from __future__ import annotations

import pytest
from memory_helpers import (
    OpCounter,
    assert_same_history,
    backward_op_counts,
    batch,
    dice_loss,
    make_unet,
    train_steps,
)

from brats_swap.config import MemoryConfig, SwapConfig
from brats_swap.memory import MemoryEngine, select_swapped
from brats_swap.memory.engine import memory_config_from

# min_bytes 0 so the tiny test volumes swap every activation (the default 1 MiB would skip most of them).
POLICIES = {
    "swap_all": {"mode": "swap", "swap": {"min_bytes": 0}},
    "swap_first_n": {"mode": "swap", "swap": {"tensors": 40, "min_bytes": 0}},
    "swap_no_decoder": {"mode": "swap", "swap": {"exclude": ["decoder.*"], "min_bytes": 0}},
    # swap_all and swap_no_decoder use the default lookahead 1 (lookahead 0: test_memory_edge.py).
    "lookahead_3": {"mode": "swap", "swap": {"lookahead": 3, "exclude": ["decoder.*"], "min_bytes": 0}},
    "recompute_blocks": {"mode": "recompute", "recompute": {"modules": ["encoder.*", "decoder.*"]}},
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"min_bytes": 0, "lookahead": 2},
               "recompute": {"norm_act": True, "modules": ["encoder.level1", "decoder.level2"]}},
    # A per-tensor mix: norm_act everywhere but one storage, which is stored and swapped instead.
    "norm_act_stored": {"mode": "hybrid", "swap": {"min_bytes": 0, "include": ["encoder.level0.context.block2.act"]},
                        "recompute": {"norm_act": True, "norm_act_exclude": ["encoder.level0.context.block2.act"]}},
}


# Two SGD steps per run: the first reloads in the order it guesses, the second in the backward order the first
# taught the engine (where prefetching must never miss), and its parameters carry the first's gradients.
STEPS = 2


@pytest.fixture(scope="module")
def reference():
    history, _, _ = train_steps(None, steps=STEPS)
    return history


@pytest.mark.parametrize("name", list(POLICIES))
def test_training_is_bitwise_identical(reference, name):
    history, stats, engine = train_steps(POLICIES[name], steps=STEPS)
    assert_same_history(reference, history, name)

    cfg = engine.cfg
    last = stats[-1]
    assert last.saved_bytes > 0
    if cfg.mode in ("swap", "hybrid"):
        assert last.swapped_out_bytes > 0 and last.swapped_in_bytes > 0
        # The planner's pure function predicts exactly what the engine swapped.
        assert select_swapped(engine.last_records(), cfg.swap) == engine.last_swapped()
        # Once the backward order is learned (step 2+), prefetching never misses on this network.
        assert last.prefetch_misses == 0, f"{name}: {last.prefetch_misses} prefetch misses"
    if cfg.recompute.modules and cfg.mode != "swap":
        assert last.recomputed_modules > 0
    if cfg.recompute.norm_act and cfg.mode != "swap":
        assert last.recomputed_tensors > 0
    records = engine.last_records()
    swapped = engine.last_swapped()
    # One decision per storage: nothing is both swapped and recomputed.
    assert not any(records[i].recompute for i in swapped)
    if name == "swap_no_decoder":
        assert swapped and not any(records[i].module.startswith("decoder.") for i in swapped)
    if name == "swap_first_n":
        assert len(swapped) == 40 and max(swapped) < max(i for i, r in enumerate(records) if not r.is_param)
    # The engine reverts cleanly.
    model = engine.model
    engine.close()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())


def _peak_and_convs(policy, cube: int, steps: int = 1):
    """The last step's stats and backward op counts; earlier steps teach the engine its unpack order."""
    model = make_unet()
    engine = MemoryEngine(model, policy, measure=True)
    first_stats = None
    for step in range(steps):
        x, y = batch(step, cube)
        with engine.step():
            loss = dice_loss(model(x), y)
        counter = OpCounter()
        with counter:
            loss.backward()
        model.zero_grad(set_to_none=True)
        first_stats = first_stats or engine.last_stats()
    stats = engine.last_stats()
    engine.close()
    return stats, counter.counts, first_stats


def test_peak_resident_saved_bytes_at_48():
    none, none_bwd, _ = _peak_and_convs("none", 48)
    # Swap every activation (min_bytes 4 KiB only keeps the per-channel statistics), reloading one tensor
    # ahead of backward (lookahead 0: the smallest window; lookahead 1 holds two blocks, about 23%). The
    # second step follows the unpack order learned in the first, as every later step of training does.
    swap, _, swap_first = _peak_and_convs({"mode": "swap", "swap": {"min_bytes": 4096, "lookahead": 0}}, 48, 2)
    norm_act, norm_act_bwd, _ = _peak_and_convs({"mode": "recompute", "recompute": {"norm_act": True}}, 48)

    assert none.peak_resident_saved_bytes == none.saved_bytes > 0
    batch_bytes = 4 * 48**3 * 4  # the input: the caller holds it, so it is never swapped
    assert swap.swapped_out_bytes <= swap.saved_bytes - batch_bytes
    assert swap.swapped_out_bytes >= 0.99 * (swap.saved_bytes - batch_bytes)
    assert swap.prefetch_misses == 0
    # The first step guesses the order (reverse forward order); it misses only where one op unpacks
    # several swapped storages saved at different times (the decoder's concatenating convolutions).
    assert swap_first.prefetch_misses <= 0.1 * swap_first.swapped_tensors
    # Besides the (kept) input, one reload ahead of backward and the tensors of the running op.
    assert swap.peak_resident_saved_bytes - batch_bytes <= 0.15 * none.peak_resident_saved_bytes, \
        swap.peak_resident_saved_bytes / none.peak_resident_saved_bytes
    assert norm_act.peak_resident_saved_bytes <= 0.60 * none.peak_resident_saved_bytes, \
        norm_act.peak_resident_saved_bytes / none.peak_resident_saved_bytes
    # No convolution is re-run: backward runs the same ops on convolutions as plain PyTorch, no forward one.
    assert norm_act_bwd.get("convolution", 0) == 0
    assert norm_act_bwd.get("convolution_backward") == none_bwd.get("convolution_backward") > 0
    assert norm_act.recomputed_tensors > 0


def test_block_checkpointing_reruns_convolutions():
    """The contrast to norm_act: block checkpointing recomputes convolutions in backward."""
    engine, counts = backward_op_counts(POLICIES["recompute_blocks"])
    assert counts.get("convolution", 0) > 0
    assert engine.checkpointed_modules == [f"encoder.level{i}" for i in range(5)] + \
        [f"decoder.level{i}" for i in (3, 2, 1, 0)]
    engine.close()


def test_mode_none_is_a_no_op():
    model = make_unet()
    engine = MemoryEngine(model, MemoryConfig())
    assert not engine.enabled
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with engine.step():
        pass
    assert engine.last_stats().saved_bytes == 0


def test_policy_from_dict_matches_yaml_section():
    cfg = memory_config_from({"mode": "swap", "swap": {"exclude": ["decoder.*"], "lookahead": 2}})
    assert cfg.swap == SwapConfig(exclude=["decoder.*"], lookahead=2)
    assert memory_config_from("recompute").mode == "recompute"


SLICED_POLICIES = {
    "swap_all": POLICIES["swap_all"],
    "hybrid": POLICIES["hybrid"],
    "swap_all_emulated_link": {"mode": "swap", "swap": {"min_bytes": 0, "lookahead": 0, "emulate_gbs": 1.0,
                                                        "copy_delay_s": 0.002}},
}


@pytest.mark.parametrize("name", sorted(SLICED_POLICIES))
def test_sliced_decoder_backward_is_bitwise_under_the_engine(monkeypatch, name):
    """At large sizes the decoder's upsampling and concatenating convolutions run backward part by part and
    slice by slice, dropping each saved part when done; with every tensor sliced (chunk size 1 byte), the
    engine's swapped, reloaded and rebuilt parts give the very gradients plain PyTorch gives."""
    from brats_swap.model import unet

    monkeypatch.setattr(unet, "_NORM_CHUNK_BYTES", 1)
    plain, _, _ = train_steps(None, steps=2, cube=32)
    tested, stats, engine = train_steps(SLICED_POLICIES[name], steps=2, cube=32)
    assert_same_history(plain, tested, name)
    assert all(s.swapped_out_bytes > 0 for s in stats)
    engine.close()
