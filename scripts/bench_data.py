"""Data-path throughput: decoding a case from NIfTI gz + preprocessing vs loading it from the prepared cache.

    .venv/bin/python scripts/bench_data.py                       # 240x240x155 -> 192^3, 5 repeats
    .venv/bin/python scripts/bench_data.py --shape 32 32 24 --cube 24 24 24 --repeats 1 --out /tmp/b.json

One phantom case (brats_swap.data.phantom, BraTS 2021 names, int16 images, gzip level 1) is written to a
temp folder; generating it is timed separately. Then, median over `--repeats`:

- decode: discover + `load_case` (nibabel, gunzip, validation) + `preprocess_case` (crop, z-score, resample);
- load:   `load_prepared(mmap=True)` + materialising image and label as torch tensors (one copy from the
          memory map). The file was just written, so this is the warm-page-cache case: what every epoch
          after the first sees when the cache fits in RAM.

Target (issue 2): load >= 10x faster than decode and < 100 ms at 240x240x155 -> 192^3.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from brats_swap.atomic import atomic_write_json
from brats_swap.config import DataConfig
from brats_swap.data.cache import list_prepared, load_prepared, prepare_dataset
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.data.preprocess import preprocess_case, preprocess_settings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[240, 240, 155], help="phantom volume X Y Z")
    parser.add_argument("--cube", type=int, nargs=3, default=[192, 192, 192], help="prepared cube D H W")
    parser.add_argument("--fit", choices=["resample", "pad_crop"], default="resample")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16", help="cache dtype")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_data.json"))
    args = parser.parse_args(argv)

    data_cfg = DataConfig(cube=list(args.cube), fit=args.fit, cache_dtype=args.dtype, prepare_workers=1)
    settings = preprocess_settings(data_cfg)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        root, cache = Path(tmp) / "raw", Path(tmp) / "cache"
        started = time.perf_counter()
        synthesize_dataset(root, cases=1, seed=args.seed, edition="2021", shape=tuple(args.shape))
        synth_s = time.perf_counter() - started
        source_bytes = sum(f.stat().st_size for f in root.rglob("*.nii.gz"))

        decode_times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            (case,) = discover_cases(root)
            image, label, _ = preprocess_case(load_case(case), settings)
            decode_times.append(time.perf_counter() - started)

        prepare_dataset(root, cache, data_cfg, workers=1, progress=False)
        (case_id,) = list_prepared(cache)
        cache_bytes = sum(f.stat().st_size for f in (cache / case_id).iterdir())
        load_times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            prepared = load_prepared(cache, case_id, mmap=True)
            image_t = torch.from_numpy(np.array(prepared.image))
            label_t = torch.from_numpy(np.array(prepared.label))
            load_times.append(time.perf_counter() - started)
        assert tuple(image_t.shape[1:]) == tuple(args.cube) and tuple(label_t.shape) == tuple(args.cube)

    decode_s = statistics.median(decode_times)
    load_s = statistics.median(load_times)
    result = {
        "shape": list(args.shape),
        "cube": list(args.cube),
        "fit": args.fit,
        "cache_dtype": args.dtype,
        "repeats": args.repeats,
        "synth_seconds": synth_s,
        "decode_preprocess_seconds": decode_s,
        "decode_preprocess_all": decode_times,
        "cache_load_seconds": load_s,
        "cache_load_all": load_times,
        "speedup": decode_s / load_s,
        "source_bytes": source_bytes,
        "cache_bytes": cache_bytes,
        "targets": {"speedup_at_least": 10, "cache_load_below_s": 0.1},
        "meets_targets": bool(decode_s / load_s >= 10 and load_s < 0.1),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
    }

    table = Table(title=f"data path: {'x'.join(map(str, args.shape))} -> {'x'.join(map(str, args.cube))} "
                        f"({args.fit}, {args.dtype}), median of {args.repeats}")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    table.add_column("MB on disk", justify="right")
    table.add_row("synthesize phantom (once)", f"{synth_s:.3f}", "")
    table.add_row("decode NIfTI gz + preprocess", f"{decode_s:.3f}", f"{source_bytes / 1e6:.1f}")
    table.add_row("load prepared (mmap -> tensor)", f"{load_s:.4f}", f"{cache_bytes / 1e6:.1f}")
    table.add_row("speed-up", f"{decode_s / load_s:.1f}x", "")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
