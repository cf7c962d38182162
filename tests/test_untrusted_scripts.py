"""Issue 31, generated scripts and the serving folders: text taken from a file or the command line never becomes
a line of its own in a Dockerfile, entrypoint, README or sbatch script; `--time-budget` is parsed before it is
written; the serving temporary folder is private; an output that is a file is one line.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile

import pytest
from ship_helpers import challenge_input, task_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.cv.slurm import SlurmOptions, cv_script, summary_script
from brats_swap.errors import BratsSwapError, ConfigError, DataError
from brats_swap.run.folder import RunFolder
from brats_swap.ship.bundle import export_bundle, open_bundle
from brats_swap.ship.container import write_container
from brats_swap.ship.writable_folders import private_temp_folder, writable_home


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    base = tmp_path_factory.mktemp("untrusted-scripts")
    return open_bundle(export_bundle(task_run(base, "met", 1), base / "met.zip").path)


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


# ---- the container's build folder ------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", ["banana", "8h; touch x", "8h\ntouch x"])
def test_the_time_budget_is_parsed_before_the_entrypoint_is_written(bundle, tmp_path, budget):
    with pytest.raises(ConfigError, match="--time-budget"):
        write_container(bundle, tmp_path / "image", time_budget=budget)
    assert not (tmp_path / "image").exists()


def test_values_in_the_generated_files_are_checked_or_quoted(bundle, tmp_path):
    with pytest.raises(DataError, match="--image .* control character"):
        write_container(bundle, tmp_path / "image", image="x:latest\nRUN touch /PWNED")
    out = tmp_path / "build here"
    write_container(bundle, out, time_budget="1.5h")
    assert "--time-budget 1.5h " in (out / "entrypoint.sh").read_text()
    assert f"docker build -t brats-swap-met:latest '{out}'" in (out / "README.md").read_text()


def test_a_container_out_that_is_a_file_is_one_line(bundle, tmp_path):
    target = tmp_path / "taken"
    target.write_text("keep me")
    result = CliRunner().invoke(app, ["container", "--model", str(bundle.path), "--out", str(target)])
    assert result.exit_code == 2 and len(_errors(result.output)) == 1, result.output
    assert "not a folder" in result.output and target.read_text() == "keep me"


# ---- serve-challenge -------------------------------------------------------------------------------------------

def test_a_serve_output_that_is_a_file_is_one_line(bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    challenge_input(tmp_path / "in", "met", 1)
    target = tmp_path / "out"
    target.write_text("keep me")
    result = CliRunner().invoke(app, ["serve-challenge", "--model", str(bundle.path), "--input", str(tmp_path / "in"),
                                      "--output", str(target), "--device", "cpu"])
    assert result.exit_code == 1 and len(_errors(result.output)) == 1, result.output
    assert "is a file" in result.output and target.read_text() == "keep me"


def test_the_temporary_folder_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    writable_home({})
    base = tmp_path / f"brats-swap-{os.getuid()}"
    assert stat.S_IMODE(base.lstat().st_mode) == 0o700 and (base / "home").is_dir()


def test_a_temporary_folder_that_is_a_symlink_or_not_ours_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = tmp_path / f"brats-swap-{os.getuid()}"
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir()
    base.symlink_to(elsewhere)
    with pytest.raises(DataError, match="symlink"):
        writable_home({})
    assert list(elsewhere.iterdir()) == []
    base.unlink()
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    assert private_temp_folder() == base and stat.S_IMODE(base.stat().st_mode) == 0o700  # ours: made private
    if os.geteuid() == 0:  # only root can give a folder to another uid
        os.chown(base, 4242, 4242)
        with pytest.raises(DataError, match="owned by uid 4242"):
            private_temp_folder()


# ---- SLURM scripts and the config name --------------------------------------------------------------------------

def test_a_config_name_with_a_newline_is_one_line(tmp_path):
    config_file = tmp_path / "shared.yaml"
    config_file.write_text('name: "x\\n#SBATCH --wrap=touch /PWNED"\n')
    with pytest.raises(ConfigError, match="name: .* control character"):
        load_config(config_file)
    result = CliRunner().invoke(app, ["config", "show", "--config", str(config_file)])
    assert result.exit_code == 2 and len(_errors(result.output)) == 1, result.output


@pytest.mark.parametrize("where", ["name", "sbatch_args", "partition", "summary_time"])
def test_every_value_of_the_sbatch_scripts_is_one_line(tmp_path, where):
    config = load_config(None, ["name=ok", "train.device=cpu"])
    options = SlurmOptions()
    injected = "x\ntouch /PWNED"
    if where == "name":  # a config built without the loader's check
        config = dataclasses.replace(config, name=injected)
    else:
        options = dataclasses.replace(options, **{where: [injected] if where == "sbatch_args" else injected})
    run = RunFolder(tmp_path / "run")
    with pytest.raises(BratsSwapError) as caught:
        cv_script(config, run, [0, 1], options) + summary_script(config, run, "123", options)
    assert "\n" not in str(caught.value) and "control character" in str(caught.value)
