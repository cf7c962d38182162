"""Shipping a model: `export` -> `predict --model` equals `predict --run`, a damaged bundle is refused in one
line, the challenge entrypoint keeps the BraTS container contract (run as another uid in its own network and
mount namespaces, read-only input and root, unwritable HOME), `check-submission` catches each problem, and
`container` writes the image's build folder."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from ship_helpers import NON_ROOT, challenge_input, namespaces_permitted, reachable_interpreter, task_run
from tiny_cv import tiny_cv_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.data.discovery import discover_cases
from brats_swap.ship.bundle import METADATA, export_bundle, fold_weights, open_bundle
from brats_swap.ship.submission import check_submission
from brats_swap.ship.time_budget import parse_duration
from brats_swap.ship.writable_folders import writable_home


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def cv_run(tmp_path_factory):
    return tiny_cv_run(tmp_path_factory)


@pytest.fixture(scope="module")
def cv_bundle(cv_run, tmp_path_factory):
    _, run, _ = cv_run
    out = tmp_path_factory.mktemp("bundle") / "model.zip"
    result = invoke("export", "--run", run, "--out", out)
    assert result.exit_code == 0, result.output
    assert "fold(s) 0, 1" in result.output
    return out


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """task -> (bundle, /input-like folder) for MET (`-` separators, 2 folds) and MEN-RT (`_`, t1c only)."""
    base = tmp_path_factory.mktemp("tasks")
    made = {}
    for task, folds, cases in (("met", 2, 3), ("men-rt", 1, 2)):
        bundle = export_bundle(task_run(base, task, folds), base / f"{task}.zip").path
        made[task] = (bundle, base / f"input-{task}", challenge_input(base / f"input-{task}", task, cases))
    return made


# ---- the bundle ---------------------------------------------------------------------------------------------

def test_export_then_predict_model_equals_predict_run(cv_run, cv_bundle, tmp_path):
    _, run, root = cv_run
    case = discover_cases(root)[0]
    outputs = {}
    for source in (("--run", run), ("--model", cv_bundle)):
        out = tmp_path / source[0].strip("-")
        result = invoke("predict", *source, "--input", case.seg.parent, "--out", out, "--tta", "--save-probabilities")
        assert result.exit_code == 0, result.output
        outputs[source[0]] = out
    by_run = np.load(outputs["--run"] / f"{case.case_id}.npz")["probabilities"]
    by_model = np.load(outputs["--model"] / f"{case.case_id}.npz")["probabilities"]
    assert torch.equal(torch.from_numpy(by_run), torch.from_numpy(by_model))
    labels = [np.asarray(nib.load(outputs[s] / f"{case.case_id}.nii.gz").dataobj) for s in ("--run", "--model")]
    np.testing.assert_array_equal(labels[0], labels[1])
    assert labels[0].any()


def test_the_bundle_holds_weights_config_labels_and_checksums_but_no_training_state(cv_run, cv_bundle):
    _, run, _ = cv_run
    with zipfile.ZipFile(cv_bundle) as archive:
        names = set(archive.namelist())
        metadata = json.loads(archive.read(METADATA))
        for name, digest in metadata["files"].items():
            import hashlib

            assert hashlib.sha256(archive.read(name)).hexdigest() == digest
        weights = torch.load(io.BytesIO(archive.read(fold_weights(1))), weights_only=True)
        labels = json.loads(archive.read("configs/labels.json"))
    assert names == {METADATA, *metadata["files"]}
    assert {"configs/config.yaml", "configs/postprocessing.json", "configs/cv_summary.json",
            "models/fold_0/model.pt", "models/fold_1/model.pt", "models/fold_0/config.yaml"} <= names
    assert not any("split" in name or "optimizer" in name for name in names)
    assert all(isinstance(value, torch.Tensor) for value in weights.values())  # a bare state dict
    assert metadata["format_version"] == 1 and metadata["challenge"] == "2021"
    assert metadata["pytorch_version"] == torch.__version__ and metadata["architecture"]["name"] == "isensee2017"
    assert labels["labels"] == {"1": "NCR/NET", "2": "ED", "4": "ET"}
    assert labels["modality_suffixes"] == {"t1": "t1", "t1ce": "t1ce", "t2": "t2", "flair": "flair"}


def _rewrite(bundle: Path, target: Path, change) -> Path:
    """A copy of `bundle` with member bytes changed by `change(name, data) -> data | None` (None drops it)."""
    with zipfile.ZipFile(bundle) as source, zipfile.ZipFile(target, "w") as copy:
        for name in source.namelist():
            data = change(name, source.read(name))
            if data is not None:
                copy.writestr(name, data)
    return target


@pytest.mark.parametrize("damage, named", [
    ("changed", "models/fold_0/model.pt"), ("truncated", "model.zip"), ("added", "models/extra.pt"),
])
def test_a_changed_or_truncated_bundle_is_refused_in_one_line(cv_bundle, cv_run, tmp_path, damage, named):
    bad = tmp_path / "model.zip"
    if damage == "changed":  # a valid zip (its CRCs fit) whose member no longer has the recorded sha256
        _rewrite(cv_bundle, bad, lambda name, data: data[:-9] + bytes([data[-9] ^ 1]) + data[-8:]
                 if name == "models/fold_0/model.pt" else data)
    elif damage == "truncated":
        bad.write_bytes(cv_bundle.read_bytes()[: cv_bundle.stat().st_size // 2])
    else:
        _rewrite(cv_bundle, bad, lambda name, data: data)
        with zipfile.ZipFile(bad, "a") as archive:
            archive.writestr("models/extra.pt", b"not listed")
    case = discover_cases(cv_run[2])[0]
    result = invoke("predict", "--model", bad, "--input", case.seg.parent, "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    lines = error_lines(result.output)
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ---- the challenge entrypoint ---------------------------------------------------------------------------------

def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.mark.skipif(not namespaces_permitted(), reason="needs root with unshare -m -n and setpriv")
def test_the_entrypoint_keeps_the_container_contract_as_another_uid_without_network(tasks):
    # Everything the other uid must read lives in a world-readable folder (pytest's own are 0700).
    work = Path(tempfile.mkdtemp(prefix="brats-swap-contract-"))
    try:
        work.chmod(0o755)
        script, runs = ["mount --make-rprivate /"], {}
        for task, (bundle, source, _) in tasks.items():
            shutil.copytree(source, work / f"input-{task}")
            shutil.copy2(bundle, work / f"{task}.zip")
            runs[task] = work / f"output-{task}"
            runs[task].mkdir()
            os.chown(runs[task], NON_ROOT, NON_ROOT)
        scratch = work / "tmp"
        scratch.mkdir(mode=0o700)
        os.chown(scratch, NON_ROOT, NON_ROOT)
        script += reachable_interpreter(work / "interpreter")
        for folder in [scratch, *runs.values()]:  # the only writable places; the root becomes read-only below
            script.append(f"mount --bind {folder} {folder}")
        for task in tasks:
            script.append(f"mount --bind {work}/input-{task} {work}/input-{task}")
            script.append(f"mount -o remount,bind,ro {work}/input-{task}")
        script.append("mount -o remount,bind,ro /")
        python = f"setpriv --reuid {NON_ROOT} --regid {NON_ROOT} --clear-groups env HOME=/nonexistent-home " \
                 f"TMPDIR={scratch} {sys.executable} -m brats_swap"
        script.append(f"{python} serve-challenge --model {work}/met.zip --input {work}/input-met "
                      f"--output {runs['met']} --time-budget 8h; echo met-exit=$?")
        # MEN-RT with MLCube's older `infer --data_path --output_path` form.
        script.append(f"{python} serve-challenge --model {work}/men-rt.zip infer --data_path={work}/input-men-rt "
                      f"--output_path={runs['men-rt']}; echo men-rt-exit=$?")
        before = {task: _snapshot(work / f"input-{task}") for task in tasks}
        done = subprocess.run(["unshare", "-m", "-n", "--", "sh", "-c", " && ".join(script[:-2]) + "; "
                               + "; ".join(script[-2:])], capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert "met-exit=0" in output and "men-rt-exit=0" in output, output
        assert "HOME: not writable" in output
        assert (scratch / f"brats-swap-{NON_ROOT}" / "home").is_dir()  # where HOME went
        for task, (_, _, ids) in tasks.items():
            assert sorted(p.name for p in runs[task].iterdir()) == sorted(f"{i}.nii.gz" for i in ids)
            assert _snapshot(work / f"input-{task}") == before[task]
            for path in runs[task].iterdir():
                assert path.stat().st_uid == NON_ROOT and nib.load(path).get_data_dtype() == np.uint8
            report = check_submission(runs[task], work / f"input-{task}", task)
            assert report.problems == [] and report.checked == len(ids)
        # The read-only root made any other write fail; the contract also reads the outputs back.
        result = invoke("check-submission", runs["men-rt"], "--input", work / "input-men-rt", "--task", "men-rt")
        assert result.exit_code == 0, result.output
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _serve(bundle: Path, input_dir: Path, output_dir: Path, *extra: str, monkeypatch):
    for variable in ("HOME", "TORCH_HOME", "MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(variable, os.environ.get(variable, "/nonexistent"))
    return invoke("serve-challenge", "--model", bundle, "--input", input_dir, "--output", output_dir, *extra)


def test_a_broken_case_is_named_and_the_others_are_written(tasks, tmp_path, monkeypatch):
    bundle, source, ids = tasks["met"]
    shutil.copytree(source, tmp_path / "in")
    broken = tmp_path / "in" / ids[1] / f"{ids[1]}-t2f.nii.gz"
    broken.write_bytes(broken.read_bytes()[:200])  # a truncated download
    result = _serve(bundle, tmp_path / "in", tmp_path / "out", "--no-tta", monkeypatch=monkeypatch)
    assert result.exit_code == 1, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{i}.nii.gz" for i in ids if i != ids[1])
    lines = error_lines(result.output)
    assert len(lines) == 1 and "1 of 3 case(s) failed" in lines[0] and ids[1] in lines[0] and broken.name in lines[0]


def test_a_tiny_time_budget_drops_tta_then_folds_and_says_so(tasks, tmp_path, monkeypatch):
    bundle, source, ids = tasks["met"]
    result = _serve(bundle, source, tmp_path / "out", "--time-budget", "0.01s", monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "dropping test-time augmentation" in text and "dropping folds (2 -> 1)" in text
    assert f"{ids[0]}: " in text and "(2 fold(s), TTA)" in text and "(1 fold(s))" in text
    assert len(list((tmp_path / "out").iterdir())) == len(ids)


def test_an_unwritable_home_and_unset_cache_folders_go_under_the_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    writable = tmp_path / "mine"
    writable.mkdir()
    environ = {"HOME": "/nonexistent-home", "XDG_CACHE_HOME": str(writable)}
    changed = writable_home(environ)
    base = tmp_path / f"brats-swap-{os.getuid()}"
    assert changed["HOME"] == (str(base / "home"), "not writable") and environ["HOME"] == str(base / "home")
    assert "XDG_CACHE_HOME" not in changed and environ["XDG_CACHE_HOME"] == str(writable)
    assert "MPLCONFIGDIR" not in changed  # unset: matplotlib's default is under the new, writable HOME
    (tmp_path / "a-file").write_text("")
    environ = {"HOME": str(writable), "MPLCONFIGDIR": str(tmp_path / "a-file" / "matplotlib")}
    assert writable_home(environ)["MPLCONFIGDIR"] == (str(base / "matplotlib"), "not writable")


def test_predict_takes_a_run_or_a_bundle(cv_bundle, tmp_path):
    for sources in ((), ("--run", tmp_path, "--model", cv_bundle)):
        result = invoke("predict", *sources, "--input", tmp_path, "--out", tmp_path / "out")
        assert result.exit_code == 2 and "either --run" in result.output


def test_durations():
    assert parse_duration("8h") == 8 * 3600 and parse_duration("90m") == 5400 and parse_duration("45") == 45
    assert parse_duration("1.5h") == 5400
    with pytest.raises(Exception, match="--time-budget"):
        parse_duration("soon")


# ---- check-submission --------------------------------------------------------------------------------------

@pytest.fixture
def good_submission(tasks, tmp_path):
    """The MET input and a valid output for it (segmentations on each case's grid, in the MET table)."""
    _, source, ids = tasks["met"]
    out = tmp_path / "out"
    out.mkdir()
    for case_id in ids:
        image = nib.load(source / case_id / f"{case_id}-t1c.nii.gz")
        labels = np.zeros(image.shape, dtype=np.uint8)
        labels[8:12, 8:12, 8:12] = 4
        nib.save(nib.Nifti1Image(labels, image.affine, image.header), out / f"{case_id}.nii.gz")
    return source, out, ids


def test_a_valid_submission_passes_and_an_empty_segmentation_is_a_warning(good_submission):
    source, out, ids = good_submission
    result = invoke("check-submission", out, "--input", source)
    assert result.exit_code == 0, result.output
    image = nib.load(out / f"{ids[0]}.nii.gz")
    nib.save(nib.Nifti1Image(np.zeros(image.shape, np.uint8), image.affine, image.header), out / f"{ids[0]}.nii.gz")
    result = invoke("check-submission", out, "--input", source, "--task", "met")
    assert result.exit_code == 0 and "empty segmentation" in result.output and ids[0] in result.output


def _label_file(path: Path, labels: np.ndarray, affine) -> None:
    nib.save(nib.Nifti1Image(labels, affine), path)


@pytest.mark.parametrize("problem, expected", [
    ("subfolder", "a subfolder"), ("misnamed", "misnamed"), ("missing", "no segmentation"),
    ("grid", "wrong grid"), ("label", "label value 5"),
])
def test_check_submission_catches_each_problem(good_submission, problem, expected):
    source, out, ids = good_submission
    victim = out / f"{ids[1]}.nii.gz"
    image = nib.load(victim)
    if problem == "subfolder":
        (out / "extra").mkdir()
        shutil.move(out / f"{ids[0]}.nii.gz", out / "extra")
    elif problem == "misnamed":
        victim.rename(out / f"{ids[1]}_seg.nii.gz")
    elif problem == "missing":
        victim.unlink()
    elif problem == "grid":
        shifted = image.affine.copy()
        shifted[0, 3] += 1.0  # one voxel off: the same shape on another grid
        _label_file(victim, np.asarray(image.dataobj), shifted)
    else:
        labels = np.asarray(image.dataobj).copy()
        labels[0, 0, 0] = 5
        _label_file(victim, labels, image.affine)
    result = invoke("check-submission", out, "--input", source, "--task", "met")
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("problem:")]
    assert any(expected in line for line in problems), result.output
    assert len(error_lines(result.output)) == 1


# ---- the image's build folder -----------------------------------------------------------------------------

@pytest.mark.parametrize("task, separator, schema", [("met", "-", "BraTS-MET-{id:05d}-000"),
                                                     ("men-rt", "_", "BraTS-MEN-RT-{id:04d}-1")])
def test_container_writes_a_build_folder_and_the_brainlesion_entry(tasks, tmp_path, task, separator, schema):
    import yaml

    bundle = tasks[task][0]
    out = tmp_path / "image"
    result = invoke("container", "--model", bundle, "--out", out)
    assert result.exit_code == 0, result.output
    assert {"Dockerfile", ".dockerignore", "entrypoint.sh", "README.md", "model.zip", "requirements.txt",
            "brainlesion.yml", "src"} == {p.name for p in out.iterdir()}
    dockerfile = (out / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvidia/cuda:12.8" in dockerfile and dockerfile.count("FROM ") == 1 and "COPY model.zip" in dockerfile
    assert f"torch=={torch.__version__.split('+')[0]}" in dockerfile and 'ENTRYPOINT ["/opt/brats-swap/' in dockerfile
    entrypoint = (out / "entrypoint.sh").read_text()
    assert os.access(out / "entrypoint.sh", os.X_OK) and f"serve-challenge --model /opt/brats-swap/model.zip " \
                                                          f"--task {task}" in entrypoint
    requirements = (out / "requirements.txt").read_text().split()
    assert f"numpy=={np.__version__}" in requirements and not any(r.startswith("torch==") for r in requirements)
    readme = (out / "README.md").read_text()
    assert "--network none" in readme and "docker build" in readme and "docker save" in readme
    assert (out / "model.zip").read_bytes() == bundle.read_bytes() and (out / "src" / "pyproject.toml").is_file()
    open_bundle(out / "model.zip")
    entry = yaml.safe_load((out / "brainlesion.yml").read_text())[f"brats-swap-{task}"]["run_args"]
    assert entry["input_name_schema"] == schema and entry["subject_modality_separator"] == separator
    assert entry["cpu_compatible"] is True and entry["requires_root"] is False
    assert schema in result.output and "docker_image" in result.output


def test_only_the_cli_imports_the_shipping_package():
    from test_layering import MODULES, _area, _violations

    below = {_area(m) for m in MODULES} - {"cli", "ship", "__main__"}
    assert "ship" in {_area(m) for m in MODULES} and _violations(below, {"ship"}) == []
