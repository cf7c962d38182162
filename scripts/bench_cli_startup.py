"""CLI start-up: how long `--help`, `--version` and a config error take, and what the imports cost.

    .venv/bin/python scripts/bench_cli_startup.py                          # 7 rounds, this checkout
    .venv/bin/python scripts/bench_cli_startup.py --before /tmp/old_src    # and another version's source tree

Each case is `python -m brats_swap ARGS` in a fresh interpreter with this checkout first on PYTHONPATH (the
`brats-swap` console script runs the same `main`). The cases run round-robin, `--rounds` times, so a change
of the machine's load spreads over all of them; the table gives each case's median and fastest wall time,
next to `python -c pass` (the interpreter alone) and `python -c "import torch"` (what a command that imports
the training stack pays before it parses anything). `--before DIR` times the same cases with DIR (a source
tree holding `brats_swap/`, e.g. `git archive <commit> brats_swap | tar -x -C DIR`) in the same rounds: the
ratio is measured in one run. The load average before and after is recorded, since it moves the numbers.

The import-time breakdown is `python -X importtime -m brats_swap --help`: each module's own time, summed
per top-level package.

Goal (issue 44): `--help` and `COMMAND --help` under 1 s on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from brats_swap.atomic import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 1.0
# (label, arguments, expected exit code); {bad} is a config with an unknown key.
CASES: list[tuple[str, list[str], int]] = [
    ("--help", ["--help"], 0),
    ("train --help", ["train", "--help"], 0),
    ("plan --help", ["plan", "--help"], 0),
    ("cv run --help", ["cv", "run", "--help"], 0),
    ("--version", ["--version"], 0),
    ("config show: config error", ["config", "show", "--config", "{bad}"], 2),
    ("train: config error", ["train", "--config", "{bad}"], 2),
]
REFERENCES: list[tuple[str, list[str]]] = [
    ("python -c pass", ["-c", "pass"]),
    ('python -c "import torch"', ["-c", "import torch"]),
]


def _timed(argv: list[str], source: Path, expected: int | None) -> float:
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=env, cwd=source, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if expected is not None and done.returncode != expected:
        raise SystemExit(f"{' '.join(argv)} ({source}): exit {done.returncode}, expected {expected}:\n{done.stderr}")
    return seconds


def import_breakdown(source: Path, top: int) -> dict:
    """`-X importtime` of `--help`: each import's own time summed per top-level package (torch, typer,
    brats_swap, ...), the largest first; the parts add up to the whole import time."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "brats_swap", "--help"], env=env, cwd=source,
                          capture_output=True, text=True, check=False)
    per_package: dict[str, int] = {}
    modules = set()
    for line in done.stderr.splitlines():
        fields = line.split("|")
        if not line.startswith("import time:") or len(fields) != 3 or not fields[1].strip().isdigit():
            continue  # the header line
        own_us, name = int(fields[0].removeprefix("import time:")), fields[2].strip()
        modules.add(name)
        package = name.split(".")[0]
        per_package[package] = per_package.get(package, 0) + own_us
    largest = sorted(per_package.items(), key=lambda item: -item[1])
    return {"total_ms": sum(per_package.values()) / 1e3, "modules": len(modules),
            "top": [{"package": name, "ms": us / 1e3} for name, us in largest[:top]],
            "torch_imported": "torch" in modules}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another version's source tree (holding brats_swap/)")
    parser.add_argument("--top", type=int, default=8, help="imports shown in the breakdown")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/cli_startup.json")
    args = parser.parse_args(argv)
    sources = {"now": REPO, **({"before": args.before.resolve()} if args.before else {})}

    load_before = os.getloadavg()
    times: dict[str, dict[str, list[float]]] = {version: {} for version in sources}
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as tmp:
        bad = Path(tmp) / "bad.yaml"
        bad.write_text("train:\n  lrr: 0.01\n", encoding="utf-8")
        for _ in range(args.rounds):
            for label, case_args, expected in CASES:
                for version, source in sources.items():
                    argv_ = ["-m", "brats_swap", *(str(bad) if a == "{bad}" else a for a in case_args)]
                    times[version].setdefault(label, []).append(_timed(argv_, source, expected))
            for label, ref_args in REFERENCES:
                times["now"].setdefault(label, []).append(_timed(ref_args, REPO, 0))
    load_after = os.getloadavg()

    rows = []
    for label in [case[0] for case in CASES] + [ref[0] for ref in REFERENCES]:
        row = {"case": label, "median_s": statistics.median(times["now"][label]), "min_s": min(times["now"][label]),
               "all_s": times["now"][label]}
        if "before" in times and label in times["before"]:
            row["before_median_s"] = statistics.median(times["before"][label])
            row["speedup"] = row["before_median_s"] / row["median_s"]
        rows.append(row)
    helps = [row for row in rows if row["case"].endswith("--help")]
    result = {
        "rounds": args.rounds,
        "goal_s": GOAL_S,
        "help_median_max_s": max(row["median_s"] for row in helps),
        "meets_goal_at_this_load": all(row["median_s"] < GOAL_S for row in helps),
        "load_average_1_5_15_before": list(load_before),
        "load_average_1_5_15_after": list(load_after),
        "rows": rows,
        "imports_of_help": {version: import_breakdown(source, args.top) for version, source in sources.items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    _print(result, "before" in sources)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


def _print(result: dict, before: bool) -> None:
    console = Console()
    load = "/".join(f"{v:.2f}" for v in result["load_average_1_5_15_before"])
    table = Table(title=f"CLI start-up, median of {result['rounds']} (load average {load} on "
                        f"{result['machine']['cpus']} CPUs at the start)")
    table.add_column("case")
    table.add_column("median s", justify="right")
    table.add_column("fastest s", justify="right")
    if before:
        table.add_column("before s", justify="right")
        table.add_column("speed-up", justify="right")
    for row in result["rows"]:
        cells = [row["case"], f"{row['median_s']:.2f}", f"{row['min_s']:.2f}"]
        if before:
            cells += [f"{row['before_median_s']:.2f}", f"{row['speedup']:.1f}x"] if "speedup" in row else ["", ""]
        table.add_row(*cells)
    console.print(table)
    for version, imports in result["imports_of_help"].items():
        breakdown = Table(title=f"-X importtime of --help ({version}): {imports['total_ms']:.0f} ms in "
                                f"{imports['modules']} imports, torch {'imported' if imports['torch_imported'] else 'not imported'}")
        breakdown.add_column("package")
        breakdown.add_column("ms (its modules' own import time)", justify="right")
        for item in imports["top"]:
            breakdown.add_row(item["package"], f"{item['ms']:.0f}")
        console.print(breakdown)
    verdict = "meets" if result["meets_goal_at_this_load"] else "misses"
    console.print(f"slowest --help median {result['help_median_max_s']:.2f} s: {verdict} the goal of "
                  f"< {result['goal_s']:g} s at this load")


if __name__ == "__main__":
    main()
