"""What a new user meets in the first hour (issue 27), and `cv` options that cannot go together (issue 28):
`cv --status` before any fold ran and on a `train` run, the SLURM scripts' resources, the run name of
another network, what `plan` says to do, `train --folds`. Nothing here trains: seconds in all."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from brats_swap.cli.common import default_run_dir
from brats_swap.cli.main import app
from brats_swap.cli.plan import priced_recipe
from brats_swap.config import config_to_yaml, load_config
from brats_swap.cv import slurm
from brats_swap.cv.slurm import (
    PROCESS_BYTES,
    SUMMARY_TIME,
    WORKER_BYTES,
    SlurmOptions,
    cv_script,
    summary_script,
)
from brats_swap.cv.status_report import run_status
from brats_swap.run.checkpoint import save_checkpoint
from brats_swap.run.folder import RunFolder
from brats_swap.splits import load_or_create_splits
from brats_swap.train.planning import GIB, arena_bound_bytes, host_memory

REPO = Path(__file__).resolve().parents[1]
TINY = ["data.cube=[16,16,16]", "model.base_filters=2", "model.depth=3", "model.segmentation_levels=2", "train.device=cpu"]


def _one_line_usage_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# ---------------------------------------------------------------------------------------------- cv --status

def test_status_right_after_a_submit_dry_run_reports_every_fold_not_started(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch: --dry-run needs none
    run = tmp_path / "run"
    submitted = CliRunner().invoke(app, ["cv", "--run", str(run), "--set", "cv.folds=3", *sum(
        (["--set", item] for item in TINY), []), "--submit", "slurm", "--dry-run"])
    assert submitted.exit_code == 0, submitted.output
    assert not (run / "splits.json").exists()  # the jobs make it; on 06237a0 --status failed here
    status = CliRunner().invoke(app, ["cv", "--status", "--run", str(run)])
    assert status.exit_code == 0, status.output
    assert status.stdout.splitlines() == [f"fold {k}: not started" for k in range(3)]  # the notice: stderr


def test_status_of_a_finished_train_run_says_trained_then_done(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.root.mkdir()
    load_or_create_splits(run.root, [f"case{i}" for i in range(10)], 2, 0)
    run.fold(0).root.mkdir()
    # What `brats-swap train` leaves: a checkpoint that says it finished, and no cv state.json.
    save_checkpoint({"epoch": 3, "step_in_epoch": 0, "finished": True}, run.fold(0).latest)
    first = run_status(run)
    assert [s.state for s in first] == ["trained, not evaluated", "not started"]  # 06237a0: "stopped"
    assert first[0].line().startswith("fold 0: trained, not evaluated, 3 epoch(s) done")
    run.fold(0).metrics_csv.write_text("case_id,dice_wt\ncase0,0.5\n")  # `brats-swap evaluate --run` scored it
    assert run_status(run)[0].state == "done"
    save_checkpoint({"epoch": 2, "step_in_epoch": 5, "finished": False}, run.fold(1).root / "checkpoint_latest.pt")
    assert run_status(run)[1].state == "stopped"  # unfinished and nobody on it: still "stopped"


# ---------------------------------------------------------------------------------------------- SLURM scripts

def test_fold_tasks_ask_for_cpus_and_memory_from_the_config(tmp_path, monkeypatch):
    config = load_config(None, [*TINY, "data.loader_workers=3", "train.batch_size=2", "name=tiny"])
    run = RunFolder(tmp_path / "run")
    two_gpus = cv_script(config, run, [0, 1], SlurmOptions(gpus_per_fold=2))
    assert "#SBATCH --cpus-per-task=8" in two_gpus  # 2 ranks x (3 workers + the rank's one compute thread)
    threads = load_config(None, [*TINY, "data.loader_workers=3", "train.threads=4", "name=tiny"])
    assert "#SBATCH --cpus-per-task=7" in cv_script(threads, run, [0], SlurmOptions(gpus_per_fold=0))
    host = host_memory(config, 0)
    # workers x (prefetch + shared-memory slots) x batch x (fp16 x 4 + u8)
    assert host.loader_bytes == 3 * (2 + 2) * 2 * 16**3 * (2 * 4 + 1)
    mem = math.ceil(2 * (PROCESS_BYTES + 3 * WORKER_BYTES + host.total_bytes) / GIB)
    assert f"#SBATCH --mem={mem}G" in two_gpus
    given = cv_script(config, run, [0], SlurmOptions(gpus_per_fold=1, cpus_per_fold=5, mem="20G"))
    assert "#SBATCH --cpus-per-task=5" in given and "#SBATCH --mem=20G" in given
    # A swapping policy adds its pinned arena (traced on the meta device) to the memory of each rank; auto
    # counts the most it could swap.
    swap = load_config(None, [*TINY, "memory.mode=swap", "memory.swap.min_bytes=0", "name=tiny"])
    auto = load_config(None, [*TINY, "memory.mode=auto", "memory.budget_gib=1", "memory.swap.min_bytes=0"])
    assert arena_bound_bytes(config) == 0 < arena_bound_bytes(swap) <= arena_bound_bytes(auto)
    monkeypatch.setattr(slurm, "arena_bound_bytes", lambda config: 10 * GIB)
    cpus, mem_text, how = slurm.fold_resources(config, 1)
    assert cpus == 4 and mem_text == f"{math.ceil((PROCESS_BYTES + 3 * WORKER_BYTES + host.total_bytes) / GIB) + 10}G"
    assert "10.00 GiB swap arena" in how


def test_the_summary_job_has_no_gpu_its_own_partition_and_a_short_time(tmp_path):
    config = load_config(None, [*TINY, "train.device=auto", "name=tiny"])
    run = RunFolder(tmp_path / "run")
    options = SlurmOptions(partition="gpu", summary_partition="cpu", time="24:00:00")
    script = summary_script(config, run, "123", options)
    assert "#SBATCH --partition=cpu" in script and "--partition=gpu" not in script
    assert "gres" not in script and f"#SBATCH --time={SUMMARY_TIME}" in script and "24:00:00" not in script
    assert "#SBATCH --partition" not in summary_script(config, run, "123", SlurmOptions(partition="gpu"))
    assert "#SBATCH --time=00:10:00" in summary_script(config, run, "1", SlurmOptions(summary_time="00:10:00"))
    assert "#SBATCH --gres=gpu:1" in cv_script(config, run, [0], options)


# ---------------------------------------------------------------------------------------------- run names

def test_the_run_name_follows_the_network_trained():
    resenc_m = load_config(REPO / "configs" / "resenc_l.yaml", ["model.name=resenc_m"])
    assert resenc_m.model.name == "resenc_m" and resenc_m.name == "resenc_m"  # 06237a0: "resenc_l"
    assert default_run_dir(resenc_m, None) == Path("runs/resenc_m")
    assert load_config(REPO / "configs" / "resenc_l_whole.yaml", ["model.name=resenc_xl"]).name == "resenc_xl_whole"
    assert load_config(REPO / "configs" / "quickstart.yaml", ["model.name=segresnet"]).name == "quickstart-segresnet"
    assert load_config(REPO / "configs" / "resenc_l.yaml", []).name == "resenc_l"
    assert load_config(REPO / "configs" / "resenc_l.yaml", ["model.name=resenc_m", "name=mine"]).name == "mine"
    assert load_config(None, ["model.name=isensee2017"]).name == "default"


# ---------------------------------------------------------------------------------------------- plan

def _plan(*args: str):
    return CliRunner().invoke(app, ["plan", "--size", "16", "--batch", "1", "--device", "cpu",
                                    "--set", "model.base_filters=2", "--set", "model.depth=3",
                                    "--set", "model.segmentation_levels=2", *args])


def test_plan_says_which_config_lines_select_its_choice_and_what_floor_means(tmp_path, monkeypatch):
    from brats_swap.train import planning

    monkeypatch.setattr(planning, "available_host_bytes", lambda: 1 << 10)  # a machine with 1 KiB free
    out = tmp_path / "plan.json"
    result = _plan("--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    chosen = report["chosen"]["policy"]
    assert "to train with it, put in the config" in result.output
    assert f"memory.mode: {chosen['mode']}" in result.output  # no budget: the explicit policy
    assert "floor: the least any keep/swap/recompute policy could need" in result.output
    assert "priced: isensee2017 with the recipe of the built-in defaults (no --config): batch 1" in result.output
    assert "host memory:" in result.output and "warning: the run needs" in result.output
    for row in report["policies"]:  # every preset's peak with the window it assumed
        assert ("max_inflight_bytes" in row) and (row["max_inflight_bytes"] is None) == (row["name"] in (
            "none", "recompute", "norm_act"))

    budgeted = _plan("--budget", "0.05", "--set", "memory.swap.min_bytes=0", "--json", str(out))
    assert budgeted.exit_code == 0, budgeted.output
    assert "  memory.mode: auto\n" in budgeted.output and "  memory.budget_gib: 0.05\n" in budgeted.output
    assert "more]" not in budgeted.output  # the chosen policy is never cut ("... 8 more")
    chosen = json.loads(out.read_text())["chosen"]["policy"]
    for glob in chosen["swap"]["include"] if chosen["mode"] in ("swap", "hybrid") else []:
        assert json.dumps(glob) in budgeted.output.replace("\n", "")


def test_plan_names_the_recipe_it_priced(monkeypatch):
    monkeypatch.chdir(REPO)
    alone = load_config(None, ["model.name=resenc_l"])
    line = priced_recipe(alone, None, ["model.name=resenc_l"], batch=None, dtype=None)
    assert line.startswith("priced: resenc_l with the recipe of the built-in defaults (no --config): batch 1 "
                           "(train.batch_size), float32 (train.amp: none), optimizer adam (train.optimizer)")
    assert line.endswith("configs/resenc_l.yaml has that network's own recipe: plan --config configs/resenc_l.yaml")
    own = load_config("configs/resenc_l.yaml", [])
    line = priced_recipe(own, Path("configs/resenc_l.yaml"), None, batch=None, dtype="bf16")
    assert "batch 3 (train.batch_size), bf16 (--dtype), optimizer sgd" in line and "own recipe" not in line


# ---------------------------------------------------------------------------------------------- train --folds

def test_train_takes_folds_in_the_one_spelling(tmp_path, monkeypatch):
    from brats_swap.train import data as train_data
    from brats_swap.train import loop, summary

    trained: list[int] = []
    monkeypatch.setattr(train_data, "prepare_run_data", lambda data_cfg: None)
    monkeypatch.setattr(loop, "train_fold", lambda config, run_dir, fold, resume: trained.append(fold) or
                        SimpleNamespace(stop_reason=None, interrupted=False))
    monkeypatch.setattr(summary, "summary_panel", lambda result, config: "")
    base = ["train", "--run", str(tmp_path / "run"), *sum((["--set", item] for item in TINY), [])]
    for spelling in ("--folds", "--fold", "-f"):
        result = CliRunner().invoke(app, [*base, spelling, "1"])
        assert result.exit_code == 0, result.output
    assert trained == [1, 1, 1]
    assert CliRunner().invoke(app, base).exit_code == 0 and trained[-1] == 0
    for several in ("0,1", "all"):
        line = _one_line_usage_error(CliRunner().invoke(app, [*base, "--folds", several]))
        assert "train trains one fold" in line and f"brats-swap cv run --folds {several}" in line
    assert "a fold number or numbers like 0,2" in _one_line_usage_error(CliRunner().invoke(app, [*base, "--folds", "x"]))


# ---------------------------------------------------------------------------------------------- cv options

@pytest.mark.parametrize(("args", "named"), [
    (["--status", "--submit", "slurm"], ("--status", "--submit")),
    (["--status", "--summary"], ("--status", "--summary")),
    (["--submit", "slurm", "--nproc", "2"], ("--submit", "--nproc")),
    (["--submit", "slurm", "--parallel-folds", "2"], ("--parallel-folds", "--submit")),
    (["--submit", "slurm", "--max-hours", "2"], ("--max-hours", "--submit")),
    (["--submit", "slurm", "--folds", "1"], ("--folds", "--submit")),
    (["--nproc", "2", "--parallel-folds", "2"], ("--parallel-folds", "--nproc")),
    (["--summary", "--max-hours", "1"], ("--max-hours", "--summary")),
    (["--summary", "--folds", "0"], ("--folds", "--summary")),
    (["--status", "--folds", "0"], ("--folds", "--status")),
    (["--status", "--set", "train.lr=1"], ("--set", "--status")),
    (["--partition", "gpu"], ("--partition", "without --submit")),
    (["--dry-run"], ("--dry-run", "without --submit")),
    (["--summary", "--mem", "8G"], ("--mem", "--summary")),
])
def test_options_that_cannot_go_together_are_a_usage_error(tmp_path, args, named):
    run = tmp_path / "run"
    line = _one_line_usage_error(CliRunner().invoke(app, ["cv", "--run", str(run), *args]))
    assert all(option in line for option in named), line
    assert not run.exists()  # refused before anything was written


def test_the_options_each_mode_reads_still_go_together(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_to_yaml(load_config(None, [*TINY, "cv.folds=2", "name=tiny"])))
    submitted = CliRunner().invoke(app, ["cv", "--run", str(run), "--submit", "slurm", "--dry-run", "--partition",
                                         "gpu", "--summary-partition", "cpu", "--summary-time", "00:20:00", "--time",
                                         "2:00:00", "--mem", "9G", "--cpus-per-fold", "3", "--grace", "60"])
    assert submitted.exit_code == 0, submitted.output
    assert "#SBATCH --time=00:20:00" in (run / "slurm" / "summary.sbatch").read_text()
    status = CliRunner().invoke(app, ["cv", "--status", "--run", str(run)])
    assert status.exit_code == 0 and "fold 1: not started" in status.output
