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


def test_the_summary_peak_is_the_largest_epoch_line_peak(tmp_path_factory, tmp_path, monkeypatch):
    """issue 44.7: `peak 2.45 GiB` on the epoch line and `peak memory 7.24 GiB` in the summary of the same
    one-epoch run: the summary measured again after the checkpoints were written. A peak that grows at every
    reading shows which readings are taken."""
    from itertools import count

    from train_helpers import SMALL, small_dataset, tiny_config

    from brats_swap.train import loop
    from brats_swap.train.loop import train_fold

    readings = count(1)
    monkeypatch.setattr(loop, "peak_memory_bytes", lambda device: next(readings) * 2**20)
    result = train_fold(tiny_config(*small_dataset(tmp_path_factory), *SMALL), tmp_path / "run", 0, progress=False)
    assert result.epochs_completed == 1
    assert result.peak_memory_bytes == max(record["peak_memory_gib"] for record in result.history) * 2**30


def test_a_resume_says_where_it_resumes_on_screen(tmp_path_factory, tmp_path, capsys):
    """issue 44.7: `train --resume` printed nothing about where it continued."""
    import dataclasses

    from train_helpers import SMALL, small_dataset, tiny_config

    from brats_swap.train.loop import train_fold

    config = tiny_config(*small_dataset(tmp_path_factory), *SMALL)
    train_fold(config, tmp_path / "run", 0, progress=True)
    assert "resuming" not in capsys.readouterr().err
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, max_epochs=2))
    train_fold(longer, tmp_path / "run", 0, resume=True, progress=True)
    assert f"{tmp_path / 'run' / 'fold_0'}: resuming fold 0 at epoch 2 step 0 of 2 epoch(s)" in \
        one_line(capsys.readouterr().err)


def test_official_tables_leave_hd95_out_when_evaluate_hd95_is_false():
    """issue 44.7: with evaluate.hd95=false the official HD95 columns still showed `inf` (a lesion without a
    matched pair); now they are not computed, and the table leaves them out."""
    import numpy as np

    from brats_swap.evaluate.official import official_table_rows, summarize_official
    from brats_swap.evaluate.scoring import _Scores

    reference = np.zeros((24, 24, 24), np.uint8)
    reference[2:8, 2:8, 2:8] = 2
    missed = np.zeros_like(reference)
    missed[14:20, 14:20, 14:20] = 2  # a lesion far from the reference's: no matched pair, lesion HD95 inf
    tables = {}
    for hd95 in (True, False):
        scores = _Scores(hd95=hd95)
        scores.add("case", missed, reference, "2021")
        header, body = official_table_rows(summarize_official(scores.official_rows), scores.groups)
        tables[hd95] = (header, [cell for row in body for cell in row])
        assert ("HD95" in header and "Lesion HD95" in header) == hd95
        assert ("inf" in tables[hd95][1]) == hd95
        assert "Lesion Dice" in header and "F1" in header
