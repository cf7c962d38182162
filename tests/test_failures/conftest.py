"""Fixtures of the failure tests: tiny phantom data, synthesized and prepared once per session.

One tiny phantom dataset (4 cases of 48x48x40, edition 2021) is synthesized and prepared once per
session into a 16³ cache (TINY); tests that damage data work on copies of single cases.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from failure_helpers import PHANTOM_CASES, PHANTOM_SHAPE, TINY


@pytest.fixture(scope="session")
def phantom_root(tmp_path_factory) -> Path:
    """Read-only: 4 phantom cases in BraTS 2021 layout (one folder per case)."""
    from brats_swap.data.phantom import synthesize_dataset

    root = tmp_path_factory.mktemp("phantoms") / "raw"
    synthesize_dataset(root, PHANTOM_CASES, seed=0, edition="2021", shape=PHANTOM_SHAPE)
    return root


@pytest.fixture(scope="session")
def prepared_cache(phantom_root, tmp_path_factory) -> Path:
    """Read-only: `phantom_root` prepared into a 16³ cache (TINY)."""
    from brats_swap.config import load_config
    from brats_swap.data.cache import prepare_dataset

    cache = tmp_path_factory.mktemp("prepared") / "cache"
    config = load_config(None, TINY)
    report = prepare_dataset(phantom_root, cache, config.data, workers=1, progress=False)
    assert len(report.cases) == PHANTOM_CASES and not report.failed
    return cache


@pytest.fixture
def one_case(phantom_root, tmp_path) -> tuple[Path, str]:
    """A writable copy of the first phantom case: (dataset root holding only it, case id)."""
    case_dir = sorted(p for p in phantom_root.iterdir() if p.is_dir())[0]
    root = tmp_path / "data"
    shutil.copytree(case_dir, root / case_dir.name)
    return root, case_dir.name


@pytest.fixture
def writable_cache(prepared_cache, tmp_path) -> Path:
    """A writable copy of the prepared cache."""
    cache = tmp_path / "cache"
    shutil.copytree(prepared_cache, cache)
    return cache


@pytest.fixture(scope="session")
def trained_run(prepared_cache, tmp_path_factory) -> Path:
    """Read-only: a finished 3-epoch tiny run on `prepared_cache` (fold 0), trained without interruption;
    the reference that interrupted runs are compared with."""
    from failure_helpers import tiny_config

    from brats_swap.train.loop import train_fold

    run = tmp_path_factory.mktemp("trained") / "run"
    result = train_fold(tiny_config(prepared_cache, "train.max_epochs=3"), run, 0, progress=False)
    assert result.finished and result.epochs_completed == 3
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A writable copy of `trained_run`."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run
