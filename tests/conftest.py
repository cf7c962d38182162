"""Test-wide settings: CPU only, few threads, deterministic."""

from __future__ import annotations

import gc
import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "2")

# A suite started in the background of a non-interactive shell (`make test &`, nohup, some CI runners)
# inherits SIGINT ignored, and so would every command the tests start: the tests that send a Ctrl-C to a
# `data prepare` or a `train-challenge` would then see it ignored and the command run to its end. What those
# tests check is a user's terminal, where Ctrl-C arrives: give the suite Python's own handler back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """Keep the garbage collector off the heap a test module starts with. A worker's heap holds torch, every
    imported module and what the files before this one left: hundreds of thousands of objects, which every full
    collection walks (0.2 s and more each), and engine runs, traces and the measuring scripts (which collect
    after every policy they run) set off dozens per file: tests/test_planner.py spent 7 s of its 65 s of CPU
    in the collector. Frozen (`gc.freeze`), those objects are left out of every collection; what the module
    allocates is collected as before, and the frozen ones go back to the collector when the module ends."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# The test files that cost the most worker-seconds (docs/testing.md's table, 2026-12-07 19:10 UTC), longest
# first. `make test` runs each file on one pytest-xdist worker (`--dist loadfile`) in the order collected
# (`--no-loadscope-reorder`): a long file handed out last keeps one core busy while the other idles, so the long
# ones go first and the short ones fill in behind them. A file not named here follows them, the files with more
# tests first (xdist's own default order). Update the list from `--durations`/`--junitxml` when it drifts.
LONGEST_FILES_FIRST = (
    "tests/test_planner.py", "tests/test_trainable_stop.py", "tests/test_networks.py", "tests/test_onnx.py",
    "tests/test_failures/test_crashes.py", "tests/test_gpu_check.py", "tests/test_group_signals.py",
    "tests/test_trainable.py", "tests/test_followups.py", "tests/test_challenges_e2e.py", "tests/test_stop_resume.py",
    "tests/test_untrusted_2.py", "tests/test_distributed_train.py", "tests/test_cv_integration.py",
    "tests/test_compile.py", "tests/test_copy_link.py", "tests/test_data_challenges.py", "tests/test_memory.py",
    "tests/test_planner_compiled.py", "tests/test_ship.py", "tests/test_nnunet_softmax.py",
    "tests/test_failures/test_bad_data.py", "tests/test_train_cli.py", "tests/test_cli_startup.py",
    "tests/test_data_scale.py", "tests/test_first_hour_3.py", "tests/test_failures/test_bad_config.py",
    "tests/test_planner_networks.py", "tests/test_predict.py", "tests/test_data_layouts.py",
)


def pytest_collection_modifyitems(config, items):
    """Order the collected tests file by file, LONGEST_FILES_FIRST first (a stable sort: the tests of a file
    keep their order)."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES_FIRST)}
    per_file: dict[str, int] = {}
    for item in items:
        name = item.nodeid.split("::")[0]
        per_file[name] = per_file.get(name, 0) + 1

    def order(item) -> tuple[int, int]:
        name = item.nodeid.split("::")[0]
        return (rank[name], 0) if name in rank else (len(rank), -per_file[name])

    items.sort(key=order)
