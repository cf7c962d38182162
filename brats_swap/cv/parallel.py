"""`brats-swap cv run --parallel-folds N`: the same cross-validation as the sequential runner, N folds at a time.

`run_cv` (cv/dispatch.py) comes here when `parallel_folds > 1`. The parent process does what the sequential
runner does (the same `cv_invocation`: run lock first, `--max-hours`, SIGTERM, the cv.log line; missing
cases prepared and splits.json made once; the summary at the end) and, while it holds the lock, hands the unfinished folds to a pool
of N worker processes (`concurrent.futures.ProcessPoolExecutor` with the `spawn` start method: fresh
interpreters, no CUDA state copied by fork). Each worker advances one fold exactly as the sequential runner
does, through the same `FoldRunner.advance` (resume from checkpoint_latest.pt, train, write
fold_<k>/state.json, evaluate), so resume and the per-fold files are identical; folds only touch their own
`fold_<k>/` folder, so they cannot collide.

Devices: on CUDA worker i trains on GPU i (`train.device=cuda:i`, also made its current device, so streams
and caches land there too); with more workers than GPUs they share GPUs round-robin. On CPU each worker gets
the available CPUs (its affinity, a SLURM allocation) / N threads unless `train.threads` says otherwise.

Stopping: the parent turns SIGTERM and the `--max-hours` window into a shared event; every worker checks it
at each epoch boundary (and before starting or evaluating a fold), saves its checkpoint there and returns,
as the sequential runner does. A signal to the whole process group (`timeout`, SLURM) also reaches each
worker: outside training the worker ignores it (the parent's event decides), while a fold trains the
training loop's own handlers take it and stop at the next step, as in a sequential run. A worker also stops when its parent has gone (the lock died with it, so a
new invocation may start). The lock itself is held by the parent only; workers are started while it is
held and are all waited for before it is released.

Worker output (progress, warnings) goes to `fold_<k>/cv_worker.log` instead of interleaving on the
terminal; the parent prints one line per fold as it finishes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from brats_swap import stop_signals
from brats_swap.config import Config
from brats_swap.cv.fold_progress import fold_standing
from brats_swap.cv.invocation import cv_invocation
from brats_swap.cv.lock import fold_locks
from brats_swap.cv.runner import CVOutcome, FoldRunner, prepared_runner, resolve_folds
from brats_swap.cv.stop_control import StopControl
from brats_swap.data.workers import available_cpus
from brats_swap.errors import ConfigError
from brats_swap.run.folder import CV_WORKER_LOG, RunFolder
from brats_swap.stop_reasons import StopReason


@dataclass
class ParallelCVOutcome(CVOutcome):
    parallel: int = 1
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)  # fold -> pid, device, start/end (monotonic)

    def describe(self) -> str:
        return f"{super().describe()} ({self.parallel} fold(s) at a time)"


def worker_devices(config: Config, parallel: int) -> list[str]:
    """The device each of the `parallel` workers trains on ("cuda:<physical index>" or "cpu")."""
    import torch

    wants_cuda = config.train.device.startswith("cuda") or (config.train.device == "auto" and torch.cuda.is_available())
    if not wants_cuda:
        return ["cpu"] * parallel
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(f"train.device: {config.train.device!r} requested but CUDA is not available")
    return [f"cuda:{i % count}" for i in range(parallel)]


def run_parallel_folds(config: Config, run_dir: Path, folds: str | int | list[int] = "all",
                       max_hours: float | None = None, *, parallel: int = 2, console=None) -> ParallelCVOutcome:
    """The sequential runner with up to `parallel` folds training at once (see the module docstring).

    Same guarantees: RunLockedError (exit 75) at once if another process holds the run; a planned stop
    (--max-hours, SIGTERM) is exit 0 with every running fold checkpointed at an epoch boundary; the summary
    files and the cv.log line are the sequential runner's.
    """
    if parallel < 1:
        raise ConfigError(f"--parallel-folds {parallel}: must be at least 1")
    run_dir = Path(run_dir)
    outcome = ParallelCVOutcome(run_dir=run_dir, folds=[], parallel=parallel)
    # time.monotonic is system-wide on Linux, so the workers can share the parent's deadline.
    with cv_invocation(run_dir, config, max_hours, outcome, outcome.describe_or_not_started,
                       clock=time.monotonic) as stop:
        # The cases prepared here, before any worker reads the cache; splits.json made under the lock.
        runner = prepared_runner(config, run_dir, stop, console=console)
        outcome.folds, outcome.run_folds = resolve_folds(folds, runner.n_folds), runner.n_folds
        with fold_locks(run_dir, outcome.folds):  # held by this process for its workers
            pending = [k for k in outcome.folds if not fold_standing(run_dir, k).state.done]
            if pending:
                _run_folds(config, run_dir, pending, stop, outcome, parallel, console)
            runner.finish(outcome)
    return outcome


def _run_folds(config: Config, run_dir: Path, pending: list[int], stop: StopControl, outcome: ParallelCVOutcome,
               parallel: int, console) -> None:
    context = multiprocessing.get_context("spawn")
    stop_event = context.Event()
    devices = context.Queue()
    n_workers = min(parallel, len(pending))
    for device in worker_devices(config, n_workers):
        devices.put(device)
    threads = config.train.threads or max(1, available_cpus() // n_workers)
    error: BaseException | None = None

    def say(text: str) -> None:
        if console is not None:
            console.print(text)

    shared = WorkerContext(stop_event=stop_event, devices=devices, parent_pid=os.getpid(), threads=threads)
    with ProcessPoolExecutor(max_workers=n_workers, mp_context=context, initializer=WorkerContext.enter,
                             initargs=(shared,)) as pool:
        futures: dict[Future, int] = {
            pool.submit(_advance_fold, config, run_dir, k, stop.deadline): k for k in pending
        }
        say(f"[{config.name}] {len(pending)} fold(s) to advance, {n_workers} at a time; worker logs in "
            f"each fold's {CV_WORKER_LOG}")
        waiting = set(futures)
        try:
            while waiting:
                finished, waiting = wait(waiting, timeout=0.5, return_when=FIRST_COMPLETED)
                if stop.time_is_up() or error is not None:
                    stop_event.set()
                for future in finished:
                    fold = futures[future]
                    try:
                        report = future.result()
                    except BaseException as exc:  # a worker's error (pickled back) or a dead worker
                        error = error or exc
                        stop_event.set()
                        say(f"[{config.name}] fold {fold}: failed ({exc.__class__.__name__}: {exc})")
                        continue
                    _merge(outcome, fold, report)
                    if report["stop_reason"] is not None:
                        stop.request(report["stop_reason"])
                        stop_event.set()
                    say(f"[{config.name}] fold {fold}: {report['summary']}")
        except KeyboardInterrupt:
            # Ctrl-C reaches the workers too (same process group): they save at the step and return.
            stop_event.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if error is not None:
        raise error


def _merge(outcome: ParallelCVOutcome, fold: int, report: dict[str, Any]) -> None:
    part: CVOutcome = report["outcome"]
    outcome.started += part.started
    outcome.resumed += part.resumed
    outcome.evaluated += part.evaluated
    outcome.epochs_trained.update(part.epochs_trained)
    outcome.workers[fold] = {key: report[key] for key in ("pid", "device", "started", "ended")}


# --------------------------------------------------------------------------------------------------
# Inside a worker process

@dataclass
class WorkerContext:
    """What the workers of one pool share, handed to each by the pool's initializer (`enter`).

    The stop event and the device queue can only reach a worker when it starts (multiprocessing shares them
    by inheritance, not through a task's arguments), so the initializer keeps the context as the process's
    `WorkerContext.current` for the folds that worker then advances.
    """

    stop_event: Any  # set by the parent: stop at the next epoch boundary
    devices: Any  # a queue of the devices not yet taken; each worker takes one when it starts
    parent_pid: int
    threads: int  # torch threads when the config does not set train.threads
    device: str = ""  # the one this worker took

    current: ClassVar[WorkerContext | None] = None  # this process's context (None outside a worker)

    def enter(self) -> None:
        """The pool's initializer, in the new worker process: take a device, set threads and signals."""
        import torch

        self.device = self.devices.get()
        if self.device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(self.device))  # code that says just "cuda" means this GPU too
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        torch.set_num_threads(self.threads)
        _own_the_process()
        WorkerContext.current = self

    def stop_control(self, deadline: float | None) -> WorkerStop:
        return WorkerStop(deadline, self.stop_event, self.parent_pid)

    def fold_config(self, config: Config) -> Config:
        """`config` trained on this worker's device, with its thread share unless train.threads says."""
        train = dataclasses.replace(config.train, device=self.device)
        if train.threads is None:
            train = dataclasses.replace(train, threads=self.threads)
        return dataclasses.replace(config, train=train)


def _own_the_process() -> None:
    """Signals, start method and the parent's death as a fold worker needs them."""
    # Between folds the parent decides and tells us through stop_event; the training loop installs its own
    # handlers while a fold trains (a group signal then stops it at the next step).
    stop_signals.ignore(stop_signals.SCHEDULER_SIGNALS)
    # A spawned process makes spawn its default start method, so its DataLoaders would spawn their workers: a
    # fresh interpreter per worker and epoch, killed by a stop signal to the job before `seed_worker` can
    # ignore it. Forked, as in a sequential run, a worker ignores it from its first instruction.
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the parent dies, as training dies with the sequential runner.

    Otherwise a killed parent (whose lock the kernel releases) would leave folds training unlocked until
    their next epoch boundary, where `WorkerStop` notices the parent is gone.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the epoch-boundary check in WorkerStop remains


class WorkerStop(StopControl):
    """The worker's `stop_requested`: the parent's event, the parent's death, or this fold's epoch estimate
    against the shared --max-hours deadline (StopControl's own rule)."""

    def __init__(self, deadline: float | None, stop_event, parent_pid: int) -> None:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 1e-3) / 3600.0
        super().__init__(remaining, clock=time.monotonic)
        self.stop_event = stop_event
        self.parent_pid = parent_pid

    def _check_parent(self) -> None:
        if self.stop_event.is_set():
            self.request(StopReason.PARENT_STOPPED)
        elif os.getppid() != self.parent_pid:
            self.request(StopReason.PARENT_EXITED)

    def __call__(self) -> bool:
        self._check_parent()
        return super().__call__()

    def time_is_up(self) -> bool:
        self._check_parent()
        return super().time_is_up()


def _advance_fold(config: Config, run_dir: Path, fold: int, deadline: float | None) -> dict[str, Any]:
    started = time.monotonic()
    worker = WorkerContext.current
    if worker is None:
        raise RuntimeError("_advance_fold runs in a fold worker, after WorkerContext.enter")
    stop = worker.stop_control(deadline)
    device = worker.device
    config = worker.fold_config(config)
    part = CVOutcome(run_dir=Path(run_dir), folds=[fold])
    log_path = RunFolder(run_dir).fold(fold).cv_worker_log
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with _redirect_output(log_path):
        runner = FoldRunner(config, run_dir, stop, console=None)
        completed = runner.advance(fold, part)
    state = fold_standing(run_dir, fold).state
    reason = None if completed else stop.reason
    # The parent's own stop (event) is not news to it; report only what this worker decided by itself.
    if reason is StopReason.PARENT_STOPPED:
        reason = None
    summary = ("done" if state.done else f"stopped after epoch {state.epochs_completed}") + \
        f" (worker pid {os.getpid()}, {device})"
    return {"outcome": part, "stop_reason": reason, "pid": os.getpid(), "device": device, "started": started,
            "ended": time.monotonic(), "summary": summary}


class _redirect_output:
    """Send this process's stdout/stderr (file descriptors 1 and 2) to `path` for the block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in __exit__
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)

    def __exit__(self, *exc) -> None:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)
        self.file.close()


__all__ = ["ParallelCVOutcome", "WorkerContext", "WorkerStop", "run_parallel_folds", "worker_devices"]
