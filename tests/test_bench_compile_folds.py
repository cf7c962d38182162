"""scripts/bench_compile_folds.py: its run configs are valid for both networks and it reads what a fold compiled from the fold's env.json
(the timings themselves are the benchmark's; a run of it compiles for minutes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from brats_swap.config import load_config

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_compile_folds.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_compile_folds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("network", ["isensee2017", "nnunet"])
def test_the_runs_config_loads_compiled_with_four_folds(script, tmp_path, network):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(script.config_for(network, tmp_path, 32, 4, 8)))
    config = load_config(path)
    assert config.model.name == network and config.train.compile is True and config.cv.folds == 4
    assert list(config.data.cube) == [32, 32, 32] and config.train.max_epochs == 1


def test_a_fold_that_fell_back_to_eager_stops_the_benchmark(script, tmp_path):
    (tmp_path / "env.json").write_text(json.dumps(
        {"compile": {"setting": True, "compiled": False, "compile_seconds": 0.0, "fallback": "no C compiler"}}))
    with pytest.raises(SystemExit, match="did not run compiled .no C compiler"):
        script.fold_compile_seconds(tmp_path)
    (tmp_path / "env.json").write_text(json.dumps(
        {"compile": {"setting": True, "compiled": True, "compile_seconds": 8.144, "fallback": None}}))
    assert script.fold_compile_seconds(tmp_path) == pytest.approx(8.144)
