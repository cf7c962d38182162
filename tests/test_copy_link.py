"""Copies that really are asynchronous on the CPU: the emulated link, the host arena, and the engine
trained through them bitwise, with a control that removes one wait and is caught.

The engine tests run the U-Net (16³, 4 base filters, dropout on) and a small non-U-Net network under
every preset at several emulated bandwidths, some with random per-copy delays that widen the windows in
which a missing wait would read a copy that has not landed.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from memory_helpers import assert_same_history, sgd_history
from torch import nn

from brats_swap.config import ConfigError, ModelConfig, SwapConfig
from brats_swap.memory.arena import ALIGN, HostArena, arena_bytes, check_host_memory
from brats_swap.memory.engine import MemoryEngine, memory_config_from
from brats_swap.memory.link import FINISHED, CopyLink, EmulatedLink, ThreadCopyEvent, open_link
from brats_swap.memory.presets import named_policies
from brats_swap.model import build_model


@pytest.fixture(autouse=True, scope="module")
def one_compute_thread():
    """One torch thread: the copy threads get the second core (a second OpenMP thread that loses its core
    to a copy, or to another process on a shared machine, stalls every parallel region)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _copy_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("brats-swap-"))


# --------------------------------------------------------------------------------------------- the link


def test_emulated_copies_are_asynchronous_ordered_and_priced_by_bandwidth():
    link = EmulatedLink(0.5)  # 2 ms per MB
    source = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    host = torch.empty(source.numel() * 4, dtype=torch.uint8)
    started = time.perf_counter()
    out = link.copy_out(host, source.view(torch.uint8))
    assert not out.done()  # issued, not finished: the caller runs on
    back = torch.empty_like(source)
    reload = link.copy_in(back.view(torch.uint8), host, after=out)
    reload.wait()
    took = time.perf_counter() - started
    assert out.done() and reload.done()
    assert torch.equal(back, source)
    # Each direction holds the link for bytes / bandwidth, and the reload waits for the copy out.
    assert took >= 2 * source.nbytes / 0.5e9
    assert link.seconds() >= 2 * source.nbytes / 0.5e9 * 0.99
    link.close()


def test_reload_never_reads_a_host_slot_before_its_copy_out_landed():
    """The copy out is delayed at random (and slow); the reload on the other thread must wait for it."""
    link = EmulatedLink(0.2, delay_s=0.01, seed=3)
    sources = [torch.full((1 << 14,), float(i)) for i in range(6)]
    hosts = [torch.zeros(s.nbytes, dtype=torch.uint8) for s in sources]
    outs = [link.copy_out(h, s.view(torch.uint8)) for h, s in zip(hosts, sources, strict=True)]
    backs = [torch.zeros_like(s) for s in sources]
    reloads = [link.copy_in(b.view(torch.uint8), h, after=e) for b, h, e in zip(backs, hosts, outs, strict=True)]
    for event in reloads:
        event.wait()
    assert all(torch.equal(b, s) for b, s in zip(backs, sources, strict=True))
    link.close()


def test_bf16_conversion_runs_on_the_copy_thread_after_the_bytes_land():
    link = EmulatedLink(1.0, delay_s=0.005, seed=0)
    values = torch.randn(1 << 15)
    host = torch.empty(values.numel(), dtype=torch.bfloat16)
    out = link.copy_out(host, values)
    widened = torch.empty_like(values)
    link.copy_in(widened, host, after=out).wait()
    assert torch.equal(widened, values.bfloat16().float())
    link.close()


def test_a_failed_copy_surfaces_where_it_is_waited_for():
    link = EmulatedLink(1.0)
    event = link.copy_out(torch.empty(3, dtype=torch.float32), torch.empty(5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="emulated link: a copy failed"):
        event.wait()
    link.close()


def test_copy_threads_stop_on_close_and_when_the_link_is_dropped():
    before = _copy_threads()
    link = EmulatedLink(1.0)
    link.copy_out(torch.empty(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8))
    assert _copy_threads() == before + 1
    link.close()
    assert _copy_threads() == before
    dropped = EmulatedLink(1.0)
    dropped.copy_in(torch.empty(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)).wait()
    del dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while _copy_threads() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _copy_threads() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_link_orders_delayed_copies_and_widens_bf16_on_the_copy_stream():
    """Copy streams delayed at random: the reload (with its bf16 -> fp32 conversion) still sees the
    bytes of its copy out, the compute waits device-side, and the arena slab is pinned."""
    device = torch.device("cuda")
    link = open_link(device, SwapConfig(copy_delay_s=0.01))
    values = torch.randn(1 << 20, device=device)
    arena = HostArena(arena_bytes([values.numel() * 2, values.nbytes]), pin=True)
    assert arena.pinned_bytes == arena.capacity
    compressed = arena.alloc(values.numel() * 2).view(torch.bfloat16)
    raw = arena.alloc(values.nbytes)
    outs = [link.copy_out(compressed, values), link.copy_out(raw, values.view(torch.uint8))]
    widened, restored = torch.empty_like(values), torch.empty_like(values)
    for event in (link.copy_in(widened, compressed, after=outs[0]),
                  link.copy_in(restored.view(torch.uint8), raw, after=outs[1])):
        event.wait()
    assert torch.equal(widened, values.bfloat16().float()) and torch.equal(restored, values)
    link.close()
    arena.close()


def test_open_link_picks_the_backend_from_the_config():
    cpu = torch.device("cpu")
    plain = open_link(cpu, SwapConfig())
    assert type(plain) is CopyLink and not plain.asynchronous
    assert plain.copy_out(torch.empty(4), torch.ones(4)) is FINISHED
    emulated = open_link(cpu, SwapConfig(emulate_gbs=2.0, copy_delay_s=0.001))
    assert isinstance(emulated, EmulatedLink) and emulated.bytes_per_s == 2e9 and emulated.delay_s == 0.001
    emulated.close()


def test_link_config_keys_are_checked():
    assert memory_config_from({"mode": "swap", "swap": {"emulate_gbs": 1}}).swap.emulate_gbs == 1.0
    assert memory_config_from("swap").swap.emulate_gbs is None  # off by default: synchronous CPU copies
    with pytest.raises(ConfigError, match="memory.swap.emulate_gbs"):
        memory_config_from({"mode": "swap", "swap": {"emulate_gbs": 0}})
    with pytest.raises(ConfigError, match="memory.swap.copy_delay_s"):
        memory_config_from({"mode": "swap", "swap": {"copy_delay_s": -0.1}})


# --------------------------------------------------------------------------------------------- the arena


def test_arena_sized_from_the_plan_is_one_exact_slab_reused_every_step():
    sizes = [3 << 20, 1 << 20, 12345, 7]
    arena = HostArena(arena_bytes(sizes))
    assert arena.capacity == arena_bytes(sizes) <= 1.2 * sum(sizes)
    for _ in range(3):
        slices = [arena.alloc(n) for n in sizes]
        assert [s.numel() for s in slices] == sizes
        assert all(s.data_ptr() % ALIGN == 0 for s in slices)
        assert len({s.data_ptr() for s in slices}) == len(sizes)  # no overlap
        assert arena.capacity == arena.peak_capacity == arena_bytes(sizes)  # never grew
        arena.reset()
    arena.close()
    assert arena.capacity == 0


def test_arena_without_a_plan_grows_once_to_the_largest_step():
    arena = HostArena()
    first = [1 << 20, 2 << 20, 5000]
    for n in first:
        arena.alloc(n)
    assert arena.capacity == arena_bytes(first)  # exact chunks, not powers of two
    arena.reset()
    assert arena.capacity == arena_bytes(first) and len(arena._slabs) == 1
    for n in first[:2]:  # a smaller step fits
        arena.alloc(n)
    arena.reset()
    assert arena.capacity == arena_bytes(first)
    assert arena.peak_capacity <= 1.2 * sum(first)  # the chunks were freed before the slab was made
    arena.close()


def test_host_memory_shortfall_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"memory.swap: the host arena needs 2.00 GiB .* 1.00 GiB available") as error:
        check_host_memory(2 << 30, available=1 << 30)
    assert "\n" not in str(error.value)
    check_host_memory(1 << 20, available=1 << 30)


# --------------------------------------------------------------------------------------------- the engine

# Emulated link settings: (GB/s, random delay per copy up to s, swap.max_inflight_bytes). At 16³ the
# copies are small, so the slow settings are what keeps them in flight when the engine needs them; the
# 64 KiB in-flight budget forces releases that wait for one specific copy.
LINK_SETTINGS = {
    "0.02GBs": (0.02, 0.0, 4 << 30),
    "0.2GBs_delays": (0.2, 0.004, 4 << 30),
    "1GBs_delays_budget": (1.0, 0.002, 64 << 10),
    "5GBs": (5.0, 0.0, 4 << 30),
}
SLOW = ("0.02GBs", "0.2GBs_delays", "1GBs_delays_budget")
SWAPPING = ("swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead", "hybrid")


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.norm = nn.InstanceNorm3d(channels, affine=True)
        self.act = nn.LeakyReLU(0.01)
        self.drop = nn.Dropout3d(0.2)
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.drop(self.act(self.norm(self.conv1(x)))))


class ResidualNet(nn.Module):
    """Not a U-Net: a stem, residual blocks, a per-voxel Linear on a channels-last view (a saved,
    non-contiguous view), and a pooled Linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(2, 6, 3, padding=1)
        self.blocks = nn.ModuleList([Residual(6), Residual(6)])
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        h = self.mix(h.permute(0, 2, 3, 4, 1)).relu()
        return self.head(h.mean((1, 2, 3)))


def _unet() -> nn.Module:
    return build_model(ModelConfig(base_filters=4, dropout=0.3))


def _unet_batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(1, 4, 16, 16, 16, generator=generator)
    y = (torch.rand(1, 3, 16, 16, 16, generator=generator) > 0.7).float()
    return x, y


def _dice(probs, target):
    dims = (0, 2, 3, 4)
    return 1 - (2 * (probs * target).sum(dims) + 1e-5).div(probs.sum(dims) + target.sum(dims) + 1e-5).mean()


def _residual_batch(step: int):
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randn(2, 2, 20, 20, 20, generator=generator), torch.randn(2, 3, generator=generator)


def _mse(out, target):
    return (out - target).pow(2).mean()


UNET = (_unet, _unet_batch, _dice)
RESIDUAL = (ResidualNet, _residual_batch, _mse)


def _train(model_kind, policy, steps: int = 2):
    """`sgd_history` of a fresh model of `model_kind` under `policy`, and the engine's last stats. Two steps: the
    first reloads in the order it guesses, the second in the backward order the first taught the engine, and
    the second's parameters carry the first's gradients through momentum."""
    factory, make_batch, loss_fn = model_kind
    torch.manual_seed(0)
    model = factory()
    engine = MemoryEngine(model, policy) if policy is not None else None
    try:
        history, stats = sgd_history(model, engine, make_batch, loss_fn, steps)
        return history, stats[-1] if stats else None
    finally:
        if engine is not None:
            engine.close()


@pytest.fixture(scope="module")
def references():
    return {"unet": _train(UNET, None)[0], "residual": _train(RESIDUAL, None)[0]}


@pytest.fixture
def blocked_waits(monkeypatch):
    """Counts the engine's waits on copies that had not finished yet: proof the copies were in flight."""
    counter = {"blocked": 0}
    original = ThreadCopyEvent.wait

    def spy(event):
        if not event.done():
            counter["blocked"] += 1
        return original(event)

    monkeypatch.setattr(ThreadCopyEvent, "wait", spy)
    return counter


def _link_policies(setting: str) -> dict:
    gbs, delay, inflight = LINK_SETTINGS[setting]
    base = memory_config_from({"swap": {"min_bytes": 0, "emulate_gbs": gbs, "copy_delay_s": delay,
                                        "max_inflight_bytes": inflight}})
    return named_policies(base)


@pytest.mark.parametrize("setting", list(LINK_SETTINGS))
def test_unet_presets_are_bitwise_through_the_emulated_link(setting, references, blocked_waits):
    policies = _link_policies(setting)
    # recompute and norm_act copy nothing: once is enough.
    names = [n for n in policies if n != "none" and (n in SWAPPING or setting == "0.02GBs")]
    for name in names:
        history, stats = _train(UNET, policies[name])
        assert_same_history(references["unet"], history, f"{name} at {setting}")
        if name in SWAPPING:
            assert stats.swapped_out_bytes > 0 and stats.swapped_in_bytes > 0, name
    if setting in SLOW:
        assert blocked_waits["blocked"] > 0  # the engine did find copies in flight, and waited


@pytest.mark.parametrize("setting", ["0.02GBs", "1GBs_delays_budget"])
def test_a_non_unet_model_is_bitwise_through_the_emulated_link(setting, references, blocked_waits):
    gbs, delay, inflight = LINK_SETTINGS[setting]
    link = {"min_bytes": 0, "emulate_gbs": gbs, "copy_delay_s": delay, "max_inflight_bytes": inflight}
    policies = {
        "swap": {"mode": "swap", "swap": link},
        "swap_lookahead_0": {"mode": "swap", "swap": {**link, "lookahead": 0}},
        "swap_first_4": {"mode": "swap", "swap": {**link, "tensors": 4}},
        "hybrid": {"mode": "hybrid", "swap": link, "recompute": {"norm_act": True}},
        "recompute_blocks": {"mode": "hybrid", "swap": link, "recompute": {"modules": ["blocks.1"]}},
    }
    for name, policy in policies.items():
        history, stats = _train(RESIDUAL, policy)
        assert_same_history(references["residual"], history, f"{name} at {setting}")
        assert stats.swapped_in_bytes > 0, name
    assert blocked_waits["blocked"] > 0


def test_control_without_the_wait_the_test_catches_it(references, monkeypatch):
    """The same check with the one wait removed (the engine reads a reload, and the reload reads the host
    slot, without waiting for the copy): the gradients differ, so the tests above would catch it."""
    monkeypatch.setattr(ThreadCopyEvent, "wait", lambda event: None)
    policy = _link_policies("0.02GBs")["swap_all"]
    try:
        history, _ = _train(UNET, policy)
    except RuntimeError:
        return  # an engine that raises is caught too
    with pytest.raises(AssertionError, match="differ"):
        assert_same_history(references["unet"], history, "swap_all without waits")


def test_a_planned_arena_the_host_cannot_hold_fails_before_the_first_step(monkeypatch):
    import brats_swap.memory.arena as arena_module

    monkeypatch.setattr(arena_module, "available_host_bytes", lambda: 1 << 20)
    net = ResidualNet()
    with pytest.raises(ConfigError, match="memory.swap: the host arena needs"):
        MemoryEngine(net, {"mode": "swap"}, "cpu", arena_bytes=64 << 20)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    engine = MemoryEngine(ResidualNet(), {"mode": "swap"}, "cpu", arena_bytes=512 << 10)
    assert engine.last_stats().arena_bytes == 512 << 10  # allocated at construction, exactly
    engine.close()
    assert engine.last_stats().arena_bytes == 0  # returned on close


def test_validate_plan_prices_and_runs_the_emulated_link(tmp_path, monkeypatch):
    """scripts/validate_plan.py --emulate-gbs: the engine copies through the link, the planner prices it."""
    import functools
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "validate_plan.py"
    spec = importlib.util.spec_from_file_location("validate_plan", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # The interference calibration times its convolution loop for 0.1 s instead of 1 s, three pairs as in a
    # real run: this checks that it streams copies and that the planner is given its price, not how precise it is.
    monkeypatch.setattr(module, "calibrate_interference", functools.partial(module.calibrate_interference, seconds=0.1))
    out = tmp_path / "v.json"
    result = module.main(["--device", "cpu", "--emulate-gbs", "0.5", "--cubes", "16", "--base-filters", "2",
                          "--steps", "1", "--min-bytes", "0", "--policies", "none", "swap_all", "--json", str(out)])
    written = json.loads(out.read_text())
    assert [row["policy"] for row in written["rows"]] == ["none", "swap_all"] == [r["policy"] for r in result["rows"]]
    cost = written["cost_models"]["16"]
    assert cost["sync_copies"] is False and cost["d2h_bytes_per_s"] == cost["h2d_bytes_per_s"] == 0.5e9
    assert cost["copy_interference_s_per_byte"] == written["interference"]["seconds_per_byte"] >= 0
    assert written["interference"]["copied_bytes"] > 0  # the calibration really streamed copies
    for row in written["rows"]:
        assert row["saved_bytes_equal"] and row["swapped_bytes_equal"]
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
    assert "| 16 | 1 | swap_all |" in out.with_suffix(".md").read_text()


def test_a_longer_reload_distance_mid_backward_is_bitwise(references, blocked_waits):
    """`swap.mid_lookahead` through a delayed emulated link: reloads issued further ahead in the middle of
    backward, gradients bitwise plain PyTorch's."""
    gbs, delay, _ = LINK_SETTINGS["0.2GBs_delays"]
    policy = memory_config_from({"mode": "swap", "swap": {
        "min_bytes": 0, "emulate_gbs": gbs, "copy_delay_s": delay, "lookahead": 1, "mid_lookahead": 4,
        "mid_from_marker": 1, "mid_until_block": 2}})
    history, stats = _train(UNET, policy)
    assert_same_history(references["unet"], history, "mid_lookahead")
    assert stats.swapped_in_bytes > 0
    assert blocked_waits["blocked"] > 0
