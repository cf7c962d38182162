"""One rulebook: the simulator's per-tensor event sequence equals the engine's, for every policy and model.

The engine (real CPU tensors, synchronous copies) and the simulator (a replay of a `meta` trace through
the same `rulebook.Rulebook`) each log every swap out, release, reload, reloaded, use and drop. The logs
must be equal, event for event, for every preset and the planner's `auto` plan, in the first step
(nothing learned) and the second (lookahead 0 follows the first step's order), on the U-Net and on two
other models: one with views, chunks, transposes and storages saved twice; one whose forward takes extra
arguments (never swapped: the caller holds them).
"""

from __future__ import annotations

import copy

import pytest
import torch
from memory_helpers import TINY_UNET
from torch import nn

from brats_swap.config import MemoryConfig, SwapConfig
from brats_swap.config.loader import from_dict
from brats_swap.memory import MemoryEngine
from brats_swap.memory.planner import BUDGET_HEADROOM, Planner
from brats_swap.memory.presets import named_policies
from brats_swap.memory.records import SavedRecord
from brats_swap.memory.rulebook import KEEP, RECOMPUTE, SWAP, Decider
from brats_swap.memory.simulate import replay
from brats_swap.model import build_model


class ViewsNet(nn.Module):
    """Linear layers with chunks, a transposed matmul, a storage saved twice and a LayerNorm + GELU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.act = nn.GELU()
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        a, b = h.chunk(2, dim=1)  # two views of one storage
        mixed = torch.cat([a.sin(), b * a.cos()], dim=1)  # sin and cos both save `a`: one record
        g = self.fc2(mixed)
        g = g + (g.t() @ g).sum(0) * 1e-3  # a transpose of a saved tensor
        return self.head(self.act(self.norm(g)))


class ExtraArgsNet(nn.Module):
    """Convolutions whose forward takes a scale tensor and a keyword mask besides the batch."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.conv1(x) * scale))
        return self.conv2(h) * mask


def _unet_step(model, x):
    probs = model(x)
    target = torch.zeros_like(probs)
    target[:, :, ::2] = 1.0
    return (probs * target).mean() + probs.square().mean()


def _views_step(model, x):
    return model(x).square().mean()


def _extra_step(model, x):
    scale = torch.full((1, 8, 1, 1), 0.5, device=x.device)
    mask = torch.ones((1, 4, 1, 1), device=x.device)
    return model(x, scale, mask=mask).square().mean()


# name -> (model, input shape, step, modules to checkpoint, norm_act storages to store and swap instead)
MODELS = {
    "unet": (lambda: build_model(TINY_UNET), (1, 4, 16, 16, 16), _unet_step, ["encoder.level*", "decoder.level*"],
             ["encoder.level0.context.block2.act"]),
    "views": (ViewsNet, (256, 32), _views_step, ["fc2", "head"], ["act"]),
    "extra_args": (ExtraArgsNet, (2, 3, 12, 12), _extra_step, ["conv2"], ["act"]),
}


def _policies(name: str, planner: Planner) -> dict[str, MemoryConfig]:
    """Every preset (block checkpointing over this model's own modules), norm_act with one storage stored
    and swapped instead (a per-tensor mix), and `planner`'s auto plan."""
    _, _, _, checkpoint, stored = MODELS[name]
    base = MemoryConfig()
    base.swap.min_bytes = 0  # tiny tensors: let every activation qualify
    policies = named_policies(base)
    policies["recompute"].recompute.modules = checkpoint
    policies["swap_mid_lookahead"] = from_dict(MemoryConfig, {  # rule 9's longer distance mid-backward
        "mode": "swap", "swap": {"min_bytes": 0, "lookahead": 1, "mid_lookahead": 3, "mid_from_marker": 1,
                                 "mid_until_block": 1}}, prefix="memory")
    policies["norm_act_stored"] = from_dict(MemoryConfig, {
        "mode": "hybrid", "swap": {"min_bytes": 0, "include": stored, "lookahead": 0},
        "recompute": {"norm_act": True, "norm_act_exclude": stored}}, prefix="memory")
    peaks = {key: planner.memory(cfg).peak_bytes for key, cfg in policies.items()}
    budget = (min(peaks.values()) + peaks["none"]) / 2 / BUDGET_HEADROOM
    best, _ = planner.auto(budget, base)
    assert best is not None and best.peak_bytes <= budget * BUDGET_HEADROOM
    policies["auto"] = best.policy
    return policies


def _engine_logs(model: nn.Module, cfg: MemoryConfig, shape, step) -> tuple[list, list, MemoryEngine]:
    """The rulebook's log of the engine's first and second training step on CPU."""
    engine = MemoryEngine(model, cfg, "cpu", measure=True, log=[])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    logs = []
    for index in range(2):
        engine.front.log = []
        torch.manual_seed(index)
        x = torch.randn(shape)
        with engine.step():
            loss = step(model, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logs.append(engine.front.log)
    return logs[0], logs[1], engine


@pytest.mark.parametrize("name", list(MODELS))
def test_simulator_replays_the_engine_event_for_event(name):
    make, shape, step, _, stored = MODELS[name]
    torch.manual_seed(0)
    model = make()
    planner = Planner(model, shape, step=step)
    policies = _policies(name, planner)
    for cfg in policies.values():
        planner.trace(cfg)  # traced before any engine is attached (a model with one cannot be copied)
    assert {"swap_all", "swap_first_n", "swap_no_decoder", "recompute", "norm_act", "hybrid", "auto"} <= set(policies)
    swapping = 0
    for policy_name, cfg in policies.items():
        first, second, engine = _engine_logs(model, cfg, shape, step)
        trace = planner.trace(engine.cfg)
        predicted_first, predicted_second = [], []
        replay(trace, engine.cfg, learned=False, log=predicted_first)
        replay(trace, engine.cfg, learned=True, log=predicted_second)
        assert predicted_first == first, f"{name}/{policy_name}: first step"
        assert predicted_second == second, f"{name}/{policy_name}: second step"
        assert planner.records(engine.cfg) == engine.last_records(), f"{name}/{policy_name}"
        if policy_name == "norm_act_stored":  # the excluded storage is stored and swapped, the others rebuilt
            records = engine.last_records()
            assert any(r.module == stored[0] and i in engine.last_swapped() for i, r in enumerate(records))
            assert not any(r.recompute and r.module == stored[0] for r in records)
            assert name != "unet" or sum(r.recompute for r in records) > 10
        engine.close()
        kinds = {event for event, _ in second}
        if {"swap_out", "release", "reload", "reloaded", "drop"} <= kinds:
            swapping += 1
    assert swapping >= 3  # the logs hold the whole swap cycle, not just uses


def test_extra_forward_arguments_are_never_swapped():
    model = ExtraArgsNet()
    engine = MemoryEngine(model, {"mode": "swap", "swap": {"min_bytes": 0}}, "cpu")
    with engine.step():
        loss = _extra_step(model, torch.randn(2, 3, 12, 12))
    loss.backward()
    records = engine.last_records()
    decisions = engine.last_decisions()
    inputs = [i for i, record in enumerate(records) if record.is_input]
    assert len(inputs) == 3  # conv1 saves the batch, the products save the scale and the mask
    assert all(decisions[i] == (KEEP, "an input of the model's forward (the caller holds it)") for i in inputs)
    assert any(decision == SWAP for decision, _ in decisions)
    engine.close()


def test_decisions_and_their_reasons():
    def record(index, nbytes=4 << 20, module="encoder.level0.conv", **facts):
        return SavedRecord(index, nbytes, module, **facts)

    decider = Decider(SwapConfig(tensors=2, exclude=["decoder.*"]))
    cases = [
        (record(0, recompute=True), RECOMPUTE, "norm_act recipe"),
        (record(1, is_param=True), KEEP, "parameter"),
        (record(2, is_input=True), KEEP, "input of the model"),
        (record(3, dense=False), KEEP, "not a plain dense tensor"),
        (record(4, nbytes=10), KEEP, "swap.min_bytes"),
        (record(5, module="decoder.level0.conv"), KEEP, "swap.exclude"),
        (record(6), SWAP, "swapped"),
        (record(7), SWAP, "swapped"),
        (record(8), KEEP, "swap.tensors"),
    ]
    for saved, kind, reason in cases:
        decision = decider.decide(saved)
        assert decision.kind == kind and reason in decision.reason, (saved, decision)
    assert "does not swap" in Decider(SwapConfig(), swapping=False).decide(record(0)).reason
    assert "swap.include" in Decider(SwapConfig(include=["other"])).decide(record(0)).reason


def test_slow_copies_are_waited_for_only_when_the_in_flight_budget_needs_it():
    """No blanket wait: with a slow link whose copies the host never finds finished, a large in-flight
    budget releases nothing before the end of the forward; a small one releases the oldest copies one at
    a time during the forward, waiting for each (a stall), while later copies stay in flight."""
    model = build_model(TINY_UNET)
    planner = Planner(model, (1, 4, 16, 16, 16), step=_unet_step)
    trace = planner.trace(MemoryConfig())
    slow = copy.deepcopy(planner.cost)
    slow.sync_copies = False  # copies in flight
    slow.d2h_bytes_per_s = slow.h2d_bytes_per_s = 1e6
    results = {}
    for budget in (1 << 40, 1 << 16):
        cfg = from_dict(MemoryConfig, {"mode": "swap", "swap": {"min_bytes": 0, "max_inflight_bytes": budget}},
                        prefix="memory")
        log: list = []
        schedule = replay(trace, cfg, cost=slow, log=log)
        last_out = max(i for i, (event, _) in enumerate(log) if event == "swap_out")
        in_forward = [i for i, (event, _) in enumerate(log) if event == "release" and i < last_out]
        results[budget] = (in_forward, last_out, log, schedule.timing)
    in_forward, _, _, _ = results[1 << 40]
    assert in_forward == []
    in_forward, last_out, log, timing = results[1 << 16]
    swapped_before = sum(1 for event, _ in log[:last_out] if event == "swap_out")
    assert 0 < len(in_forward) < swapped_before
    assert timing.exposed_transfer_s > 0


def test_release_points_and_peak_do_not_depend_on_copy_timing():
    """Rule 6: where a swapped storage is released depends on the saves alone, so the predicted peak and
    the per-tensor sequence are the same for an asynchronous link of any speed (a very fast one, a GPU's,
    one so slow that no copy has finished by then); only the waits (exposed transfer time) change."""
    from brats_swap.memory.cost import default_cost_model
    from brats_swap.memory.simulate import simulate_memory

    planner = Planner(build_model(TINY_UNET), (1, 4, 16, 16, 16), step=_unet_step)
    trace = planner.trace(MemoryConfig())
    cfg = from_dict(MemoryConfig, {"mode": "swap", "swap": {"min_bytes": 0, "max_inflight_bytes": 1 << 16}},
                    prefix="memory")
    fast, slow = default_cost_model("gpu"), default_cost_model("gpu")
    fast.d2h_bytes_per_s = fast.h2d_bytes_per_s = 1e15
    slow.d2h_bytes_per_s = slow.h2d_bytes_per_s = 1e6
    peaks, logs, exposed = [], [], []
    for cost in (fast, default_cost_model("gpu"), slow):
        log: list = []
        schedule = replay(trace, cfg, cost=cost, log=log)
        peaks.append(simulate_memory(trace, schedule=schedule).peak_bytes)
        logs.append(log)
        exposed.append(schedule.timing.exposed_transfer_s)
    assert peaks[0] == peaks[1] == peaks[2] and logs[0] == logs[1] == logs[2]
    assert any(event == "release" for event, _ in logs[0])
    assert exposed[2] > exposed[1]


def test_mid_lookahead_reloads_further_ahead_only_in_the_middle_of_backward():
    """Rule 9 with `swap.mid_lookahead`: past the first marker and above the last blocks, reloads are issued
    earlier (fewer uses before them), none later, and the same storages are reloaded."""
    from brats_swap.memory.events import EventKind

    planner = Planner(build_model(TINY_UNET), (1, 4, 16, 16, 16), step=_unet_step)
    trace = planner.trace(MemoryConfig())
    markers = [event.arg for event in trace.events if event.kind is EventKind.MARKER]
    positions = {}
    for mid in (-1, 4):
        cfg = from_dict(MemoryConfig, {"mode": "swap", "swap": {
            "min_bytes": 0, "lookahead": 1, "mid_lookahead": mid, "mid_from_marker": 1,
            "mid_until_block": markers[-2]}}, prefix="memory")
        log: list = []
        replay(trace, cfg, log=log)
        uses, first_reload = 0, {}
        for event, index in log:
            if event == "use":
                uses += 1
            elif event == "reload":
                first_reload.setdefault(index, uses)
        positions[mid] = first_reload
    plain, mid = positions[-1], positions[4]
    assert plain.keys() == mid.keys()
    assert all(mid[i] <= plain[i] for i in plain) and any(mid[i] < plain[i] for i in plain)
