"""The BraTS challenge entrypoint (`brats-swap serve-challenge`): what the organisers' run of an image expects.

The contract (BraTS 2025+: a Docker image run with no network, as any uid, with a read-only root file system;
2023-2024: MLCube's `infer --data_path --output_path` task):

- `/input` is read-only, one folder per case: `/input/<case id>/<case id><sep><modality>.nii.gz`, `sep` "-"
  (or "_", as MEN-RT's cases are named). Nothing is ever written there.
- `/output` is flat: one `<case id>.nii.gz` per case, uint8 labels of the task's table, on the case's own grid
  and header (those of its first modality). Each file is written through a temporary file and a rename, so
  a case cut short leaves no half-written segmentation.
- Any uid, an unwritable HOME: home, torch, matplotlib and cache folders are set under the temporary folder
  (`$TMPDIR`, else /tmp) only when theirs (or, unset, their default under HOME) cannot be written, before
  anything could use them.
- Case by case: a broken case (a missing or unreadable image, a folder holding no case) is named and skipped,
  the others are segmented, and the command then fails (exit 1) naming every failed case.
- A time budget for the whole test set: after each case, the time so far plus the remaining cases at the last
  case's pace is the projection; when it passes the budget, test-time augmentation is dropped first, then
  folds (keeping as many as the pace allows), and each change is said.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.data.discovery import discover_cases
from brats_swap.errors import ConfigError, DataError
from brats_swap.evaluate.failures import CaseFailures
from brats_swap.evaluate.predicting import predict_case

# Variables naming folders that torch, matplotlib and other libraries write to, each with the folder its library
# uses when it is unset (under another of them, resolved in this order); each is pointed under the temporary
# folder only when the folder it names, or would default to, cannot be written.
CACHE_VARIABLES = {"HOME": "home", "TORCH_HOME": "torch", "MPLCONFIGDIR": "matplotlib",
                   "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config"}
_DEFAULT_FOLDERS = {"HOME": None, "XDG_CACHE_HOME": ("HOME", ".cache"), "XDG_CONFIG_HOME": ("HOME", ".config"),
                    "TORCH_HOME": ("XDG_CACHE_HOME", "torch"), "MPLCONFIGDIR": ("XDG_CONFIG_HOME", "matplotlib")}
_DURATION = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _writable(folder: str | None, *, creatable: bool = True) -> bool:
    """A writable folder, or (`creatable`) one its nearest existing parent, a writable folder, can hold."""
    if not folder:
        return False
    path = Path(folder)
    while creatable and not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _default_folder(variable: str, environ) -> str | None:
    """The folder the library uses when `variable` is unset: under the (already resolved) variable above it."""
    if _DEFAULT_FOLDERS[variable] is None:
        return None
    above, name = _DEFAULT_FOLDERS[variable]
    parent = environ.get(above) or _default_folder(above, environ)
    return os.path.join(parent, name) if parent else None


def writable_home(environ: dict | None = None) -> dict[str, tuple[str, str]]:
    """Point HOME and the cache folders under the temporary folder when the folder they name (or, unset, the
    one their library defaults to: ~/.cache/torch, ~/.config/matplotlib, ...) cannot be written, in `environ`
    (default os.environ); returns variable -> (the folder it set, why). Call it before importing matplotlib:
    it reads MPLCONFIGDIR once, at import."""
    environ = os.environ if environ is None else environ
    base: Path | None = None
    changed = {}
    for variable in _DEFAULT_FOLDERS:
        name = CACHE_VARIABLES[variable]
        given = environ.get(variable)
        # A missing HOME is not made (its owner would be this uid, not the user's); a cache folder is.
        if _writable(given if given is not None else _default_folder(variable, environ), creatable=variable != "HOME"):
            continue
        base = base or private_temp_folder()
        folder = base / name
        folder.mkdir(exist_ok=True, mode=0o700)
        changed[variable] = (str(folder), "unset" if given is None else "not writable")
        environ[variable] = str(folder)
    return changed


def private_temp_folder() -> Path:
    """`<temporary folder>/brats-swap-<uid>`, private to this uid: created with mode 0700, or reused only when it
    is a real folder (not a symlink) owned by this uid, then set to 0700; DataError otherwise. The
    temporary folder is shared by every user of the machine, so a folder someone else made there first is
    never used."""
    uid = os.getuid()
    base = Path(tempfile.gettempdir()) / f"brats-swap-{uid}"
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise DataError(f"{base}: cannot create the private temporary folder ({exc.strerror})") from None
    info = base.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise DataError(f"{base}: not a folder but a {'symlink' if stat.S_ISLNK(info.st_mode) else 'file'}; "
                        "brats-swap uses it only as its own private folder: remove it, or set TMPDIR")
    if info.st_uid != uid:
        raise DataError(f"{base}: owned by uid {info.st_uid}, not {uid}; brats-swap uses it only as its own "
                        "private folder: remove it, or set TMPDIR")
    if stat.S_IMODE(info.st_mode) != 0o700:
        base.chmod(0o700)  # ours (an older brats-swap made it with the default mode): made private again
    return base


def parse_duration(text: str) -> float:
    """`8h`, `90m`, `3600`, `1.5h`, `45s`, `1d` -> seconds; ConfigError for anything else."""
    match = _DURATION.match(str(text))
    if match is None or float(match["number"]) <= 0:
        raise ConfigError(f"--time-budget {text!r}: expected a positive duration like 8h, 90m or 3600s")
    return float(match["number"]) * _UNIT_SECONDS[match["unit"].lower()]


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


@dataclass
class TimeBudget:
    """The whole test set's time, and what to drop when the cases done so far project past it."""

    seconds: float
    total: int
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    said_exhausted: bool = False

    def after_case(self, case_seconds: float, tta: bool, folds: int) -> tuple[bool, int, str | None]:
        """(tta, folds, what changed or None) for the cases still to do, after one took `case_seconds`."""
        self.done += 1
        remaining = self.total - self.done
        elapsed = time.monotonic() - self.started
        projected = elapsed + remaining * case_seconds
        if remaining == 0 or projected <= self.seconds:
            return tta, folds, None
        why = (f"time budget {_clock(self.seconds)}: {self.done} of {self.total} cases took {_clock(elapsed)}, the "
               f"{remaining} left at {case_seconds:.1f} s each project to {_clock(projected)}")
        if tta:
            return False, folds, f"{why}; dropping test-time augmentation (8 mirrorings -> 1)"
        if folds > 1:
            per_fold = case_seconds / folds
            allowed = max(self.seconds - elapsed, 0.0) / remaining
            keep = min(folds - 1, max(1, int(allowed // per_fold)))
            return tta, keep, f"{why}; dropping folds ({folds} -> {keep})"
        if not self.said_exhausted:
            self.said_exhausted = True
            return tta, folds, f"{why}; already one fold without test-time augmentation, going on"
        return tta, folds, None


def case_folders(input_dir: Path) -> list[Path]:
    """The case folders of the challenge's input (`<input>/<case id>/`), sorted; DataError when there are none."""
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise DataError(f"{input_dir}: input folder not found")
    # Each real folder once (a link to a case folder already listed, or back to the input, is skipped).
    here = input_dir.stat()
    seen, folders = {(here.st_dev, here.st_ino)}, []
    for path in sorted(p for p in input_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        real = path.stat()
        if (real.st_dev, real.st_ino) not in seen:
            seen.add((real.st_dev, real.st_ino))
            folders.append(path)
    if not folders:
        raise DataError(f"{input_dir}: no case folders (expected {input_dir}/<case id>/<case id>-t1c.nii.gz, ...)")
    return folders


def _check_output(input_dir: Path, output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise DataError(f"{output_dir}: the output is a file, not a folder; give a folder for <case id>.nii.gz")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{output_dir}: cannot create the output folder ({exc.strerror})") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise DataError(f"{output_dir}: output folder is not writable by uid {os.getuid()}")
    resolved_in, resolved_out = input_dir.resolve(), output_dir.resolve()
    if resolved_out == resolved_in or resolved_in in resolved_out.parents:
        raise ConfigError(f"{output_dir}: the output folder is inside the input folder {input_dir}, which is never "
                          "written to")


@dataclass
class ServeReport:
    written: list[Path]
    failures: CaseFailures
    changes: list[str]
    cases: int


def serve(predictor, input_dir: Path, output_dir: Path, *, tta: bool = True, time_budget_s: float | None = None,
          say: Callable[[str], None] = print) -> ServeReport:
    """Segment every case folder of `input_dir` into `output_dir` (see the module docstring) with the loaded
    models of `predictor` (`evaluate.predicting.Predictor`); the caller raises on the report's failures."""
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    folders = case_folders(input_dir)
    _check_output(input_dir, output_dir)
    config = predictor.config
    failures = CaseFailures(say=say)
    budget = TimeBudget(time_budget_s, len(folders)) if time_budget_s is not None else None
    folds, written, changes = len(predictor.members), [], []
    say(f"serve-challenge: {len(folders)} case(s) from {input_dir} to {output_dir}; {predictor.description}"
        f"{', 8-mirror TTA' if tta else ''}; device {predictor.device}")
    for folder in folders:
        started = time.monotonic()
        with failures.case(folder.name):
            case = _one_case(folder, config)
            written.append(predict_case(case, config, predictor.members[:folds], predictor.device, output_dir,
                                        tta=tta, plan=predictor.plan, probabilities=False, say=None))
            say(f"{case.case_id}: {time.monotonic() - started:.1f} s ({folds} fold(s){', TTA' if tta else ''})")
        if budget is not None:
            tta, folds, change = budget.after_case(time.monotonic() - started, tta, folds)
            if change is not None:
                changes.append(change)
                say(change)
    return ServeReport(written, failures, changes, len(folders))


def _one_case(folder: Path, config):
    """The one case of a case folder, read with the bundle's modalities and label table."""
    cases = discover_cases(folder, config.data.edition, config.data.modalities, config.data.challenge)
    if len(cases) != 1:
        raise DataError(f"case {folder.name}: the folder holds {len(cases)} cases "
                        f"({', '.join(c.case_id for c in cases[:3])}); expected one")
    return cases[0]
