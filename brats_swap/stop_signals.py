"""The signals that ask a run to stop, and the one way this package handles them.

- `SCHEDULER_SIGNALS`: a scheduler's warnings, SIGTERM (a plain kill, a preemption) and SIGUSR1 (SLURM's
  `--signal=B:USR1@N`). A run answers them by saving its state and exiting 0; a requeued job resumes it.
- `STOP_SIGNALS`: those and Ctrl-C (SIGINT), which stops with exit 130.

`handled(signals, handler)` installs a handler for the length of a block and restores the previous ones
after it; handlers can only be installed from the main thread, so elsewhere it installs nothing and the
signals keep their previous meaning. A handler writes with `say` (os.write), not through the console:
it may run while the console holds its lock. `ignore(signals)` is for child processes whose parent
decides when to stop (cross-validation's fold workers and followers, DataLoader workers, the data preparation's
workers): the signals that reach the whole process group must not kill them under the parent; `held_back`
keeps them from a worker that is still starting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

SCHEDULER_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, *SCHEDULER_SIGNALS)

Handler = Callable[[int, Any], None]


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def handled(signals: Iterable[int], handler: Handler) -> Iterator[bool]:
    """While in the block, `handler` receives `signals`; the previous handlers come back after it. Yields
    whether the handler was installed (False off the main thread, where Python cannot install one)."""
    if not on_main_thread():
        yield False
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield True
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


@contextlib.contextmanager
def held_back(signals: Iterable[int] = SCHEDULER_SIGNALS) -> Iterator[None]:
    """In the block, `signals` wait (blocked, not lost) and arrive at its end. For starting worker processes
    that `ignore` them: a child starts with its parent's blocked signals, so one sent to the whole group while
    the child still imports cannot kill it before it ignores them. Main thread only; elsewhere nothing is held."""
    signals = tuple(signals)
    if not on_main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """From now on `signals` do nothing to this process (its parent decides when to stop)."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


# The mark `distributed.launch_torchrun` puts in the ranks' environment: the SIG_IGN of SCHEDULER_SIGNALS they
# inherit was meant for torchrun alone. Here, not in `distributed` (torch), because `python -m brats_swap`
# reads it before anything else is imported.
SHIELDED_ENV = "BRATS_SWAP_TORCHRUN_IGNORES_STOP_SIGNALS"


def restore_after_torchrun() -> None:
    """In a rank started by `distributed.launch_torchrun`: SIGTERM/SIGUSR1 back to their default action
    (torchrun passed on its SIG_IGN), so a rank that is not training yet still ends on them."""
    if os.environ.get(SHIELDED_ENV) != "1":
        return
    for sig in SCHEDULER_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def name(signum: int) -> str:
    """`signal.SIGTERM` -> "SIGTERM"."""
    return signal.Signals(signum).name


def say(text: str) -> None:
    """One line on stderr from inside a signal handler (os.write is safe there; the console may be locked)."""
    os.write(2, f"{text}\n".encode())
