"""`brats-swap cv` and `compare --patch` with the real training loop on tiny phantoms (CPU, seconds).

The crash test runs the CLI in a process of its own, forked from this one (tests/forked_cli.py), because SIGKILL
must hit a real process; the other invocations run in-process (an flock taken through another open file
conflicts within one process too), which keeps the file fast.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from cv_helpers import snapshot
from forked_cli import ForkedCli
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.cv import compare, run_cv
from brats_swap.data.cache import prepare_dataset
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.run.folder import COMPARE_ARMS

PHANTOM_SHAPE = (40, 40, 32)
TINY = [
    "data.cube=[32,32,32]", "data.loader_workers=0", "data.prepare_workers=1", "model.base_filters=4",
    "train.max_epochs=2", "train.device=cpu", "train.threads=1", "train.augment=none", "train.patch=[16,16,16]",
    "evaluate.hd95=false", "evaluate.sw_overlap=0", "evaluate.sw_batch_size=8", "cv.folds=2", "name=tiny",
]
EPOCH_LINE = re.compile(r"\bepoch (\d+)/\d+ +train_loss")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """4 phantom cases of 40×40×32 prepared into 32³ cubes, shared by every test of this file."""
    base = tmp_path_factory.mktemp("cv_phantoms")
    root, cache = base / "phantoms", base / "cache"
    synthesize_dataset(root, cases=4, seed=0, shape=PHANTOM_SHAPE)
    config = load_config(None, [f"data.root={root}", f"data.cache={cache}", *TINY])
    report = prepare_dataset(root, cache, config.data, workers=1, progress=False)
    assert not report.failed
    return {"root": root, "cache": cache}


def tiny_overrides(data: dict[str, Path], *extra: str) -> list[str]:
    return [f"data.root={data['root']}", f"data.cache={data['cache']}", *TINY, *extra]


def cv_args(data: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    sets = [arg for item in tiny_overrides(data) for arg in ("--set", item)]
    return ["cv", *sets, "--run", str(run_dir), *extra]


def wait_for(path: Path, process: ForkedCli, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the cv process ended (exit {process.returncode}) before {path.name} appeared:\n"
                                 + "".join(process.output()))
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def logged_epochs(run_dir: Path, fold: int) -> list[int]:
    """Epoch numbers in the order train.log recorded them (one line per finished epoch)."""
    text = (run_dir / f"fold_{fold}" / "train.log").read_text()
    return [int(m.group(1)) for m in EPOCH_LINE.finditer(text)]


def assert_complete(run_dir: Path, folds: int = 2, epochs: int = 2) -> None:
    summary = json.loads((run_dir / "cv_summary.json").read_text())
    assert summary["complete"] and summary["folds_done"] == list(range(folds))
    for k in range(folds):
        state = json.loads((run_dir / f"fold_{k}" / "state.json").read_text())
        assert state["trained"] and state["evaluated"] and state["epochs_completed"] == epochs
        assert (run_dir / f"fold_{k}" / "metrics.csv").exists()
    assert (run_dir / "figures" / "dice_boxplot.png").exists()
    assert "Dice" in (run_dir / "cv_summary.md").read_text()


@pytest.mark.slow  # a process of its own and two tiny folds
def test_sigkill_mid_fold_then_rerun_finishes_without_retraining_and_a_done_run_is_left_alone(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    with ForkedCli(cv_args(tiny_data, run_dir)) as process:
        wait_for(run_dir / "fold_0" / "checkpoint_latest.pt", process)  # epoch 1 of fold 0 is saved
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    before_rerun = logged_epochs(run_dir, 0)
    assert 1 in before_rerun and not (run_dir / "cv_summary.json").exists()

    outcome = run_cv(load_config(None, tiny_overrides(tiny_data)), run_dir)
    assert outcome.complete and outcome.exit_code == 0
    assert_complete(run_dir)
    fold0 = logged_epochs(run_dir, 0)
    # Every epoch once, except at most the one the kill interrupted (logged, then killed before its checkpoint).
    assert sorted(set(fold0)) == [1, 2] and len(fold0) - 2 <= 1
    assert logged_epochs(run_dir, 1) == [1, 2]
    assert len((run_dir / "cv.log").read_text().splitlines()) == 1  # the killed invocation never wrote its line

    # Re-invoked through the CLI once complete: exit 0, nothing changes but the summary's timestamp.
    volatile = ("cv.log", ".lock", "cv_summary.json", "cv_summary.md")
    before = snapshot(run_dir, ignore=volatile)
    summary_before = json.loads((run_dir / "cv_summary.json").read_text())
    again = CliRunner().invoke(app, cv_args(tiny_data, run_dir))
    assert again.exit_code == 0, again.output
    assert "nothing to train or evaluate" in again.output
    assert snapshot(run_dir, ignore=volatile) == before
    summary_after = json.loads((run_dir / "cv_summary.json").read_text())
    assert summary_after.pop("generated_at") >= summary_before.pop("generated_at")
    assert summary_after == summary_before


def test_a_second_concurrent_invocation_exits_75_touching_nothing_and_the_first_completes(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    second: dict = {}

    def clock_that_runs_a_second_invocation() -> float:
        # Called by the first invocation at its epoch boundaries, i.e. while it holds the run's lock.
        if not second and (run_dir / "fold_0" / "checkpoint_latest.pt").exists():
            before = snapshot(run_dir)
            second["result"] = CliRunner().invoke(app, cv_args(tiny_data, run_dir))
            second["unchanged"] = snapshot(run_dir) == before
        return time.monotonic()

    first = run_cv(load_config(None, tiny_overrides(tiny_data)), run_dir, max_hours=24.0,
                   clock=clock_that_runs_a_second_invocation)
    result = second["result"]
    assert result.exit_code == 75, result.output
    assert "another brats-swap process" in result.output and "Traceback" not in result.output
    assert second["unchanged"]
    assert first.complete and first.exit_code == 0
    assert_complete(run_dir)
    assert logged_epochs(run_dir, 0) == [1, 2] and logged_epochs(run_dir, 1) == [1, 2]
    assert len((run_dir / "cv.log").read_text().splitlines()) == 1  # only the first invocation's line


def test_max_hours_stops_at_an_epoch_boundary_with_the_checkpoint_written(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    latest = run_dir / "fold_0" / "checkpoint_latest.pt"

    def clock() -> float:
        # The window closes while epoch 1 runs: time jumps by a day once its checkpoint exists.
        return time.monotonic() + (86400.0 if latest.exists() else 0.0)

    config = load_config(None, tiny_overrides(tiny_data))
    outcome = run_cv(config, run_dir, folds="all", max_hours=1.0, clock=clock)
    assert outcome.stop_reason == "max-hours" and not outcome.complete and outcome.exit_code == 0
    assert logged_epochs(run_dir, 0) == [1]
    assert "stop requested at the start of epoch 2" in (run_dir / "fold_0" / "train.log").read_text()
    state = json.loads((run_dir / "fold_0" / "state.json").read_text())
    assert state["epochs_completed"] == 1 and not state["trained"]
    assert not (run_dir / "fold_1").exists()


@pytest.mark.slow  # two arms, sliding-window inference, three figures
def test_compare_patch_on_tiny_phantoms_writes_both_result_sets_the_table_and_figures(tiny_data, tmp_path):
    run_dir = tmp_path / "cmp"
    config = load_config(None, tiny_overrides(tiny_data, "train.max_epochs=1"))
    outcome = compare.run_compare(config, run_dir, folds=[0])
    assert outcome.complete
    for arm in COMPARE_ARMS:
        assert (run_dir / arm / "fold_0" / "metrics.csv").exists()
        assert json.loads((run_dir / arm / "cv_summary.json").read_text())["folds_done"] == [0]
    assert "mode patch [16, 16, 16]" in (run_dir / "patch" / "fold_0" / "train.log").read_text()
    result = json.loads((run_dir / "compare.json").read_text())
    assert result["paired_cases"] == 2 and set(result["metrics"]) >= {"dice", "sensitivity", "specificity"}
    for arm in COMPARE_ARMS:
        assert result["timing"][arm]["median_epoch_seconds"] > 0 and result["timing"][arm]["epochs_per_fold"] == [1]
    markdown = (run_dir / "compare.md").read_text()
    assert "| Dice | WT |" in markdown and "| Specificity | ET |" in markdown
    for arm in COMPARE_ARMS:  # the real loop's records: a step, an epoch's training and its validation apart
        timing = result["timing"][arm]
        assert timing["median_step_seconds"] > 0 and timing["validations"] == 1
        assert 0 < timing["median_epoch_training_seconds"] < timing["median_epoch_seconds"]
    assert "| validation (median, s) |" in markdown and "(1 run) | " in markdown
    assert result["figures"] == ["figures/compare_dice_boxplot.png", "figures/compare_overlays.png",
                                 "figures/training_curves.png"]
    for figure in result["figures"]:
        assert (run_dir / figure).read_bytes()[:4] == b"\x89PNG"
