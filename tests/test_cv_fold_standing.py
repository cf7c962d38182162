"""Where a fold stands, said the same way everywhere (issue 54, points 2 and 4, and `export`'s notes): `cv status`,
cv_summary.* and the bundle's summary follow `fold_standing`, also for folds trained by `train` and scored by
`evaluate` (no state.json); the summary says why the postprocessing was not tuned. Works on copies of the
shared tiny cross-validation (tests/tiny_cv.py): nothing is trained here."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest
from tiny_cv import copy_run, tiny_cv_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.cv import run_cv
from brats_swap.run.checkpoint import load_checkpoint, save_checkpoint
from brats_swap.run.evaluation_record import record_evaluated_state
from brats_swap.run.folder import RunFolder


@pytest.fixture(scope="module")
def cv_run(tmp_path_factory):
    return tiny_cv_run(tmp_path_factory)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(arg) for arg in args])


def as_train_and_evaluate_left_it(run):
    """Fold 0 as `train --fold 0` then `evaluate --run --fold 0` leave it (no cv state); fold 1 trained by
    `train` and never evaluated."""
    (run / "fold_0" / "state.json").unlink()
    (run / "fold_1" / "state.json").unlink()
    for name in ("metrics.csv", "summary.json", "summary.md", "official.csv", "official_summary.json"):
        (run / "fold_1" / name).unlink(missing_ok=True)
    return run


def test_status_summary_and_export_agree_on_folds_trained_by_train_and_scored_by_evaluate(cv_run, tmp_path):
    _, run, _ = cv_run
    run = as_train_and_evaluate_left_it(copy_run(run, tmp_path / "run"))
    status = invoke("cv", "status", "--run", run)
    assert status.exit_code == 0, status.output
    assert "fold 0: done, 1 epoch(s) done" in status.output
    assert "fold 1: trained, not evaluated, 1 epoch(s) done" in status.output

    result = invoke("cv", "summary", "--run", run)
    assert result.exit_code == 0, result.output
    summary = json.loads((run / "cv_summary.json").read_text())
    assert [(f["status"], f["epochs"]) for f in summary["folds"]] == [("done", 1), ("trained, not evaluated", 1)]
    assert summary["folds_done"] == [0] and not summary["complete"]
    assert summary["folds"][0]["mean"] is not None and summary["table"]

    exported = invoke("export", "--run", run, "--out", tmp_path / "model.zip")
    assert exported.exit_code == 0, exported.output
    assert "fold 1 is trained, not evaluated: no validation score of it is in the bundle" in exported.output
    with zipfile.ZipFile(tmp_path / "model.zip") as bundle:
        shipped = json.loads(bundle.read("configs/cv_summary.json"))
    assert [f["status"] for f in shipped["folds"]] == ["done", "trained, not evaluated"]


def test_export_names_the_settings_a_fold_was_trained_with_when_they_differ(cv_run, tmp_path):
    _, run, _ = cv_run
    run = copy_run(run, tmp_path / "run")
    for name in ("checkpoint_best.pt", "checkpoint_latest.pt"):
        path = run / "fold_1" / name
        state = load_checkpoint(path)
        state["config"]["train"]["lr"] = 0.5
        save_checkpoint(state, path)
    record_evaluated_state(RunFolder(run).fold(1))  # as if fold 1 had trained so and been evaluated after
    exported = invoke("export", "--run", run, "--out", tmp_path / "model.zip")
    assert exported.exit_code == 0, exported.output
    assert "fold 1 was trained with other settings than fold 0: train.lr 0.5 (fold 0: " in exported.output
    assert "no validation score" not in exported.output  # both folds are evaluated


def test_the_summary_says_postprocessing_waits_for_the_folds_not_done(cv_run, tmp_path):
    # The issue's case: `cv run --folds 0` with fold 1 not started said "the out-of-fold predictions or the
    # reference segmentations were not available" while fold 0's predictions were there.
    config, run, _ = cv_run
    run = copy_run(run, tmp_path / "run")
    shutil.rmtree(run / "fold_1")
    (run / "postprocessing.json").unlink()
    run_cv(config, run, folds=[0])
    markdown = (run / "cv_summary.md").read_text()
    assert ("Not tuned: it is tuned on the out-of-fold predictions once every fold is trained and evaluated, "
            "and 1 of the run's 2 folds are.") in markdown
    assert "not available" not in markdown
    assert not json.loads((run / "cv_summary.json").read_text())["complete"]


def test_the_summary_gives_the_reason_the_tuning_gave(cv_run, tmp_path):
    config, run, _ = cv_run
    run = copy_run(run, tmp_path / "run")
    prediction = sorted((run / "fold_0" / "predictions").iterdir())[0]
    prediction.unlink()
    (run / "postprocessing.json").unlink()
    assert run_cv(config, run).complete
    markdown = (run / "cv_summary.md").read_text()
    assert f"Not tuned: {prediction} is missing (are predictions saved? evaluate.save_predictions)." in markdown


def test_a_fold_trained_further_after_its_evaluation_is_not_done_until_evaluated_again(cv_run, tmp_path):
    # A cron job's `cv run` read `complete: true` of a fold whose metrics described a model it had since trained
    # past (`train --fold 0 --resume --set train.max_epochs=2` continues a finished fold).
    import dataclasses

    from brats_swap.train.loop import train_fold

    config, run, _ = cv_run
    run = copy_run(run, tmp_path / "run")
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, max_epochs=2))
    assert train_fold(longer, run, 0, resume=True, progress=False).epochs_completed == 2

    status = invoke("cv", "status", "--run", run)
    assert status.exit_code == 0, status.output
    assert "fold 0: trained, not evaluated (trained further since its last evaluation), 2 epoch(s) done" \
        in status.output
    assert "fold 1: done" in status.output
    assert invoke("cv", "summary", "--run", run).exit_code == 0
    summary = json.loads((run / "cv_summary.json").read_text())
    assert not summary["complete"] and summary["folds_done"] == [1]
    assert summary["folds"][0]["epochs"] == 2 and summary["folds"][0]["mean"] is None  # not the old model's scores

    outcome = run_cv(longer, run)  # what the cron job runs next: fold 0 is evaluated again, nothing retrained
    assert outcome.complete and outcome.evaluated == [0] and not outcome.epochs_trained, outcome.describe()
    assert json.loads((run / "cv_summary.json").read_text())["complete"]


def test_a_copied_run_stays_evaluated_and_a_forged_record_never_names_a_file(cv_run, tmp_path):
    _, run, _ = cv_run
    copied = tmp_path / "copied"
    shutil.copytree(run, copied, copy_function=shutil.copyfile)  # new modification times, the same bytes
    status = invoke("cv", "status", "--run", copied)
    assert "fold 0: done" in status.output and "fold 1: done" in status.output, status.output
    record = json.loads((copied / "fold_0" / "evaluated_checkpoint.json").read_text())
    assert record["training_state"]["mtime_ns"] == (copied / "fold_0" / record["training_state"]["name"]).stat().st_mtime_ns

    huge = {"training_state": None, "padding": "x" * (1 << 20)}  # a 1 MB "record" is not read
    for forged in ({"training_state": {"name": "../../../etc/passwd", "size": 1, "mtime_ns": 1}}, ["not", "a", "record"],
                   huge):
        (copied / "fold_1" / "evaluated_checkpoint.json").write_text(json.dumps(forged))
        status = invoke("cv", "status", "--run", copied)
        assert status.exit_code == 0, status.output
        assert "fold 1: trained, not evaluated (trained further since its last evaluation)" in status.output
