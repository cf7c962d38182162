"""The torch-free serving image (`container --runtime onnxruntime`) and the BrainLesion `brats` orchestrator's
contract: the build folder's environment holds onnxruntime's GPU build and no torch, and the entrypoint, run
as the orchestrator runs an image (`--data_path=/mlcube_io0 --output_path=/mlcube_io2 --weights=/mlcube_io1/
model.zip`, the data read-only, a non-root uid, no network) in a process where importing torch fails, writes
one segmentation per input case, which the orchestrator's checks accept (an all-zero one is flagged)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml
from ship_helpers import NON_ROOT, challenge_input, namespaces_permitted, reachable_interpreter, task_run
from test_onnx import BLOCK_TORCH, invoke

from brats_swap.ship.bundle import export_bundle
from brats_swap.ship.submission import check_submission

pytest.importorskip("onnxruntime")
TASK = "met"


@pytest.fixture(scope="module")
def met(tmp_path_factory):
    """(bundle with ONNX networks, bundle without, /input-like folder, case ids) for MET, 2 folds."""
    base = tmp_path_factory.mktemp("onnx-met")
    run = task_run(base, TASK, folds=2)
    with_onnx = export_bundle(run, base / "onnx.zip", onnx=True).path
    plain = export_bundle(run, base / "plain.zip").path
    return with_onnx, plain, base / "input", challenge_input(base / "input", TASK, 3)


def test_the_onnxruntime_image_holds_onnxruntime_gpu_and_no_torch(met, tmp_path):
    bundle, _, _, _ = met
    out = tmp_path / "image"
    result = invoke("container", "--model", bundle, "--out", out, "--runtime", "onnxruntime", "--weights-record",
                    "1234567")
    assert result.exit_code == 0, result.output
    dockerfile = (out / "Dockerfile").read_text()
    assert "cudnn-runtime" in dockerfile and "torch" not in dockerfile.replace("torch-free", "").replace(
        "no torch", "")
    requirements = (out / "requirements.txt").read_text().split()
    names = {line.split("==")[0] for line in requirements}
    assert f"onnxruntime-gpu=={version('onnxruntime')}" in requirements
    assert {"numpy", "scipy", "nibabel", "pyyaml", "typer", "rich"} <= names
    assert not names & {"torch", "monai", "onnxruntime", "triton"} and not any(n.startswith("nvidia-") for n in names)
    assert "--runtime onnxruntime" in (out / "entrypoint.sh").read_text()
    entry = yaml.safe_load((out / "brainlesion.yml").read_text())[f"brats-swap-{TASK}"]
    assert entry["additional_files"] == {"record_id": "1234567", "param_name": ["weights"], "param_path": ["model.zip"]}
    assert entry["run_args"]["requires_root"] is False and entry["run_args"]["input_name_schema"] == "BraTS-MET-{id:05d}-000"


def test_an_onnxruntime_image_of_a_bundle_without_onnx_is_refused_in_one_line(met, tmp_path):
    _, plain, _, _ = met
    result = invoke("container", "--model", plain, "--out", tmp_path / "image", "--runtime", "onnxruntime")
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "fold 0 has no ONNX network; export the run with --onnx" in errors[0]


def orchestrator_check(data: Path, output: Path) -> list[Path]:
    """What the `brats` orchestrator checks after a run (`_sanity_check_output`): at least as many outputs as
    inputs named BraTS*, each a readable NIfTI; returns the all-zero outputs it warns about."""
    inputs = [entry for entry in data.iterdir() if entry.name.startswith("BraTS")]
    outputs = sorted(output.iterdir())
    assert len(outputs) >= len(inputs), f"{len(outputs)} outputs for {len(inputs)} inputs"
    return [path for path in outputs if np.count_nonzero(nib.load(str(path)).get_fdata()) == 0]


@pytest.mark.skipif(not namespaces_permitted(), reason="needs root with unshare -m -n and setpriv")
def test_the_entrypoint_runs_as_the_orchestrator_runs_it_without_torch(met, tmp_path):
    bundle, _, source, ids = met
    image = tmp_path / "image"
    assert invoke("container", "--model", bundle, "--out", image, "--runtime", "onnxruntime").exit_code == 0
    work = Path(tempfile.mkdtemp(prefix="brats-swap-orchestrator-"))  # world-readable, pytest's folders are not
    try:
        work.chmod(0o755)
        io = [work / f"mlcube_io{k}" for k in range(4)]  # data, weights, output, parameters
        shutil.copytree(source, io[0])
        io[1].mkdir()
        shutil.copy2(bundle, io[1] / "model.zip")  # the weights mount: the baked-in bundle is not there
        for folder in io[2:]:
            folder.mkdir()
        os.chown(io[2], NON_ROOT, NON_ROOT)
        scratch, blocker = work / "tmp", work / "blocker"
        scratch.mkdir(mode=0o700)
        os.chown(scratch, NON_ROOT, NON_ROOT)
        blocker.mkdir()
        (blocker / "sitecustomize.py").write_text(BLOCK_TORCH, encoding="utf-8")
        shutil.copy2(image / "entrypoint.sh", work / "entrypoint.sh")
        script = ["mount --make-rprivate /", *reachable_interpreter(work / "interpreter")]
        script += [f"mount --bind {scratch} {scratch}", f"mount --bind {io[2]} {io[2]}"]
        for folder in (io[0], io[1], io[3]):
            script += [f"mount --bind {folder} {folder}", f"mount -o remount,bind,ro {folder}"]
        script.append("mount -o remount,bind,ro /")
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        pythonpath = os.pathsep.join([str(blocker), str(Path(__file__).resolve().parents[1])])
        # The orchestrator's command: its arguments only, as the current (here: another, non-root) uid.
        script.append(f"setpriv --reuid {NON_ROOT} --regid {NON_ROOT} --clear-groups env HOME=/nonexistent-home "
                      f"TMPDIR={scratch} PATH={path} PYTHONPATH={pythonpath} {work}/entrypoint.sh "
                      f"--data_path={io[0]} --output_path={io[2]} --weights={io[1]}/model.zip; echo exit=$?")
        done = subprocess.run(["unshare", "-m", "-n", "--", "sh", "-c", " && ".join(script[:-1]) + "; " + script[-1]],
                              capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert "exit=0" in output and f"--weights: serving {io[1]}/model.zip" in output, output
        assert sorted(p.name for p in io[2].iterdir()) == sorted(f"{i}.nii.gz" for i in ids)
        assert all(p.stat().st_uid == NON_ROOT for p in io[2].iterdir())
        zero = orchestrator_check(io[0], io[2])
        report = check_submission(io[2], io[0], TASK)
        assert report.problems == [] and report.checked == len(ids)
        assert sorted(line.split(":")[0] for line in report.warnings) == sorted(str(p) for p in zero)
        # An all-zero output is flagged by both checks.
        flagged = io[2] / f"{ids[0]}.nii.gz"
        first = nib.load(str(flagged))
        nib.save(nib.Nifti1Image(np.zeros(first.shape, np.uint8), first.affine, first.header), str(flagged))
        assert flagged in orchestrator_check(io[0], io[2])
        assert any(line.startswith(str(flagged)) for line in check_submission(io[2], io[0], TASK).warnings)
    finally:
        shutil.rmtree(work, ignore_errors=True)
