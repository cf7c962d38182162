"""Deploying without the training stack: `export --onnx` writes each fold's network as ONNX checked against
torch (refused in one line when an operation has no ONNX form), `predict --runtime onnxruntime` equals `predict
--runtime torch` without importing torch or MONAI, and a changed model.onnx is refused by the bundle's sha256."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from layout_helpers import nnunet_phantoms
from tiny_cv import tiny_cv_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.config.loader import config_to_dict, config_to_yaml
from brats_swap.errors import ConfigError
from brats_swap.model import build_model
from brats_swap.model.targets import run_output_count
from brats_swap.run.checkpoint import load_checkpoint, save_checkpoint
from brats_swap.run.folder import RunFolder
from brats_swap.ship.bundle import METADATA, fold_onnx, open_bundle
from brats_swap.ship.onnx_export import ATOL, FP16_ATOL, OPSET, RTOL, onnx_bytes

pytest.importorskip("onnxruntime")

REPO = Path(__file__).resolve().parents[1]
NNUNET_RESULTS = (REPO / "tests" / "fixtures" / "nnunet_results" / "Dataset991_BraTSPhantoms"
                  / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres")
# The agreement `predict --runtime onnxruntime` keeps with `--runtime torch`.
MIN_EQUAL_LABELS = 0.9999
MAX_MEAN_PROBABILITY_DIFF = 1e-4


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _first_cases(root: Path, folder: Path, count: int) -> Path:
    """`folder` holding links to the first `count` cases of the dataset at `root`."""
    folder.mkdir()
    for case in sorted(p for p in Path(root).iterdir() if p.is_dir())[:count]:
        (folder / case.name).symlink_to(case, target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def cv_run(tmp_path_factory):
    return tiny_cv_run(tmp_path_factory)


@pytest.fixture(scope="module")
def onnx_bundle(cv_run, tmp_path_factory):
    _, run, _ = cv_run
    out = tmp_path_factory.mktemp("onnx-bundle") / "model.zip"
    result = invoke("export", "--run", run, "--out", out, "--onnx")
    assert result.exit_code == 0, result.output
    assert "ONNX networks checked against torch" in result.output
    return out


def test_export_onnx_adds_each_folds_checked_network_with_its_sha256(onnx_bundle):
    import onnx

    bundle = open_bundle(onnx_bundle)
    for record in bundle.metadata["folds"]:
        member = fold_onnx(record["fold"])
        assert record["onnx"]["file"] == member and member in bundle.metadata["files"]
        model = onnx.load_from_string(bundle.members[member])
        assert max(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")) >= OPSET
        shape = [d.dim_value or d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert shape == ["batch", 4, 24, 24, 24]  # the tiny run's cube: a whole-volume model
        checks = record["onnx"]["checks"]
        assert [c["input"].split(" ")[0] for c in checks] == ["random", "case"]  # a real case of the run too
        assert all(0 <= c["max_abs_diff"] <= ATOL for c in checks)
        assert (record["onnx"]["rtol"], record["onnx"]["atol"]) == (RTOL, ATOL)
        half = record["onnx"]["fp16"]  # the Isensee U-Net exports and runs in float16 too
        assert half["written"] and half["file"] in bundle.metadata["files"], half
        model = onnx.load_from_string(bundle.members[half["file"]])
        assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
        assert all(c["max_abs_diff"] <= FP16_ATOL for c in half["checks"]) and len(half["checks"]) == 2


class _FourierNet(torch.nn.Module):
    def forward(self, x):
        return torch.fft.fftn(x).real


def test_a_network_with_an_operation_without_onnx_form_is_refused_in_one_line(capfd):
    with pytest.raises(ConfigError) as refused:
        onnx_bytes(_FourierNet(), "probabilities", (1, 1, 4, 4, 4), "fold 0")
    message = str(refused.value)
    assert "\n" not in message and "aten::fft_fftn" in message and "fold 0" in message
    assert "graph" not in capfd.readouterr().out  # the exporter's own dump of the graph is not shown


def test_a_forged_onnx_record_is_never_trusted_for_what_the_network_takes(onnx_bundle, cv_run, tmp_path):
    """metadata.json's ONNX record (input and output names, input shape, what it returns) is written by someone
    else: the runtime reads them from the graph and the fold's config instead, so a record without them or with
    a string for a shape still predicts, bit for bit as the honest bundle does, and never prints a traceback."""
    import json

    _, _, root = cv_run
    cases = _first_cases(root, tmp_path / "cases", 1)
    (case,) = cases.iterdir()
    forged = tmp_path / "forged.zip"
    with zipfile.ZipFile(onnx_bundle) as source, zipfile.ZipFile(forged, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == METADATA:
                metadata = json.loads(data)
                for record in metadata["folds"]:
                    for key in ("input", "output", "returns"):
                        record["onnx"].pop(key)
                    record["onnx"]["input_shape"] = "../../etc\n"
                data = json.dumps(metadata).encode()
            target.writestr(info, data)
    written = {}
    for name, bundle in (("honest", onnx_bundle), ("forged", forged)):
        result = invoke("predict", "--model", bundle, "--input", cases, "--out", tmp_path / name,
                        "--runtime", "onnxruntime")
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output
        written[name] = nib.load(tmp_path / name / f"{case.name}.nii.gz").get_fdata()
    assert np.array_equal(written["honest"], written["forged"])


def test_a_changed_model_onnx_is_refused_by_the_sha256_check(onnx_bundle, tmp_path):
    changed = tmp_path / "changed.zip"
    with zipfile.ZipFile(onnx_bundle) as source, zipfile.ZipFile(changed, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == fold_onnx(0):
                data = data[:-1] + bytes([data[-1] ^ 1])
            target.writestr(info, data)
    result = invoke("predict", "--model", changed, "--input", tmp_path, "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert f"{fold_onnx(0)}: sha256 differs from {METADATA}" in result.output


# ---- predict --runtime onnxruntime equals --runtime torch -----------------------------------------------------

# Untrained networks of each kind the pipeline predicts differently, on the tiny cross-validation's phantoms:
# the sliding window (Isensee U-Net on 16³ windows of the 24³ cube, pad_crop), region outputs (nnU-Net's plain
# U-Net, whole cube) and softmax outputs (its residual-encoder U-Net, sliding window).
KINDS = {
    "patch": ["train.mode=patch", "train.patch=[16,16,16]", "data.fit=pad_crop", "model.base_filters=2",
              "model.depth=3", "model.segmentation_levels=2"],
    "regions": ["model.name=nnunet", "model.features=[2,4,8]", "model.outputs=regions"],
    "softmax": ["model.name=resenc_m", "model.features=[2,4,8]", "model.outputs=softmax", "train.loss=dice_ce",
                "train.mode=patch", "train.patch=[16,16,16]", "evaluate.sw_batch_size=2"],
}


def _untrained_run(base: Path, kind: str, root: Path, edition: str) -> Path:
    """A run folder of one fold of an untrained tiny network of `kind` (as training leaves it: config.yaml and a
    checksummed checkpoint_best.pt)."""
    config = load_config(None, [f"name=onnx-{kind}", f"data.root={root}", "data.cube=[24,24,24]", "train.device=cpu",
                                *KINDS[kind]])
    run = RunFolder(base / kind)
    run.root.mkdir(parents=True)
    run.config.write_text(config_to_yaml(config), encoding="utf-8")
    torch.manual_seed(1)
    model = build_model(config.model, out_channels=run_output_count(edition, config.model))
    save_checkpoint({"model": model.state_dict(), "config": config_to_dict(config), "edition": edition, "epoch": 1,
                     "optimizer": {"state": {}, "param_groups": []}}, run.fold(0).best)
    return run.root


@pytest.fixture(scope="module")
def runs(cv_run, onnx_bundle, tmp_path_factory):
    """kind -> (bundle exported with --onnx, the cases to predict): the tiny cross-validation (whole volume,
    trained, two folds), the untrained kinds above and an imported nnU-Net model. Two of the run's phantoms are
    predicted (every case is predicted by the same code; each one costs 8 mirrored forwards per fold and runtime)."""
    _, cv, root = cv_run
    base = tmp_path_factory.mktemp("onnx-runs")
    edition = load_checkpoint(RunFolder(cv).fold(0).best)["edition"]
    cases = _first_cases(root, base / "cases", 2)
    made = {"whole": (onnx_bundle, cases)}
    for kind in KINDS:
        made[kind] = (base / f"{kind}.zip", cases)
        result = invoke("export", "--run", _untrained_run(base, kind, root, edition), "--out", made[kind][0], "--onnx")
        assert result.exit_code == 0, result.output
    imported = base / "nnunet-run"
    result = invoke("import-nnunet", NNUNET_RESULTS, "--out", imported)
    assert result.exit_code == 0, result.output
    made["nnunet"] = (base / "nnunet.zip", nnunet_phantoms(base / "nnunet-data", ((41, 33, 30),), seed=5, id_offset=500))
    result = invoke("export", "--run", imported, "--out", made["nnunet"][0], "--onnx")
    assert result.exit_code == 0, result.output
    return made


def _predicted(out: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    found = {}
    for path in sorted(out.glob("*.nii.gz")):
        with np.load(out / f"{path.name.removesuffix('.nii.gz')}.npz") as saved:
            found[path.name] = (np.asarray(nib.load(str(path)).dataobj), saved["probabilities"])
    return found


def _predict(bundle: Path, cases: Path, out: Path, runtime: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    result = invoke("predict", "--model", bundle, "--input", cases, "--out", out, "--runtime", runtime, "--tta",
                    "--save-probabilities")
    assert result.exit_code == 0, result.output
    return _predicted(out)


def assert_runtimes_agree(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys() and ours
    for name, (labels, probs) in ours.items():
        their_labels, their_probs = theirs[name]
        assert labels.shape == their_labels.shape and probs.shape == their_probs.shape
        assert np.mean(labels == their_labels) >= MIN_EQUAL_LABELS, name
        assert np.mean(np.abs(probs - their_probs)) <= MAX_MEAN_PROBABILITY_DIFF, name


@pytest.fixture(scope="module")
def torch_predicted(runs, tmp_path_factory):
    """kind -> what `predict --runtime torch` writes for the kind's bundle (with TTA and probabilities),
    predicted once per module: the tests below compare several onnxruntime predictions with it."""
    base = tmp_path_factory.mktemp("torch-predictions")
    made = {}

    def predicted(kind: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if kind not in made:
            bundle, cases = runs[kind]
            made[kind] = _predict(bundle, cases, base / kind, "torch")
        return made[kind]

    return predicted


@pytest.mark.parametrize("kind", ["whole", *KINDS, "nnunet"])
def test_onnxruntime_predicts_what_torch_predicts(runs, torch_predicted, kind, tmp_path):
    bundle, cases = runs[kind]
    theirs = torch_predicted(kind)
    ours = _predict(bundle, cases, tmp_path / "onnxruntime", "onnxruntime")
    assert_runtimes_agree(ours, theirs)
    assert any(labels.any() for labels, _ in theirs.values()) or kind != "whole"  # the trained run paints tumour


BLOCK_TORCH = """\
import sys


class _NoTorch:
    \"\"\"Importing torch or MONAI fails in this process: the onnxruntime path must not need them.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "monai"):
            raise ImportError(f"{name}: blocked (this process predicts without torch)")
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def _without_torch(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCK_TORCH, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "brats_swap", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("kind", ["softmax", "nnunet"])
def test_the_onnxruntime_path_runs_where_importing_torch_fails(runs, torch_predicted, kind, tmp_path):
    bundle, cases = runs[kind]
    blocked = _without_torch(tmp_path, "predict", "--model", bundle, "--runtime", "torch", "--input", cases,
                             "--out", tmp_path / "torch")
    assert blocked.returncode != 0 and "blocked" in blocked.stdout + blocked.stderr  # the blocker works
    done = _without_torch(tmp_path, "predict", "--model", bundle, "--runtime", "onnxruntime", "--input", cases,
                          "--out", tmp_path / "free", "--tta", "--save-probabilities")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_runtimes_agree(_predicted(tmp_path / "free"), torch_predicted(kind))


# ---- the numpy forms of what torch and MONAI did ------------------------------------------------------------

def test_the_numpy_resize_is_torchs_interpolate():
    from brats_swap.data.preprocess import _trilinear_numpy, resize_label

    rng = np.random.default_rng(3)
    for shape, size in (((30, 37, 23), (24, 24, 24)), ((24, 24, 24), (30, 37, 23)), ((64, 70, 50), (48, 48, 48))):
        volume = rng.standard_normal(shape).astype(np.float32)
        theirs = torch.nn.functional.interpolate(torch.from_numpy(volume)[None, None], size=size, mode="trilinear",
                                                 align_corners=False)[0, 0].numpy()
        np.testing.assert_allclose(_trilinear_numpy(volume, size), theirs, rtol=1e-6, atol=1e-6)  # bitwise here
        labels = rng.integers(0, 5, shape).astype(np.uint8)
        nearest = torch.nn.functional.interpolate(torch.from_numpy(labels.astype(np.float32))[None, None], size=size,
                                                  mode="nearest-exact")[0, 0].numpy().astype(np.uint8)
        assert np.array_equal(resize_label(labels, size), nearest)


def test_the_sliding_window_is_monais():
    from monai.inferers import sliding_window_inference

    from brats_swap.run.array_inference import sliding_window

    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Conv3d(2, 3, 3, padding=1), torch.nn.Sigmoid()).eval()
    for shape, window, overlap, blend, batch in (((1, 2, 20, 17, 9), (8, 8, 8), 0.5, "gaussian", 1),
                                                 ((2, 2, 16, 16, 16), (16, 8, 12), 0.25, "constant", 3),
                                                 ((1, 2, 7, 30, 12), (8, 8, 8), 0.6, "gaussian", 4)):
        images = torch.randn(shape)
        with torch.no_grad():
            theirs = sliding_window_inference(images, window, batch, network, overlap=overlap, mode=blend).numpy()
            ours = sliding_window(lambda a: network(torch.from_numpy(a)).numpy(), images.numpy(), window,
                                  overlap=overlap, blend=blend, batch_size=batch)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


def test_onnxruntime_on_a_bundle_exported_without_onnx_is_one_line(cv_run, tmp_path):
    _, run, root = cv_run
    plain = tmp_path / "plain.zip"
    assert invoke("export", "--run", run, "--out", plain, "--folds", "0").exit_code == 0
    result = invoke("predict", "--model", plain, "--runtime", "onnxruntime", "--input", root, "--out", tmp_path / "o")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1
    assert "fold 0 has no models/fold_0/model.onnx; export the run with --onnx" in errors[0]
    result = invoke("predict", "--run", run, "--runtime", "onnxruntime", "--input", root, "--out", tmp_path / "o")
    assert result.exit_code == 2 and "give --model FILE" in result.output


def test_onnxruntime_runs_the_float16_network_where_torch_predicts_under_autocast(onnx_bundle, cv_run, tmp_path,
                                                                                  monkeypatch):
    """On CUDA, `--runtime torch` predicts under autocast (the fold's train.amp, or nnU-Net's rules), so
    onnxruntime runs the fold's model.fp16.onnx there; on the CPU the float32 network. No GPU here: the choice
    is checked by its rule, and the float16 network predicted on the CPU's onnxruntime."""
    import dataclasses

    from brats_swap.ship import onnx_runtime

    config, _, root = cv_run
    cuda, cpu = onnx_runtime.providers_for("cuda"), onnx_runtime.providers_for("cpu")
    with_amp = dataclasses.replace(config, train=dataclasses.replace(config.train, amp="fp16"))
    nnunet_rules = dataclasses.replace(config, evaluate=dataclasses.replace(config.evaluate, inference="nnunet"))
    assert onnx_runtime.runs_in_float16(with_amp, cuda) and onnx_runtime.runs_in_float16(nnunet_rules, cuda)
    assert not onnx_runtime.runs_in_float16(config, cuda)  # amp off: torch predicts in float32 on CUDA too
    assert not onnx_runtime.runs_in_float16(with_amp, cpu) and not onnx_runtime.runs_in_float16(nnunet_rules, cpu)

    cases = _first_cases(root, tmp_path / "cases", 2)
    single = invoke("predict", "--model", onnx_bundle, "--input", cases, "--out", tmp_path / "fp32",
                    "--runtime", "onnxruntime", "--save-probabilities")
    assert single.exit_code == 0 and "ONNX in onnxruntime, float32)" in single.output, single.output
    monkeypatch.setattr(onnx_runtime, "runs_in_float16", lambda predicts_with, providers: True)
    half = invoke("predict", "--model", onnx_bundle, "--input", cases, "--out", tmp_path / "fp16",
                  "--runtime", "onnxruntime", "--save-probabilities")
    assert half.exit_code == 0 and "ONNX in onnxruntime, float16)" in half.output, half.output
    ours, theirs = _predicted(tmp_path / "fp16"), _predicted(tmp_path / "fp32")
    assert ours.keys() == theirs.keys() and len(ours) == 2
    for name, (labels, probs) in ours.items():
        assert not np.array_equal(probs, theirs[name][1])  # another network ran
        assert np.mean(labels == theirs[name][0]) >= 0.999 and np.max(np.abs(probs - theirs[name][1])) <= 1e-2, name
