"""The project's own error types and the exit codes they map to.

Every failure we can foresee is raised as a `BratsSwapError` subclass with a one-line message that names
the file, case or setting and the problem; the CLI prints that line and exits with `exit_code`, and only
`--debug` shows a traceback. Exit codes are documented in docs/failures.md.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 1
EXIT_USAGE = 2
EXIT_OUT_OF_MEMORY = 3
EXIT_LOCKED = 75
EXIT_INTERRUPTED = 130


class BratsSwapError(Exception):
    """Base class: a foreseeable failure with a one-line, user-facing message."""

    exit_code: int = EXIT_BAD_INPUT


class DataError(BratsSwapError):
    """Bad input data: a case, file or folder that cannot be used (exit 1)."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(BratsSwapError):
    """Unknown key, wrong type, impossible value or missing config file (exit 2)."""

    exit_code = EXIT_USAGE


class CheckpointError(BratsSwapError):
    """A checkpoint that is missing, corrupted or does not match the model (exit 1)."""

    exit_code = EXIT_BAD_INPUT


class DeviceOutOfMemoryError(BratsSwapError):
    """The device ran out of memory; the message carries the planner's advice (exit 3)."""

    exit_code = EXIT_OUT_OF_MEMORY


class RunLockedError(BratsSwapError):
    """Another process holds this fold's lock, or the whole run's (exit 75, EX_TEMPFAIL: try later)."""

    exit_code = EXIT_LOCKED


class TrainingInterrupted(BratsSwapError):
    """Ctrl-C: the running step finished and the state was saved; the run can be resumed (exit 130).

    A scheduler's SIGTERM/SIGUSR1 and `cv --max-hours` are planned stops, not this error: they save the state
    too and exit 0.
    """

    exit_code = EXIT_INTERRUPTED


class PlannedStop(TrainingInterrupted):
    """A stop someone planned (SIGTERM/SIGUSR1) where the command still ends unfinished with exit 130, because
    its caller must tell "stopped, run me again" from "done" (`train-challenge`: the organisers' runner). The
    state is saved as for Ctrl-C; the CLI prints the line as `stopped: ...`, not as an error."""


class PreparationInterrupted(BratsSwapError):
    """Ctrl-C while cases were being prepared (`data prepare`, or a run's prepare step): the finished cases are
    kept in the cache, and the same command prepares the rest (exit 130)."""

    exit_code = EXIT_INTERRUPTED


class NumericalError(BratsSwapError):
    """A NaN/Inf loss stopped training; the last good checkpoint is kept (exit 1)."""

    exit_code = EXIT_BAD_INPUT


class DiskError(BratsSwapError, OSError):
    """A file could not be written: disk full, quota, permissions or a read-only file system (exit 1).

    Raised by `brats_swap.atomic` instead of the bare OSError, after the temporary file was removed, so the
    previous version of the file is still in place. Also an OSError, so callers that already handle
    OSError (e.g. to add the case id) keep working.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, errno: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.filename = filename
        self.strerror = message

    def __str__(self) -> str:
        return self.args[0]


def user_message(exc: BaseException) -> str:
    """The error's own message. A DataLoader worker re-raises the worker's error with the worker's whole
    traceback as the message ("Caught DataError in DataLoader worker process 0. Original Traceback ...");
    its last line is the original one-line message."""
    text = str(exc)
    if "DataLoader worker process" not in text or "Traceback" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    prefix = f"{type(exc).__module__}.{type(exc).__qualname__}: "
    return last[len(prefix):] if last.startswith(prefix) else last


def case_problem(case_id: str, exc: BaseException) -> str | None:
    """The one line that skips a case, for `exc` raised while that case was read or segmented; None when `exc`
    must stop the command instead. A case's problem is a DataError, or any exception that is not the project's
    own (a RecursionError from a file nested too deeply, a library's error on a strange file): the case is
    skipped and the others go on (`data check`, `data prepare`, `predict`, `serve-challenge`). Not a case's
    problem: the project's other errors (a config value, a full disk: every case would fail alike) and running
    out of memory (the machine's limit, exit 3 with advice; what one case may take is priced before it is read),
    on the host (MemoryError) or on the card (torch's OutOfMemoryError, matched by name: no torch import here)."""
    if isinstance(exc, DataError):
        return str(exc)
    if (not isinstance(exc, Exception) or isinstance(exc, BratsSwapError | MemoryError)
            or type(exc).__name__ == "OutOfMemoryError"):
        return None
    return f"case {case_id}: {type(exc).__name__}: {' '.join(str(exc).split())[:200] or 'no message'}"
