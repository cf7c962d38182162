"""`compare --patch` logic with the scripted training loop: two arms, shared folds, tables, figures, resume.

tests/test_cv_integration.py runs the real comparison on tiny phantoms.
"""

from __future__ import annotations

import json

import pytest
from cv_helpers import PATCH_PENALTY, epochs_trained, install_fake_training

from brats_swap.config import load_config
from brats_swap.cv import compare
from brats_swap.cv.lock import run_lock
from brats_swap.errors import ConfigError, DataError, RunLockedError
from brats_swap.run.folder import COMPARE_ARMS

BOXPLOT, OVERLAYS, CURVES = ("figures/compare_dice_boxplot.png", "figures/compare_overlays.png",
                             "figures/training_curves.png")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return install_fake_training(monkeypatch, tmp_path)


def overrides(tmp_path) -> list[str]:
    return [f"data.cache={tmp_path / 'cache'}", f"data.root={tmp_path / 'no-data'}", "cv.folds=3", "train.max_epochs=2",
            "name=cmp", "data.cube=[64,64,64]", "train.patch=[32,32,32]", "memory.mode=swap"]


@pytest.fixture
def config(tmp_path):
    return load_config(None, overrides(tmp_path))


def test_compare_trains_both_arms_on_the_same_folds_and_writes_the_comparison(fake, config, tmp_path):
    run_dir = tmp_path / "cmp"
    outcome = compare.run_compare(config, run_dir, folds=[0, 1])
    assert outcome.complete and outcome.folds == [0, 1]
    # Alternating arms, fold by fold; the patch arm without the memory engine.
    assert fake.modes == [("full", "swap", 0), ("patch", "none", 0), ("full", "swap", 1), ("patch", "none", 1)]
    splits = json.loads((run_dir / "splits.json").read_text())
    for arm in COMPARE_ARMS:
        assert json.loads((run_dir / arm / "splits.json").read_text())["folds"] == splits["folds"]
        assert (run_dir / arm / "cv_summary.md").exists()
        assert epochs_trained(run_dir / arm, 1) == [1, 2] and not (run_dir / arm / "fold_2").exists()

    result = json.loads((run_dir / "compare.json").read_text())
    assert result["paired_cases"] == 4 and result["folds_compared"] == [0, 1]
    wt = result["metrics"]["dice"]["WT"]
    assert wt["difference"] == pytest.approx(PATCH_PENALTY)
    assert wt["full_better_cases"] == 4
    assert wt["full"]["mean"] - wt["patch"]["mean"] == pytest.approx(PATCH_PENALTY)
    assert result["metrics"]["dice"]["TC"]["difference"] == pytest.approx(0.0)
    assert result["timing"]["full"]["epochs_per_fold"] == [2, 2]
    assert result["timing"]["patch"]["median_epoch_seconds"] == pytest.approx(0.5)
    markdown = (run_dir / "compare.md").read_text()
    assert "| Dice | WT |" in markdown and f"{PATCH_PENALTY:+.3f}" in markdown
    assert "| epoch without validation (median, s) | 0.5 | 0.5 |" in markdown
    assert "| validation (median, s) | — (0 runs) | — (0 runs) |" in markdown
    for figure in (BOXPLOT, CURVES):
        assert (run_dir / figure).read_bytes()[:4] == b"\x89PNG"
        assert f"({figure})" in markdown
    # No predictions/ground truth on disk for the stand-in: the overlay figure is left out, not broken.
    assert result["figures"] == [BOXPLOT, CURVES] and OVERLAYS not in markdown


def test_a_selection_of_folds_is_counted_as_one_not_as_the_run(fake, config, tmp_path):
    """issue 44.7: `compare --folds 0,` on a run of 3 folds said "all 1 fold(s) done"."""
    outcome = compare.run_compare(config, tmp_path / "cmp", folds=[0])
    said = outcome.describe()
    assert outcome.complete and "all 1 selected fold(s) (0; the run has 3) done" in said
    assert "all 1 fold(s) done" not in said
    assert "all 3 fold(s) done" in compare.run_compare(config, tmp_path / "cmp", folds="all").describe()


def test_compare_resumes_where_the_window_closed(fake, config, tmp_path):
    run_dir = tmp_path / "cmp"
    now = [0.0]

    def one_minute_epochs(fold, epoch):
        now[0] += 60.0

    fake.during_epoch = one_minute_epochs
    first = compare.run_compare(config, run_dir, folds=[0], max_hours=150 / 3600, clock=lambda: now[0])
    assert not first.complete and first.stop_reason == "max-hours"
    assert (run_dir / "full" / "fold_0" / "state.json").exists()
    fake.during_epoch = None
    second = compare.run_compare(config, run_dir, folds=[0])
    assert second.complete
    for arm in COMPARE_ARMS:
        assert epochs_trained(run_dir / arm, 0) == [1, 2]
    assert len((run_dir / "cv.log").read_text().splitlines()) == 2


def test_compare_is_locked_per_folder(fake, config, tmp_path):
    run_dir = tmp_path / "cmp"
    with run_lock(run_dir / "patch"):  # e.g. `brats-swap cv run --run cmp/patch` still running
        with pytest.raises(RunLockedError, match="patch"):
            compare.run_compare(config, run_dir, folds=[0])
    assert fake.calls == []


def test_compare_refuses_diverging_splits_and_bad_fold_counts(fake, config, tmp_path):
    run_dir = tmp_path / "cmp"
    compare.run_compare(config, run_dir, folds=[0])
    with pytest.raises(ConfigError, match=r"--folds 3: the run has folds 0\.\.2"):
        compare.run_compare(config, run_dir, folds=[0, 1, 2, 3])
    patch_splits = run_dir / "patch" / "splits.json"
    edited = json.loads(patch_splits.read_text())
    edited["folds"].reverse()
    patch_splits.write_text(json.dumps(edited))
    with pytest.raises(DataError, match="same folds"):
        compare.run_compare(config, run_dir, folds=[0])


def test_arm_configs_reject_a_patch_larger_than_the_cube(config):
    config.train.patch = [128, 128, 128]
    with pytest.raises(ConfigError, match="train.patch"):
        compare.arm_configs(config)


def test_the_cost_table_times_steps_epochs_and_validation_apart_and_compare_prints_its_tables(fake, tmp_path):
    """Issue 54, point 6: "one epoch" included validation, "one pass over the training cases" was claimed under
    train.steps_per_epoch, and `compare` printed only the report's path."""
    from typer.testing import CliRunner

    from brats_swap.cli.main import app
    from brats_swap.cv.comparison import write_comparison

    run_dir = tmp_path / "cmp"
    settings = [*overrides(tmp_path), "train.steps_per_epoch=4"]
    result = CliRunner().invoke(app, ["compare", "--patch", "--run", str(run_dir), "--folds", "0,",
                                      *(arg for item in settings for arg in ("--set", item))])
    assert result.exit_code == 0, result.output
    printed = result.output
    assert "whole volume vs patches: 2 paired validation cases" in printed and "+0.050" in printed  # WT Dice
    assert "training step (median, s)" in printed and "epoch without validation" in printed
    assert printed.index("training cost") < printed.index(f"comparison: {run_dir / 'compare.md'}")

    # Two epochs per arm: 4 steps of 0.25 s, the first validated in 2 s.
    for arm in COMPARE_ARMS:
        state_path = run_dir / arm / "fold_0" / "state.json"
        state = json.loads(state_path.read_text())
        state["history"] = [{"epoch": 1, "step_s": 0.25, "val_seconds": 2.0, "epoch_s": 3.0},
                            {"epoch": 2, "step_s": 0.25, "epoch_s": 1.0}]
        state_path.write_text(json.dumps(state))
    write_comparison(load_config(None, settings), run_dir, [0])
    markdown = (run_dir / "compare.md").read_text()
    assert "| training step (median, s) | 0.25 | 0.25 |" in markdown
    assert "| epoch without validation (median, s) | 1.0 | 1.0 |" in markdown
    assert "| validation (median, s) | 2.0 (1 run) | 2.0 (1 run) |" in markdown
    assert "An epoch is `train.steps_per_epoch` = 4 training step(s) in both arms, not a pass" in markdown
    assert "one pass over the training cases" not in markdown
