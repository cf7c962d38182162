"""brats_swap/stop_reasons.py: one enum for why a run stopped, used by the loop, StopControl and the cv runners."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import queue
import signal
import threading
from pathlib import Path

import pytest
import torch

from brats_swap import stop_signals
from brats_swap.config import Config
from brats_swap.cv.parallel import WorkerContext, WorkerStop
from brats_swap.cv.runner import CVOutcome
from brats_swap.cv.stop_control import StopControl
from brats_swap.stop_reasons import StopReason
from brats_swap.train.loop import StopSignals


def test_each_reason_keeps_the_string_the_logs_were_written_with():
    # train.log, cv.log and the terminal lines of older runs carry these strings: a member must read the same.
    assert {reason.name: f"{reason}" for reason in StopReason} == {
        "SIGINT": "SIGINT", "SIGTERM": "SIGTERM", "SIGUSR1": "SIGUSR1", "MAX_HOURS": "max-hours",
        "PARENT_STOPPED": "stopped by the parent", "PARENT_EXITED": "parent exited",
        "OTHER_RANK": "a signal on another rank", "UNFINISHED": "interrupted"}
    assert StopReason("max-hours") is StopReason.MAX_HOURS and StopReason.SIGTERM == "SIGTERM"
    assert str(StopReason.PARENT_EXITED) == "parent exited"
    assert pickle.loads(pickle.dumps(StopReason.SIGUSR1)) is StopReason.SIGUSR1  # a worker's report


def test_every_stop_signal_is_a_reason_and_only_ctrl_c_interrupts():
    reasons = [StopReason.from_signal(sig) for sig in stop_signals.STOP_SIGNALS]
    assert reasons == [StopReason.SIGINT, StopReason.SIGTERM, StopReason.SIGUSR1]
    assert [reason.is_interrupt for reason in reasons] == [True, False, False]


def test_the_training_loops_flag_is_a_reason_and_sets_the_level():
    signals = StopSignals()
    signals._handle(signal.SIGTERM, None)
    assert signals.requested == StopReason.SIGTERM and signals.level == StopSignals.STOP
    # The training result carries the flag out as a plain string: a torch.save of it loads with weights_only.
    buffer = io.BytesIO()
    torch.save({"reason": signals.requested}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"reason": "SIGTERM"}
    signals._handle(signal.SIGINT, None)  # Ctrl-C after a scheduler's warning still means "stop and tell me"
    assert signals.requested == StopReason.SIGINT and signals.level == StopSignals.INTERRUPT
    with pytest.raises(KeyboardInterrupt):
        signals._handle(signal.SIGINT, None)


def test_stop_control_holds_a_member_whether_given_one_or_its_string():
    clock = iter([0.0, 0.0, 7200.0])
    window = StopControl(1.0, clock=lambda: next(clock))
    assert not window() and window()
    assert window.reason is StopReason.MAX_HOURS
    requested = StopControl(None)
    requested.request("SIGTERM")  # e.g. a result that carries the signal's name
    requested.request(StopReason.SIGUSR1)  # the first reason stays
    assert requested.reason is StopReason.SIGTERM


def test_the_summary_line_says_each_reason_in_prose(tmp_path: Path):
    def line(reason):
        return CVOutcome(run_dir=tmp_path, folds=[0], stop_reason=reason).describe()

    assert "stopped (the --max-hours window closed at an epoch boundary)" in line(StopReason.MAX_HOURS)
    assert "stopped (SIGUSR1 received)" in line(StopReason.SIGUSR1)
    assert "stopped (stopped) with the checkpoint written" in line(StopReason.UNFINISHED)


def test_a_worker_names_the_parents_stop_and_the_parents_exit():
    event = threading.Event()
    told = WorkerStop(None, event, os.getppid())
    assert not told()
    event.set()
    assert told() and told.reason is StopReason.PARENT_STOPPED
    orphan = WorkerStop(None, threading.Event(), parent_pid=-1)  # not this process's parent
    assert orphan.time_is_up() and orphan.reason is StopReason.PARENT_EXITED


def test_the_worker_context_gives_each_fold_its_device_threads_and_stop(monkeypatch, config_for_workers):
    devices: queue.Queue[str] = queue.Queue()
    devices.put("cpu")
    event = threading.Event()
    context = WorkerContext(stop_event=event, devices=devices, parent_pid=os.getppid(), threads=1)
    monkeypatch.setattr("brats_swap.cv.parallel._own_the_process", lambda: None)  # keep this process's signals
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)  # and its threads
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # restored after the test
    monkeypatch.setattr(WorkerContext, "current", None)
    context.enter()
    assert WorkerContext.current is context and context.device == "cpu" and devices.empty()
    config = context.fold_config(config_for_workers)
    assert (config.train.device, config.train.threads) == ("cpu", 1)
    stop = context.stop_control(None)
    event.set()
    assert stop() and stop.reason is StopReason.PARENT_STOPPED


@pytest.fixture
def config_for_workers():
    config = Config()
    return dataclasses.replace(config, train=dataclasses.replace(config.train, device="auto", threads=None))
