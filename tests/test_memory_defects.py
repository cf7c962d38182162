"""The defects a review of the CUDA paths found, each shown where a CPU can show it: host-arena registration
(through an injected registrar), per-rank arena sizing, BatchNorm statistics under checkpointing, no host
sync before backward, a step boundary that does not block the host, and bf16 transport that does not
depend on copy timing."""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import types

import pytest
import torch
from memory_helpers import assert_same_history, make_unet, train_steps
from torch import nn

import brats_swap.memory.arena as arena_module
import brats_swap.train.loop as loop_module
from brats_swap.errors import ConfigError
from brats_swap.memory import MemoryEngine, memory_config_from
from brats_swap.memory.arena import HOST_REGISTER_PORTABLE, HostArena, check_host_memory
from brats_swap.memory.link import CopyLink, EmulatedLink, ThreadCopyEvent
from brats_swap.train.planning import swap_arena_bytes


class RecordingRegistrar:
    """Stands in for `cudaHostRegister`: records every call; `fail` makes registration return an error."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.cleared = 0

    def register(self, address: int, nbytes: int) -> int:
        self.registered.append((address, nbytes))
        return 1 if self.fail else 0

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)

    def clear_error(self) -> None:
        self.cleared += 1


# ------------------------------------------------------------------------------------------ host arena


def test_arena_registers_portable_pages_and_unregisters_once_on_close():
    registrar = RecordingRegistrar()
    arena = HostArena(10_000, pin=True, registrar=registrar)
    assert arena.pinned_bytes == arena.capacity
    ((address, nbytes),) = registrar.registered
    assert address % arena_module.PAGE == 0 and nbytes % arena_module.PAGE == 0 and nbytes >= 10_000
    assert HOST_REGISTER_PORTABLE == 1  # cudaHostRegisterPortable, as torch's own pinning
    arena.close()
    arena.close()
    assert registrar.unregistered == [address] and arena.pinned_bytes == 0


def test_failed_registration_clears_the_cuda_error_and_says_so():
    registrar = RecordingRegistrar(fail=True)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of \d+ bytes failed with CUDA error 1"):
        HostArena(10_000, pin=True, registrar=registrar)
    assert registrar.cleared == 1 and registrar.unregistered == []


def test_arena_dropped_without_close_unregisters_its_slabs():
    registrar = RecordingRegistrar()
    arena = HostArena(0, pin=True, registrar=registrar)
    arena.alloc(3000)
    arena.alloc(5000)  # no plan: one chunk per storage
    addresses = [address for address, _ in registrar.registered]
    assert len(addresses) == 2
    del arena
    gc.collect()
    assert sorted(registrar.unregistered) == sorted(addresses)


# ------------------------------------------------------------------------------------------ DDP ranks


def test_host_check_counts_every_rank_on_the_host(monkeypatch):
    check_host_memory(3 << 30, available=10 << 30, ranks=3)
    with pytest.raises(ConfigError, match="4 ranks on this host"):
        check_host_memory(3 << 30, available=10 << 30, ranks=4)
    model = nn.Sequential(nn.Conv3d(4, 3, 3, padding=1), nn.Sigmoid())
    cfg = memory_config_from({"mode": "swap", "swap": {"min_bytes": 0}})
    nbytes = swap_arena_bytes(model, cfg, (1, 4, 16, 16, 16), torch.float32)
    assert nbytes > 0
    monkeypatch.setattr(arena_module, "available_host_bytes", lambda: 3 * nbytes)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert swap_arena_bytes(model, cfg, (1, 4, 16, 16, 16), torch.float32) == nbytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="memory.swap: .*4 ranks on this host"):
        swap_arena_bytes(model, cfg, (1, 4, 16, 16, 16), torch.float32)


# ------------------------------------------------------------------------------------------ BatchNorm


class GatedNet(nn.Module):
    """A BatchNorm inside a region (as in an attention gate), with dropout to check the RNG replay too."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.Dropout3d(0.2))
        self.head = nn.Conv3d(4, 1, 1)

    def forward(self, x):
        return self.head(self.gate(x)).sigmoid()


def _gated_run(policy):
    torch.manual_seed(0)
    net = GatedNet()
    engine = MemoryEngine(net, policy) if policy is not None else None
    grads = []
    for step in range(2):
        x = torch.randn(2, 2, 6, 6, 6, generator=torch.Generator().manual_seed(step))
        torch.manual_seed(10 + step)
        with engine.step() if engine is not None else contextlib.nullcontext():
            loss = net(x).mean()
        loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
    net.eval()
    with torch.no_grad():
        out = net(torch.ones(1, 2, 6, 6, 6))
    return grads, dict(net.named_buffers()), out


def test_checkpointed_batchnorm_updates_running_statistics_once():
    expected_grads, expected_buffers, expected_out = _gated_run(None)
    grads, buffers, out = _gated_run({"mode": "recompute", "recompute": {"modules": ["gate"]}})
    for step_grads, step_expected in zip(grads, expected_grads, strict=True):
        assert all(torch.equal(g, e) for g, e in zip(step_grads, step_expected, strict=True))
    assert buffers.keys() == expected_buffers.keys()
    for name, buffer in buffers.items():
        assert torch.equal(buffer, expected_buffers[name]), name  # running_mean, running_var, num_batches_tracked
    assert torch.equal(out, expected_out)


# ------------------------------------------------------------------------------------------ training loop


def test_train_step_reads_the_loss_only_after_backward_is_queued(monkeypatch):
    order: list[str] = []
    model = nn.Conv3d(1, 3, 1)

    class Scaled:
        def __init__(self, loss):
            self.loss = loss

        def backward(self):
            order.append("backward")
            self.loss.backward()

    def reduce(value, ctx):
        order.append("loss read")
        return value

    monkeypatch.setattr(loop_module, "all_reduce_mean", reduce)
    fake = types.SimpleNamespace(
        folder=types.SimpleNamespace(root="run/fold0"), loop=types.SimpleNamespace(epoch=0, step_in_epoch=0),
        device=torch.device("cpu"), config=types.SimpleNamespace(train=types.SimpleNamespace(amp="none", grad_clip=None)),
        model=model, loss=lambda output, target: (output - target).abs().mean(),
        engine=types.SimpleNamespace(step=contextlib.nullcontext), train_model=lambda x: model(x).sigmoid(),
        scaler=types.SimpleNamespace(scale=Scaled, step=lambda optimizer: order.append("step"), update=lambda: None),
        optimizer=types.SimpleNamespace(zero_grad=lambda set_to_none: None), ctx=None,
        data=types.SimpleNamespace(device_batches=types.SimpleNamespace(prepare=lambda b: (b["image"], b["target"]))),
        # eager steps (train.compile off): the step runs as given
        compilation=types.SimpleNamespace(run=lambda step, what, module=None: step()),
        _engine_for_eager=lambda: None, _note_compilation=lambda: None)
    batch = {"image": torch.randn(1, 1, 4, 4, 4), "target": torch.ones(1, 3, 4, 4, 4)}
    loss = loop_module.FoldRecipe.train_step(fake, batch)
    assert order == ["backward", "loss read", "step"] and math.isfinite(loss)


# ------------------------------------------------------------------------------------------ step boundary


def test_fence_orders_the_next_copy_out_after_the_last_reload_without_blocking_the_host():
    link = EmulatedLink(gbs=100.0)
    gate = ThreadCopyEvent()  # holds the reload until the test releases it
    host = torch.zeros(1024, dtype=torch.uint8)
    reload = link.copy_in(torch.empty(1024, dtype=torch.uint8), host, after=gate)
    link.fence()  # returns while the reload still waits
    out = link.copy_out(host, torch.ones(1024, dtype=torch.uint8))
    threading.Event().wait(0.2)
    assert not reload.done() and not out.done()
    gate._flag.set()
    out.wait()
    assert reload.done() and bool((host == 1).all())
    link.close()


def test_begin_step_fences_the_link_instead_of_waiting_for_it():
    calls: list[str] = []

    class RecordingLink(CopyLink):
        def synchronize(self):
            calls.append("synchronize")

        def fence(self):
            calls.append("fence")

    engine = MemoryEngine(make_unet(), {"mode": "swap", "swap": {"min_bytes": 0}})
    engine.executor._links[torch.device("cpu")] = RecordingLink()
    engine.executor._arena(torch.device("cpu"))
    engine.front.begin_step()
    assert calls == ["fence"]
    engine.executor._arenas[False].alloc(10)
    engine.executor._arenas[False].alloc(10)  # a spill: the next step frees chunks, so it must wait
    engine.front.begin_step()
    assert calls == ["fence", "synchronize"]
    engine.executor._links = {}
    engine.close()


# ------------------------------------------------------------------------------------------ bf16 transport


def test_bf16_gradients_do_not_depend_on_copy_timing():
    """Instant copies (every storage released before backward) and slow, randomly delayed copies (storages
    still copying when backward starts): bitwise the same training, since backward always reads the host's
    rounded copy of a compressed storage."""
    base = {"mode": "swap", "swap": {"min_bytes": 0, "compress": "bf16", "lookahead": 2}}
    instant, _, _ = train_steps(base, steps=1, cube=16)
    slow = {**base, "swap": {**base["swap"], "emulate_gbs": 0.2, "copy_delay_s": 0.004}}
    delayed, stats, engine = train_steps(slow, steps=1, cube=16)
    engine.close()
    assert stats[-1].swapped_out_bytes > 0
    assert_same_history(instant, delayed, "bf16, instant vs delayed copies")
    plain, _, _ = train_steps(None, steps=1, cube=16)
    assert not torch.equal(plain[0][1][0], instant[0][1][0])  # bf16 transport does round


def test_bf16_conversion_buffers_are_counted_on_a_gpu():
    """CUDA converts bf16 transport through staging buffers on the compute stream: the planner counts them
    (in the resident-bytes counter and the liveness walk) for a GPU time model, not for the CPU links."""
    from brats_swap.memory.cost import default_cost_model
    from brats_swap.memory.planner import Planner
    from brats_swap.memory.simulate import replay, simulate_memory

    planner = Planner(nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 1, 1)), (1, 2, 8, 8, 8),
                      step=lambda model, x: model(x).mean())
    trace = planner.trace()
    cfg = memory_config_from({"mode": "swap", "swap": {"min_bytes": 0, "compress": "bf16"}})
    results = {}
    for staged in (False, True):
        cost = default_cost_model("gpu")
        cost.staged_conversion = staged
        schedule = replay(trace, cfg, cost=cost)
        results[staged] = (schedule.stats.peak_resident_saved_bytes, simulate_memory(trace, schedule=schedule).peak_bytes,
                           len(schedule.staging))
    assert results[False][2] == 0 and results[True][2] > 0
    assert results[True][0] > results[False][0] and results[True][1] >= results[False][1]
    assert default_cost_model("gpu").staged_conversion and not default_cost_model("cpu").staged_conversion
