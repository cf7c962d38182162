"""The demo script and the shipped configs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from brats_swap.config import load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["quickstart", "default"])
def test_shipped_configs_load_and_validate(name):
    config = load_config(REPO / "configs" / f"{name}.yaml")
    assert config.name == name


def test_quickstart_holds_out_a_fifth_of_the_phantoms():
    config = load_config(REPO / "configs" / "quickstart.yaml")
    held_out = config.data.synth.cases // config.cv.folds
    assert held_out >= 4  # enough held-out cases for a meaningful mean Dice
    assert config.train.device == "cpu" and config.model.base_filters < 16


def test_demo_runs_synth_prepare_train_evaluate(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    monkeypatch.chdir(tmp_path)
    overrides = ["data.synth.cases=4", "data.synth.shape=[40,40,32]", "data.cube=[32,32,32]", "data.prepare_workers=1",
                 "data.loader_workers=0", "model.base_filters=4", "train.max_epochs=1", "train.steps_per_epoch=1",
                 "cv.folds=2", "evaluate.hd95=false", "data.root=phantoms", "data.cache=cache"]
    record = demo.main([arg for o in overrides for arg in ("--set", o)] + ["--run", "run"])
    assert set(record["dice"]) == {"wt", "tc", "et"} and all(0.0 <= d <= 1.0 for d in record["dice"].values())
    assert json.loads((tmp_path / "run" / "demo.json").read_text())["epochs"] == 1
    assert (tmp_path / "run" / "fold_0" / "metrics.csv").exists()
    # It says where its report went (issue 54, point 6).
    said = " ".join(capsys.readouterr().out.split())
    assert f"report: {Path('run') / 'fold_0' / 'summary.md'} (per case: {Path('run') / 'fold_0' / 'metrics.csv'}" in said
    # Re-running skips synthesis and preparation and does not train a finished fold again.
    again = demo.main([arg for o in overrides for arg in ("--set", o)] + ["--run", "run"])
    assert again["dice"] == record["dice"]
