"""What makes a run folder safe under cron and on a cluster: its locks.

Locks are `fcntl.flock` locks, which the kernel drops when the process dies, even by SIGKILL, so there is
never a stale lock to clean up by hand; on a file system without working flock (some Lustre mounts), a
one-line error says so instead of pretending. Three kinds:

- a fold's lock (`.fold_<k>.lock` in the run folder, exclusive, non-blocking): one process per fold; a second `cv --fold K`
  (or `train --fold K`) for the same K fails at once with `RunLockedError` (exit 75, EX_TEMPFAIL). Different
  folds of one run train at once, on one machine or on several sharing the run folder;
- the run's `.lock`: held *shared* by every process working on folds of the run, *exclusive* by `run_lock`
  (`compare` on its arms), so nothing trains a fold while the whole run is held;
- the run's shared files (`splits.json`, `cv_summary.*`, `postprocessing.json`, `cv.log`) are written in
  short critical sections (`shared_files`) that wait for each other, with a timeout.

When to stop (the `--max-hours` window, a scheduler's signal) is `cv.stop_control.StopControl`'s business.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from brats_swap.errors import DataError, RunLockedError
from brats_swap.run.folder import RunFolder

# The run-level file locks: `.lock` (held shared by every process working on some folds of the run, exclusive
# by `run_lock`) and `.shared.lock` (the short critical sections around the run's shared files).
SHARED_FILES_LOCK = ".shared.lock"


def fold_holder(run_dir: RunFolder | Path, fold: int) -> str | None:
    """Who works on the fold now (`holder_record`'s text, '' if unknown), None when nobody does."""
    path = fold_lock_path(RunFolder.of(run_dir), fold)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, path):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return os.pread(fd, 256, 0).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def fold_lock_path(run: RunFolder, fold: int) -> Path:
    """In the run folder, not the fold's: taking the lock must not create (or change) the fold folder."""
    return run.root / f".fold_{fold}.lock"


# How long a process waits for another's critical section (preparing the cases the cache lacks is the long
# one: the first array task prepares, the others wait and then find the cache fresh).
SHARED_FILES_TIMEOUT_S = 2 * 3600.0


# The lock files this process has open. A forked child (a DataLoader worker) inherits the descriptors, and
# a flock belongs to the open file description they share: the kernel drops it only when the last of them
# closes, so a worker that outlives its SIGKILLed parent by a few seconds would keep the fold locked and
# refuse the rerun. Every forked child closes its copies at once: close, never LOCK_UN, which would unlock
# the parent's lock too.
_OPEN_LOCK_FDS: set[int] = set()


def _close_inherited_lock_files() -> None:
    for fd in _OPEN_LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_lock_files)


def _open_lock_file(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No O_TRUNC: the file may belong to the process that holds the lock. O_CLOEXEC keeps programs we
    # exec from inheriting (and so prolonging) the lock.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _OPEN_LOCK_FDS.add(fd)
    return fd


def _close_lock_file(fd: int, *, unlock: bool) -> None:
    """Release and close a descriptor of `_open_lock_file`; nothing in a forked child, which closed it at the
    fork (the descriptor number may belong to another file there)."""
    if fd not in _OPEN_LOCK_FDS:
        return
    _OPEN_LOCK_FDS.discard(fd)
    try:
        if unlock:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _flock(fd: int, operation: int, path: Path) -> bool:
    """flock; False when another process holds it (non-blocking), a one-line error where flock does not work."""
    try:
        fcntl.flock(fd, operation)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise DataError(
                f"{path}: this file system does not support flock ({exc.strerror}), so two jobs could train one "
                "fold at once; mount it with flock support (Lustre: -o flock) or put the run folder on one that has it"
            ) from None
        raise


def holder_record() -> str:
    """Who holds a lock, written into its file: `pid host [SLURM job]` (`cv --status` shows it)."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"{os.getpid()} {socket.gethostname()}" + (f" {job}" if job else "")


def describe_holder(text: str) -> str:
    """' (pid P on HOST, SLURM job J)' from a lock file's `holder_record`; '' when there is none."""
    parts = text.split()
    if not parts or not parts[0].isdigit():
        return ""
    where = f" on {parts[1]}" if len(parts) > 1 else ""
    job = f", SLURM job {parts[2]}" if len(parts) > 2 else ""
    return f" (pid {parts[0]}{where}{job})"


def _read_holder(fd: int) -> str:
    try:
        return describe_holder(os.pread(fd, 256, 0).decode("ascii", "replace"))
    except OSError:
        return ""


@contextlib.contextmanager
def _held(path: Path, operation: int, busy_message: Callable[[str], str], *, write_pid: bool) -> Iterator[Path]:
    fd = _open_lock_file(path)
    try:
        locked = _flock(fd, operation | fcntl.LOCK_NB, path)
    except BaseException:
        _close_lock_file(fd, unlock=False)
        raise
    if not locked:
        holder = _read_holder(fd)
        _close_lock_file(fd, unlock=False)
        raise RunLockedError(busy_message(holder)) from None
    try:
        if write_pid:  # only an exclusive holder writes who it is, so the message above can name it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder_record()}\n".encode(), 0)
        yield path
    finally:
        _close_lock_file(fd, unlock=True)


def run_lock(run_dir: RunFolder | Path) -> contextlib.AbstractContextManager[Path]:
    """Hold the whole run folder for the block (non-blocking): no other process works on any of its folds."""
    return _run_level_lock(run_dir, exclusive=True)


def run_share(run_dir: RunFolder | Path) -> contextlib.AbstractContextManager[Path]:
    """Work on some folds of the run (non-blocking): many processes at once, none while `run_lock` is held."""
    return _run_level_lock(run_dir, exclusive=False)


def _run_level_lock(run_dir: RunFolder | Path, exclusive: bool) -> contextlib.AbstractContextManager[Path]:
    run = RunFolder.of(run_dir)

    def busy(holder: str) -> str:
        # `.lock` names its exclusive holder only: processes sharing it write nothing, so a refused exclusive
        # request cannot say who they are.
        who = " is working on this run" if exclusive else f"{holder} holds the whole run"
        return (f"{run.root}: another brats-swap process{who} (lock {run.lock}); nothing was changed, try again "
                "when it has finished")

    return _held(run.lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, busy, write_pid=exclusive)


@contextlib.contextmanager
def fold_locks(run_dir: RunFolder | Path, folds: list[int]) -> Iterator[None]:
    """Hold the locks of `folds` for the block (non-blocking, in fold order): one process per fold.

    A fold another process holds raises RunLockedError (exit 75) before anything of it is touched.
    """
    run = RunFolder.of(run_dir)
    with contextlib.ExitStack() as stack:
        for k in sorted(folds):
            path = fold_lock_path(run, k)
            stack.enter_context(_held(path, fcntl.LOCK_EX, lambda holder, k=k, path=path: (
                f"{run.root}: fold {k} is being worked on by another brats-swap process{holder} (lock {path}); "
                "nothing was changed, try again when it has finished"), write_pid=True))
        yield


@contextlib.contextmanager
def fold_work(run_dir: RunFolder | Path, folds: list[int]) -> Iterator[None]:
    """`run_share` and `fold_locks` together: what `brats-swap train --fold K` holds while it trains."""
    with run_share(run_dir), fold_locks(run_dir, folds):
        yield


@contextlib.contextmanager
def shared_files(run_dir: RunFolder | Path, timeout_s: float = SHARED_FILES_TIMEOUT_S,
                 poll_s: float = 0.2) -> Iterator[None]:
    """A short critical section over the run's shared files (splits.json, cv_summary.*, postprocessing.json,
    cv.log): waits for another process's section, up to `timeout_s` (then RunLockedError, exit 75)."""
    run = RunFolder.of(run_dir)
    path = run.root / SHARED_FILES_LOCK
    fd = _open_lock_file(path)
    deadline = time.monotonic() + timeout_s
    try:
        while not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path):
            if time.monotonic() >= deadline:
                raise RunLockedError(f"{path}: another brats-swap process held the run's shared files for more "
                                     f"than {timeout_s:.0f} s; nothing was changed, try again later")
            time.sleep(poll_s)
    except BaseException:
        _close_lock_file(fd, unlock=False)
        raise
    try:
        yield
    finally:
        _close_lock_file(fd, unlock=True)
