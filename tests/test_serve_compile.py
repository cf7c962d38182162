"""serve-challenge and `evaluate.compile`: a bundle's `auto` serves eager, an explicit `true` compiles
(`ship.serve.serving_compile`; why: docs/submit.md#compiling-when-serving).

On this CPU `auto` is eager anyway, so the test makes `auto` compile as it does on CUDA and stands a recorder in
for the compiled regions: no network is compiled, and the old serve-challenge (the bundle's `auto` as it is) is
caught compiling."""

from __future__ import annotations

from pathlib import Path

import pytest
from ship_helpers import challenge_input, task_run
from typer.testing import CliRunner

import brats_swap.run.compiling as compiling
from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.config.loader import config_to_yaml
from brats_swap.run.folder import RunFolder
from brats_swap.ship.bundle import export_bundle


@pytest.fixture
def compiled_models(monkeypatch, tmp_path) -> list:
    """The models whose blocks would be compiled; `auto` compiles here as on CUDA."""
    built: list = []

    class RecordedRegions:  # in place of memory.CompiledRegions: records the model, compiles nothing
        def __init__(self, model, **_options):
            built.append(model)

    monkeypatch.setattr(compiling, "CompiledRegions", RecordedRegions)
    monkeypatch.setattr(compiling, "compile_wanted", lambda setting, device: setting in (True, "auto"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return built


def _bundle(base: Path, setting: str) -> Path:
    """A MET bundle of one untrained fold whose config says `evaluate.compile: <setting>`."""
    run = RunFolder(task_run(base, "met"))
    config = load_config(run.config, [f"evaluate.compile={setting}"])
    run.config.write_text(config_to_yaml(config), encoding="utf-8")
    return export_bundle(run.root, base / "model.zip").path


@pytest.mark.parametrize(("setting", "compiles"), [("auto", False), ("true", True)])
def test_serve_challenge_serves_auto_eager_and_an_explicit_true_compiled(compiled_models, tmp_path, setting,
                                                                           compiles):
    bundle = _bundle(tmp_path, setting)
    ids = challenge_input(tmp_path / "in", "met", 1)
    result = CliRunner().invoke(app, ["serve-challenge", "--model", str(bundle), "--input", str(tmp_path / "in"),
                                      "--output", str(tmp_path / "out"), "--no-tta", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{ids[0]}.nii.gz"]
    assert len(compiled_models) == (1 if compiles else 0)
    # `predict --model` keeps the bundle's setting: `auto` compiles where it would (here, as on CUDA).
    result = CliRunner().invoke(app, ["predict", "--model", str(bundle), "--input", str(tmp_path / "in"),
                                      "--out", str(tmp_path / "predicted"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert len(compiled_models) == (2 if compiles else 1)
