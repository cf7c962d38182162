"""Deploying without the training stack: `export --onnx` writes each fold's network as ONNX checked against
torch (refused in one line when an operation has no ONNX form), `predict --runtime onnxruntime` equals `predict
--runtime torch` without importing torch or MONAI, and a changed model.onnx is refused by the bundle's sha256."""

from __future__ import annotations

import zipfile

import pytest
import torch
from tiny_cv import tiny_cv_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.errors import ConfigError
from brats_swap.ship.bundle import METADATA, fold_onnx, open_bundle
from brats_swap.ship.onnx_export import ATOL, OPSET, RTOL, onnx_bytes

pytest.importorskip("onnxruntime")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


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


class _FourierNet(torch.nn.Module):
    def forward(self, x):
        return torch.fft.fftn(x).real


def test_a_network_with_an_operation_without_onnx_form_is_refused_in_one_line(capfd):
    with pytest.raises(ConfigError) as refused:
        onnx_bytes(_FourierNet(), "probabilities", (1, 1, 4, 4, 4), "fold 0")
    message = str(refused.value)
    assert "\n" not in message and "aten::fft_fftn" in message and "fold 0" in message
    assert "graph" not in capfd.readouterr().out  # the exporter's own dump of the graph is not shown


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
