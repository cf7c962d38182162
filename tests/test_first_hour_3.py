"""Issue 44, the first hour's third round: the text a new user reads says what the commands do.

Checks of docs and on-screen lines; the behaviour behind them is tested where it lives (named per test)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_first_run_names_data_fit_and_the_keys_that_narrow_mednext():
    """issue 44.2 and 44.6: following first_run.md with configs/mednext_l.yaml built the full MedNeXt-L, and
    pad_crop's warnings came unexplained (tests/test_data_layouts.py checks that train says them)."""
    from brats_swap.config import load_config

    text = one_line((DOCS / "first_run.md").read_text())
    assert "| `data.fit` |" in text and "`pad_crop`" in text and "loses tumour voxels" in text
    keys = ["model.features=[8]", "model.blocks=[1,1,1,1,1,1,1,1,1]", "model.kernel_size=3"]
    assert all(f"--set {key}" in text for key in keys)
    narrowed = load_config(DOCS.parent / "configs" / "mednext_l.yaml", [*keys, "data.cube=[32,32,32]",
                                                                       "train.patch=[32,32,32]"])
    from brats_swap.model.networks import build_model

    parameters = sum(p.numel() for p in build_model(narrowed.model).parameters())
    assert f"({parameters / 1e6:.2f} M parameters" in text


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout not installed")
def test_stopping_says_timeout_exits_124_and_how_to_keep_the_exit_code():
    """issue 44.10; and what the page says about `timeout`, on a process that exits 0 on SIGTERM as we do."""
    text = one_line((DOCS / "stopping.md").read_text())
    assert "exits 124" in text and "timeout --preserve-status" in text
    exits_0_on_sigterm = [sys.executable, "-c", "import signal, sys, time; "
                          "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(30)"]
    assert subprocess.run(["timeout", "1", *exits_0_on_sigterm]).returncode == 124
    assert subprocess.run(["timeout", "--preserve-status", "1", *exits_0_on_sigterm]).returncode == 0
