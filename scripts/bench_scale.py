"""A dataset at full size: `data check`, `data prepare` and the training loader per case on N real-geometry
phantoms, the cache's bytes per case, peak memory, and what that makes for 1,251 and 2,500 cases.

    .venv/bin/python scripts/bench_scale.py --cases 50                     # docs/benchmarks/scale_50.{json,md}
    .venv/bin/python scripts/bench_scale.py --cases 2 --shape 64 64 48 --cube 48 48 48 --patch 32 32 32 --out /tmp/s

N phantoms (brats_swap.data.phantom: BraTS 2021 names, int16, gzip, 1 mm) are written to a temp folder, then:

- check, prepare: `check_dataset` / `prepare_dataset` with `--workers` processes (default auto: every CPU this
  process may use); wall seconds, and the CPU seconds of the worker processes per case (what a case costs
  whatever the number of cores);
- bytes: the source files and the cache entries per case; the format-1 entry (the whole cube as `.npy`) beside;
- loader: one DataLoader worker's job per sample (`CubeDataset` + the loaders' collate, the nnunet recipe's
  draws and foreground rule) in this process on one thread: CPU seconds per sample in whole-volume mode (the
  cube) and patch mode (`--patch`, nnU-Net's enlarged crop around it), goal <= 0.10 s, with each batch
  copied as it arrives, as training does (pinned on a GPU, copied out on the CPU: the worker reuses its
  shared-memory slots), and into fresh shared memory (a worker whose slots are all still held); and the
  same job in a real DataLoader worker process, from its resource usage (its start and hand-over included),
  with the main process's copy of each batch beside;
- cold read: a whole case read after its files were dropped from the page cache (posix_fadvise DONTNEED),
  format 2 (`load_prepared`) against format 1 (`np.load` of the cube's `.npy`), median over `--cold` cases;
- peak memory: the largest resident set of this process and of any worker process.

The extrapolation to 1,251 and 2,500 cases on 2 and 16 cores divides the measured CPU seconds per case by
the cores (check and prepare are one process per core and share nothing). The machine's load average is
recorded: other jobs sharing the cores make every wall time longer than the CPU seconds say.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config import DataConfig
from brats_swap.data.cache import list_prepared, load_prepared, prepare_dataset
from brats_swap.data.check import check_dataset
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.data.workers import available_cpus, resolve_workers
from brats_swap.train.data import CubeDataset, EpochSampler, SampleKey, loader_collate, stacked
from brats_swap.train.shared_batches import free_slot

GOAL_LOADER_S = 0.10
GOAL_BYTES_PER_CASE = 25e6
EXTRAPOLATE_CASES = (1251, 2500)
EXTRAPOLATE_CORES = (2, 16)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--shape", type=int, nargs=3, default=[240, 240, 155], help="phantom volume X Y Z")
    parser.add_argument("--cube", type=int, nargs=3, default=[192, 192, 192], help="prepared cube D H W")
    parser.add_argument("--patch", type=int, nargs=3, default=[128, 128, 128], help="patch-mode sample")
    parser.add_argument("--fit", choices=["resample", "pad_crop"], default="resample")
    parser.add_argument("--workers", default="auto", help="processes of check and prepare (a number or auto)")
    parser.add_argument("--samples", type=int, default=20, help="loader samples per mode")
    parser.add_argument("--cold", type=int, default=5, help="cases read cold per format")
    parser.add_argument("--out", type=Path, default=None, help="output stem (default docs/benchmarks/scale_N)")
    parser.add_argument("--phantoms", type=Path, default=None,
                        help="keep the phantoms in this folder and reuse them when it holds N cases (default: temp)")
    args = parser.parse_args(argv)
    out = args.out or Path(f"docs/benchmarks/scale_{args.cases}")
    torch.set_num_threads(1)
    workers = resolve_workers(args.workers if args.workers == "auto" else int(args.workers))
    data_cfg = DataConfig(cube=list(args.cube), fit=args.fit, prepare_workers=workers)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        root, cache = args.phantoms or Path(tmp) / "raw", Path(tmp) / "cache"
        reuse = root.is_dir() and len([p for p in root.iterdir() if p.is_dir()]) == args.cases
        synth_s = None if reuse else synthesize(root, args.cases, tuple(args.shape), workers)
        check = timed_in_workers(lambda: check_dataset(root, data_cfg.edition, data_cfg.modalities, progress=False,
                                                       workers=workers))
        prepare = timed_in_workers(lambda: prepare_dataset(root, cache, data_cfg, workers=workers, progress=False))
        ids = list_prepared(cache)
        os.sync()  # the kernel's writeback of the cache just written would otherwise share the cores with the loader
        loader = {reuse: {"whole": loader_cpu_seconds(cache, ids, None, args.samples, reuse=reuse),
                          "patch": loader_cpu_seconds(cache, ids, tuple(args.patch), args.samples, reuse=reuse)}
                  for reuse in (True, False)}
        in_worker = {reuse: {"whole": worker_process_cpu_seconds(cache, ids, None, args.samples, reuse=reuse),
                             "patch": worker_process_cpu_seconds(cache, ids, tuple(args.patch), args.samples,
                                                                 reuse=reuse)}
                     for reuse in (True, False)}
        cold = cold_reads(cache, ids[: args.cold], Path(tmp) / "format1")
        source_bytes = sum(f.stat().st_size for f in root.rglob("*.nii.gz")) / args.cases
        cache_bytes = sum(f.stat().st_size for case in ids for f in (cache / case).iterdir()) / len(ids)
    result = {
        "cases": args.cases, "shape": args.shape, "cube": args.cube, "patch": args.patch, "fit": args.fit,
        "workers": workers, "synth_seconds": synth_s,
        "check": {"wall_seconds": check["wall"], "cpu_seconds_per_case": check["cpu"] / args.cases,
                  "bad_cases": sum(not r.ok for r in check["value"])},
        "prepare": {"wall_seconds": prepare["wall"], "cpu_seconds_per_case": prepare["cpu"] / args.cases,
                    "prepared": len(prepare["value"].prepared), "failed": len(prepare["value"].failed)},
        "bytes_per_case": {"source": source_bytes, "cache": cache_bytes, "cache_format1": cold["format1_bytes"]},
        "loader_cpu_seconds_per_sample": {mode: statistics.median(t) for mode, t in loader[True].items()},
        "loader_fresh_memory_cpu_seconds_per_sample": {mode: statistics.median(t)
                                                       for mode, t in loader[False].items()},
        "loader_all": {"slots": loader[True], "fresh": loader[False]},
        "loader_worker_process_cpu_seconds_per_sample": {
            kind: {mode: measured["worker"] for mode, measured in in_worker[reuse].items()}
            for kind, reuse in (("slots", True), ("fresh", False))},
        "copy_out_cpu_seconds_per_sample": {mode: measured["copy"] for mode, measured in in_worker[True].items()},
        "cold_read_seconds": {"format2": cold["format2"], "format1": cold["format1"]},
        "whole_case_into_batch_cpu_seconds": {"format2": cold["batch_format2"], "format1": cold["batch_format1"]},
        "peak_rss_bytes": {"main": _rss(resource.RUSAGE_SELF), "largest_worker": _rss(resource.RUSAGE_CHILDREN)},
        "goals": {"cache_bytes_per_case_at_most": GOAL_BYTES_PER_CASE, "loader_cpu_seconds_at_most": GOAL_LOADER_S},
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": {"cpus_available": available_cpus(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__},
    }
    result["extrapolation"] = extrapolate(result)
    markdown = markdown_table(result)
    Console().print(markdown, markup=False, highlight=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), result)
    atomic_write_text(out.with_suffix(".md"), markdown)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return result


def synthesize(root: Path, cases: int, shape: tuple[int, ...], workers: int) -> float:
    """Write the phantoms in `workers` processes (one id range each); wall seconds."""
    started = time.perf_counter()
    share = -(-cases // workers)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        jobs = [pool.submit(synthesize_dataset, root, min(share, cases - start), 0, "2021", shape, False, start)
                for start in range(0, cases, share)]
        for job in jobs:
            job.result()
    return time.perf_counter() - started


def timed_in_workers(work) -> dict:
    """Wall seconds of `work()` and the CPU seconds it spent, its worker processes included (they have ended
    and been waited for when `work` returns, so RUSAGE_CHILDREN counts them)."""
    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    cpu_before, started = cpu(), time.perf_counter()
    value = work()
    return {"wall": time.perf_counter() - started, "cpu": cpu() - cpu_before, "value": value}


def loader_cpu_seconds(cache: Path, ids: list[str], patch: tuple[int, ...] | None, samples: int, *, reuse: bool
                       ) -> list[float]:
    """CPU seconds of one loader worker's job per sample (read, crop, draw, collate) on one thread, its batch
    in shared memory as a DataLoader worker makes it (`collate_samples` asks `get_worker_info`, answered here
    as in a worker). `reuse`: as in training, the worker reuses its slots, each freed after the sample as the
    main process frees it once it has copied the batch (`LoaderBatch.copied`); otherwise each batch is fresh
    shared memory, whose first-touch page faults are part of the cost."""
    import brats_swap.train.data as train_data

    dataset = CubeDataset(cache, ids, crop=patch, augment="nnunet", seed=0, foreground="nnunet", batch_size=2,
                          channels=4)
    collate = loader_collate(reuse_slots=reuse)
    times = []
    worker_info, train_data.get_worker_info = train_data.get_worker_info, lambda: "bench: as in a worker"
    try:
        for position in range(samples):
            started = time.process_time()
            batch = collate([dataset[SampleKey(0, position, position % len(dataset))]])
            times.append(time.process_time() - started)
            if batch.in_slot:
                free_slot(batch.image)
    finally:
        train_data.get_worker_info = worker_info
    return times


def worker_process_cpu_seconds(cache: Path, ids: list[str], patch: tuple[int, ...] | None, samples: int, *,
                               reuse: bool) -> dict[str, float]:
    """CPU seconds per sample of a real DataLoader worker process, everything it does included (start, read,
    collate, hand-over), from its resource usage once the loader has joined it: one worker, one sample per
    batch, one batch ahead. `reuse`: this process copies each batch out of its slot as it arrives and frees
    it, as training does on the CPU (on a GPU the pin thread's copy into pinned memory); `copy`: the CPU
    seconds of that copy per sample, in this process."""
    dataset = CubeDataset(cache, ids, crop=patch, augment="nnunet", seed=0, foreground="nnunet", batch_size=2,
                          channels=4)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=EpochSampler(len(dataset), samples, 0),
                                         num_workers=1, prefetch_factor=1, collate_fn=loader_collate(reuse_slots=reuse))
    before, copying = resource.getrusage(resource.RUSAGE_CHILDREN), 0.0
    for batch in loader:  # exhausted, the pass joins its worker: RUSAGE_CHILDREN then counts it
        if reuse:
            started = time.process_time()
            batch.copied(torch.Tensor.clone)
            copying += time.process_time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"worker": (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / samples,
            "copy": copying / samples}


def cold_reads(cache: Path, ids: list[str], old: Path) -> dict:
    """Wall seconds of reading a whole case whose files are not in the page cache: format 2 against the
    format-1 `.npy` of the same cube (written here), and format 1's bytes per case. Also, warm, the CPU
    seconds of what a loader worker does with a whole case of each format: read it into a fresh batch tensor
    (`stacked`; format 1 was a memory map that `np.stack` copied)."""
    format2, format1, old_bytes, batch2, batch1 = [], [], [], [], []
    for case_id in ids:
        whole = load_prepared(cache, case_id, mmap=False)
        folder = old / case_id
        folder.mkdir(parents=True)
        np.save(folder / "image.npy", whole.image)
        np.save(folder / "label.npy", whole.label)
        old_bytes.append(sum(f.stat().st_size for f in folder.iterdir()))
        _drop_from_page_cache(cache / case_id)
        started = time.perf_counter()
        prepared = load_prepared(cache, case_id, mmap=True)
        np.asarray(prepared.image), np.asarray(prepared.label)
        format2.append(time.perf_counter() - started)
        _drop_from_page_cache(folder)
        started = time.perf_counter()
        np.array(np.load(folder / "image.npy", mmap_mode="r")), np.array(np.load(folder / "label.npy", mmap_mode="r"))
        format1.append(time.perf_counter() - started)
        for _ in range(3):
            started = time.process_time()
            prepared = load_prepared(cache, case_id, mmap=True)
            stacked([prepared.image]), stacked([prepared.label])
            batch2.append(time.process_time() - started)
            started = time.process_time()
            stacked([np.load(folder / "image.npy", mmap_mode="r")]), stacked([np.load(folder / "label.npy", mmap_mode="r")])
            batch1.append(time.process_time() - started)
    return {"format2": statistics.median(format2), "format1": statistics.median(format1),
            "format1_bytes": statistics.mean(old_bytes), "batch_format2": statistics.median(batch2),
            "batch_format1": statistics.median(batch1)}


def _drop_from_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rss(who: int) -> int:
    return resource.getrusage(who).ru_maxrss * 1024  # Linux reports KiB


def extrapolate(result: dict) -> list[dict]:
    rows = []
    for cases in EXTRAPOLATE_CASES:
        for cores in EXTRAPOLATE_CORES:
            rows.append({"cases": cases, "cores": cores,
                         "check_minutes": result["check"]["cpu_seconds_per_case"] * cases / cores / 60,
                         "prepare_minutes": result["prepare"]["cpu_seconds_per_case"] * cases / cores / 60,
                         "cache_gb": result["bytes_per_case"]["cache"] * cases / 1e9,
                         "cache_gb_format1": result["bytes_per_case"]["cache_format1"] * cases / 1e9})
    return rows


def markdown_table(result: dict) -> str:
    shape, cube = "×".join(map(str, result["shape"])), "×".join(map(str, result["cube"]))
    loader, cold, bytes_ = result["loader_cpu_seconds_per_sample"], result["cold_read_seconds"], result["bytes_per_case"]
    fresh, patch = result["loader_fresh_memory_cpu_seconds_per_sample"], "×".join(map(str, result["patch"]))
    process, copy = result["loader_worker_process_cpu_seconds_per_sample"], result["copy_out_cpu_seconds_per_sample"]
    lines = [
        f"{result['cases']} phantoms {shape} → {cube} ({result['fit']}, float16), {result['workers']} worker processes "
        f"on {result['machine']['cpus_available']} available CPUs; load average before/after "
        f"{result['load_average']['before'][0]:.1f}/{result['load_average']['after'][0]:.1f}",
        "",
        "| measure | value |",
        "|---|---|",
        f"| check: CPU s per case (wall for all) | {result['check']['cpu_seconds_per_case']:.2f} "
        f"({result['check']['wall_seconds']:.0f} s) |",
        f"| prepare: CPU s per case (wall for all) | {result['prepare']['cpu_seconds_per_case']:.2f} "
        f"({result['prepare']['wall_seconds']:.0f} s) |",
        f"| source MB per case | {bytes_['source'] / 1e6:.1f} |",
        f"| cache MB per case (format 2; goal ≤ 25) | {bytes_['cache'] / 1e6:.1f} |",
        f"| cache MB per case, format 1 (whole cube `.npy`) | {bytes_['cache_format1'] / 1e6:.1f} |",
        f"| loader CPU s per sample, whole {cube}, slots reused (goal ≤ 0.10) | {loader['whole']:.3f} |",
        f"| loader CPU s per sample, patch {patch}, slots reused (goal ≤ 0.10) | {loader['patch']:.3f} |",
        f"| loader CPU s per sample, whole / patch, fresh shared memory (no free slot) | "
        f"{fresh['whole']:.3f} / {fresh['patch']:.3f} |",
        f"| a DataLoader worker process's CPU s per sample, whole / patch: slots reused | "
        f"{process['slots']['whole']:.3f} / {process['slots']['patch']:.3f} |",
        f"| a DataLoader worker process's CPU s per sample, whole / patch: fresh shared memory | "
        f"{process['fresh']['whole']:.3f} / {process['fresh']['patch']:.3f} |",
        f"| the main process's copy out of the slot, CPU s per sample, whole / patch | "
        f"{copy['whole']:.3f} / {copy['patch']:.3f} |",
        f"| whole case into a batch tensor, CPU s: format 2 / format 1 | "
        f"{result['whole_case_into_batch_cpu_seconds']['format2']:.3f} / "
        f"{result['whole_case_into_batch_cpu_seconds']['format1']:.3f} |",
        f"| \"cold\" read of a whole case, wall s: format 2 / format 1 | {cold['format2']:.3f} / {cold['format1']:.3f} |",
        f"| peak RSS: main process / largest worker (GB) | {result['peak_rss_bytes']['main'] / 1e9:.2f} / "
        f"{result['peak_rss_bytes']['largest_worker'] / 1e9:.2f} |",
        "",
        "| cases | cores | check (min) | prepare (min) | cache (GB) | format-1 cache (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["extrapolation"]:
        lines.append(f"| {row['cases']:,} | {row['cores']} | {row['check_minutes']:.1f} | {row['prepare_minutes']:.1f} "
                     f"| {row['cache_gb']:.1f} | {row['cache_gb_format1']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
