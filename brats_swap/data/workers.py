"""Per-case work on every core: how many processes (`auto`), and one loop that runs a case function over a
dataset in a process pool with a progress bar, or plain progress lines when the output is not a terminal.

`data check` and `data prepare` (also the prepare step of train/cv/compare) use it; the training loader sizes
its workers from the same `available_cpus`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from multiprocessing import get_context
from typing import Any

from rich.console import Console

from brats_swap import stop_signals
from brats_swap.progress import ProgressLines, progress_bar

# A progress line at least this often when the output is not a terminal (STANDARDS: at least every 60 s).
PROGRESS_LINE_SECONDS = 60.0
# How often a worker looks whether its parent is still there (`_init_worker`).
ORPHAN_POLL_SECONDS = 1.0


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity (a SLURM allocation or `taskset` narrows it), else the
    machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def resolve_workers(value: int | str) -> int:
    """`data.prepare_workers` (or `--workers`): `auto` is every available CPU, a number is taken as it is."""
    if value == "auto":
        return available_cpus()
    return max(1, int(value))


def log_console(console: Console | None) -> Console:
    """`console`, or a plain one on stderr (where the CLI's lines of long work go) when the caller gave none."""
    return console if console is not None else Console(stderr=True, highlight=False, soft_wrap=True)


def run_cases(fn: Callable[..., Any], jobs: Sequence[tuple], workers: int, *, done: Callable[[Any], None],
              failures: Callable[[], int], description: str, progress: bool = True,
              console: Console | None = None) -> None:
    """Call `fn(*job)` for every job, `done(result)` in this process as each one finishes (in finishing order).

    `workers` > 1 runs them in that many spawned processes (spawn, not fork: a forked child of a process that
    already ran torch/OpenMP threads can hang); the workers ignore the stop signals (they leave when their
    parent is gone), so on Ctrl-C the cases being prepared finish and the caller records them, while those not
    started are cancelled.
    Progress: a rich bar on a terminal; otherwise a line at least every `PROGRESS_LINE_SECONDS` with done/total,
    rate, time left and `failures()` so far."""
    console = log_console(console)
    lines = ProgressLines(description, len(jobs), console=console, unit="case", every_s=PROGRESS_LINE_SECONDS) \
        if progress and not console.is_terminal else None
    show_bar = progress and console.is_terminal and bool(jobs)
    with progress_bar("[bold]{task.description}", console=console) if show_bar else nullcontext() as bar:
        task = bar.add_task(description, total=len(jobs)) if bar is not None else None
        finished = 0

        def advance(result: Any) -> None:
            nonlocal finished
            done(result)
            finished += 1
            if bar is not None:
                bar.advance(task)
            if lines is not None:
                lines.update(finished, f"{failures()} failed")

        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                advance(fn(*job))
            return
        _run_in_pool(fn, jobs, min(workers, len(jobs)), advance,
                     lambda: lines.update(finished, f"{failures()} failed") if lines is not None else None)


def _run_in_pool(fn, jobs, workers: int, advance, tick) -> None:
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
        pending: set[Future] = set()
        try:
            with stop_signals.held_back():  # the workers start here (see _init_worker)
                pending = {pool.submit(fn, *job) for job in jobs}
            while pending:
                # Wakes at least every interval, so a slow case still gets its progress line.
                done, pending = wait_futures(pending, timeout=PROGRESS_LINE_SECONDS / 2, return_when=FIRST_COMPLETED)
                for future in done:
                    advance(future.result())
                if not done:
                    tick()
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core already; more threads would oversubscribe
    # The stop signals reach the whole process group (Ctrl-C, `docker stop`, a shell's kill): the main process
    # decides (it cancels the cases not started and waits for the running ones, or stops at once); a worker
    # finishes the case it holds so that it is recorded, and one killed under the parent would break the pool
    # during the parent's own orderly stop. They were held back while the worker started (`_run_in_pool`).
    stop_signals.ignore(stop_signals.STOP_SIGNALS)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals.SCHEDULER_SIGNALS)
    # A worker that ignores SIGTERM outlives a parent that SIGTERM (or SIGKILL) ended, waiting on the pool's
    # queue forever: it watches its parent instead and leaves when the parent is gone.
    threading.Thread(target=_leave_when_orphaned, args=(os.getppid(),), daemon=True, name="parent-watch").start()


def _leave_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_SECONDS)
    os._exit(1)
