"""CPU inference time per case: whole-cube vs sliding-window, at the quickstart size and at 128³.

For each setting it times the two inference paths of `brats_swap.run.inference` on random input
(time does not depend on the values): one pass over the whole cube, and MONAI's sliding window with
windows of about half the cube per axis, 50% overlap and Gaussian blending (what a patch model pays).
Prints a table and writes JSON.

    .venv/bin/python scripts/bench_infer.py [--out docs/benchmarks/bench_infer.json] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# (label, config file or None for the schema defaults = the paper's model, cube, window): the quickstart
# model at its cube, and the paper's model (16 base filters, IBM variant) at 128³. Windows are multiples
# of 16 (the 5-level U-Net halves the size four times).
SETTINGS = [("quickstart", REPO / "configs" / "quickstart.yaml", None, 32), ("paper 128³", None, 128, 64)]


def time_call(fn, repeats: int) -> float:
    fn()  # warm-up: oneDNN primitive creation, allocator
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs") / "benchmarks" / "bench_infer.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from brats_swap.atomic import atomic_write_json
    from brats_swap.config import load_config
    from brats_swap.model import build_model
    from brats_swap.run.inference import predict_full, predict_sliding_window

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    rows = []
    for label, config_file, cube, window in SETTINGS:
        config = load_config(config_file)
        cube = cube or config.data.cube[0]
        base_filters = config.model.base_filters
        torch.manual_seed(0)
        model = build_model(config.model).eval()
        image = torch.randn(1, config.model.in_channels, cube, cube, cube)
        roi = [window] * 3
        full_s = time_call(lambda: predict_full(model, image, device=device), args.repeats)  # noqa: B023
        window_s = time_call(lambda: predict_sliding_window(model, image, roi_size=roi, device=device,  # noqa: B023
                                                            overlap=0.5, blend="gaussian"), args.repeats)
        rows.append({"setting": label, "cube": cube, "base_filters": base_filters, "seg_layer": config.model.seg_layer,
                     "parameters": sum(p.numel() for p in model.parameters()), "sliding_window_roi": roi,
                     "overlap": 0.5, "full_volume_s": full_s, "sliding_window_s": window_s})

    table = Table(title=f"CPU inference time per case ({torch.get_num_threads()} threads)")
    for column in ("setting", "cube", "filters", "whole cube (s)", "sliding window (s)", "window"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["setting"], f"{row['cube']}³", str(row["base_filters"]), f"{row['full_volume_s']:.2f}",
                      f"{row['sliding_window_s']:.2f}", f"{row['sliding_window_roi'][0]}³ 50%")
    Console().print(table)
    record = {"device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
              "processor": platform.processor() or platform.machine(), "repeats": args.repeats, "results": rows}
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
