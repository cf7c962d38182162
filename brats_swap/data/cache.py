"""The prepared-case cache: `brats-swap data prepare` writes it, training reads it.

Layout (stable, documented in docs/data.md), format 2:

    CACHE/index.json                 format, source (data.root resolved + dataset identity), settings, the
                                     prepared cases of the last `prepare` (+ failures)
    CACHE/<case_id>/image.b2nd       the cube's content box (C, d, h, w) float16/float32, blosc2 (compressed.py)
    CACHE/<case_id>/label.b2nd       (d, h, w) uint8, raw label values of meta["edition"]'s table (absent: no seg)
    CACHE/<case_id>/class_locations.npy  nnU-Net's sample of each tumour class's voxels, cube coordinates
                                     (class_locations.py; absent: no seg, or an entry written before them)
    CACHE/<case_id>/region_locations.npy  the same per region of the table's default regions (region models)
    CACHE/<case_id>/meta.json        what `to_original_grid` needs + sources' fingerprints + settings + the
                                     stored box (`stored_box`) and `cache_format`

`load_prepared` is the one reader: every user of the cache (training loader, evaluation, compare, cv, the
tests) gets the arrays from it, as `CachedVolume`s the size of the cube. Entries of format 1 (uncompressed
`image.npy` of the whole cube) are recognised by their meta.json and never read: `prepare` rebuilds them
(one line says so) and `load_prepared` refuses them.

Entries written before the class (or region) locations were stored are brought up to date by the next
`prepare` (or a run's prepare step, also with `data.cache_only` when the cache is writable) from their own
label: the NIfTI files are not read and the image is not compressed again (`add_locations_one`).

`prepare_missing(data_cfg)` is what train/cv/compare call: it prepares whatever cases of `data.root` the
cache lacks (or holds stale) before they read it, so one command goes from a download to a run.

Incremental: a case is redone only if its source files changed (name, size, mtime) or the preprocessing
settings did. A cache holds one setting of the `data.*` keys that shape its arrays (`CONFIG_SETTINGS`): a run
whose settings differ from its cases' is refused in one line (`settings_change`), so that two runs of two
cubes never prepare the cache in turn; `data prepare` (asked for) replaces them, saying so. Atomic: each case is written into `CACHE/.tmp-<case>-<pid>-<nonce>/` and renamed into place,
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

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from brats_swap.atomic import DISK_PROBLEMS, atomic_write_json, remove_stale_temp_files
from brats_swap.config.schema import INTEGER_LIMITS
from brats_swap.data.class_locations import (
    LOCATIONS_FILE,
    META_KEY,
    REGIONS_FILE,
    REGIONS_KEY,
    ClassLocations,
    default_regions,
    read_locations,
    recorded_counts,
    recorded_regions,
    sample_locations,
    sample_region_locations,
    write_locations,
)
from brats_swap.data.compressed import CachedVolume, content_box, write_volume
from brats_swap.data.discovery import Case, discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.data.preprocess import describe_cropped, preprocess_case, preprocess_settings
from brats_swap.data.workers import log_console, resolve_workers, run_cases
from brats_swap.errors import DataError, PreparationInterrupted, case_problem
from brats_swap.foreign_files import parse_json, read_text
from brats_swap.names import name_problem, path_inside

INDEX_FILE = "index.json"
META_FILE = "meta.json"
IMAGE_FILE = "image.b2nd"
LABEL_FILE = "label.b2nd"
CACHE_FORMAT = 2
OLD_FORMAT_IMAGE = "image.npy"  # format 1 (the whole cube, uncompressed): recognised, rebuilt, never read
INDEX_WRITE_SECONDS = 2.0
# What `write_entry` and `_remove_entry` name their temp folders: .tmp-<case id>-<pid>-<nonce> (being
# written) and .old-<case id>-<pid>-<nonce> (an entry being replaced or removed).
_TEMP_FOLDER = re.compile(r"\.(?:tmp|old)-(?P<case>.+)-(?P<pid>\d+)-[0-9a-f]{8}")


@dataclass
class PreparedCase:
    case_id: str
    image: CachedVolume | np.ndarray  # (C, D, H, W) float16/float32: lazy (mmap=True) or read whole
    label: CachedVolume | np.ndarray | None  # (D, H, W) uint8, raw label values of meta["edition"]
    meta: dict[str, Any]
    folder: Path | None = None  # the entry (None: not from a cache)

    def class_locations(self) -> ClassLocations:
        """The entry's tumour-class locations (class_locations.py), read and checked now. DataError for an
        entry without them (written before the cache stored them: `prepare` adds them) or damaged."""
        where, cube, counts = self._recorded(META_KEY, "tumour-class")
        return read_locations(self.folder / LOCATIONS_FILE, counts, cube)

    def region_locations(self, regions: dict[str, tuple[int, ...]]) -> ClassLocations:
        """The entry's locations per region (class_locations.py), keyed by the region's position in `regions`
        (the run's regions: name -> label values, in order), the regions present only; read and checked now.
        DataError for an entry without them (`prepare` adds them), damaged, or storing other regions."""
        where, cube, counts = self._recorded(REGIONS_KEY, "region")
        return read_locations(self.folder / REGIONS_FILE, recorded_regions(self.meta, regions, counts, where), cube)

    def _recorded(self, key: str, what: str) -> tuple[str, tuple[int, ...], dict[int, tuple[int, int]]]:
        """(where, cube, the checked per-label counts) for reading the locations meta.json records under `key`."""
        where = f"cache {self.folder.parent if self.folder else '?'}: case {self.case_id}"
        if key not in self.meta or self.folder is None:
            raise DataError(f"{where} has no {what} locations (prepared before the cache stored them); "
                            f"{LOCATIONS_HINT}")
        cube = tuple(self.meta["cube"])
        return where, cube, recorded_counts(self.meta, cube, where)


@dataclass
class PrepareReport:
    cache: Path
    prepared: list[str] = field(default_factory=list)  # (re)written by this run
    up_to_date: list[str] = field(default_factory=list)  # unchanged sources and settings: skipped
    failed: dict[str, str] = field(default_factory=dict)  # case id -> one-line problem (skipped)
    cropped: dict[str, str] = field(default_factory=dict)  # case id -> warning: tumour voxels lost to the cube
    editions: dict[str, str] = field(default_factory=dict)  # case id -> label table, every case found
    removed_temp: int = 0  # stale temp folders of interrupted runs that were deleted
    old_format: int = 0  # entries of an older cache format found (rebuilt by this run)
    located: list[str] = field(default_factory=list)  # up-to-date entries given their class/region locations by this run
    seconds: float = 0.0

    @property
    def cases(self) -> list[str]:
        return sorted([*self.prepared, *self.up_to_date])


class CacheWriteError(DataError):
    """The cache itself cannot be written (disk full, permissions): stops the whole run."""


def prepare_dataset(root: str | os.PathLike, cache: str | os.PathLike, data_cfg, workers: int | str | None = None,
                    strict: bool = False, progress: bool = True, console: Console | None = None,
                    replace_settings: bool = True) -> PrepareReport:
    """Preprocess every case under `root` into `cache` (see the module docstring).

    `workers` processes prepare cases in parallel (default `data_cfg.prepare_workers`; `auto` = every CPU this
    process may use, 1 = in this process). Each case is read and validated once, as `data check` does
    (`prepare_one`): bad cases are listed in the report and skipped, or raise DataError with `strict=True`.
    DataError when the cache was prepared from another dataset (`check_source`), or with other `data.*` settings
    and not `replace_settings` (`_check_settings`). PreparationInterrupted on Ctrl-C, the finished cases kept.
    """
    started = time.perf_counter()
    cache_dir = Path(cache)
    settings = preprocess_settings(data_cfg)
    cases = discover_cases(root, data_cfg.edition, tuple(data_cfg.modalities), data_cfg.challenge)
    source = cache_source(root, cases)
    check_source(cache_dir, source)
    _check_settings(cache_dir, settings, replace_settings, console)
    report = PrepareReport(cache=cache_dir)
    _make_cache_dir(cache_dir)
    report.removed_temp = clean_stale_temp(cache_dir)
    report.editions = {case.case_id: case.edition for case in cases}
    todo = _sort_cases(cases, cache_dir, settings, report, strict)
    if report.old_format:
        _say(console, f"{cache_dir}: {report.old_format} case(s) are in an older cache format (uncompressed "
                      f"image.npy); rebuilding them in format {CACHE_FORMAT} (compressed, docs/data.md)")
    count = resolve_workers(workers if workers is not None else data_cfg.prepare_workers)
    lacking = [case_id for case_id in report.up_to_date if _meta_lacks_locations(_read_meta(entry_folder(cache_dir, case_id)))]
    broken = add_locations(cache_dir, lacking, count, report, progress=progress, console=console)
    if broken:  # an entry whose label cannot be read: prepared again from its files
        report.up_to_date = [case_id for case_id in report.up_to_date if case_id not in broken]
        todo += [(case, source_fingerprints(case)) for case in cases if case.case_id in broken]
    space = DiskBudget(cache_dir, settings, len(todo), [entry_folder(cache_dir, c) for c in report.up_to_date])

    index_cases = {}
    for case_id in report.up_to_date:
        meta = _read_meta(entry_folder(cache_dir, case_id))
        index_cases[case_id] = _index_entry(meta)
        _note_cropped(report, case_id, meta, settings)
    _write_index(cache_dir, source, settings, index_cases, report.failed)
    last_index_write = time.monotonic()

    def finished(result: tuple[str, str | None, dict | None]) -> None:
        nonlocal last_index_write
        case_id, problem, meta = result
        if problem is None:
            report.prepared.append(case_id)
            index_cases[case_id] = _index_entry(meta)
            _note_cropped(report, case_id, meta, settings)
            space.written(entry_folder(cache_dir, case_id))
        else:
            report.failed[case_id] = problem
            _remove_entry(cache_dir, case_id)  # a stale entry of a case that is now bad must not be used
        # The index is rewritten every few seconds, not after every case (1000s of fsyncs); on the way out
        # (`finally`) it is written whole, with the cases that finished while stopping (`_finished_on_disk`).
        if time.monotonic() - last_index_write > INDEX_WRITE_SECONDS:
            _write_index(cache_dir, source, settings, index_cases, report.failed)
            last_index_write = time.monotonic()
        if problem is not None and strict:
            raise DataError(problem)

    interrupted = False
    try:
        run_cases(prepare_one, [(case, str(cache_dir), settings, sources) for case, sources in todo], count,
                  done=finished, failures=lambda: len(report.failed), description="prepare", progress=progress,
                  console=console)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for case_id in _finished_on_disk(cache_dir, todo, settings, index_cases, report.failed):
            report.prepared.append(case_id)
            index_cases[case_id] = _index_entry(_read_meta(entry_folder(cache_dir, case_id)))
        _write_index(cache_dir, source, settings, index_cases, report.failed)
    if interrupted:  # the index lists every finished case: the next call prepares only the others
        raise _interrupted(cache_dir, len(cases), len(index_cases), report)

    report.prepared.sort()
    report.seconds = time.perf_counter() - started
    return report


def _sort_cases(cases: list[Case], cache_dir: Path, settings: dict, report: PrepareReport, strict: bool
                ) -> list[tuple[Case, dict]]:
    """The cases to prepare (with their sources' fingerprints); up-to-date ones go to `report.up_to_date`,
    those whose files cannot be read to `report.failed` (their stale entry removed)."""
    todo = []
    for case in cases:
        try:
            sources = source_fingerprints(case)
        except DataError as exc:  # a listed file that is gone: this case is skipped, the others go on
            if strict:
                raise
            report.failed[case.case_id] = str(exc)
            _remove_entry(cache_dir, case.case_id)
            continue
        folder = entry_folder(cache_dir, case.case_id)
        if _is_up_to_date(folder, sources, settings):
            report.up_to_date.append(case.case_id)
        else:
            report.old_format += _is_old_format(folder)
            todo.append((case, sources))
    return todo


LOCATIONS_PER_WORKER = 100  # entries given their class locations per worker process, at least
LOCATIONS_HINT = ("run `brats-swap data prepare` (or a run with data.root, or with data.cache_only on a writable "
                  "cache) to add them from the cached labels")


def add_locations(cache_dir: Path, case_ids: list[str], workers: int, report: PrepareReport, *, progress: bool,
                  console: Console | None) -> dict[str, str]:
    """Give the entries `case_ids` (written before the cache stored class locations) their locations, from their
    own cached label (`add_locations_one`), saying so in one line; the ones done go to `report.located`.
    Returns case id -> problem for the entries whose label could not be read."""
    if not case_ids:
        return {}
    _say(console, f"{cache_dir}: {len(case_ids)} case(s) were prepared before the cache stored their tumour-class "
                  "and region locations; adding them from the cached labels (images and NIfTI files are not read "
                  "again)")
    broken: dict[str, str] = {}

    def finished(result: tuple[str, str | None]) -> None:
        case_id, problem = result
        if problem is None:
            report.located.append(case_id)
        else:
            broken[case_id] = problem

    # A case takes ~0.07 s here and a spawned worker ~5 s to start (it imports torch): processes only for many.
    workers = min(workers, max(1, len(case_ids) // LOCATIONS_PER_WORKER))
    run_cases(add_locations_one, [(str(cache_dir), case_id) for case_id in case_ids], workers, done=finished,
              failures=lambda: len(broken), description="class locations", progress=progress, console=console)
    report.located.sort()
    return broken


def add_locations_one(cache_dir: str, case_id: str) -> tuple[str, str | None]:
    """Sample one entry's class and region locations from its cached label (only the stored box is
    decompressed), write them, then its meta.json (last: it marks the entry complete). (case_id, problem or
    None)."""
    folder = entry_folder(Path(cache_dir), case_id)
    remove_stale_temp_files(folder)  # a locations file an earlier, killed run was writing
    try:
        prepared = load_prepared(cache_dir, case_id)
        box = prepared.meta["stored_box"]
        label = prepared.label[tuple(slice(a, b) for a, b in box)]
        sampled = sample_all_locations(label, prepared.meta["edition"], box)
    except DataError as exc:
        return case_id, str(exc)
    except KeyError as exc:  # an edition no table has: the entry is prepared again from its files
        return case_id, f"cache {cache_dir}: case {case_id}: meta.json {exc.args[0]}"
    try:
        write_all_locations(folder, sampled)
        atomic_write_json(folder / META_FILE, {**prepared.meta, **{key: record for key, (record, _) in sampled.items()}})
    except OSError as exc:
        problem = DISK_PROBLEMS.get(exc.errno) or exc.strerror or exc
        raise CacheWriteError(f"cache {cache_dir}: cannot write the class locations of case {case_id} "
                              f"({problem})") from exc
    return case_id, None


def sample_all_locations(label, edition: str, box) -> dict[str, tuple[Any, ClassLocations]]:
    """An entry's locations from the label of its stored `box`: meta.json key -> (what meta.json records, the
    locations the .npy holds), per label value and per default region of the `edition`'s table."""
    offset = tuple(a for a, _ in box)
    per_label = sample_locations(label, offset=offset)
    return {META_KEY: (per_label.counts(), per_label),
            REGIONS_KEY: sample_region_locations(label, default_regions(edition), offset=offset)}


def write_all_locations(folder: Path, sampled: dict[str, tuple[Any, ClassLocations]]) -> None:
    """The .npy files of `sample_all_locations`, into the entry `folder` (each written atomically)."""
    write_locations(folder / LOCATIONS_FILE, sampled[META_KEY][1])
    write_locations(folder / REGIONS_FILE, sampled[REGIONS_KEY][1])


def require_locations(cache: str | os.PathLike, case_ids: list[str],
                      regions: dict[str, tuple[int, ...]] | None = None) -> None:
    """DataError in one line when some of `case_ids` have a label but no class locations (what patch training
    with forced-foreground patches reads), or, for a run drawing per region (`regions`: name -> label values,
    in order), no region locations or region locations of other regions: refused before training starts, not
    in a loader worker mid-epoch."""
    keys = (META_KEY,) if regions is None else (META_KEY, REGIONS_KEY)
    metas = {case_id: _read_meta(entry_folder(Path(cache), case_id)) for case_id in case_ids}
    lacking = [case_id for case_id, meta in metas.items() if _meta_lacks_locations(meta, keys)]
    if lacking:
        what = "tumour-class" if regions is None else "tumour-class or region"
        raise DataError(f"cache {cache}: {len(lacking)} of {len(case_ids)} case(s) (e.g. {lacking[0]}) have no "
                        f"{what} locations (prepared before the cache stored them), which patches on "
                        f"tumour (train.patch_foreground) need; {LOCATIONS_HINT}")
    for case_id, meta in metas.items() if regions is not None else ():
        if meta is not None and meta.get("has_label"):  # the counts are checked now, the rows when read
            where = f"cache {cache}: case {case_id}"
            check_entry_meta(meta, f"{where}: {entry_folder(Path(cache), case_id) / META_FILE}")
            cube = tuple(meta["cube"])
            recorded_regions(meta, regions, recorded_counts(meta, cube, where), where)


def _meta_lacks_locations(meta: dict | None, keys: tuple[str, ...] = (META_KEY, REGIONS_KEY)) -> bool:
    """Whether the entry of `meta` (its meta.json) has a label but lacks some of the locations `keys`."""
    return meta is not None and bool(meta.get("has_label")) and any(key not in meta for key in keys)


def _finished_on_disk(cache_dir: Path, todo, settings: dict, index_cases: dict, failed: dict) -> list[str]:
    """Cases of `todo` not yet recorded whose complete entry is on disk: those a worker finished while the run
    was stopping (Ctrl-C, an error), so that the index lists every case that is there."""
    return [case.case_id for case, sources in todo
            if case.case_id not in index_cases and case.case_id not in failed
            and _is_up_to_date(entry_folder(cache_dir, case.case_id), sources, settings)]


def prepare_missing(data_cfg, workers: int | str | None = None, progress: bool = True,
                    console: Console | None = None) -> PrepareReport:
    """Bring `data_cfg.cache` up to date with `data_cfg.root` before a run reads it: new cases, changed
    files and changed settings are prepared (with a progress bar), the rest is left as it is.

    With `data.cache_only` the cache is the data: it is used as it stands and `data.root` is not looked at
    (a cache copied from elsewhere is enough to train); only entries without class locations get them, from
    their own label, when the cache can be written (`add_locations`). Otherwise a `data.root` that does not exist, or is
    another dataset than the one the cache was prepared from, is refused (DataError naming both). Bad cases
    are skipped and listed in `report.failed`; DataError if no case is usable at all.
    """
    root, cache = Path(data_cfg.root), Path(data_cfg.cache)
    if data_cfg.cache_only:
        prepared = list_prepared(cache) if cache.is_dir() else []
        if not prepared:
            raise DataError(f"{cache}: no prepared cases (data.cache), and data.cache_only is set")
        report = PrepareReport(cache=cache, up_to_date=prepared)
        # A cache copied from elsewhere: its entries must be what this run reads.
        lacking = [case_id for case_id in prepared
                   if _meta_lacks_locations(check_entry_fits_run(cache, case_id, data_cfg))]
        # Derived from the cache's own labels, so the cache alone can bring itself up to date; a read-only
        # cache stays as it is (whole-cube runs do not need them; a patch run says so, `require_locations`).
        if lacking and os.access(cache, os.W_OK):
            count = resolve_workers(workers if workers is not None else data_cfg.prepare_workers)
            broken = add_locations(cache, lacking, count, report, progress=progress, console=console)
            if broken:
                case_id, problem = next(iter(broken.items()))
                raise DataError(problem if len(broken) == 1 else f"{problem} (and {len(broken) - 1} more case(s))")
        return report
    if not root.is_dir():
        if not (list_prepared(cache) if cache.is_dir() else []):
            raise DataError(f"{cache}: no prepared cases (data.cache), and data.root {root} is not a folder "
                            "to prepare them from")
        recorded = recorded_source(cache).get("root", "a folder it does not record")
        raise DataError(f"data.root {root} is not a folder, and the cache {cache} was prepared from {recorded}: "
                        "set data.root to that folder, or data.cache_only=true to use the cache alone")
    report = prepare_dataset(root, cache, data_cfg, workers=workers, progress=progress, console=console,
                             replace_settings=False)
    if not report.cases:
        first = next(iter(report.failed.values()), "no case found")
        raise DataError(f"{root}: no usable case to prepare into {cache} ({first})")
    return report


# The preprocessing settings (`preprocess_settings`) a config sets, by the key that sets them; the others change
# with brats-swap itself, and a new version re-prepares the cache without asking.
CONFIG_SETTINGS = {"edition": "data.edition", "challenge": "data.challenge", "modalities": "data.modalities",
                   "cube": "data.cube", "fit": "data.fit", "cache_dtype": "data.cache_dtype",
                   "clip_percentiles": "data.clip_percentiles"}


def _interrupted(cache_dir: Path, cases: int, kept: int, report: PrepareReport) -> PreparationInterrupted:
    """Ctrl-C's one line: what is kept, and what the same command again would prepare."""
    left = cases - kept - len(report.failed)
    rest = (f"{left} not yet: run the same command again to prepare the rest" if left else "none is left to prepare")
    return PreparationInterrupted(f"{cache_dir}: interrupted; {kept} of {cases} case(s) are prepared and kept "
                                  f"({len(report.prepared)} by this call), {rest}")


def _check_settings(cache_dir: Path, settings: dict, replace: bool, console: Console | None) -> None:
    """A cache whose cases were prepared with other `data.*` settings: DataError in one line naming both, or
    with `replace` (`data prepare`, asked for) one line saying they are prepared again."""
    change = settings_change(cache_dir, settings)
    if change is not None and not replace:
        raise DataError(f"cache {cache_dir} holds {change}: give this run its own data.cache, or replace "
                        f"them with `brats-swap data prepare --out {cache_dir}` and this run's settings (runs "
                        "with the old ones then refuse the cache)")
    if change is not None:
        _say(console, f"cache {cache_dir} holds {change}: preparing them again with this call's settings (runs "
                      "with the old ones will refuse the cache; give each setting its own data.cache)")


def settings_change(cache_dir: Path, settings: dict) -> str | None:
    """In words, what the cache's cases were prepared with that differs from `settings` in a `data.*` key
    ("4 case(s) prepared with data.cube [64, 64, 64], not [48, 48, 48]"); None when the index lists no case or
    records the same. The index's settings are those of every case it lists (`_write_index`)."""
    index = _read_index(cache_dir) if cache_dir.is_dir() else {}
    recorded, cases = index.get("settings"), index.get("cases")
    if not (isinstance(recorded, dict) and isinstance(cases, dict) and cases):
        return None
    defaults = {"challenge": "auto"}  # absent while auto (`preprocess_settings`)
    changed = [(key, recorded.get(name, defaults.get(name)), settings.get(name, defaults.get(name)))
               for name, key in CONFIG_SETTINGS.items()]
    changed = [(key, old, new) for key, old, new in changed if old != new]
    if not changed:
        return None
    said = ", ".join(f"{key} {str(old)[:60]}, not {str(new)[:60]}" for key, old, new in changed)
    return f"{len(cases)} case(s) prepared with {said}"


def cache_source(root: str | os.PathLike, cases: list[Case]) -> dict[str, str]:
    """What the cache records as its source: `data.root` resolved, and the dataset's identity (a digest of its
    case ids and file names, so a copy of the same dataset elsewhere is recognised)."""
    digest = hashlib.sha256()
    for case in sorted(cases, key=lambda c: c.case_id):
        digest.update(json.dumps([case.case_id, sorted((role, p.name) for role, p in case.files.items())]).encode())
    return {"root": os.fspath(Path(root).resolve()), "dataset": f"{len(cases)} cases, {digest.hexdigest()[:16]}"}


def recorded_source(cache: str | os.PathLike) -> dict[str, str]:
    """The source index.json records (format 2), {} when there is none (no index, an older format)."""
    index = _read_index(Path(cache))
    source = index.get("source") if index.get("format") == CACHE_FORMAT else None
    return source if isinstance(source, dict) else {}


def check_source(cache_dir: Path, source: dict[str, str]) -> None:
    """DataError when `cache_dir` holds cases prepared from another dataset than `source`: another folder whose
    cases differ. The same dataset moved or copied elsewhere (same identity) is accepted and recorded."""
    recorded = recorded_source(cache_dir) if cache_dir.is_dir() else {}
    if not recorded or not _read_index(cache_dir).get("cases"):
        return
    if recorded.get("root") != source["root"] and recorded.get("dataset") != source["dataset"]:
        raise DataError(f"data.root {source['root']} ({source['dataset']}) is not the dataset the cache {cache_dir} "
                        f"was prepared from ({recorded.get('root')}, {recorded.get('dataset')}): use another "
                        "data.cache for it, set data.root back, or data.cache_only=true to use the cache alone")


def prepare_one(case: Case, cache_dir: str, settings: dict, sources: dict) -> tuple[str, str | None, dict | None]:
    """Load, validate, preprocess and atomically store one case: (case_id, problem or None, meta).

    The one place a case is read for the cache: a bad case (DataError) becomes its one-line problem."""
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
    """Write one case into a temp folder, then swap it into place (old entry removed afterwards). Only the
    cube's content box is stored (compressed.py), with the label's class and region locations
    (class_locations.py); `meta` gains `stored_box`, `cache_format`, `class_locations` and `region_locations`.

    CacheWriteError when a folder of that name is there and is not an entry the cache wrote."""
    final = entry_folder(cache_dir, case_id)
    if os.path.lexists(final) and not _written_by_cache(final):
        raise CacheWriteError(f"cache {cache_dir}: {final} is there but was not written by brats-swap (no meta.json "
                              f"of case {case_id}); not replaced: move it away or use another cache folder")
    box = content_box(image, label)
    inside = tuple(slice(a, b) for a, b in box)
    sampled = sample_all_locations(label[inside], meta["edition"], box) if label is not None else {}
    meta.update(stored_box=box, cache_format=CACHE_FORMAT)
    meta.update({key: record for key, (record, _) in sampled.items()})
    nonce = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temp = cache_dir / f".tmp-{case_id}-{nonce}"
    try:
        temp.mkdir(parents=True)
        write_volume(temp / IMAGE_FILE, image[(slice(None), *inside)])
        if label is not None:
            write_volume(temp / LABEL_FILE, label[inside])
            write_all_locations(temp, sampled)
        atomic_write_json(temp / META_FILE, meta)  # written last: its presence marks a complete entry
        old = cache_dir / f".old-{case_id}-{nonce}"
        if final.exists():
            os.replace(final, old)
        os.replace(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        problem = DISK_PROBLEMS.get(exc.errno) or exc.strerror or exc
        raise CacheWriteError(f"cache {cache_dir}: cannot write case {case_id} ({problem})") from exc
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
        index = parse_json(read_text(index_path, what="cache index"), str(index_path))
        candidates = index.get("cases") if isinstance(index, dict) else None
        if not (isinstance(candidates, dict | list) and all(isinstance(c, str) for c in candidates)):
            raise DataError(f"{index_path}: unreadable cache index (its \"cases\" are not case ids); run "
                            "`brats-swap data prepare` to write it again")
    else:
        candidates = [p.name for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(c for c in candidates if (entry_folder(cache_dir, c) / META_FILE).is_file())


def load_prepared(cache: str | os.PathLike, case_id: str, mmap: bool = True) -> PreparedCase:
    """One prepared case: the one reader of the cache. With `mmap` the arrays are `CachedVolume`s (read-only,
    the cube's shape; slicing one decompresses only what the slice needs), without it whole numpy arrays.

    DataError for an entry that is not prepared, of an older format (never misread), or unreadable."""
    folder = entry_folder(Path(cache), case_id)
    meta = _read_meta(folder)
    if meta is None:
        raise DataError(f"cache {Path(cache)}: case {case_id} is not prepared (no {folder / META_FILE})")
    if meta.get("cache_format") != CACHE_FORMAT:
        raise DataError(f"cache {Path(cache)}: case {case_id} is in an older cache format ({OLD_FORMAT_IMAGE}); "
                        "rebuild it with `brats-swap data prepare` (train and cv do it when data.root is set)")
    check_entry_meta(meta, f"cache {Path(cache)}: case {case_id}: {folder / META_FILE}")
    cube, box = tuple(meta["cube"]), meta["stored_box"]
    image = CachedVolume(folder / IMAGE_FILE, (len(meta["modalities"]), *cube), meta["image_dtype"], box)
    label = CachedVolume(folder / LABEL_FILE, cube, np.uint8, box) if meta.get("has_label") else None
    if not mmap:
        try:
            image, label = np.asarray(image), (np.asarray(label) if label is not None else None)
        except (OSError, RuntimeError, ValueError) as exc:
            raise DataError(f"cache {Path(cache)}: case {case_id}: unreadable arrays ({exc}); "
                            "re-run `brats-swap data prepare`") from exc
    return PreparedCase(case_id=case_id, image=image, label=label, meta=meta, folder=folder)


MAX_MODALITIES = 64  # image channels an entry may declare: BraTS has 4


def check_entry_fits_run(cache: Path, case_id: str, data_cfg) -> dict | None:
    """The entry's meta.json (None: not ours, which `load_prepared` reports as not prepared). DataError (one
    line naming it) when the entry is unsound (`check_entry_meta`) or was prepared for another cube or other
    modalities than the run's `data.cube` and `data.modalities`: the run would allocate, or train on, what the
    cache says rather than what its config says."""
    path = entry_folder(cache, case_id) / META_FILE
    meta = _read_meta(path.parent)
    if meta is None:
        return None
    where = f"cache {cache}: case {case_id}: {path}"
    check_entry_meta(meta, where)
    for key, setting in (("cube", "data.cube"), ("modalities", "data.modalities")):
        if list(meta[key]) != list(getattr(data_cfg, key)):
            raise DataError(f"{where} was prepared for {key} {meta[key]}, and this run's {setting} is "
                            f"{list(getattr(data_cfg, key))}: set {setting} to the cache's, or prepare the data "
                            "again for this run (data.root, without data.cache_only)")
    return meta


def check_entry_meta(meta: dict, where: str) -> None:
    """DataError naming `where` (the entry's meta.json) when `entry_meta_problem` finds one: a cache copied from
    elsewhere is someone else's file."""
    problem = entry_meta_problem(meta)
    if problem is not None:
        raise DataError(f"{where} {problem}; prepare the case again (`brats-swap data prepare`, or remove its "
                        "folder from the cache)")


def entry_meta_problem(meta: dict) -> str | None:
    """What is wrong with the fields of an entry's meta.json that say what to allocate and read (the cube, the
    stored box, the channels, the dtype), in words; None when they are sound. The cube is bounded as
    `data.cube` is, so a forged entry cannot ask for more memory than any prepared one."""
    def ints(value: object, count: int) -> bool:
        return isinstance(value, list) and len(value) == count and all(type(v) is int for v in value)

    largest = INTEGER_LIMITS["data.cube"]
    cube, box = meta.get("cube"), meta.get("stored_box")
    if not ints(cube, 3) or not all(1 <= s <= largest for s in cube):
        return f"gives the cube as {str(cube)[:60]}, not 3 sizes of 1 to {largest} voxels"
    if not (isinstance(box, list) and len(box) == 3 and all(ints(pair, 2) for pair in box)
            and all(0 <= a <= b <= s for (a, b), s in zip(box, cube, strict=True))):
        return f"gives the stored box as {str(box)[:60]}, not 3 [start, stop] pairs inside the cube {cube}"
    modalities = meta.get("modalities")
    if not (isinstance(modalities, list) and 1 <= len(modalities) <= MAX_MODALITIES
            and all(isinstance(m, str) for m in modalities)):
        return f"gives the modalities as {str(modalities)[:60]}, not a list of 1 to {MAX_MODALITIES} names"
    if meta.get("image_dtype") not in ("float16", "float32"):
        return f"gives the image dtype as {str(meta.get('image_dtype'))[:30]!r}, not float16 or float32"
    if type(meta.get("has_label", False)) is not bool:
        return "gives has_label as something other than true or false"
    return None


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
    """An upper bound of one entry's size: the whole cube uncompressed (compression usually leaves 40% of it,
    scripts/bench_scale.py; random data would not compress at all)."""
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
    """Whether the entry holds these sources prepared with these settings, and its own description of what to
    allocate agrees with them (an entry whose `cube` was altered is prepared again, never allocated)."""
    meta = _read_meta(folder)
    return (meta is not None and meta.get("cache_format") == CACHE_FORMAT and meta.get("sources") == sources
            and meta.get("settings") == settings and entry_meta_problem(meta) is None
            and meta["cube"] == list(settings["cube"]) and meta["modalities"] == list(settings["modalities"])
            and (folder / IMAGE_FILE).is_file() and ((folder / LABEL_FILE).is_file() or not meta.get("has_label")))


def _is_old_format(folder: Path) -> bool:
    """An entry the cache wrote in an older format (format 1: meta.json without `cache_format`, image.npy)."""
    meta = _read_meta(folder)
    return meta is not None and meta.get("cache_format") != CACHE_FORMAT and (folder / OLD_FORMAT_IMAGE).is_file()


def _read_meta(folder: Path) -> dict | None:
    return _read_json_object(folder / META_FILE)


def _read_json_object(path: Path) -> dict | None:
    """A cache JSON file's object; None when it is missing, unreadable, not a regular file (a FIFO would block
    the reader), too large or too deeply nested to be ours (`foreign_files` limits), or not a JSON object."""
    try:
        value = parse_json(read_text(path), str(path))
    except DataError:
        return None
    return value if isinstance(value, dict) else None


def _note_cropped(report: PrepareReport, case_id: str, meta: dict | None, settings: dict) -> None:
    cropped = (meta or {}).get("cropped_labels")
    if cropped:
        report.cropped[case_id] = describe_cropped(case_id, cropped, settings)


def _index_entry(meta: dict | None) -> dict:
    meta = meta or {}
    return {key: meta.get(key) for key in ("edition", "original_shape", "spacing", "bbox", "has_label")}


def _read_index(cache_dir: Path) -> dict:
    return _read_json_object(cache_dir / INDEX_FILE) or {}


def _write_index(cache_dir: Path, source: dict, settings: dict, cases: dict, failed: dict) -> None:
    atomic_write_json(cache_dir / INDEX_FILE, {
        "format": CACHE_FORMAT,
        "source": source,
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


# prepare's free-space rule. A compressed entry's size depends on the data (22.6 MB per real-geometry phantom
# against 63.7 MB uncompressed, scripts/bench_scale.py; noise would not compress at all), so the uncompressed
# upper bound would refuse datasets that fit (1,251 BraTS cases: 80 GB bound, 28 GB written). Before any entry
# is measured a case is priced at EXPECTED_SHARE of the bound (or at the mean of the cache's entries); after
# the first MEASURE_AFTER cases of the run, and every RECHECK_EVERY after that, at the mean of the cases written.
EXPECTED_SHARE = 0.5
MEASURE_AFTER, RECHECK_EVERY = 4, 50
SPACE_MARGIN = 1.1  # the mean of a few cases is a sample, and the index and temp folders take a little too


def _entry_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


class DiskBudget:
    """Whether the cases left to prepare fit on the cache's disk: checked before the first case (CacheWriteError
    when they would not) and again as measured entries come in (`written`), so that a dataset which does not
    fit stops early with the cases already prepared kept, instead of filling the disk."""

    def __init__(self, cache_dir: Path, settings: dict, cases: int, existing: list[Path]) -> None:
        self.cache_dir, self.left = cache_dir, cases
        self.sizes: list[int] = []
        sample = [_entry_bytes(folder) for folder in existing[:20]]
        per_case = (sum(sample) / len(sample) if sample else EXPECTED_SHARE * estimate_case_bytes(settings))
        self._check(per_case, "about {size} each" if sample else "about {size} each (compressed; not measured yet)")

    def written(self, folder: Path) -> None:
        self.left -= 1
        self.sizes.append(_entry_bytes(folder))
        count = len(self.sizes)
        if count == MEASURE_AFTER or (count > MEASURE_AFTER and count % RECHECK_EVERY == 0):
            self._check(sum(self.sizes) / count, f"{{size}} each, the mean of the {count} prepared so far, which "
                        "are kept")

    def _check(self, per_case: float, how: str) -> None:
        if self.left <= 0:
            return
        needed, free = self.left * per_case * SPACE_MARGIN, shutil.disk_usage(self.cache_dir).free
        if needed > free:
            size = f"{per_case / 1e6:.1f} MB"
            raise CacheWriteError(f"{self.cache_dir}: preparing {self.left} cases needs about {needed / 2**30:.2f} "
                                  f"GiB ({how.format(size=size)}) but only {free / 2**30:.2f} GiB is free")


def _say(console: Console | None, line: str) -> None:
    log_console(console).print(line, markup=False)


__all__ = [
    "CacheWriteError", "INDEX_FILE", "PrepareReport", "PreparedCase", "cache_source", "check_source",
    "add_locations", "add_locations_one", "clean_stale_temp", "estimate_case_bytes", "recorded_source",
    "require_locations", "sample_all_locations",
    "list_prepared", "load_prepared", "prepare_dataset", "prepare_missing", "prepare_one", "source_fingerprints", "write_entry",
]
