"""The first hour, third round: the friction a new user still met. A bundle trained on a 2017-2021 table ships
as the glioma task, check-submission counts the inputs it could not name, serve-challenge redirects only the
folders that cannot be written, honest --help, a plan under the device overhead says what fits, the image's
Python is the pins', and the contract test reaches a venv under a home only its owner can enter."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from ship_helpers import NON_ROOT, challenge_input, namespaces_permitted, reachable_paths, task_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.memory.planner import PlanReport
from brats_swap.ship.bundle import export_bundle
from brats_swap.ship.submission import check_submission
from brats_swap.ship.writable_folders import writable_home
from brats_swap.train.planning import no_fit_advice


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def legacy_bundle(tmp_path_factory):
    base = tmp_path_factory.mktemp("legacy")
    return export_bundle(task_run(base, "2021"), base / "model.zip").path


# ---- a bundle trained on the 2017-2021 tables ships as the glioma task ---------------------------------------

def test_container_defaults_a_legacy_bundle_to_the_glioma_task_and_says_so(legacy_bundle, tmp_path):
    result = invoke("container", "--model", legacy_bundle, "--out", tmp_path / "image")
    assert result.exit_code == 0, result.output
    assert "--task gli: the bundle was trained on the 2021 table" in result.output
    assert "--task gli " in (tmp_path / "image" / "entrypoint.sh").read_text()


def test_serve_challenge_defaults_a_legacy_bundle_to_the_glioma_task_and_writes_its_labels(legacy_bundle, tmp_path):
    ids = challenge_input(tmp_path / "in", "gli", 1)
    result = invoke("serve-challenge", "--model", legacy_bundle, "--input", tmp_path / "in", "--output",
                    tmp_path / "out", "--no-tta", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert sum("--task gli: the bundle was trained on the 2021 table" in line for line in result.output.splitlines()) == 1
    labels = np.asarray(nib.load(tmp_path / "out" / f"{ids[0]}.nii.gz").dataobj)
    assert set(np.unique(labels).tolist()) <= {0, 1, 2, 3}
    assert check_submission(tmp_path / "out", tmp_path / "in", "gli").problems == []


def test_a_legacy_task_given_is_still_refused(legacy_bundle, tmp_path):
    result = invoke("container", "--model", legacy_bundle, "--out", tmp_path / "image", "--task", "2021")
    assert result.exit_code == 2 and "expected a 2023+ task" in result.output


# ---- serve-challenge redirects only what cannot be written ----------------------------------------------------

def test_a_writable_home_leaves_every_cache_folder_alone(tmp_path):
    environ = {"HOME": str(tmp_path)}
    assert writable_home(environ) == {} and environ == {"HOME": str(tmp_path)}


# ---- check-submission counts the inputs it could not name -----------------------------------------------------

def test_check_submission_counts_and_names_the_inputs_named_another_way(tmp_path):
    ids = synthesize_dataset(tmp_path / "in", 2, seed=0, shape=(16, 16, 16))  # named the 2021 way
    (tmp_path / "out").mkdir()
    for case_id in ids:
        shutil.copy2(next((tmp_path / "in" / case_id).glob("*seg.nii.gz")), tmp_path / "out" / f"{case_id}.nii.gz")
    result = invoke("check-submission", tmp_path / "out", "--input", tmp_path / "in", "--task", "gli")
    assert result.exit_code == 1
    last = [line for line in result.output.splitlines() if line.startswith("error:")][-1]
    assert "for 2 input case(s) (2 could not be named: BraTS2021_00000, BraTS2021_00001)" in last
    assert f"input {tmp_path / 'in' / ids[0]}: no image named as a gli case" in result.output
    assert "BraTS-GLI-00001-000" in result.output and "MET" not in result.output


# ---- a plan below the device overhead says what fits --------------------------------------------------------

# A 16³ cube and the smallest U-Net: planning takes seconds, and the device overhead (2 GiB on a GPU) dominates.
PLAN_TINY = ["plan", "--size", "16", "--set", "model.base_filters=2", "--set", "model.depth=3", "--set",
             "model.segmentation_levels=2", "--device", "gpu"]


def _plan(*extra: str) -> str:
    result = CliRunner().invoke(app, [*PLAN_TINY, *extra], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_a_budget_below_the_device_overhead_says_the_smallest_budget_that_fits_and_it_does():
    text = _plan("--budget", "1.5")
    assert "1.5 GiB is not above the device overhead of 2 GiB" in text, text
    smallest = re.search(r"the smallest budget that fits is ([\d.]+) GiB", text)
    assert smallest is not None, text
    assert "chosen: auto" in _plan("--budget", smallest[1])


def test_a_budget_above_the_overhead_but_below_the_floor_says_what_to_shrink():
    config = load_config(None, ["data.cube=[32,32,32]", "train.batch_size=2"])
    report = PlanReport(input_shape=(2, 4, 32, 32, 32), dtype="float32", budget_gib=2.5, floor_gib=3.0,
                        bandwidth_gbs=50, cost_model={}, device_overhead_gib=2.0)
    advice = no_fit_advice(config, report, 3.4, batch=2)
    assert advice.startswith("the smallest budget that fits is 3.4 GiB (--budget 3.4")
    assert "to fit 2.5 GiB, shrink data.cube (now 32x32x32), --batch / train.batch_size (now 2), train.amp" in advice


# ---- the image's Python is the one the pins were resolved for -------------------------------------------------

def _supports(tag: str, major: int, minor: int) -> bool:
    """A wheel tag (`cp311-cp311-manylinux_2_17_x86_64`, `py3-none-any`, `cp39-abi3-...`) installable on
    CPython major.minor on Linux."""
    interpreter, abi, platform = tag.split("-")
    version = f"{major}{minor}"
    if interpreter in (f"py{major}", f"py{version}", f"cp{version}"):
        runs = abi in ("none", "abi3", f"cp{version}")
    elif abi == "abi3" and interpreter.startswith(f"cp{major}"):
        runs = int(interpreter[len(f"cp{major}"):]) <= minor
    else:
        runs = False
    return runs and (platform == "any" or platform.startswith(("manylinux", "linux")))


def test_every_pin_has_a_wheel_for_the_python_the_dockerfile_installs(legacy_bundle, tmp_path):
    from importlib import metadata

    image = tmp_path / "image"
    assert invoke("container", "--model", legacy_bundle, "--out", image).exit_code == 0
    recorded = re.search(r"^ARG PYTHON_VERSION=(\d+)\.(\d+)$", (image / "Dockerfile").read_text(), re.MULTILINE)
    assert recorded is not None, "the Dockerfile records the Python it installs"
    major, minor = int(recorded[1]), int(recorded[2])
    pins = [line.split("==")[0] for line in (image / "requirements.txt").read_text().split()]
    assert pins
    for pin in pins:
        wheel = metadata.distribution(pin).read_text("WHEEL")
        tags = [line.split(":", 1)[1].strip() for line in (wheel or "").splitlines() if line.startswith("Tag:")]
        assert tags and any(_supports(tag, major, minor) for tag in tags), (pin, tags, f"{major}.{minor}")


# ---- the contract tests reach a venv under a home only its owner can enter ------------------------------------

@pytest.mark.skipif(not namespaces_permitted(), reason="needs root with unshare -m -n and setpriv")
def test_another_uid_reaches_a_venv_under_a_home_only_its_owner_can_enter():
    work = Path(tempfile.mkdtemp(prefix="brats-swap-home-"))
    try:
        work.chmod(0o755)
        home = work / "root"  # as /root: mode 0700, holding the venv and, beside it, a checkout
        tools = [home / ".venv" / "bin" / "tool", home / "src" / "deeper" / "tool"]
        for tool in tools:
            tool.parent.mkdir(parents=True)
            tool.write_text("echo reached\n")
        (home / "src").chmod(0o700)  # a second folder others cannot enter, below the first
        home.chmod(0o700)
        mounts = reachable_paths([tool.parent for tool in tools], work / "stage")
        runs = [f"setpriv --reuid {NON_ROOT} --regid {NON_ROOT} --clear-groups sh {tool}" for tool in tools]
        done = subprocess.run(["unshare", "-m", "--", "sh", "-c", " && ".join(["mount --make-rprivate /", *mounts,
                                                                             *runs])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.split() == ["reached", "reached"], done.stdout + done.stderr
        assert stat.S_IMODE(home.stat().st_mode) == 0o700  # outside the namespace nothing changed
    finally:
        shutil.rmtree(work, ignore_errors=True)
