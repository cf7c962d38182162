"""`make demo`: phantoms -> prepared cache -> train fold 0 -> evaluate the held-out cases -> metric tables.

The held-out cases are scored twice: the BraTS 2017-2021 table (WT/TC/ET Dice, sensitivity, specificity,
HD95) and the official 2023+ lesion-wise table of the challenge's groups (panoptica, as the BraTS
evaluation configures it).

Runs on a laptop CPU in a few minutes with configs/quickstart.yaml (half-size phantoms resampled to a
small cube, a U-Net with 8 base filters). Every stage calls the package's own functions, the same ones
behind `brats-swap data synth|prepare`, `brats-swap train` and `brats-swap evaluate`.

Re-running is cheap: existing phantoms are kept, the cache only re-prepares what changed, and training
resumes from the run's checkpoint (a finished fold is not trained again). `--fresh` starts the run over.

    .venv/bin/python scripts/demo.py [--config configs/quickstart.yaml] [--run runs/quickstart] [--fresh]
                                     [--set key=value ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    parser.add_argument("--run", type=Path, default=None, help="run folder (default runs/<config name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, repeatable (e.g. --set train.max_epochs=4)")
    parser.add_argument("--fresh", action="store_true", help="delete the run folder first and train from scratch")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from brats_swap.process_env import configure_process

    configure_process()  # as the CLI sets its process up, before torch is imported
    from rich.console import Console

    from brats_swap.config import load_config
    from brats_swap.data.cache import list_prepared, prepare_dataset
    from brats_swap.data.phantom import synthesize_dataset
    from brats_swap.errors import BratsSwapError
    from brats_swap.evaluate.metrics import print_summary
    from brats_swap.evaluate.official import json_safe, print_official_summary, read_official_summary
    from brats_swap.evaluate.scoring import evaluate_fold
    from brats_swap.run.folder import RunFolder
    from brats_swap.train.loop import train_fold
    from brats_swap.train.summary import summary_panel

    console = Console()
    config = load_config(args.config, args.overrides)
    run_dir = args.run if args.run is not None else Path("runs") / config.name
    root, cache = Path(config.data.root), Path(config.data.cache)
    synth = config.data.synth
    timings: dict[str, float] = {}
    started = time.perf_counter()

    try:
        console.rule(f"[bold]1/4 phantoms[/] -> {root}")
        t = time.perf_counter()
        existing = sorted(p for p in root.glob("*/") if p.is_dir()) if root.is_dir() else []
        if len(existing) >= synth.cases:
            console.print(f"{len(existing)} cases already in {root}; skipping synthesis")
        else:
            ids = synthesize_dataset(root, synth.cases, synth.seed, edition=synth.edition, shape=tuple(synth.shape),
                                     progress=True)
            console.print(f"wrote {len(ids)} phantom cases of shape {tuple(synth.shape)} (edition {synth.edition})")
        timings["synth_s"] = time.perf_counter() - t

        console.rule(f"[bold]2/4 prepare[/] -> {cache} (cube {config.data.cube})")
        t = time.perf_counter()
        report = prepare_dataset(root, cache, config.data)
        console.print(f"{len(report.prepared)} prepared, {len(report.up_to_date)} up to date, "
                      f"{len(report.failed)} failed; {len(list_prepared(cache))} cases in the cache")
        timings["prepare_s"] = time.perf_counter() - t

        console.rule(f"[bold]3/4 train[/] fold 0 -> {run_dir}")
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        t = time.perf_counter()
        resume = RunFolder(run_dir).fold(0).latest.exists()  # a finished fold is not retrained
        result = train_fold(config, run_dir, 0, resume=resume)
        console.print(summary_panel(result, config))
        timings["train_s"] = time.perf_counter() - t

        console.rule("[bold]4/4 evaluate[/] the held-out cases of fold 0 on the original grid")
        t = time.perf_counter()
        summary = evaluate_fold(config, run_dir, 0)
        timings["evaluate_s"] = time.perf_counter() - t
    except BratsSwapError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise SystemExit(exc.exit_code) from None

    timings["total_s"] = time.perf_counter() - started
    print_summary(summary, console, title=f"{config.name}: held-out phantom cases, fold 0")
    groups, official = read_official_summary(RunFolder(run_dir).fold(0).root)
    print_official_summary(official, groups, console,
                           title=f"{config.name}: held-out phantom cases, official BraTS metrics (lesion-wise)")
    dice = {region: summary[f"dice_{region}"]["mean"] for region in ("wt", "tc", "et")}
    lesionwise_dice = {name.lower(): official[f"lesionwise_dsc_mean_{name.lower()}"]["mean"] for name in groups}
    console.print("time: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in timings.items()))
    record = {"config": str(args.config), "run": str(run_dir), "dice": dice, "lesionwise_dice": lesionwise_dice,
              "timings": timings, "epochs": result.epochs_completed, "best_epoch": result.best_epoch}
    from brats_swap.atomic import atomic_write_json

    atomic_write_json(run_dir / "demo.json", json_safe(record))  # a group without lesions: null, not NaN
    fold = RunFolder(run_dir).fold(0)
    console.print(f"report: {fold.summary_md} (per case: {fold.metrics_csv}, official: {fold.official_csv}); "
                  f"timings and means: {run_dir / 'demo.json'}", soft_wrap=True)
    return record


if __name__ == "__main__":  # the guard matters: `prepare` starts worker processes with spawn
    main(sys.argv[1:])
