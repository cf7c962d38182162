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
from torch import nn

from brats_swap.config import ConfigError, ModelConfig, SwapConfig
from brats_swap.memory.arena import ALIGN, HostArena, arena_bytes, check_host_memory
from brats_swap.memory.engine import MemoryEngine, memory_config_from
from brats_swap.memory.link import FINISHED, CopyLink, EmulatedLink, ThreadCopyEvent, open_link
from brats_swap.memory.presets import named_policies
from brats_swap.model import build_model


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
