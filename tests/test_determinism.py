"""`train.deterministic` (run/device.py): the default runs cuDNN benchmark without deterministic algorithms on
CUDA; asked for, deterministic algorithms run and the ops without a deterministic kernel are collected once;
the engine's own buffers are never NaN-filled. CUDA is the rehearsed card of `memory.cuda_device` (it keeps
torch's argument rules), so `set_device` is checked too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from brats_swap.config import load_config
from brats_swap.memory import cuda_device
from brats_swap.run.device import NondeterministicOps, torch_settings


def _flags():
    return torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()


def test_the_default_on_cuda_is_cudnn_benchmark_without_determinism_and_sets_the_device():
    config = load_config(None, [])
    assert config.train.deterministic is False
    before = _flags()
    with cuda_device.rehearsal(24 << 30, device_count=2) as card:
        with torch_settings(config, torch.device("cuda", 1)) as nondeterministic:
            assert _flags() == (True, False) and nondeterministic is None
        assert ("set_device", 1, None) in card.calls  # a single-process run on cuda:1 makes it current
    assert _flags() == before
    with torch_settings(config, torch.device("cpu")) as nondeterministic:  # the CPU: nothing changes
        assert _flags() == before and nondeterministic is None


def test_prediction_on_cuda_n_makes_it_the_current_device(monkeypatch):
    """predict/evaluate on cuda:1 load each fold with that card current (its tiles and library handles
    would otherwise open a context on GPU 0, someone else's)."""
    from brats_swap.run import trained

    config = load_config(None, ["train.device=cuda:1"])
    monkeypatch.setattr(trained, "load_trained_model", lambda run, fold, checkpoint, device: (torch.nn.Identity(),
                                                                                             config, {}))
    monkeypatch.setattr(trained, "resolve_device", torch.device)  # the rehearsed card has no CUDA runtime behind it
    with cuda_device.rehearsal(24 << 30, device_count=2) as card:
        _, _, device = trained.load_for_inference(None, 0, "best", config)
    assert device == torch.device("cuda", 1) and ("set_device", 1, None) in card.calls


def test_asked_for_determinism_runs_deterministic_algorithms_and_lists_ops_once():
    config = load_config(None, ["train.deterministic=true"])
    seen = []
    with cuda_device.rehearsal(24 << 30):
        with torch_settings(config, torch.device("cuda")) as nondeterministic:
            assert _flags() == (False, True) and isinstance(nondeterministic, NondeterministicOps)
            nondeterministic.on_new = seen.append
            x = torch.zeros(8)
            for _ in range(3):  # put_ has no deterministic kernel (also on the CPU): warned 3 times
                x.put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))
            with pytest.warns(UserWarning, match="another warning"):  # any other warning still shows
                warnings.warn("another warning", UserWarning, stacklevel=1)
    assert seen == ["put_"] and nondeterministic.ops == ["put_"]
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_engines_buffers_are_not_filled_under_deterministic_algorithms():
    # In a fresh process: 64 MiB is above glibc's largest mmap threshold, so each allocation gets fresh pages,
    # which are zero, and deterministic mode's fill makes them NaN. (In a test process, memory that an earlier
    # test filled with NaN on purpose, test_run_device's heap, may be handed back instead.)
    script = textwrap.dedent("""
        import torch
        from brats_swap.memory.arena import empty_unfilled
        n = 1 << 24
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert not empty_unfilled(n).isnan().any()
        assert torch.empty(n).isnan().all()  # what torch does to every tensor in this mode
        assert torch.utils.deterministic.fill_uninitialized_memory  # the global flag is back
        print("ok")
        """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
