"""`brats-swap cv run --parallel-folds 2` on CPU: two folds train at once in worker processes, with the
sequential runner's lock and summary (the real training loop on 4 tiny phantom cases, 16³ cubes)."""

from __future__ import annotations

import json

import pytest
from train_helpers import SMALL, small_dataset, tiny_config

from brats_swap.cv import run_cv, run_lock
from brats_swap.errors import RunLockedError


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


def test_parallel_folds_train_concurrently_and_summarise_like_the_sequential_runner(data, tmp_path):
    run = tmp_path / "run"
    config = tiny_config(*data, *SMALL, "train.threads=1", "train.augment=none")
    outcome = run_cv(config, run, parallel_folds=2)

    assert outcome.complete and outcome.exit_code == 0 and outcome.stop_reason is None
    assert sorted(outcome.started) == [0, 1] and sorted(outcome.evaluated) == [0, 1]
    first, second = outcome.workers[0], outcome.workers[1]
    assert first["pid"] != second["pid"]
    # Concurrent: each fold started before the other one ended.
    assert first["started"] < second["ended"] and second["started"] < first["ended"]
    for k in (0, 1):
        fold = run / f"fold_{k}"
        state = json.loads((fold / "state.json").read_text())
        assert state["trained"] and state["evaluated"] and state["epochs_completed"] == 1
        assert (fold / "checkpoint_best.pt").exists() and (fold / "metrics.csv").exists()
        assert (fold / "cv_worker.log").exists()
    parallel_summary = json.loads((run / "cv_summary.json").read_text())
    assert parallel_summary["complete"] and parallel_summary["folds_done"] == [0, 1]
    assert "(2 fold(s) at a time)" in (run / "cv.log").read_text()

    # The sequential runner accepts the parallel run as complete (trains and evaluates nothing) and
    # rewrites the same summary.
    again = run_cv(config, run)
    assert again.complete and again.started == [] and again.resumed == [] and again.evaluated == []
    sequential_summary = json.loads((run / "cv_summary.json").read_text())
    for summary in (parallel_summary, sequential_summary):
        summary.pop("updated_at", None)
        summary.pop("generated_at", None)
    assert sequential_summary == parallel_summary


def test_parallel_folds_respect_the_run_lock(data, tmp_path):
    run = tmp_path / "run"
    config = tiny_config(*data, *SMALL)
    with run_lock(run), pytest.raises(RunLockedError):
        run_cv(config, run, parallel_folds=2)
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
