"""Memory engine edge cases on tiny tensors: dedupe, views, in-place checks, leaks, stale steps, knobs."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from memory_helpers import make_unet
from torch import nn

from brats_swap.config import SwapConfig
from brats_swap.errors import ConfigError
from brats_swap.memory import (
    MemoryEngine,
    SavedRecord,
    SavedTensorModifiedError,
    StaleSavedTensorError,
    discover_blocks,
    memory_policy,
    module_matches,
    select_swapped,
)
from brats_swap.memory.rulebook import EntryState

SWAP_EVERYTHING = {"mode": "swap", "swap": {"min_bytes": 0}}


class Lambda(nn.Module):
    """Runs `fn`; the trailing Identity starts a module after it, which releases finished copies."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.after = nn.Identity()

    def forward(self, *args):
        return self.after(self.fn(*args))


def _grads_with(policy, fn, *inputs):
    """Gradients of fn(*inputs).sum() w.r.t. inputs, plain (policy None) or under an engine."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    module = Lambda(fn)
    engine = MemoryEngine(module, policy) if policy is not None else None
    if engine is None:
        out = module(*leaves)
    else:
        with engine.step():
            out = module(*leaves)
    out.sum().backward()
    return [leaf.grad for leaf in leaves], engine


class TinyNet(nn.Module):
    """Conv -> Norm -> Act -> Dropout -> Conv, plus an auxiliary head that a loss may ignore."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = nn.InstanceNorm3d(4, affine=True)
        self.act = nn.LeakyReLU(0.1)
        self.drop = nn.Dropout3d(0.3)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)
        self.aux = nn.Conv3d(4, 1, 1)

    def forward(self, x):
        h = self.conv2(self.drop(self.act(self.norm(self.conv1(x)))))
        return h, self.aux(h).sigmoid()


# --------------------------------------------------------------------------------------------- policy


def test_select_swapped_rules():
    records = [
        SavedRecord(0, 4 << 20, "encoder.level0.in_conv.conv"),
        SavedRecord(1, 4 << 20, "encoder.level0.in_conv.norm", recompute=True),
        SavedRecord(2, 8 << 20, "decoder.level0.localization.block1.conv"),
        SavedRecord(3, 100, "encoder.level1.in_conv.norm"),
        SavedRecord(4, 8 << 20, "encoder.level1.in_conv.conv", is_param=True),
        SavedRecord(5, 4 << 20, ""),
    ]
    assert select_swapped(records, SwapConfig()) == {0, 2, 5}
    assert select_swapped(records, SwapConfig(exclude=["decoder.*"])) == {0, 5}
    assert select_swapped(records, SwapConfig(exclude=["decoder"])) == {0, 5}
    assert select_swapped(records, SwapConfig(include=["encoder.level0"])) == {0}
    assert select_swapped(records, SwapConfig(tensors=2)) == {0, 2}
    assert select_swapped(records, SwapConfig(tensors=0)) == set()
    assert select_swapped(records, SwapConfig(min_bytes=0)) == {0, 2, 3, 5}
    assert module_matches("a.b.c", ["a.b"]) and not module_matches("a.bc", ["a.b"])


def test_discover_blocks_on_the_unet():
    names = [name for name, _ in discover_blocks(make_unet())]
    assert "encoder.level0.in_conv" in names and "decoder.level0.segmentation" in names
    assert "encoder.level0" not in names and "decoder.level0.localization.block2" in names
    assert len(names) == 30


# --------------------------------------------------------------------------------------------- dedupe and views


def test_storage_saved_twice_is_copied_once():
    x = torch.randn(64, 64)

    def twice(x):
        y = x * 2  # saved by sin and by cos: one storage, two saves
        return y.sin() + y.cos() + (y.t() @ y).sum()  # and y / y.t() by mm

    ref, _ = _grads_with(None, twice, x)
    got, engine = _grads_with(SWAP_EVERYTHING, twice, x)
    assert torch.equal(got[0], ref[0])
    stats = engine.last_stats()
    assert stats.saved_tensors == 1 and stats.swapped_tensors == 1
    assert stats.swapped_out_bytes == stats.swapped_in_bytes == 64 * 64 * 4


def test_views_with_offsets_transposes_stride0_and_gaps_survive():
    def views(x, w):
        y = x * 1.5
        a = (y[3:, 2:] * w[3:, 2:]).sum()  # storage offset
        b = (y.t() @ w).sum()  # transpose
        c = (y[:1].expand(16, -1) * w[:16]).sum()  # stride 0
        d = (torch.as_strided(y, (8, 8), (20, 2), 5) * w[:8, :8]).sum()  # padded strides, offset
        e = (w[:, :1].expand(-1, 32) * y).sum()  # stride-0 view of a leaf
        return a + b + c + d + e

    x, w = torch.randn(32, 32), torch.randn(32, 32)
    ref, _ = _grads_with(None, views, x, w)
    for policy in (SWAP_EVERYTHING, {"mode": "swap", "swap": {"min_bytes": 0, "compress": "none", "sync": True}}):
        got, engine = _grads_with(policy, views, x, w)
        assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
        assert engine.last_stats().swapped_tensors >= 1


# --------------------------------------------------------------------------------------------- in-place


@pytest.mark.parametrize("policy", [SWAP_EVERYTHING, "none"])
def test_in_place_change_after_save_raises(policy):
    x = torch.randn(64, 64, requires_grad=True)
    module = Lambda(lambda t: t)
    engine = MemoryEngine(module, policy, measure=True)
    with engine.step():
        y = module(x) * 2
        z = y.sin()
        y.add_(1)  # autograd does not check versions under saved-tensor hooks: the engine must
    with pytest.raises(SavedTensorModifiedError, match="modified in place"):
        z.sum().backward()


def test_in_place_activation_is_recomputed_not_stored():
    net = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.LeakyReLU(0.2, inplace=True),
                        nn.Conv3d(4, 2, 3, padding=1))
    x = torch.randn(1, 2, 8, 8, 8)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    engine = MemoryEngine(net, {"mode": "recompute", "recompute": {"norm_act": True}})
    with engine.step():
        out = net(x)
    out.sum().backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), ref, strict=True))
    records = engine.last_records()
    # The in-place LeakyReLU result, saved by itself and by the next conv, is one storage rebuilt in backward.
    assert [r.module for r in records if r.recompute] == ["2"]
    assert not any(r.module == "3" and not r.is_param for r in records)
    assert engine.last_stats().recomputed_tensors == 1


# --------------------------------------------------------------------------------------------- lifecycle


def _tiny_step(engine, net, x, use_aux: bool):
    with engine.step():
        main, aux = net(x)
        loss = main.mean() + (aux.mean() if use_aux else 0.0)
    aux_ref = weakref.ref(aux)
    del main, aux
    loss.backward()
    return aux_ref


def test_unused_head_leaks_nothing():
    torch.manual_seed(0)
    net = TinyNet()
    engine = MemoryEngine(net, {"mode": "hybrid", "swap": {"min_bytes": 0, "lookahead": 0},
                                "recompute": {"norm_act": True}})
    x = torch.randn(1, 2, 8, 8, 8)
    aux_ref = _tiny_step(engine, net, x, use_aux=False)
    gc.collect()
    assert aux_ref() is None
    rulebook = engine.front.rulebook
    assert rulebook.resident == 0 and not rulebook.unreleased
    assert all(entry.alive == 0 and entry.state is EntryState.DEAD and entry.payload.reloaded is None
               and entry.payload.gpu_ref is None for entry in rulebook.entries)
    assert any(r.module == "aux" for r in engine.last_records())  # the head did save tensors


def test_fifty_steps_do_not_grow_live_tensors_or_arena():
    torch.manual_seed(0)
    net = TinyNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = MemoryEngine(net, {"mode": "hybrid", "swap": {"min_bytes": 0},
                                "recompute": {"norm_act": True}})
    x = torch.randn(1, 2, 8, 8, 8)

    def live_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on deprecated torch.distributed aliases warns
            warnings.simplefilter("ignore")
            return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))

    counts, arenas = [], []
    for step in range(50):
        _tiny_step(engine, net, x, use_aux=step % 2 == 0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert engine.front.rulebook.resident == 0
        if step in (4, 49):
            counts.append(live_tensors())
        arenas.append(engine.last_stats().arena_bytes)
    assert counts[0] == counts[1]
    assert len(set(arenas[1:])) == 1 and arenas[1] > 0


def test_graph_kept_past_the_next_step_is_refused():
    torch.manual_seed(0)
    net = TinyNet()
    engine = MemoryEngine(net, {"mode": "swap", "swap": {"min_bytes": 0}})
    x = torch.randn(1, 2, 8, 8, 8)
    with engine.step():
        first = net(x)[0].sum()
    with engine.step():
        net(x)[0].sum()
    with pytest.raises(StaleSavedTensorError):
        first.backward()


# --------------------------------------------------------------------------------------------- knobs


def _tiny_grads(policy, **kwargs):
    torch.manual_seed(0)
    net = TinyNet()
    engine = MemoryEngine(net, policy, **kwargs) if policy is not None else None
    x = torch.randn(1, 2, 8, 8, 8)
    torch.manual_seed(1)
    if engine is None:
        main, aux = net(x)
    else:
        with engine.step():
            main, aux = net(x)
    (main.mean() + aux.mean()).backward()
    return [p.grad for p in net.parameters()], engine


def test_prefetch_off_lookahead_0_and_inflight_cap_stay_exact():
    ref, _ = _tiny_grads(None)
    got, engine = _tiny_grads({"mode": "swap", "swap": {"min_bytes": 0, "lookahead": 0}})
    assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
    assert engine.last_stats().swapped_in_bytes > 0
    got, engine = _tiny_grads(SWAP_EVERYTHING, prefetch=False)
    assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
    assert engine.last_stats().prefetch_misses > 0
    got, engine = _tiny_grads({"mode": "swap", "swap": {"min_bytes": 0, "max_inflight_bytes": 1}})
    assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))


def test_bf16_compression_is_close_and_halves_host_bytes():
    ref, _ = _tiny_grads(None)
    got, engine = _tiny_grads({"mode": "swap", "swap": {"min_bytes": 0, "compress": "bf16"}})
    got_flat, ref_flat = torch.cat([g.flatten() for g in got]), torch.cat([r.flatten() for r in ref])
    assert ((got_flat - ref_flat).norm() / ref_flat.norm()).item() < 0.02  # bf16 keeps ~3 significant digits
    assert any(not torch.equal(g, r) for g, r in zip(got, ref, strict=True))  # and it is lossy
    stats = engine.last_stats()
    assert 0 < engine.executor._arenas[False].used <= stats.swapped_out_bytes // 2 + 512 * stats.swapped_tensors


def test_memory_policy_context_manager_reverts_the_model():
    torch.manual_seed(0)
    net = TinyNet()
    policy = {"mode": "hybrid", "swap": {"min_bytes": 0}, "recompute": {"modules": ["conv2"], "norm_act": True}}
    with memory_policy(net, policy) as engine:
        with engine.step():
            loss = net(torch.randn(1, 2, 8, 8, 8))[0].sum()
        loss.backward()
        assert engine.last_stats().recomputed_modules == 1
        assert "forward" in net.conv2.__dict__
    assert "forward" not in net.conv2.__dict__
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_bad_policies_are_config_errors():
    net = TinyNet()
    with pytest.raises(ConfigError, match="auto"):
        MemoryEngine(net, {"mode": "auto", "budget_gib": 8})
    with pytest.raises(ConfigError, match="lookahead"):
        MemoryEngine(net, {"mode": "swap", "swap": {"lookahead": -1}})
    with pytest.raises(ConfigError, match="match no module"):
        MemoryEngine(net, {"mode": "recompute", "recompute": {"modules": ["nothing.*"]}})
    with pytest.raises(ConfigError, match="memory.swap.bogus"):
        MemoryEngine(net, {"mode": "swap", "swap": {"bogus": 1}})
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_meta_trace_predicts_the_cpu_records():
    """A planner can run the engine on the meta device and get the records of a real run."""
    policy = {"mode": "hybrid", "swap": {"min_bytes": 0, "exclude": ["decoder.level0*"]},
              "recompute": {"norm_act": True}}
    results = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = make_unet()
            x = torch.randn(1, 4, 16, 16, 16)
        engine = MemoryEngine(model, policy)
        with engine.step():
            model(x).mean()
        results.append((engine.last_records(), engine.last_swapped(), engine.last_stats()))
    (cpu_records, cpu_swapped, cpu_stats), (meta_records, meta_swapped, meta_stats) = results
    assert [(r.nbytes, r.module, r.block, r.is_param, r.recompute) for r in meta_records] == \
        [(r.nbytes, r.module, r.block, r.is_param, r.recompute) for r in cpu_records]
    assert meta_swapped == cpu_swapped
    assert meta_stats.swapped_out_bytes == cpu_stats.swapped_out_bytes > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sync", [False, True])
def test_cuda_swap_is_bitwise_identical(sync, monkeypatch):
    # Default cuDNN conv3d backward may pick atomics-based (nondeterministic) algorithms: bitwise needs this.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    torch.manual_seed(0)
    net = TinyNet().cuda()
    x = torch.randn(2, 2, 32, 32, 32, device="cuda")
    torch.manual_seed(1)
    main, aux = net(x)
    (main.mean() + aux.mean()).backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    for policy in ({"mode": "swap", "swap": {"min_bytes": 0, "sync": sync}},
                   {"mode": "hybrid", "swap": {"min_bytes": 0, "lookahead": 0, "sync": sync},
                    "recompute": {"norm_act": True}}):
        engine = MemoryEngine(net, policy)
        for _ in range(3):
            torch.manual_seed(1)
            with engine.step():
                main, aux = net(x)
            (main.mean() + aux.mean()).backward()
            assert all(torch.equal(p.grad, r) for p, r in zip(net.parameters(), ref, strict=True))
            net.zero_grad()
        assert engine.last_stats().swapped_in_bytes > 0
        engine.close()


def test_skip_saved_in_two_blocks_is_parked_between_its_uses():
    """The level-0 skip is saved by encoder level 1 (its input) and by decoder level 0 (the concatenating
    convolution). Backward uses it first in decoder level 0 and then, eight blocks later, in encoder level
    1: in between the engine drops the reload and reloads it from the host copy when backward comes near
    (with lookahead 1), rather than holding a full-resolution tensor through the whole backward."""
    from memory_helpers import batch, dice_loss

    model = make_unet()
    log: list = []
    engine = MemoryEngine(model, {"mode": "swap", "swap": {"lookahead": 1, "min_bytes": 0}}, log=log)
    x, y = batch(0, 32)
    with engine.step():
        loss = dice_loss(model(x), y)
    loss.backward()
    records = engine.last_records()
    skip = next(r for r in records if r.module == "encoder.level1.in_conv.conv" and not r.is_param
                and r.nbytes == 4 * model.encoder.level0.in_conv.conv.out_channels * 32**3)
    events = [event for event, index in log if index == skip.index]
    assert events == ["swap_out", "release", "reload", "use", "reloaded", "drop", "reload", "use", "reloaded",
                      "drop"], events
    engine.close()
