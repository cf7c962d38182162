"""`brats-swap cv run | status | summary | submit`, and the spellings from before the subcommands
(`cv --status`, `cv --summary`, `cv --submit slurm`, a plain `cv`), which do the same with one notice line
on stderr naming the new spelling. Training is the scripted FakeTraining of cv_helpers (fast)."""

from __future__ import annotations

import json

import pytest
from cv_helpers import install_fake_training
from typer.testing import CliRunner

from brats_swap.cli import cv as cv_cli
from brats_swap.cli.main import app
from brats_swap.config import config_to_yaml, load_config


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return install_fake_training(monkeypatch, tmp_path)


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    config = load_config(None, [f"data.cache={tmp_path / 'cache'}", "cv.folds=2", "train.max_epochs=2", "name=fake",
                                "train.device=cpu"])
    (folder / "config.yaml").write_text(config_to_yaml(config))
    return folder


def _invoke(*args: str):
    return CliRunner().invoke(app, ["cv", *args])


def _notices(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning:")]


def test_the_subcommands_run_summarise_and_report_status_without_a_notice(fake, run):
    trained = _invoke("run", "--run", str(run), "--folds", "1")
    assert trained.exit_code == 0, trained.output
    assert fake.calls == [(1, False)] and _notices(trained) == []
    status = _invoke("status", "--run", str(run))
    assert status.exit_code == 0 and status.stdout.splitlines()[0].startswith("fold 0: not started")
    assert status.stdout.splitlines()[1].startswith("fold 1: done") and status.stderr == ""
    summary = _invoke("summary", "--run", str(run))
    assert summary.exit_code == 0 and _notices(summary) == []
    assert json.loads((run / "cv_summary.json").read_text())["complete"] is False


def test_cv_run_and_summary_end_with_the_metrics_table_then_its_path(fake, run):
    """issue 44.7: they ended with a path and no numbers; now the table of cv_summary.md, as evaluate does."""
    for args in (["run", "--run", str(run)], ["summary", "--run", str(run)]):
        result = _invoke(*args)
        assert result.exit_code == 0, result.output
        said = " ".join(result.stdout.split())
        summary = json.loads((run / "cv_summary.json").read_text())
        wt = summary["table"]["dice"]["WT"]
        assert "fake: validation metrics" in said and "mean ± std over 2 folds" in said
        assert f"{wt['mean']:.3f} ± {wt['std']:.3f}" in said
        assert said.index("validation metrics") < said.index(f"summary: {run / 'cv_summary.md'}")


@pytest.mark.parametrize(("old", "new"), [
    (["--status"], "`brats-swap cv status`"),
    (["--summary"], "`brats-swap cv summary`"),
    ([], "`brats-swap cv run`"),
    (["--folds", "0"], "`brats-swap cv run`"),
])
def test_each_old_spelling_still_works_with_one_notice_naming_the_new_one(fake, run, old, new):
    result = _invoke("--run", str(run), *old)
    assert result.exit_code == 0, result.output
    notices = _notices(result)
    assert len(notices) == 1 and new in notices[0] and "until the next release" in notices[0], result.stderr


def test_the_old_spelling_does_what_the_new_one_does(fake, run):
    old = _invoke("--run", str(run), "--folds", "0")
    new = _invoke("run", "--run", str(run), "--folds", "1")
    assert old.exit_code == new.exit_code == 0
    assert fake.calls == [(0, False), (1, False)]
    lines = (run / "cv.log").read_text().splitlines()
    assert len(lines) == 2 and "fold 0: trained" in lines[0] and "fold 1: trained" in lines[1]
    assert "warning" not in old.stdout  # the notice is on stderr: the command's output stays as it was


def test_submit_and_its_old_spelling_write_the_same_scripts_in_the_new_words(fake, run, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # --dry-run needs no sbatch
    new = _invoke("submit", "slurm", "--run", str(run), "--dry-run", "--time", "01:00:00")
    assert new.exit_code == 0, new.output
    scripts = {name: (run / "slurm" / name).read_text() for name in ("cv.sbatch", "summary.sbatch")}
    assert 'cv run --config "$RUN/config.yaml" --run "$RUN" --fold "$fold" &' in scripts["cv.sbatch"]
    assert 'cv summary --config "$RUN/config.yaml" --run "$RUN"' in scripts["summary.sbatch"]
    assert "cv --" not in scripts["cv.sbatch"] + scripts["summary.sbatch"]
    assert _invoke("submit", "--run", str(run), "--dry-run").exit_code == 0  # slurm is the default scheduler
    old = _invoke("--run", str(run), "--submit", "slurm", "--dry-run", "--time", "01:00:00")
    assert old.exit_code == 0 and "`brats-swap cv submit slurm`" in _notices(old)[0]
    assert {name: (run / "slurm" / name).read_text() for name in scripts} == scripts
    other = _invoke("submit", "pbs", "--run", str(run), "--dry-run")
    assert other.exit_code == 2 and "the only scheduler is 'slurm'" in other.output


def test_submit_refuses_a_run_folder_sbatch_cannot_carry_before_writing_its_config(tmp_path, monkeypatch):
    """A backslash cannot be written in a SLURM --output path: refused in one line (exit 1) before the run
    folder or its config.yaml exist."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bad = tmp_path / "bad\\run"
    result = _invoke("submit", "slurm", "--run", str(bad), "--set", f"data.cache={tmp_path / 'cache'}", "--dry-run")
    assert result.exit_code == 1, result.output
    assert "backslash" in result.output and len(result.output.strip().splitlines()) == 1
    assert not bad.exists()


def test_submit_dry_run_prints_the_sbatch_command_quoted_for_a_shell(tmp_path, monkeypatch):
    import shlex

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    run = tmp_path / "my run's folder"
    result = _invoke("submit", "slurm", "--run", str(run), "--set", f"data.cache={tmp_path / 'cache'}", "--dry-run")
    assert result.exit_code == 0, result.output
    hint = next(line for line in result.output.splitlines() if line.startswith("--dry-run:"))
    command = hint.split("to submit: ", 1)[1].split(", then", 1)[0]
    assert shlex.split(command) == ["sbatch", str(run / "slurm" / "cv.sbatch")]


def test_usage_errors_of_the_subcommands_are_one_line(run):
    both = _invoke("run", "--run", str(run), "--nproc", "2", "--parallel-folds", "2")
    assert both.exit_code == 2 and both.output.strip().splitlines() == [
        "error: cv run: --parallel-folds does not apply with --nproc; --nproc trains one fold at a time on all "
        "ranks (no --parallel-folds)"]
    no_run = _invoke("status")
    assert no_run.exit_code == 2 and no_run.output.strip() == "error: cv status: name the run folder with --run"
    assert _invoke("status", "--partition", "gpu").exit_code == 2  # an option status does not read
    unknown = _invoke("bogus")
    assert unknown.exit_code == 2 and "No such command 'bogus'" in unknown.output


def test_help_lists_the_subcommands_and_hides_the_old_spellings():
    text = _invoke("--help").stdout
    for command in ("run", "status", "summary", "submit"):
        assert f"│ {command} " in text
    assert cv_cli.OLD_SPELLINGS_COMMAND not in [line.split()[1] for line in text.splitlines()
                                                if line.startswith("│ ") and len(line.split()) > 1]


def test_the_ranks_of_an_old_nproc_call_run_the_new_spelling():
    assert cv_cli._with_run_subcommand(["--debug", "cv", "--run", "r", "--fold", "1"]) == [
        "--debug", "cv", "run", "--run", "r", "--fold", "1"]


def test_compare_takes_cvs_fold_selection_and_a_bare_count_once_more_with_a_notice(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from brats_swap.cv import compare

    asked: list = []
    monkeypatch.setattr(compare, "run_compare", lambda config, run_dir, folds, **_: asked.append(folds) or
                        SimpleNamespace(describe=lambda: "done", seconds=0.0, comparison={}))
    base = ["compare", "--patch", "--run", str(tmp_path / "cmp")]
    named = CliRunner().invoke(app, [*base, "--folds", "0,2"])
    single = CliRunner().invoke(app, [*base, "--folds", "2,"])
    counted = CliRunner().invoke(app, [*base, "--folds", "2"])
    assert [r.exit_code for r in (named, single, counted)] == [0, 0, 0]
    assert asked == [[0, 2], [2], [0, 1]]
    assert _notices(named) == _notices(single) == []
    assert len(_notices(counted)) == 1 and "write --folds 0,1" in _notices(counted)[0]


@pytest.mark.parametrize("spelling", [["--nproc", "2"], ["run", "--nproc", "2"]])
def test_nproc_hands_torchrun_the_new_spelling(fake, run, monkeypatch, spelling):
    from brats_swap import distributed
    from brats_swap.train import data as train_data

    launched: list = []
    monkeypatch.setattr(distributed, "launch_torchrun", lambda nproc, argv: launched.append((nproc, argv)) or 0)
    monkeypatch.setattr(train_data, "prepare_run_data", lambda data_cfg: None)
    tail = [*spelling, "--run", str(run)]
    monkeypatch.setattr("sys.argv", ["brats-swap", "cv", *tail])
    result = _invoke(*tail)
    assert result.exit_code == 0, result.output
    assert launched == [(2, ["cv", "run", "--nproc", "2", "--run", str(run)])]
    assert len(_notices(result)) == (1 if spelling[0] == "--nproc" else 0)
