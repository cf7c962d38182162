"""The planner predicts what the memory engine does: records, bytes, peaks; and it fits budgets."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest
import torch
from memory_helpers import dice_loss
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typer.testing import CliRunner

from brats_swap.config.schema import MemoryConfig, ModelConfig
from brats_swap.errors import ConfigError
from brats_swap.memory.cost import OpCostModel, default_cost_model
from brats_swap.memory.engine import MemoryEngine
from brats_swap.memory.planner import (
    BUDGET_HEADROOM,
    Planner,
    choose_policy,
    plan_report,
)
from brats_swap.memory.presets import named_policies
from brats_swap.memory.recorder import meta_copy
from brats_swap.memory.simulate import GIB, simulate_memory
from brats_swap.model import build_model
from brats_swap.train.losses import weighted_dice_loss


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig())  # the real U-Net, dropout on


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return build_model(ModelConfig(base_filters=4))  # the same architecture, cheaper on 2 CPU cores


@pytest.fixture(scope="module")
def planner_192(model):
    """The real U-Net's step at 192³, batch 2, fp32, priced on the GPU time model: traced once for the two tests
    that read its no-policy trace (the auto-tune test traces its recompute variants on top)."""
    return Planner(model, (2, 4, 192, 192, 192), cost=default_cost_model("gpu", torch.float32),
                   loss_fn=weighted_dice_loss)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(ModelConfig(base_filters=2))  # the same architecture at half the width: half the engine's CPU


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
            loss = dice_loss(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return engine.last_stats(), engine.last_records(), engine.last_swapped()
    finally:
        engine.close()


@pytest.mark.parametrize("size", [32, 48])
def test_predictions_equal_engine_measurements_for_every_policy(tiny_model, size, one_thread):
    model = tiny_model
    shape = (1, 4, size, size, size)
    planner = Planner(model, shape, loss_fn=dice_loss)
    x = torch.randn(shape)
    y = (torch.rand(1, 3, size, size, size) > 0.5).float()
    policies = named_policies(_small_base())
    assert set(policies) == {"none", "swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead",
                             "recompute", "norm_act", "hybrid"}
    for name, cfg in policies.items():
        stats, records, swapped = _engine_step(model, cfg, x, y)
        memory = planner.memory(cfg)
        assert planner.records(cfg) == records, name
        assert planner.swapped(cfg) == swapped, name
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


def test_none_peak_at_192_matches_a_direct_meta_count(model, planner_192):
    shape = (2, 4, 192, 192, 192)
    trace = planner_192.trace()  # `trace_step(model, shape, loss_fn=weighted_dice_loss)`: fp32 takes no autocast
    predicted = simulate_memory(trace, optimizer_state_factor=0).peak_bytes

    meta_model = meta_copy(model)
    x = torch.empty(shape, device="meta")
    y = torch.empty((2, 3, 192, 192, 192), device="meta")
    params = {p.untyped_storage()._cdata for p in meta_model.parameters()}
    with _LiveBytes(params) as counter:
        weighted_dice_loss(meta_model(x), y).backward()
    direct = counter.peak + x.untyped_storage().nbytes() + y.untyped_storage().nbytes() + trace.param_bytes
    assert abs(predicted - direct) <= 0.01 * direct
    assert 20 * GIB < predicted < 40 * GIB  # about 12 GiB of saved activations per 192³ sample
    assert trace.saved_bytes > 20 * GIB


def test_auto_tune_at_192_meets_the_acceptance_numbers(planner_192, monkeypatch):
    """192³ batch 2 fp32 on the assumed H200 time model: 16 GiB within 1.15x of the no-policy step on a
    50 GB/s link and 1.30x on 25 GB/s (swap mixed with recomputation per tensor), 8 GiB fits, and 4 GiB is
    under the floor (nothing fits)."""
    planner = planner_192
    monkeypatch.setattr(planner, "cost", copy.deepcopy(planner.cost))  # the link is changed below: this test's own
    assert planner.cost.h2d_bytes_per_s == 50e9  # the default link: PCIe 5 x16
    none = planner.predict("none", named_policies()["none"])
    for gbs, ratio in ((50, 1.15), (25, 1.30)):
        planner.cost.h2d_bytes_per_s = planner.cost.d2h_bytes_per_s = gbs * 1e9
        best, _ = planner.auto(16 * GIB)
        assert best is not None and best.peak_bytes <= 16 * GIB * BUDGET_HEADROOM
        assert best.step_s <= ratio * none.step_s, (gbs, best.step_s / none.step_s, best.policy)
        assert best.policy.mode in ("swap", "recompute", "hybrid")
    best, _ = planner.auto(8 * GIB)
    assert best is not None and best.peak_bytes <= 8 * GIB * BUDGET_HEADROOM
    assert planner.floor_bytes() < none.peak_bytes
    assert planner.floor_bytes() > 4 * GIB * BUDGET_HEADROOM and planner.auto(4 * GIB)[0] is None


def test_a_budget_under_the_floor_is_refused_naming_it(small_model):
    shape = (1, 4, 32, 32, 32)
    planner = Planner(small_model, shape, loss_fn=weighted_dice_loss)
    budget_gib = planner.floor_bytes() / GIB / 2
    memory_cfg = MemoryConfig(mode="auto", budget_gib=budget_gib)
    with pytest.raises(ConfigError, match=rf"memory.budget_gib={budget_gib:g}.*floor"):
        choose_policy(small_model, memory_cfg, shape, torch.float32, "cpu", loss_fn=weighted_dice_loss)


def test_336_cube_at_batch_1_fits_16_gib(model):
    """The resolution gain Large Model Support reported for this 3D U-Net: 336³ (5.6x the voxels of 192³) at
    batch 1, fp32, in 16 GiB. The floor is under the planner's limit, and one concrete policy (norm and
    activation outputs rebuilt, everything else swapped, 1 GiB of copies in flight, one reload ahead) fits
    it on the H200 time model,
    so `plan --size 336 --batch 1 --budget 16` has a plan."""
    planner = Planner(model, (1, 4, 336, 336, 336), cost=default_cost_model("gpu", torch.float32),
                      loss_fn=weighted_dice_loss)
    limit = 16 * GIB * BUDGET_HEADROOM
    assert planner.floor_bytes() <= 0.95 * limit
    policy = MemoryConfig(mode="hybrid")
    policy.swap.lookahead = 0
    policy.swap.max_inflight_bytes = 1 << 30  # the forward waits for copies rather than hold 4 GiB of them
    policy.recompute.norm_act = True
    assert planner.memory(policy).peak_bytes <= limit


def test_auto_plan_is_checked_against_the_engine_on_cpu(small_model, one_thread):
    model = small_model
    size = 32
    shape = (1, 4, size, size, size)
    base = _small_base()
    planner = Planner(model, shape, loss_fn=dice_loss)
    none = planner.memory(named_policies(base)["none"])
    lowest = min(planner.memory(cfg).peak_bytes for cfg in named_policies(base).values())
    # Scale the budget down so that keeping everything does not fit but the leanest preset does.
    budget = (lowest + none.peak_bytes) / 2 / BUDGET_HEADROOM
    base.budget_gib = budget / GIB
    chosen, report = choose_policy(model, base, shape, torch.float32, "cpu", loss_fn=dice_loss)
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


def test_auto_without_a_budget_is_refused_where_policies_are_read():
    # One validator (the config loader's) for YAML, --set and policies handed to the memory package.
    from brats_swap.config import load_config
    from brats_swap.memory import memory_config_from

    with pytest.raises(ConfigError, match="memory.budget_gib"):
        load_config(None, ["memory.mode=auto"])
    with pytest.raises(ConfigError, match="memory.budget_gib"):
        memory_config_from({"mode": "auto"})
    with pytest.raises(ConfigError, match="memory.budget_gib"):
        memory_config_from({"mode": "auto", "budget_gib": -1})


def test_copy_engine_prices_the_link(small_model):
    model = small_model
    planner = Planner(model, (1, 4, 32, 32, 32), cost=OpCostModel(flops_per_s=1e12, bytes_per_s=1e11),
                      loss_fn=weighted_dice_loss)
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
    fp32, _ = plan_report(model, MemoryConfig(), shape, dtype="float32", cost=default_cost_model("gpu"),
                          loss_fn=weighted_dice_loss)
    bf16, _ = plan_report(model, MemoryConfig(), shape, dtype="bfloat16", cost=default_cost_model("gpu"),
                          loss_fn=weighted_dice_loss)
    saved32 = next(p for p in fp32.policies if p.name == "none").saved_bytes
    saved16 = next(p for p in bf16.policies if p.name == "none").saved_bytes
    assert 0.4 * saved32 < saved16 < 0.75 * saved32


def test_plan_cli_writes_json_and_timeline(tmp_path):
    from brats_swap.cli.main import app

    out, png = tmp_path / "plan.json", tmp_path / "timeline.png"
    result = CliRunner().invoke(app, ["plan", "--size", "32", "--batch", "1", "--budget", "0.25",
                                      "--set", "memory.device_overhead_gib=0.05", "--set", "train.compile=false",
                                      "--device", "gpu", "--bandwidth", "25", "--json", str(out),
                                      "--timeline", str(png)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["size"] == 32 and report["batch"] == 1 and report["budget_gib"] == 0.25
    names = [p["name"] for p in report["policies"]]
    assert names[:8] == ["none", "swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead",
                         "recompute", "norm_act", "hybrid"]
    for row in report["policies"]:
        assert set(row) == {"name", "predicted_peak_gib", "swapped_gib", "recompute_gflop", "predicted_step_s",
                            "prefetch_misses", "fits", "max_inflight_bytes"}
    assert report["chosen"]["fits"] is True
    assert report["chosen"]["predicted_peak_gib"] <= 0.25
    # Every peak is on the card: the step's tensors and the device overhead, reported on its own too.
    assert report["device_overhead_gib"] == 0.05 and report["floor_gib"] > 0.05
    assert min(row["predicted_peak_gib"] for row in report["policies"]) > 0.05
    assert report["chosen"]["policy"]["mode"] in ("none", "swap", "recompute", "hybrid")
    # A run that does not compile is priced eager, and the report says why (the compiled step, priced where
    # the run compiles: tests/test_planner_compiled.py).
    assert report["step"] == "eager" and report["eager_reason"] is None
    assert report["step_reason"] == "train.compile false"
    assert "eager step" in result.output and "step: eager (train.compile false)" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "memory plan" in result.output


def test_plan_cli_rejects_a_bad_dtype():
    from brats_swap.cli.main import app

    result = CliRunner().invoke(app, ["plan", "--size", "16", "--batch", "1", "--dtype", "fp8"])
    assert result.exit_code == 2
    assert "--dtype" in result.output


def test_validate_plan_script_runs_on_cpu(tmp_path, one_thread):
    import importlib.util

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
        # The step relative to none: the median over rounds of the two steps of one round.
        pairs = zip(row["measured_step_times_s"], result["rows"][0]["measured_step_times_s"], strict=True)
        assert row["measured_step_ratio"] == pytest.approx(statistics.median(a / b for a, b in pairs))
        assert row["predicted_step_ratio"] == pytest.approx(row["predicted_step_s"] / result["rows"][0]["predicted_step_s"])
    assert result["rows"][0]["measured_step_ratio"] == 1.0
    assert "| 16 | 1 | swap_all |" in (tmp_path / "validate_plan.md").read_text()
    assert json.loads((tmp_path / "validate_plan.json").read_text())["rows"][0]["policy"] == "none"


def test_yaml_presets_equal_the_preset_data():
    """configs/<preset>.yaml are for users; the planner reads `memory.presets`. They must not drift."""
    import yaml

    from brats_swap.memory.presets import PRESETS

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name, section in PRESETS.items():
        raw = yaml.safe_load((configs / f"{name}.yaml").read_text(encoding="utf-8"))
        assert raw["memory"] == section, name
    assert {"swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead", "recompute", "norm_act",
            "hybrid"} == set(PRESETS)


def test_presets_resolved_on_the_unet_match_the_same_modules_as_its_globs(small_model):
    """`resolve_presets` writes each rule in the model's own names; on the default U-Net they are the modules
    `PRESETS` (and configs/*.yaml) name with globs."""
    from brats_swap.memory.presets import PRESETS, resolve_presets
    from brats_swap.memory.records import module_matches
    from brats_swap.memory.stages import policy_globs

    names = [name for name, _ in small_model.named_modules() if name]
    resolved = named_policies(sections=resolve_presets(small_model, (1, 4, 32, 32, 32)))
    spelled = named_policies(sections=PRESETS)
    for preset in PRESETS:
        for key, patterns in policy_globs(spelled[preset]).items():
            theirs = policy_globs(resolved[preset])[key]
            assert {n for n in names if module_matches(n, patterns)} == \
                {n for n in names if module_matches(n, theirs)}, (preset, key, theirs)
    assert resolved["hybrid"].swap.include == ["encoder.level0", "encoder.level1"]


def _tiny_config(*overrides: str):
    from brats_swap.config import load_config

    return load_config(None, ["model.base_filters=4", "data.cube=[32,32,32]", *overrides])


def test_fp16_training_is_priced_in_fp16(monkeypatch, tmp_path):
    from brats_swap.run.folder import FoldFolder
    from brats_swap.train import planning

    # `brats-swap plan`: the dtype train.amp trains in, unless --dtype says otherwise.
    saved = {}
    for amp in ("none", "fp16"):  # the eager step both times (train.compile auto would compile fp32 on a GPU)
        report, _ = planning.plan_for_config(_tiny_config(f"train.amp={amp}", "train.compile=false"), batch=1,
                                             device="gpu")
        saved[amp] = next(p for p in report.policies if p.name == "none").saved_bytes
        assert report.dtype == {"none": "float32", "fp16": "float16"}[amp]
        assert report.step == "eager" and report.eager_reason is None
    assert 0.4 * saved["none"] < saved["fp16"] < 0.75 * saved["none"]
    # Under autocast the compiled step is not traced: the eager one is priced, and the report says why.
    compiled_amp, _ = planning.plan_for_config(_tiny_config("train.amp=fp16", "train.compile=true"), batch=1,
                                               device="gpu")
    assert compiled_amp.step == "eager" and "autocast" in compiled_amp.eager_reason
    assert next(p for p in compiled_amp.policies if p.name == "none").saved_bytes == saved["fp16"]
    forced, _ = planning.plan_for_config(_tiny_config("train.amp=fp16", "train.compile=false"), batch=1, device="gpu",
                                         dtype="fp32")
    assert next(p for p in forced.policies if p.name == "none").saved_bytes == saved["none"]

    # The out-of-memory advice prices the same dtype (at 96³: its GiB are printed with two decimals).
    def needs_gib(amp: str) -> float:
        config = _tiny_config(f"train.amp={amp}", "data.cube=[96,96,96]")
        message = str(planning.out_of_memory_error(torch.device("cpu"), config, "here"))
        return float(message.split("needs about ")[1].split(" GiB")[0])

    assert needs_gib("fp16") < 0.8 * needs_gib("none")

    # memory.mode=auto plans in it too.
    seen = []

    def fake_choose_policy(model, memory_cfg, input_shape, dtype, device, *, loss_fn, optimizer_state_factor,
                           prelude_bytes, compiled):
        seen.append((dtype, compiled))
        raise ConfigError("stop here")

    monkeypatch.setattr(planning, "choose_policy", fake_choose_policy)
    config = _tiny_config("train.amp=fp16", "memory.mode=auto", "memory.budget_gib=1")
    with pytest.raises(ConfigError, match="stop here"):
        planning.plan_memory(config, build_model(config.model), FoldFolder(tmp_path / "fold_0", 0), (1, 4, 32, 32, 32),
                             torch.device("cpu"), reuse=False)
    assert seen == [(torch.float16, False)]  # train.compile auto: eager on the CPU, so priced eager


def test_the_memory_policy_is_resolved_once(tmp_path):
    """`plan_memory` gives the concrete policy the engine runs, the checkpoint saves and a resume reuses."""
    from brats_swap.memory import MemoryEngine
    from brats_swap.run.folder import FoldFolder
    from brats_swap.train.planning import plan_memory

    config = _tiny_config("memory.mode=recompute")
    model = build_model(config.model)
    folder = FoldFolder(tmp_path / "fold_0", 0)
    folder.root.mkdir()
    shape = (1, 4, 32, 32, 32)
    policy = plan_memory(config, model, folder, shape, torch.device("cpu"), reuse=False)
    assert policy.mode == "recompute" and policy.recompute.norm_act  # recompute with nothing named: norm_act
    engine = MemoryEngine(model, policy)
    assert engine.cfg == policy  # the engine runs exactly the resolved policy
    engine.close()
    assert not folder.memory_plan.exists()

    config = _tiny_config("memory.mode=auto", "memory.budget_gib=4", "memory.bandwidth_gbs=10")
    policy = plan_memory(config, model, folder, shape, torch.device("cpu"), reuse=False)
    assert policy.mode in ("none", "swap", "recompute", "hybrid")
    assert policy.budget_gib == 4 and policy.bandwidth_gbs == 10
    recorded = json.loads(folder.memory_plan.read_text())
    assert recorded["memory"]["mode"] == policy.mode and recorded["report"]["chosen"] is not None
    # A resumed fold reads the recorded plan back instead of planning again.
    recorded["memory"] = {**recorded["memory"], "mode": "swap", "swap": {**recorded["memory"]["swap"], "tensors": 3}}
    folder.memory_plan.write_text(json.dumps(recorded))
    resumed = plan_memory(config, model, folder, shape, torch.device("cpu"), reuse=True)
    assert resumed.mode == "swap" and resumed.swap.tensors == 3
