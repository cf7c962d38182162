"""What compiling costs each fold of a `cv` run with `train.compile: true`, on the CPU: the first fold against
the later ones, in the same process and in a new one.

For each network, three `brats-swap cv run` processes in a fresh run folder, with an empty per-user cache
(`XDG_CACHE_HOME` points at a new folder, so the compiler's cache is the one `train.compile` uses by default,
`<XDG_CACHE_HOME>/brats-swap/inductor`):

1. `--folds 0`: the first fold, compiling from the empty cache (a new machine, a new torch);
2. `--folds 1`: a later fold in a new process, which loads what fold 0 compiled (a SLURM array task, a
   `--parallel-folds` worker, a `--resume`, a cron job's next call);
3. `--folds 2,3`: fold 2 again from the cache, then fold 3 in the same process (sequential `cv run`).

Each fold's compile seconds are the `compile.compile_seconds` of its own `fold_<k>/env.json` (what dynamo and
inductor spent during its training steps and validations; torch imports the compiler's modules the first
time it compiles, which every new process pays and is counted). A table on stdout, the rows as JSON.

    OMP_NUM_THREADS=1 python scripts/bench_compile_folds.py --cube 64 --json docs/benchmarks/bench_compile_folds.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile import NETWORKS, network_overrides, write_record  # noqa: E402  (the compiled-step table's)


def model_keys(network: str, filters: int) -> dict:
    """`bench_compile.network_overrides` as the `model:` mapping of a config file."""
    pairs = (item.split("=", 1) for item in network_overrides(network, filters))
    return {key.removeprefix("model."): yaml.safe_load(value) for key, value in pairs}


def config_for(network: str, root: Path, cube: int, filters: int, cases: int) -> dict:
    """A tiny cv run: `cases` phantoms, 4 folds, one epoch of two steps and a validation, compiled."""
    return {"name": f"compile-folds-{network}", "seed": 0,
            "data": {"root": str(root / "phantoms"), "cache": str(root / "cache"), "cube": [cube] * 3,
                     "loader_workers": 0,
                     "synth": {"cases": cases, "seed": 0, "edition": "2021", "shape": [cube + 8, cube + 8, cube]}},
            "model": model_keys(network, filters),
            "train": {"mode": "full", "max_epochs": 1, "steps_per_epoch": 2, "val_every": 1, "device": "cpu",
                      "compile": True},
            "evaluate": {"hd95": False},
            "cv": {"folds": 4}}


def brats_swap(args: list[str], env: dict) -> float:
    """Run the CLI in a new process; its wall seconds. A failure ends the benchmark with the command's last lines."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "brats_swap", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-5:])
        raise SystemExit(f"brats-swap {' '.join(args)}: exit {done.returncode}\n{tail}")
    return time.perf_counter() - started


def fold_compile_seconds(fold: Path) -> float:
    """The compile seconds in a fold's env.json; a fold whose steps fell back to eager ends the benchmark."""
    path = fold / "env.json"
    record = json.loads(path.read_text(encoding="utf-8"))["compile"]
    if not record["compiled"]:
        raise SystemExit(f"{path}: the step did not run compiled ({record.get('fallback')})")
    return float(record["compile_seconds"])


def bench(network: str, scratch: Path, args) -> dict:
    root = scratch / network
    root.mkdir()
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(config_for(network, root, args.cube, args.filters, args.cases)))
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "xdg")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the per-user default, as a user has it
    brats_swap(["data", "synth", "--config", str(config)], env)
    brats_swap(["data", "prepare", "--config", str(config)], env)
    run = root / "run"
    walls = {}
    for label, folds in (("first", "0"), ("new_process", "1"), ("sequential", "2,3")):
        walls[label] = brats_swap(["cv", "run", "--config", str(config), "--run", str(run), "--folds", folds], env)
    seconds = [fold_compile_seconds(run / f"fold_{k}") for k in range(4)]
    cache_bytes = sum(p.stat().st_size for p in (root / "xdg").rglob("*") if p.is_file())
    row = {"network": network, "cube": args.cube, "filters": args.filters,
           "first_fold_s": round(seconds[0], 2),  # fold 0, empty cache
           "new_process_fold_s": round(seconds[1], 2),  # fold 1, its own process
           "new_process_fold_2_s": round(seconds[2], 2),  # fold 2, first in its process
           "sequential_fold_s": round(seconds[3], 2),  # fold 3, after fold 2 in the same process
           "speedup_new_process": round(seconds[0] / max(seconds[1], 1e-9), 1),
           "process_wall_s": {k: round(v, 1) for k, v in walls.items()},
           "cache_mib": round(cache_bytes / 2**20, 1)}
    print(f"{network:12} {row['first_fold_s']:9.1f} {row['new_process_fold_s']:12.1f} "
          f"{row['speedup_new_process']:6.1f}x {row['sequential_fold_s']:11.2f} {row['cache_mib']:9.1f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--cube", type=int, default=64)
    parser.add_argument("--filters", type=int, default=4)
    parser.add_argument("--cases", type=int, default=8, help="phantoms (4 folds: 6 train and 2 validation each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    print(f"{'network':12} {'fold 0 s':>9} {'new proc. s':>12} {'ratio':>7} {'same proc. s':>11} {'cache MiB':>9}")
    with tempfile.TemporaryDirectory(prefix="bench-compile-folds-") as scratch:
        rows = [bench(network, Path(scratch), args) for network in args.networks]
    write_record(args, {"torch": torch.__version__, "load_average": os.getloadavg(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
