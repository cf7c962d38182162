"""`brats-swap ARGS` in a process forked from the test process, for the tests that SIGKILL a command and then
read what it left on disk (tests/test_failures/test_crashes.py, tests/test_cv_integration.py,
tests/test_trainable_stop.py, tests/test_group_signals.py).

A fresh interpreter spends about 3.5 s of CPU importing torch and `torch._dynamo` (the first optimizer imports
it) before a tiny command does a tenth of that in work; a fork starts with what the test process has imported.
What these tests check is the same in both: a real process, killed through the kernel at a moment no handler
can see, and the files it wrote until then (its temporary files named with its pid, which a rerun removes once
that pid has gone). What a process does as it ends by itself (its exit code, its last lines, no traceback, its
handlers of SIGTERM and SIGINT) is for fresh interpreters (`python -m brats_swap`, tests/signal_hook.py): there
the interpreter's own start and end are part of what is tested.

The child takes fresh standard streams on files, the signal dispositions of a fresh interpreter and one torch
thread (as `OMP_NUM_THREADS=1` gives a fresh one), runs the CLI's `main` and leaves with `os._exit`: nothing of
the test process (pytest's capture, its atexit, its temporary folders) runs in it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from signal_hook import install

# What a fresh interpreter starts with (Python's own SIGINT handler; the default for the rest).
_FRESH_DISPOSITIONS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                       signal.SIGUSR1: signal.SIG_DFL, signal.SIGUSR2: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}


def _run_child(args: list[str], signal_at: str | None, cwd: Path | None, stdout: Path, stderr: Path,
               new_session: bool) -> None:
    code = 1
    try:
        if new_session:
            os.setsid()
        for signum, disposition in _FRESH_DISPOSITIONS.items():
            signal.signal(signum, disposition)
        for fd, path in ((1, stdout), (2, stderr)):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115
        if cwd is not None:
            os.chdir(cwd)
        import torch

        torch.set_num_threads(1)
        if signal_at is not None:
            install(signal_at)
        sys.argv = ["brats-swap", *args]
        from brats_swap.cli.main import main

        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the interpreter's last word, as a fresh one would print it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - leaving anyway
                pass
        os._exit(code)


class ForkedCli:
    """`brats-swap ARGS` forked from this process, its output in two files; a `subprocess.Popen`'s `pid`,
    `poll`, `wait`, `send_signal` and `returncode` (negative: the signal that ended it). `new_session`: in a
    session of its own, as `Popen(start_new_session=True)` (its process group is the job)."""

    def __init__(self, args: list, *, signal_at: str | None = None, cwd: Path | None = None,
                 new_session: bool = False) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="forked-cli-"))
        self.stdout_path, self.stderr_path = self._folder / "stdout", self._folder / "stderr"
        self.args = [str(a) for a in args]
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(self.args, signal_at, cwd, self.stdout_path, self.stderr_path, new_session)
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far."""
        return (self.stdout_path.read_text(errors="backslashreplace"),
                self.stderr_path.read_text(errors="backslashreplace"))

    def __enter__(self) -> ForkedCli:
        return self

    def __exit__(self, *exc_info) -> None:
        """Never leaves the child running (killed and reaped) nor its output files."""
        if self.poll() is None:
            self.kill()
            self.wait()
        for path in (self.stdout_path, self.stderr_path):
            path.unlink(missing_ok=True)
        self._folder.rmdir()


def run_forked(args: list, *, signal_at: str | None = None, cwd: Path | None = None, timeout: float = 120
               ) -> subprocess.CompletedProcess:
    """`ForkedCli` to its end, as `subprocess.run(..., capture_output=True, text=True, timeout=timeout)`."""
    with ForkedCli(args, signal_at=signal_at, cwd=cwd) as child:
        child.wait(timeout)
        stdout, stderr = child.output()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
