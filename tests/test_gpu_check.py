"""scripts/gpu_check.py: every stage runs tiny on the CPU (`--dry-run`) and writes its JSON section."""

from __future__ import annotations

import importlib.util
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


def test_dry_run_runs_every_stage_on_the_cpu(tmp_path, capsys):
    gpu_check = _load()
    threads = torch.get_num_threads()
    flags = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled())
    document = gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    assert torch.get_num_threads() == threads  # the dry run's one thread is given back
    assert flags == (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                     torch.are_deterministic_algorithms_enabled())  # every global setting restored
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # one summary line, last
    assert last["gpu_check"] == "ok" and last["failed_stages"] == [] and document["exit_code"] == 0
    written = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert written["stages"].keys() == set(gpu_check.STAGES)
    assert {name: stage["status"] for name, stage in written["stages"].items()} == dict.fromkeys(gpu_check.STAGES, "ok")
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


def test_a_stage_past_the_deadline_is_skipped_not_started(tmp_path):
    document = _load().main(["--dry-run", "--out", str(tmp_path), "--stages", "bandwidth", "--time-limit", "0"])
    assert document["stages"]["bandwidth"]["status"] == "skipped" and document["exit_code"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_only_the_dry_run_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load().main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
