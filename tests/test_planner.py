"""The planner predicts what the memory engine does: records, bytes, peaks; and it fits budgets."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typer.testing import CliRunner

from brats_swap.config.schema import MemoryConfig, ModelConfig
from brats_swap.errors import ConfigError
from brats_swap.memory.engine import MemoryEngine
from brats_swap.memory.planner import (
    BUDGET_HEADROOM,
    Planner,
    choose_policy,
    default_cost_model,
    named_policies,
    plan_report,
)
from brats_swap.memory.simulate import GIB, OpCostModel, Placement, simulate_memory
from brats_swap.memory.trace import meta_copy, soft_dice_loss, trace_step
from brats_swap.model import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig())  # the real U-Net, dropout on


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return build_model(ModelConfig(base_filters=4))  # the same architecture, cheaper on 2 CPU cores


@pytest.fixture
def one_thread():
    """The engine runs real CPU steps here; one thread wastes less on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _small_base() -> MemoryConfig:
    base = MemoryConfig()
    base.swap.min_bytes = 1 << 16  # small cubes: let more storages qualify for swapping
    return base


def _engine_step(model, cfg, x, y):
    engine = MemoryEngine(model, cfg, "cpu", measure=True)
    try:
        with engine.step():
            loss = soft_dice_loss(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return engine.last_stats(), engine.last_records(), engine.last_swapped()
    finally:
        engine.close()


@pytest.mark.parametrize("size", [32, 48])
def test_predictions_equal_engine_measurements_for_every_policy(small_model, size, one_thread):
    model = small_model
    shape = (1, 4, size, size, size)
    planner = Planner(model, shape, loss_fn=soft_dice_loss)
    x = torch.randn(shape)
    y = (torch.rand(1, 3, size, size, size) > 0.5).float()
    policies = named_policies(_small_base())
    assert set(policies) == {"none", "swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead",
                             "recompute", "norm_act", "hybrid"}
    for name, cfg in policies.items():
        stats, records, swapped = _engine_step(model, cfg, x, y)
        memory = planner.memory(cfg)
        assert planner.records(cfg) == records, name
        assert planner.placement(cfg).swapped == swapped, name
        assert memory.saved_bytes == stats.saved_bytes, name
        assert memory.swapped_bytes == stats.swapped_out_bytes, name
        assert memory.swapped_in_bytes == stats.swapped_in_bytes, name
        assert memory.recomputed_bytes == stats.recomputed_bytes, name
        assert memory.peak_resident_saved_bytes == stats.peak_resident_saved_bytes, name
        assert memory.prefetch_misses == stats.prefetch_misses, name
    # The policies really differ (the equalities above are not all zeros).
    none = planner.memory(policies["none"])
    results = [planner.memory(cfg) for cfg in policies.values()]
    assert max(r.swapped_bytes for r in results) > 0.3 * none.saved_bytes
    assert max(r.recomputed_bytes for r in results) > 0.3 * none.saved_bytes
    assert min(r.peak_resident_saved_bytes for r in results) < 0.5 * none.peak_resident_saved_bytes


class _LiveBytes(TorchDispatchMode):
    """An independent direct count: bytes of live storages after every op (no hooks, plain autograd)."""

    def __init__(self, external: set[int]):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.external = external
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in self.external:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def test_none_peak_at_192_matches_a_direct_meta_count(model):
    shape = (2, 4, 192, 192, 192)
    trace = trace_step(model, shape, loss_fn=soft_dice_loss)
    predicted = simulate_memory(trace, Placement(), optimizer_state_factor=0).peak_bytes

    meta_model = meta_copy(model)
    x = torch.empty(shape, device="meta")
    y = torch.empty((2, 3, 192, 192, 192), device="meta")
    params = {p.untyped_storage()._cdata for p in meta_model.parameters()}
    with _LiveBytes(params) as counter:
        soft_dice_loss(meta_model(x), y).backward()
    direct = counter.peak + x.untyped_storage().nbytes() + y.untyped_storage().nbytes() + trace.param_bytes
    assert abs(predicted - direct) <= 0.01 * direct
    assert 20 * GIB < predicted < 40 * GIB  # about 12 GiB of saved activations per 192³ sample
    assert trace.saved_bytes > 20 * GIB


def test_auto_tune_at_192_fits_16_8_4_gib_or_reports_the_floor(model):
    shape = (2, 4, 192, 192, 192)
    planner = Planner(model, shape, cost=default_cost_model("gpu", torch.float32))
    floor = planner.floor_bytes()
    none_peak = planner.memory(named_policies()["none"]).peak_bytes
    assert floor < none_peak
    fitted = 0
    for budget_gib in (16, 8, 4):
        best, _ = planner.auto(budget_gib * GIB)
        if best is None:
            assert floor > budget_gib * GIB * BUDGET_HEADROOM or budget_gib < 16
        else:
            fitted += 1
            assert best.peak_bytes <= budget_gib * GIB * BUDGET_HEADROOM
            assert best.policy.mode in ("none", "swap", "recompute", "hybrid")
    assert fitted >= 1  # 16 GiB fits with swapping; the floor (~9 GiB fp32, batch 2) rules out 4 GiB
    memory_cfg = MemoryConfig(mode="auto", budget_gib=4.0)
    with pytest.raises(ConfigError, match=r"memory.budget_gib=4.*floor"):
        choose_policy(model, memory_cfg, shape, torch.float32, "cpu",
                      cost=default_cost_model("gpu", torch.float32))


def test_auto_plan_is_checked_against_the_engine_on_cpu(small_model, one_thread):
    model = small_model
    size = 32
    shape = (1, 4, size, size, size)
    base = _small_base()
    planner = Planner(model, shape, loss_fn=soft_dice_loss)
    none = planner.memory(named_policies(base)["none"])
    lowest = min(planner.memory(cfg).peak_bytes for cfg in named_policies(base).values())
    # Scale the budget down so that keeping everything does not fit but the leanest preset does.
    budget = (lowest + none.peak_bytes) / 2 / BUDGET_HEADROOM
    base.budget_gib = budget / GIB
    chosen, report = choose_policy(model, base, shape, torch.float32, "cpu", loss_fn=soft_dice_loss)
    assert chosen.mode in ("swap", "recompute", "hybrid")
    assert report.chosen.peak_bytes <= budget * BUDGET_HEADROOM
    predicted = planner.memory(chosen)
    x = torch.randn(shape)
    y = (torch.rand(1, 3, size, size, size) > 0.5).float()
    stats, _, _ = _engine_step(model, chosen, x, y)
    assert stats.peak_resident_saved_bytes == predicted.peak_resident_saved_bytes
    # The saved-tensor share the plan leaves within the budget holds in the real run.
    share = budget * BUDGET_HEADROOM - (predicted.peak_bytes - predicted.peak_resident_saved_bytes)
    assert stats.peak_resident_saved_bytes <= share
    assert stats.peak_resident_saved_bytes < none.peak_resident_saved_bytes


def test_choose_policy_needs_a_budget(model):
    with pytest.raises(ConfigError, match="memory.budget_gib"):
        choose_policy(model, MemoryConfig(mode="auto"), (1, 4, 16, 16, 16), torch.float32, "cpu")


def test_copy_engine_prices_the_link(small_model):
    model = small_model
    planner = Planner(model, (1, 4, 32, 32, 32), cost=OpCostModel(flops_per_s=1e12, bytes_per_s=1e11))
    cfg = named_policies(_small_base())["swap_all"]
    none = planner.time(named_policies()["none"])
    planner.cost.h2d_bytes_per_s = planner.cost.d2h_bytes_per_s = 1e15  # a free link hides everything
    fast = planner.time(cfg)
    planner.cost.h2d_bytes_per_s = planner.cost.d2h_bytes_per_s = 1e8  # a slow link stalls compute
    slow = planner.time(cfg)
    assert fast.step_s == pytest.approx(none.step_s, rel=1e-3)
    assert slow.exposed_transfer_s > 0.5 * (slow.d2h_s + slow.h2d_s) > 0
    assert slow.step_s == pytest.approx(none.step_s + slow.exposed_transfer_s, rel=1e-6)
    later = copy.deepcopy(cfg)
    later.swap.lookahead = 0  # reloads issued at the block itself: less overlap than lookahead 3
    earlier = copy.deepcopy(cfg)
    earlier.swap.lookahead = 3
    planner.cost.h2d_bytes_per_s = planner.cost.d2h_bytes_per_s = 2e9
    assert planner.time(earlier).step_s <= planner.time(later).step_s


def test_plan_report_bf16_halves_activations(small_model):
    model = small_model
    shape = (1, 4, 32, 32, 32)
    fp32, _ = plan_report(model, MemoryConfig(), shape, dtype="float32", cost=default_cost_model("gpu"))
    bf16, _ = plan_report(model, MemoryConfig(), shape, dtype="bfloat16", cost=default_cost_model("gpu"))
    saved32 = next(p for p in fp32.policies if p.name == "none").saved_bytes
    saved16 = next(p for p in bf16.policies if p.name == "none").saved_bytes
    assert 0.4 * saved32 < saved16 < 0.75 * saved32


def test_plan_cli_writes_json_and_timeline(tmp_path):
    from brats_swap.cli.main import app

    out, png = tmp_path / "plan.json", tmp_path / "timeline.png"
    result = CliRunner().invoke(app, ["plan", "--size", "32", "--batch", "1", "--budget", "0.2",
                                      "--device", "gpu", "--bandwidth", "25", "--json", str(out),
                                      "--timeline", str(png)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["size"] == 32 and report["batch"] == 1 and report["budget_gib"] == 0.2
    names = [p["name"] for p in report["policies"]]
    assert names[:8] == ["none", "swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead",
                         "recompute", "norm_act", "hybrid"]
    for row in report["policies"]:
        assert set(row) == {"name", "predicted_peak_gib", "swapped_gib", "recompute_gflop", "predicted_step_s",
                            "fits"}
    assert report["chosen"]["fits"] is True
    assert report["chosen"]["predicted_peak_gib"] <= 0.2
    assert report["chosen"]["policy"]["mode"] in ("none", "swap", "recompute", "hybrid")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "memory plan" in result.output


def test_plan_cli_rejects_a_bad_dtype():
    from brats_swap.cli.main import app

    result = CliRunner().invoke(app, ["plan", "--size", "16", "--batch", "1", "--dtype", "fp8"])
    assert result.exit_code == 2
    assert "--dtype" in result.output


def test_validate_plan_script_runs_on_cpu(tmp_path, one_thread):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "validate_plan.py"
    spec = importlib.util.spec_from_file_location("validate_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--device", "cpu", "--cubes", "16", "--base-filters", "2", "--steps", "1",
                          "--min-bytes", "0", "--policies", "none", "swap_all", "hybrid", "--out", str(tmp_path)])
    assert [row["policy"] for row in result["rows"]] == ["none", "swap_all", "hybrid"]
    for row in result["rows"]:
        assert row["saved_bytes_equal"] and row["swapped_bytes_equal"] and row["resident_bytes_equal"]
        assert row["predicted_peak_bytes"] == row["measured_peak_bytes"]  # CPU: peak resident saved bytes
    assert "| 16 | 1 | swap_all |" in (tmp_path / "validate_plan.md").read_text()
    assert json.loads((tmp_path / "validate_plan.json").read_text())["rows"][0]["policy"] == "none"
