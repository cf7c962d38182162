"""Help, --version and config errors answer without importing the training stack (issue 44, point 8).

Behaviour, not time: each case runs `python -m brats_swap` (its `__main__`, as the console script does) in a
fresh interpreter and names the heavy packages it imported. How long it takes is measured by
scripts/bench_cli_startup.py (docs/benchmarks.md), never here.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest
from cli_helpers import command_paths

# What makes the CLI slow to start: torch and what comes with it, MONAI, nibabel, scipy, matplotlib.
TRAINING_STACK = ("torch", "monai", "nibabel", "scipy", "matplotlib", "dynamic_network_architectures")

# Runs each command line of argv's JSON as `python -m brats_swap ...` in this one interpreter, and prints, per
# command line, its exit code and the heavy packages that appeared during it (a package loaded by an earlier
# line is charged to that line, whose own check fails).
_PROBE = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    heavy = json.loads(sys.argv[2])
    results = []
    for argv in json.loads(sys.argv[1]):
        before = {name for name in heavy if name in sys.modules}
        sys.argv = ["brats-swap", *argv]
        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_module("brats_swap", run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        loaded = sorted(name for name in heavy if name in sys.modules and name not in before)
        results.append({"argv": argv, "code": code, "loaded": loaded, "stdout": out.getvalue(),
                        "stderr": err.getvalue()})
    print(json.dumps(results))
""")


def _run(command_lines: list[list[str]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(command_lines), json.dumps(TRAINING_STACK)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_and_version_import_none_of_the_training_stack():
    paths = command_paths()
    assert {"train", "plan", "train-challenge", "container", "cv run", "config show"} <= {" ".join(p) for p in paths}
    lines = [["--help"], ["--version"], *([*path, "--help"] for path in paths)]
    results = _run(lines)
    assert [r["code"] for r in results] == [0] * len(lines), [(r["argv"], r["stderr"]) for r in results if r["code"]]
    assert results[0]["stdout"].count("train") >= 1 and results[1]["stdout"].startswith("brats-swap ")
    assert all("Usage:" in r["stdout"] for r in results[2:])
    assert {" ".join(r["argv"]): r["loaded"] for r in results if r["loaded"]} == {}

    # The guard of the check itself: a command that goes past its options imports the stack, and the probe
    # sees it (`evaluate` loads its metrics before it finds that the run folder is missing).
    assert "torch" in _run([["evaluate", "--run", "no-such-run"]])[0]["loaded"]


@pytest.mark.parametrize("command", [
    ["config", "show"],
    ["train"],
    ["plan"],
    ["cv", "run"],
    ["cv", "summary"],
    ["compare", "--patch"],
    ["data", "check"],
    ["data", "prepare"],
])
def test_a_config_error_is_reported_before_the_training_stack_loads(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 0.01\n", encoding="utf-8")
    typo, missing, bad_value = _run([[*command, "--config", str(bad)],
                                     [*command, "--config", str(tmp_path / "missing.yaml")],
                                     [*command, "--set", "train.lr=fast"]])
    assert "unknown config key 'train.lrr'" in typo["stderr"]
    assert "config file not found" in missing["stderr"]
    assert "train.lr: expected a number" in bad_value["stderr"]
    for result in (typo, missing, bad_value):
        assert result["code"] == 2 and result["stderr"].startswith("error: "), result
        assert result["loaded"] == [], result


def test_a_config_error_in_a_runs_own_config_is_reported_before_the_training_stack_loads(tmp_path):
    """`train --resume --run R` and `cv run --run R` read R/config.yaml (cv/run_config.py) first."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  lrr: 0.01\n", encoding="utf-8")
    for result in _run([["train", "--resume", "--run", str(run)], ["cv", "run", "--run", str(run)]]):
        assert result["code"] == 2 and "unknown config key 'train.lrr'" in result["stderr"], result
        assert result["loaded"] == [], result


def test_the_environment_record_names_monais_version_without_importing_it():
    # A run whose network and loss are our own never needs MONAI; reading its version for env.json once imported
    # all of it (2.5 s of CPU per training process).
    probe = textwrap.dedent("""
        import json, sys, torch
        from brats_swap.run.environment import environment_record
        record = environment_record(torch.device("cpu"))
        print(json.dumps({"monai": record["monai"], "imported": "monai" in sys.modules}))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] is False
    assert result["monai"] == importlib.metadata.version("monai")
