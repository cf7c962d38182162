"""scripts/gpu_check.py: every stage runs tiny on the CPU (`--dry-run`) and writes its JSON section."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _has_train_compile() -> bool:
    from brats_swap.config import load_config
    from brats_swap.errors import ConfigError

    try:
        load_config(None, ["train.compile=false"])
    except ConfigError:
        return False
    return True


def _global_settings() -> tuple:
    return (torch.get_num_threads(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled())


@dataclasses.dataclass(frozen=True)
class DryRun:
    """One whole `--dry-run`, shared read-only by the tests that check different parts of it (the dry run is
    the slowest thing in this file): the script's module, the document `main` returned, what it printed, the
    global settings before and after it, and the `train.compile=...` overrides its compile stage passed."""

    module: object
    out: Path
    document: dict
    stdout: str
    settings_before: tuple
    settings_after: tuple
    compile_keys_seen: list


@pytest.fixture(scope="module")
def gpu_check():
    """The script's module, loaded once for the in-process dry runs of this file. Each dry run records the fit
    of a GPU run's sizes to the floor machine (`fit_sizes`: meta traces of the 16-filter U-Net at 192³, about
    3 s of CPU, the same answer every time): planned once here, a copy handed to each run."""
    module = _load()
    fit_once = functools.cache(module.fit_sizes)
    module.fit_sizes = lambda *args: copy.deepcopy(fit_once(*args))
    return module


@pytest.fixture(scope="module")
def dry_run(gpu_check, tmp_path_factory) -> DryRun:
    out = tmp_path_factory.mktemp("dry-run")
    before, printed = _global_settings(), io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(printed):
        seen = _compile_keys_seen(monkeypatch, known=True)
        document = gpu_check.main(["--dry-run", "--out", str(out)])
    return DryRun(gpu_check, out, document, printed.getvalue(), before, _global_settings(), seen)


def test_dry_run_runs_every_stage_on_the_cpu(dry_run):
    gpu_check, tmp_path, document = dry_run.module, dry_run.out, dry_run.document
    threads, *flags = dry_run.settings_before
    assert dry_run.settings_after[0] == threads  # the dry run's one thread is given back
    assert dry_run.settings_after[1:] == tuple(flags)  # every global setting restored
    last = json.loads(dry_run.stdout.strip().splitlines()[-1])  # one summary line, last
    # A build without train.compile skips the compile stage (said in its section): the run is "incomplete".
    compile_status = "ok" if _has_train_compile() else "skipped"
    assert last["gpu_check"] == ("ok" if compile_status == "ok" else "incomplete")
    assert last["failed_stages"] == [] and document["exit_code"] == 0
    written = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert written["stages"].keys() == set(gpu_check.STAGES)
    assert {name: stage["status"] for name, stage in written["stages"].items()} == {
        **dict.fromkeys(gpu_check.STAGES, "ok"), "compile": compile_status}
    assert written["dry_run"] is True and document["stages"].keys() == written["stages"].keys()
    stages = written["stages"]

    # The emulated link never beats its bandwidth (1 GB/s), and moves data at a real rate.
    assert 0.1 < stages["bandwidth"]["d2h_gbs"] <= 1.05 and 0.1 < stages["bandwidth"]["h2d_gbs"] <= 1.05

    bitwise = stages["bitwise"]
    assert bitwise["reference_repeatable"] and bitwise["all_equal"]
    assert {(row["policy"], row["copy_delay_s"] > 0) for row in bitwise["rows"]} == {
        (name, delayed) for name in gpu_check.PRESET_NAMES for delayed in (False, True)}
    assert all(row["swapped_out_bytes"] > 0 for row in bitwise["rows"] if row["policy"].startswith("swap"))

    peak = stages["peak"]
    assert {(row["policy"], row["batch"]) for row in peak["rows"]} == {
        (name, 1) for name in ("none", *gpu_check.PRESET_NAMES, "auto")}
    assert all(row["status"] == "ok" for row in peak["rows"])
    # Release points do not depend on copy timing: the prediction is exact even through the emulated
    # link, however busy this CPU is.
    for row in peak["rows"]:
        assert row["peak_error"] == 0.0 and row["peak_within_bound"], row

    times = {row["policy"]: row for row in stages["step_time"]["rows"]}
    assert {"none", "save_on_cpu", "checkpoint_blocks", "swap_all", "hybrid"} <= times.keys()
    assert all(row["status"] == "ok" and row["step_s"] > 0 and row["vs_none"] > 0 for row in times.values())

    pinned = stages["pinned"]
    # One arena for the run, pinned once at the largest plan; the step used exactly the plan's slices.
    assert pinned["arena_used_bytes"] == pinned["planned_arena_bytes"] <= pinned["arena_bytes"]
    assert pinned["swapped_bytes"] > 0 and pinned["arena_per_swapped_byte"] <= 1.2 and pinned["within_target"]

    augment = stages["augment"]  # the training DataLoader and the device-side nnunet augmentation, per step
    assert augment["steps"] == 3 and augment["loader_workers"] >= 1 and len(augment["data_wait_s"]) == 3
    assert all(v > 0 for v in augment["augment_s"] + augment["step_s"]) and augment["augment_over_step"] > 0

    mednext = {row["policy"]: row for row in stages["mednext"]["rows"]}  # MedNeXt-L k5 (tiny) under its plan
    assert mednext.keys() == {"none", "auto"} and all(row["status"] == "ok" for row in mednext.values())
    assert mednext["auto"]["mode"] != "none" and mednext["auto"]["measured_step_s"] > 0
    assert mednext["auto"]["peak_error"] == 0.0  # the engine's resident saved bytes, as predicted

    # The capping code of a GPU run ran against the rehearsed floor card, which refuses an unindexed device
    # as torch does: every capped row set its fraction on device 0 and lifted it afterwards.
    card = gpu_check.FLOOR_CARD_BYTES
    for name, budget_gib, rows in (("peak", peak["cap_gib"], len(peak["rows"])),
                                   ("mednext", stages["mednext"]["budget_gib"], 1)):
        calls = stages[name]["rehearsed_cuda_calls"]
        fractions = [(index, fraction) for call, index, fraction in calls if call == "set_per_process_memory_fraction"]
        assert len(fractions) == 2 * rows, name
        for (index, fraction), (lift_index, lifted) in zip(fractions[::2], fractions[1::2], strict=True):
            assert index == lift_index == 0 and lifted == 1.0
            assert fraction == pytest.approx(budget_gib * 2**30 / card, rel=1e-2), name  # budget_gib rounded
    assert all("rehearsed_cuda_calls" in stage for stage in stages.values())
    # The sizes a GPU run fits to the floor machine: batch 2's arena does not fit its host, and is said.
    fit = written["fit"]
    assert fit["applied"] is False and fit["changed"]["peak_batches"] == [[1, 2], [1]]
    assert fit["arena_gib"] <= fit["pin_limit_gib"] and "batch 2" in fit["skipped"][0]


def _compile_keys_seen(monkeypatch, *, known: bool) -> list[str]:
    """Route the compile stage's `load_config` through a wrapper that records each `train.compile=...` it is
    given; `known=False` refuses it as a build without the key does, `known=True` drops it before the real
    loader (eager rows train as they would with the key off, whichever build this is)."""
    import brats_swap.config as config_package
    from brats_swap.errors import ConfigError

    real, seen = config_package.load_config, []

    def load_config(path=None, overrides=(), **kwargs):
        kept = []
        for item in overrides:
            if item.startswith("train.compile="):
                seen.append(item)
                if not known:
                    raise ConfigError("train.compile: unknown key")
            else:
                kept.append(item)
        return real(path, kept, **kwargs)

    monkeypatch.setattr(config_package, "load_config", load_config)
    return seen


def test_a_build_without_train_compile_skips_the_compile_stage_in_one_line(gpu_check, tmp_path, monkeypatch, capsys):
    seen = _compile_keys_seen(monkeypatch, known=False)
    document = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--stages", "compile"])
    stage = document["stages"]["compile"]
    assert stage["status"] == "skipped" and stage["reason"] == "this build has no train.compile"
    assert seen == ["train.compile=false"] and document["exit_code"] == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compile:")]
    assert len(lines) == 1 and lines[0].startswith("compile: skipped: this build has no train.compile in ")


def test_the_compile_stage_drives_train_compile_and_measures_its_eager_rows_in_the_dry_run(dry_run):
    # The whole dry run's compile stage (the fixture records its overrides): the same stage `--stages compile`
    # runs alone.
    seen, document = dry_run.compile_keys_seen, dry_run.document
    stage = document["stages"]["compile"]
    assert stage["status"] == "ok" and document["exit_code"] == 0, stage
    rows = {(row["policy"], row["compiled"]): row for row in stage["rows"]}
    assert rows.keys() == {(policy, compiled) for policy in ("none", "auto") for compiled in (False, True)}
    # Every fold got the key as a dotted override: the probe, the budget's plan, then each eager row.
    assert seen == ["train.compile=false"] * 4
    for policy in ("none", "auto"):
        eager, compiled = rows[policy, False], rows[policy, True]
        assert eager["status"] == "ok" and eager["step_s"] > 0 and eager["first_epoch_step_s"] > 0
        assert eager["peak_bytes"] > 0 and "step_vs_eager" not in compiled
        assert compiled["status"] == "skipped" and "GPU" in compiled["reason"]
    assert rows["auto", False]["budget_gib"] > 0 and rows["none", False]["mode"] == "none"
    assert len(stage["skipped"]) == 2


def test_a_failing_stage_exits_1_and_the_json_names_it(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--stages",
                             "environment", "bandwidth", "--fail-stage", "bandwidth"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    document = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    stages = document["stages"]
    assert stages["environment"]["status"] == "ok"
    assert stages["bandwidth"]["status"] == "error" and "bandwidth forced to fail" in stages["bandwidth"]["error"]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["gpu_check"] == "failed" and last["failed_stages"] == ["bandwidth"] and document["exit_code"] == 1


def test_a_stage_past_the_deadline_is_skipped_not_started(gpu_check, tmp_path):
    document = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--stages", "bandwidth", "--time-limit", "0"])
    assert document["stages"]["bandwidth"]["status"] == "skipped" and document["exit_code"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_only_the_dry_run_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load().main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_rehearsed_card_keeps_torchs_device_index_rule():
    """The fake CUDA of the dry run refuses what torch 2.13 refuses: an unindexed device where torch indexes
    strictly (the crash of the first gpu_check on a GPU), and answers "cuda" as the current device where
    torch does; the package's capping code indexes first, so it passes."""
    from brats_swap.memory import cuda_device

    unindexed = torch.device("cuda")
    with pytest.raises(ValueError) as torch_error:
        torch.cuda._utils._get_device_index(unindexed)
    with cuda_device.rehearsal(24 << 30, device_count=2) as card:
        with pytest.raises(ValueError) as fake_error:
            card.set_per_process_memory_fraction(0.5, unindexed)  # what gpu_check called before
        assert str(fake_error.value) == str(torch_error.value)
        with pytest.raises(ValueError):
            card.set_device(unindexed)
        assert card.get_device_properties(unindexed).total_memory == 24 << 30  # optional: the current one
        cuda_device.use_device("cuda:1")
        with cuda_device.memory_cap(unindexed, 6 << 30):
            assert card.fractions == {1: 0.25}
        assert card.fractions == {1: 1.0} and cuda_device.peak_allocated_bytes(unindexed) == 0
        assert [call[:2] for call in card.calls if call[0] != "empty_cache"] == [
            ("get_device_properties", 0), ("set_device", 1), ("get_device_properties", 1),
            ("set_per_process_memory_fraction", 1), ("set_per_process_memory_fraction", 1),
            ("max_memory_allocated", 1)]
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            cuda_device.use_device("cuda:2")
    # On the CPU every call is a no-op or answers None.
    with cuda_device.memory_cap(torch.device("cpu"), 1):
        assert cuda_device.total_bytes("cpu") is None and cuda_device.peak_allocated_bytes("cpu") is None


def test_the_check_fits_a_large_machine_unchanged_and_the_floor_card_down():
    gpu_check = _load()
    sizes, fit = gpu_check.fit_sizes(gpu_check.GPU_SIZES, 141 * 10**9, 1500 << 30)  # H200, a large host
    assert sizes == dataclasses.replace(gpu_check.GPU_SIZES, card_limit_bytes=sizes.card_limit_bytes)
    assert fit["changed"] == {} and fit["skipped"] == []
    sizes, fit = gpu_check.fit_sizes(gpu_check.GPU_SIZES, 15 << 30, 28 << 30)  # a 16 GB card
    assert sizes.cap_gib < 15 - 2 and sizes.augment_batch == 1 and sizes.time_cube < 192
    assert fit["changed"]["cap_gib"][0] == 16.0
