"""The prepared-case cache: `brats-swap data prepare` writes it, training reads it.

Layout (stable, documented in docs/data.md):

    CACHE/index.json                 settings + the prepared cases of the last `prepare` (+ failures)
    CACHE/<case_id>/image.npy        (C, D, H, W) float16/float32 (`data.cache_dtype`), memory-mappable
    CACHE/<case_id>/label.npy        (D, H, W) uint8, raw label values of meta["edition"]'s table (absent: no seg)
    CACHE/<case_id>/meta.json        what `to_original_grid` needs + sources' fingerprints + settings

`prepare_missing(data_cfg)` is what train/cv/compare call: it prepares whatever cases of `data.root` the
cache lacks (or holds stale) before they read it, so one command goes from a download to a run.

Incremental: a case is redone only if its source files changed (name, size, mtime) or the preprocessing
settings did. Atomic: each case is written into `CACHE/.tmp-<case>-<pid>-<nonce>/` and renamed into place,
so an interrupted run leaves either the old complete entry or the new one; a later run deletes temp
folders whose writer process is gone.

Case ids come from someone else's files (a dataset.json's keys, file names), so the cache touches only what
it wrote: an entry's folder is `brats_swap.names.path_inside` the cache (a checked name, resolved inside
it), and it is replaced or removed only when it is a real folder (not a link) whose meta.json is the
cache's own (its `case_id` is the folder's name; it holds the sources and settings). Temp folders are
deleted only when their whole name is the one `write_entry` gives them. A folder of the same name that the
cache did not write is never replaced (CacheWriteError) nor removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import Progress

from brats_swap import stop_signals
from brats_swap.atomic import atomic_save_npy, atomic_write_json, remove_stale_temp_files
from brats_swap.data.discovery import Case, discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.data.preprocess import describe_cropped, preprocess_case, preprocess_settings
from brats_swap.errors import DataError, case_problem
from brats_swap.names import name_problem, path_inside
from brats_swap.progress import progress_bar

INDEX_FILE = "index.json"
META_FILE = "meta.json"
IMAGE_FILE = "image.npy"
LABEL_FILE = "label.npy"
CACHE_FORMAT = 1
INDEX_WRITE_SECONDS = 2.0
# What `write_entry` and `_remove_entry` name their temp folders: .tmp-<case id>-<pid>-<nonce> (being
# written) and .old-<case id>-<pid>-<nonce> (an entry being replaced or removed).
_TEMP_FOLDER = re.compile(r"\.(?:tmp|old)-(?P<case>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


@dataclass
class PreparedCase:
    case_id: str
    image: np.ndarray  # (C, D, H, W) float16/float32; a read-only memory map when loaded with mmap=True
    label: np.ndarray | None  # (D, H, W) uint8, raw label values of meta["edition"]
    meta: dict[str, Any]


@dataclass
class PrepareReport:
    cache: Path
    prepared: list[str] = field(default_factory=list)  # (re)written by this run
    up_to_date: list[str] = field(default_factory=list)  # unchanged sources and settings: skipped
    failed: dict[str, str] = field(default_factory=dict)  # case id -> one-line problem (skipped)
    cropped: dict[str, str] = field(default_factory=dict)  # case id -> warning: tumour voxels lost to the cube
    editions: dict[str, str] = field(default_factory=dict)  # case id -> label table, every case found
    removed_temp: int = 0  # stale temp folders of interrupted runs that were deleted
    seconds: float = 0.0

    @property
    def cases(self) -> list[str]:
        return sorted([*self.prepared, *self.up_to_date])


class CacheWriteError(DataError):
    """The cache itself cannot be written (disk full, permissions): stops the whole run."""


def prepare_dataset(root: str | os.PathLike, cache: str | os.PathLike, data_cfg, workers: int | None = None,
                    strict: bool = False, progress: bool = True) -> PrepareReport:
    """Preprocess every case under `root` into `cache` (see the module docstring).

    `workers` processes prepare cases in parallel (default `data_cfg.prepare_workers`; 1 = in this process).
    Bad cases are listed in the report and skipped, or raise DataError with `strict=True`.
    """
    started = time.perf_counter()
    cache_dir = Path(cache)
    settings = preprocess_settings(data_cfg)
    cases = discover_cases(root, data_cfg.edition, tuple(data_cfg.modalities), data_cfg.challenge)
    report = PrepareReport(cache=cache_dir)
    _make_cache_dir(cache_dir)
    report.removed_temp = clean_stale_temp(cache_dir)

    todo: list[tuple[Case, dict]] = []
    report.editions = {case.case_id: case.edition for case in cases}
    for case in cases:
        try:
            sources = source_fingerprints(case)
        except DataError as exc:  # a listed file that is gone: this case is skipped, the others go on
            if strict:
                raise
            report.failed[case.case_id] = str(exc)
            _remove_entry(cache_dir, case.case_id)
            continue
        if _is_up_to_date(entry_folder(cache_dir, case.case_id), sources, settings):
            report.up_to_date.append(case.case_id)
        else:
            todo.append((case, sources))
    _check_free_space(cache_dir, len(todo), settings)

    index_cases = {}
    for case_id in report.up_to_date:
        meta = _read_meta(entry_folder(cache_dir, case_id))
        index_cases[case_id] = _index_entry(meta)
        _note_cropped(report, case_id, meta, settings)
    _write_index(cache_dir, root, settings, index_cases, report.failed)
    last_index_write = time.monotonic()

    def finished(case_id: str, problem: str | None, meta: dict | None) -> None:
        nonlocal last_index_write
        if problem is None:
            report.prepared.append(case_id)
            index_cases[case_id] = _index_entry(meta)
            _note_cropped(report, case_id, meta, settings)
        else:
            report.failed[case_id] = problem
            _remove_entry(cache_dir, case_id)  # a stale entry of a case that is now bad must not be used
        # The index is rewritten every few seconds, not after every case (1000s of fsyncs); entries it
        # misses after a crash are complete on disk and the next run finds them up to date.
        if time.monotonic() - last_index_write > INDEX_WRITE_SECONDS:
            _write_index(cache_dir, root, settings, index_cases, report.failed)
            last_index_write = time.monotonic()
        if problem is not None and strict:
            raise DataError(problem)

    workers = max(1, int(workers if workers is not None else data_cfg.prepare_workers))
    try:
        with _progress_bar(progress and bool(todo)) as bar:
            task = bar.add_task("prepare", total=len(todo))
            if workers == 1 or len(todo) <= 1:
                for case, sources in todo:
                    finished(*prepare_one(case, str(cache_dir), settings, sources))
                    bar.advance(task)
            else:
                _prepare_in_pool(todo, cache_dir, settings, min(workers, len(todo)), finished,
                                 lambda: bar.advance(task))
    finally:
        _write_index(cache_dir, root, settings, index_cases, report.failed)

    report.prepared.sort()
    report.seconds = time.perf_counter() - started
    return report


def prepare_missing(data_cfg, workers: int | None = None, progress: bool = True) -> PrepareReport:
    """Bring `data_cfg.cache` up to date with `data_cfg.root` before a run reads it: new cases, changed
    files and changed settings are prepared (with a progress bar), the rest is left as it is.

    Without a `data.root` folder the cache is used as it stands (a cache copied from elsewhere is enough to
    train). Bad cases are skipped and listed in `report.failed`; DataError if no case is usable at all.
    """
    root, cache = Path(data_cfg.root), Path(data_cfg.cache)
    if not root.is_dir():
        prepared = list_prepared(cache) if cache.is_dir() else []
        if not prepared:
            raise DataError(f"{cache}: no prepared cases (data.cache), and data.root {root} is not a folder "
                            "to prepare them from")
        return PrepareReport(cache=cache, up_to_date=prepared)
    report = prepare_dataset(root, cache, data_cfg, workers=workers, progress=progress)
    if not report.cases:
        first = next(iter(report.failed.values()), "no case found")
        raise DataError(f"{root}: no usable case to prepare into {cache} ({first})")
    return report


def _prepare_in_pool(todo, cache_dir: Path, settings: dict, workers: int, finished, advance) -> None:
    # spawn, not fork: a forked child of a process that already ran torch/OpenMP threads can hang.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
        pending: set[Future] = set()
        try:
            with stop_signals.held_back():  # the workers start here (see _init_worker)
                pending = {pool.submit(prepare_one, case, str(cache_dir), settings, sources) for case, sources in todo}
            while pending:
                done, pending = wait_futures(pending, return_when="FIRST_COMPLETED")
                for future in done:
                    finished(*future.result())
                    advance()
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def prepare_one(case: Case, cache_dir: str, settings: dict, sources: dict) -> tuple[str, str | None, dict | None]:
    """Load, validate, preprocess and atomically store one case: (case_id, problem or None, meta)."""
    try:
        loaded = load_case(case, tuple(settings["modalities"]))
        image, label, meta = preprocess_case(loaded, settings)
    except Exception as exc:  # one case's files never stop the others (errors.case_problem)
        problem = case_problem(case.case_id, exc)
        if problem is None:
            raise
        return case.case_id, problem, None
    meta["sources"] = sources
    meta["image_dtype"] = str(image.dtype)
    write_entry(Path(cache_dir), case.case_id, image, label, meta)
    return case.case_id, None, meta


def write_entry(cache_dir: Path, case_id: str, image: np.ndarray, label: np.ndarray | None, meta: dict) -> None:
    """Write one case into a temp folder, then swap it into place (old entry removed afterwards).

    CacheWriteError when a folder of that name is there and is not an entry the cache wrote."""
    final = entry_folder(cache_dir, case_id)
    if os.path.lexists(final) and not _written_by_cache(final):
        raise CacheWriteError(f"cache {cache_dir}: {final} is there but was not written by brats-swap (no meta.json "
                              f"of case {case_id}); not replaced: move it away or use another cache folder")
    nonce = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temp = cache_dir / f".tmp-{case_id}-{nonce}"
    try:
        temp.mkdir(parents=True)
        atomic_save_npy(temp / IMAGE_FILE, image)
        if label is not None:
            atomic_save_npy(temp / LABEL_FILE, label)
        atomic_write_json(temp / META_FILE, meta)  # written last: its presence marks a complete entry
        old = cache_dir / f".old-{case_id}-{nonce}"
        if final.exists():
            os.replace(final, old)
        os.replace(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise CacheWriteError(f"cache {cache_dir}: cannot write case {case_id} ({exc.strerror or exc})") from exc
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)


def list_prepared(cache: str | os.PathLike) -> list[str]:
    """Sorted ids of the complete cases in `cache` (those the last `prepare` listed in index.json)."""
    cache_dir = Path(cache)
    if not cache_dir.is_dir():
        raise DataError(f"{cache_dir}: prepared cache not found (run `brats-swap data prepare DIR --out {cache_dir}`)")
    index_path = cache_dir / INDEX_FILE
    if index_path.is_file():
        try:
            candidates = list(json.loads(index_path.read_text(encoding="utf-8"))["cases"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{index_path}: unreadable cache index ({exc})") from exc
    else:
        candidates = [p.name for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(c for c in candidates if (entry_folder(cache_dir, c) / META_FILE).is_file())


def load_prepared(cache: str | os.PathLike, case_id: str, mmap: bool = True) -> PreparedCase:
    """One prepared case; with `mmap` the arrays are read-only memory maps (copy before writing)."""
    folder = entry_folder(Path(cache), case_id)
    meta = _read_meta(folder)
    if meta is None:
        raise DataError(f"cache {Path(cache)}: case {case_id} is not prepared (no {folder / META_FILE})")
    mode = "r" if mmap else None
    arrays = {}
    for name in (IMAGE_FILE, LABEL_FILE):
        path = folder / name
        if name == LABEL_FILE and not path.exists():
            arrays[name] = None
            continue
        try:
            arrays[name] = np.load(path, mmap_mode=mode, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"cache {Path(cache)}: case {case_id}: file {name}: unreadable array ({exc}); "
                            "re-run `brats-swap data prepare`") from exc
    image, label = arrays[IMAGE_FILE], arrays[LABEL_FILE]
    return PreparedCase(case_id=case_id, image=image, label=label, meta=meta)


def source_fingerprints(case: Case) -> dict[str, dict[str, Any]]:
    """Role -> {name, size, mtime_ns} of each source file: what decides whether a case changed."""
    prints = {}
    for role, path in case.files.items():
        try:
            stat = path.stat()
        except OSError as exc:
            raise DataError(f"case {case.case_id}: file {path.name}: cannot stat ({exc.strerror})") from exc
        prints[role] = {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return prints


def estimate_case_bytes(settings: dict) -> int:
    voxels = int(np.prod(settings["cube"]))
    itemsize = np.dtype(settings["cache_dtype"]).itemsize
    return voxels * (len(settings["modalities"]) * itemsize + 1) + 64 * 1024


def clean_stale_temp(cache_dir: Path) -> int:
    """Delete temp/old folders left by writers that no longer run; returns how many were removed.

    Only real folders (not links) named exactly as `write_entry` names them are touched."""
    removed = 0
    for entry in cache_dir.iterdir():
        named = _TEMP_FOLDER.fullmatch(entry.name)
        if named is None or name_problem(named["case"]) is not None or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(named["pid"])
        if pid != os.getpid() and _process_alive(pid):
            continue  # another prepare (or its worker) is writing it right now
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    # Temp files of atomic writes (index.json) whose writer was killed mid-write.
    return removed + remove_stale_temp_files(cache_dir)


def entry_folder(cache_dir: Path, case_id: str) -> Path:
    """`CACHE/<case_id>` for a checked case id that stays inside the cache once resolved (DataError otherwise);
    returned unresolved, so that a link in its place is seen as a link."""
    path_inside(cache_dir, case_id, "case id", f"cache {cache_dir}")
    return Path(cache_dir) / case_id


def _written_by_cache(folder: Path) -> bool:
    """Whether `folder` is an entry this cache wrote: a real folder whose meta.json names it and holds the
    sources and settings that `prepare_one` writes into every entry."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    meta = _read_meta(folder)
    return meta is not None and meta.get("case_id") == folder.name and {"sources", "settings"} <= meta.keys()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_up_to_date(folder: Path, sources: dict, settings: dict) -> bool:
    meta = _read_meta(folder)
    return (meta is not None and meta.get("sources") == sources and meta.get("settings") == settings
            and (folder / IMAGE_FILE).is_file() and ((folder / LABEL_FILE).is_file() or not meta.get("has_label")))


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _note_cropped(report: PrepareReport, case_id: str, meta: dict | None, settings: dict) -> None:
    cropped = (meta or {}).get("cropped_labels")
    if cropped:
        report.cropped[case_id] = describe_cropped(case_id, cropped, settings)


def _index_entry(meta: dict | None) -> dict:
    meta = meta or {}
    return {key: meta.get(key) for key in ("edition", "original_shape", "spacing", "bbox", "has_label")}


def _write_index(cache_dir: Path, root, settings: dict, cases: dict, failed: dict) -> None:
    atomic_write_json(cache_dir / INDEX_FILE, {
        "format": CACHE_FORMAT,
        "root": os.fspath(root),
        "settings": settings,
        "cases": dict(sorted(cases.items())),
        "failed": dict(sorted(failed.items())),
    })


def _remove_entry(cache_dir: Path, case_id: str) -> None:
    """Remove the cache's entry of `case_id`, if there is one the cache wrote (anything else stays)."""
    folder = entry_folder(cache_dir, case_id)
    if _written_by_cache(folder):
        trash = cache_dir / f".old-{case_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _make_cache_dir(cache_dir: Path) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheWriteError(f"{cache_dir}: cannot create the cache folder ({exc.strerror or exc})") from exc
    if not os.access(cache_dir, os.W_OK):
        raise CacheWriteError(f"{cache_dir}: cache folder is not writable")


def _check_free_space(cache_dir: Path, n_cases: int, settings: dict) -> None:
    if n_cases == 0:
        return
    needed = n_cases * estimate_case_bytes(settings)
    free = shutil.disk_usage(cache_dir).free
    if needed > free:
        raise CacheWriteError(f"{cache_dir}: preparing {n_cases} cases needs about {needed / 2**30:.2f} GiB "
                              f"but only {free / 2**30:.2f} GiB is free")


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core already; more threads would oversubscribe
    # A scheduler's SIGTERM to the whole group (`docker stop`, a shell's kill) is the parent's to act on; a worker
    # it killed would break the pool under the parent's own orderly stop.
    stop_signals.ignore(stop_signals.SCHEDULER_SIGNALS)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals.SCHEDULER_SIGNALS)  # held back while it started


def _progress_bar(enabled: bool) -> Progress:
    return progress_bar("[bold]{task.description}", disable=not enabled)


__all__ = [
    "CacheWriteError", "INDEX_FILE", "PrepareReport", "PreparedCase", "clean_stale_temp", "estimate_case_bytes",
    "list_prepared", "load_prepared", "prepare_dataset", "prepare_missing", "prepare_one", "source_fingerprints", "write_entry",
]
