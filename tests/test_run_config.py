"""The run folder remembers how it was made (cv/run_config.py): `cv --run R` without `--config` uses
R/config.yaml, a harmless `--set` is recorded and printed, one that would change what was trained is refused
with one line; and the cv --submit slurm scripts (--dry-run, no SLURM needed) run that recorded config."""

from __future__ import annotations

import pytest
import yaml
from cv_helpers import fake_train_command, install_fake_training
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import config_to_yaml, load_config
from brats_swap.cv.run_config import run_config
from brats_swap.errors import ConfigError


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return install_fake_training(monkeypatch, tmp_path)


def recorded_run(tmp_path, *overrides: str):
    run = tmp_path / "run"
    run.mkdir()
    config = load_config(None, [f"data.cache={tmp_path / 'cache'}", "cv.folds=2", "train.max_epochs=2",
                                "name=fake", *overrides])
    (run / "config.yaml").write_text(config_to_yaml(config))
    return run


def recorded(run) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def test_a_harmless_set_is_recorded_and_a_training_changing_one_refused(tmp_path):
    run = recorded_run(tmp_path)
    said: list[str] = []
    assert run_config(run, None, ["train.max_epochs=5"], say=said.append).train.max_epochs == 5
    assert recorded(run)["train"]["max_epochs"] == 5 and said == [
        f"{run / 'config.yaml'}: recorded train.max_epochs 2 -> 5; every later call on this run uses it, for each "
        "of its folds, not only this call's"]
    assert run_config(run, None, []).train.max_epochs == 5  # the next plain call uses it
    # Nothing trained yet: the model may still change. Once a fold has a checkpoint, it may not.
    assert run_config(run, None, ["model.base_filters=8"]).model.base_filters == 8
    (run / "fold_0").mkdir()
    (run / "fold_0" / "checkpoint_latest.pt").write_bytes(b"")
    before = (run / "config.yaml").read_text()
    for key_value in ("model.base_filters=16", "data.cube=[64,64,64]", "cv.folds=3", "seed=7"):
        with pytest.raises(ConfigError, match=f"{key_value.split('=')[0]} differs .* new --run folder") as error:
            run_config(run, None, [key_value])
        assert "\n" not in str(error.value)
    assert (run / "config.yaml").read_text() == before
    assert run_config(run, None, [f"data.cache={tmp_path / 'moved'}"]).data.cache == str(tmp_path / "moved")
    assert run_config(run, None, ["data.prepare_workers=1"]).data.prepare_workers == 1  # how many processes


def test_cv_run_without_config_uses_the_run_config_and_records_a_set(fake, tmp_path):
    run = recorded_run(tmp_path)
    result = CliRunner().invoke(app, ["cv", "--run", str(run), "--set", "train.max_epochs=3"])
    assert result.exit_code == 0, result.output
    assert "recorded train.max_epochs 2 -> 3" in result.output
    assert sorted(fold for fold, _ in fake.calls) == [0, 1] and recorded(run)["train"]["max_epochs"] == 3
    refused = CliRunner().invoke(app, ["cv", "--run", str(run), "--set", "model.depth=4"])
    assert refused.exit_code == 2 and "model.depth differs" in refused.output


def test_submit_dry_run_writes_plain_scripts_and_without_sbatch_is_one_line(fake, tmp_path, monkeypatch):
    run = recorded_run(tmp_path, "train.device=cpu")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch
    args = ["cv", "--run", str(run), "--submit", "slurm", "--time", "01:00:00", "--partition", "debug",
            "--sbatch-arg=--exclusive"]
    missing = CliRunner().invoke(app, args)
    assert missing.exit_code == 1 and "sbatch: not found on the PATH" in missing.output
    result = CliRunner().invoke(app, [*args, "--dry-run", "--gpus-per-fold", "2", "--grace", "300"])
    assert result.exit_code == 0, result.output
    script = (run / "slurm" / "cv.sbatch").read_text()
    for line in ("#SBATCH --array=0,1", "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --exclusive",
                 "#SBATCH --open-mode=append", "#SBATCH --time=01:00:00", "#SBATCH --partition=debug",
                 "#SBATCH --gres=gpu:2", f"#SBATCH --output={run.resolve()}/fold_%a/slurm-%A_%a.log",
                 'cv run --config "$RUN/config.yaml" --run "$RUN" --fold "$fold" --nproc 2 &',
                 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script, line
    assert "#SBATCH --dependency=afterany:ARRAY_JOB_ID" in (run / "slurm" / "summary.sbatch").read_text()
    assert "nothing submitted" in result.output and fake.calls == []


def test_train_on_an_existing_run_records_a_set_or_refuses_it_with_or_without_resume(monkeypatch, tmp_path):
    """issue 44.1: `train --config C --run R --fold 1 --set train.lr=...` on a run whose config.yaml says
    otherwise trained a second recipe silently; now it is the rule of cv --run (recorded or refused)."""
    trained = fake_train_command(monkeypatch)
    run = recorded_run(tmp_path, "train.lr=0.01")
    config_file = tmp_path / "recipe.yaml"
    config_file.write_text((run / "config.yaml").read_text())
    (run / "fold_0").mkdir()
    (run / "fold_0" / "checkpoint_latest.pt").write_bytes(b"")  # fold 0 trained
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--config", str(config_file), "--run", str(run), "--fold", "1",
                                 "--set", "train.lr=0.001"])
    assert result.exit_code == 0, result.output
    assert "recorded train.lr 0.01 -> 0.001" in " ".join(result.output.split())
    assert recorded(run)["train"]["lr"] == 0.001 and trained[-1][0].train.lr == 0.001 and trained[-1][1] == 1
    for args in (["--fold", "1"], ["--fold", "0", "--resume"]):
        refused = runner.invoke(app, ["train", "--run", str(run), *args, "--set", "model.base_filters=8"])
        assert refused.exit_code == 2 and "model.base_filters differs" in refused.output, refused.output
    assert recorded(run)["model"]["base_filters"] != 8 and len(trained) == 1
    # Without --run: the default folder runs/<name> is the same run, and the same rule holds.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    run.rename(tmp_path / "runs" / "fake")
    refused = runner.invoke(app, ["train", "--config", str(config_file), "--set", "seed=3"])
    assert refused.exit_code == 2 and "seed differs" in refused.output, refused.output


def test_evaluate_run_records_a_set_in_the_run_config(monkeypatch, tmp_path):
    run = recorded_run(tmp_path)
    from brats_swap.evaluate import predicting

    monkeypatch.setattr(predicting, "select_folds", lambda *a: [])
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run), "--set", "evaluate.hd95=false"])
    assert "recorded evaluate.hd95 True -> False" in " ".join(result.output.split()), result.output
    assert recorded(run)["evaluate"]["hd95"] is False


def test_a_set_on_one_fold_says_it_reaches_every_later_fold_and_names_the_finished_ones(tmp_path):
    """Issue 54: `train --run R --fold 1 --set ...` rewrote the config every later fold uses in one line that
    said nothing of it."""
    from brats_swap.cv.fold_progress import FoldState

    run = recorded_run(tmp_path)
    FoldState(fold=0, trained=True, evaluated=True).write(run)
    said: list[str] = []
    run_config(run, None, ["train.lr=0.01"], say=said.append)
    assert len(said) == 1 and "every later call on this run uses it, for each of its folds" in said[0]
    assert "(fold 0 finished training with the old value: the run's folds then differ, which `export` names)" in said[0]
