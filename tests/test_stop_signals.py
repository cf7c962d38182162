"""brats_swap/stop_signals.py: the one place that installs, ignores and restores the stop signals."""

from __future__ import annotations

import os
import signal
import threading

from brats_swap import stop_signals


def test_the_stop_signals_are_ctrl_c_and_the_schedulers_warnings():
    assert stop_signals.SCHEDULER_SIGNALS == (signal.SIGTERM, signal.SIGUSR1)
    assert stop_signals.STOP_SIGNALS == (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def test_handled_installs_for_the_block_and_restores_after_it():
    received = []
    before = {sig: signal.getsignal(sig) for sig in stop_signals.SCHEDULER_SIGNALS}
    with stop_signals.handled(stop_signals.SCHEDULER_SIGNALS, lambda signum, frame: received.append(signum)) as on:
        assert on
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGUSR1, signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in stop_signals.SCHEDULER_SIGNALS} == before


def test_handled_off_the_main_thread_installs_nothing():
    before = signal.getsignal(signal.SIGUSR1)
    seen = []

    def worker():
        with stop_signals.handled([signal.SIGUSR1], lambda signum, frame: None) as on:
            seen.append((on, signal.getsignal(signal.SIGUSR1)))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(False, before)]


def test_ignore_leaves_the_signals_to_the_parent():
    before = {sig: signal.getsignal(sig) for sig in stop_signals.STOP_SIGNALS}
    try:
        stop_signals.ignore()
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in stop_signals.STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process under the default handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
