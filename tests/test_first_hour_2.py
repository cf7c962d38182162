"""The first hour, second round: an error in a training step with loader workers alive ends the process at
once, cases without a segmentation stay out of the folds, and the friction a new user met."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from layout_helpers import to_nnunet_brats21
from train_helpers import SMALL, small_dataset, tiny_config
from typer.testing import CliRunner

from brats_swap import progress
from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.cv.status_report import run_status
from brats_swap.data.cache import prepare_dataset
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.errors import ConfigError
from brats_swap.train.loop import train_fold

PHANTOM = (40, 40, 32)
# A 16³ cube, a U-Net one level shallower, one step: the cheapest training a step-1 error can interrupt.
TINY_TRAIN = ["data.cube=[16,16,16]", "model.depth=4", "model.base_filters=4", "train.max_epochs=1",
              "train.steps_per_epoch=2", "train.device=cpu", "cv.folds=2", "evaluate.hd95=false"]

# `brats-swap train` with an error at step 1, raised in the step (main process) or in a loader worker (as a bad
# case would); the pids of the training loader's workers are written to argv[1]. The step's error is held in a
# reference cycle (its frame holds it), as any `error = ...; raise error` is: nothing frees it before exit.
FAILING_RUN = """
import json, pathlib, sys
import torch.utils.data
from brats_swap.errors import DataError, NumericalError
from brats_swap.train import data, loop

pid_file, where = pathlib.Path(sys.argv[1]), sys.argv[2]
started = torch.utils.data.DataLoader.__iter__

def recording_iter(self):
    iterator = started(self)
    if not pid_file.exists():  # the first pass: the training loader's
        pid_file.write_text(json.dumps([w.pid for w in getattr(iterator, "_workers", [])]))
    return iterator

def failing_step(self, batch):
    error = NumericalError(f"{self.folder.root}: injected failure at step 1")
    raise error

def failing_sample(self, key):
    raise DataError(f"{self.cache}: injected failure of a sample at step 1")

torch.utils.data.DataLoader.__iter__ = recording_iter
if where == "step":
    loop.FoldRecipe.train_step = failing_step
else:
    data.CubeDataset.__getitem__ = failing_sample
sys.argv = ["brats-swap", *sys.argv[3:]]
from brats_swap.cli.main import main
main()
"""


def _brats_layout(base: Path) -> tuple[Path, str]:
    """Four BraTS 2021 phantoms, the last without its segmentation; (folder, the unlabelled case)."""
    root = base / "brats"
    ids = synthesize_dataset(root, 4, seed=0, shape=PHANTOM)
    for seg in (root / ids[-1]).glob("*_seg.nii.gz"):
        seg.unlink()
    return root, ids[-1]


def _nnunet_layout(base: Path) -> tuple[Path, str]:
    """An nnU-Net raw dataset (Dataset137_BraTS21's conversion) with one case moved to imagesTs/."""
    brats = base / "brats-source"
    ids = synthesize_dataset(brats, 4, seed=0, shape=PHANTOM)
    root = to_nnunet_brats21(brats, base / "Dataset137_BraTS21")
    (root / "imagesTs").mkdir()
    for image in (root / "imagesTr").glob(f"{ids[-1]}_*.nii.gz"):
        image.rename(root / "imagesTs" / image.name)
    (root / "labelsTr" / f"{ids[-1]}.nii.gz").unlink()
    return root, ids[-1]


LAYOUTS = {"brats": _brats_layout, "nnunet": _nnunet_layout}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.mark.parametrize(("layout", "where"), [("brats", "step"), ("nnunet", "worker")])
def test_an_error_at_step_1_with_two_loader_workers_ends_the_process_at_once(layout, where, tmp_path):
    root, unlabelled = LAYOUTS[layout](tmp_path)
    run, pids = tmp_path / "run", tmp_path / "workers.json"
    overrides = [f"data.root={root}", f"data.cache={tmp_path / 'cache'}", "data.loader_workers=2", *TINY_TRAIN]
    config = load_config(None, overrides)
    prepare_dataset(root, config.data.cache, config.data, workers=1, progress=False)  # in-process: cheaper
    command = [sys.executable, "-c", FAILING_RUN, str(pids), where, "train", "--run", str(run),
               *(arg for o in overrides for arg in ("--set", o))]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "COLUMNS": "200"})
    try:
        out, err = child.communicate(timeout=60)  # seconds of work; before the fix it waited forever
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail("train did not exit after the step's error (it waits for its loader workers)")
    assert child.returncode == 1, err
    expected = (f"error: {run / 'fold_0'}: injected failure at step 1" if where == "step" else
                f"error: {tmp_path / 'cache'}: injected failure of a sample at step 1")
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [expected]
    workers = json.loads(pids.read_text())
    assert len(workers) == 2 and not any(_alive(pid) for pid in workers)  # no orphaned worker
    folds = json.loads((run / "splits.json").read_text())["folds"]
    in_folds = {case for fold in folds for case in (*fold["train"], *fold["val"])}
    assert len(in_folds) == 3 and unlabelled not in in_folds
    # cv --status: the fold failed, with its error line (not "not started")
    assert run_status(run)[0].line() == f"fold 0: {expected.replace('error:', 'failed:', 1)}"
    assert f"{expected}" in (run / "fold_0" / "train.log").read_text()


def test_train_log_gets_the_progress_lines_inside_an_epoch(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setattr(progress.ProgressLines.__init__, "__kwdefaults__",
                        {**progress.ProgressLines.__init__.__kwdefaults__, "every_s": 0.0})
    train_fold(tiny_config(*small_dataset(tmp_path_factory), *SMALL, "train.steps_per_epoch=3"), tmp_path / "run",
               0, progress=False)
    log = (tmp_path / "run" / "fold_0" / "train.log").read_text()
    assert "epoch 1/1 step 1/3, " in log and "epoch 1/1 step 2/3, " in log


def test_resume_of_a_run_folder_that_does_not_exist_says_so(tmp_path):
    result = CliRunner().invoke(app, ["train", "--run", str(tmp_path / "nothere"), "--resume"])
    assert result.exit_code == 2
    assert f"no run folder {tmp_path / 'nothere'}" in " ".join(result.output.split())
    assert not (tmp_path / "nothere").exists()


def test_a_failed_start_leaves_no_folder_holding_only_lock_files(tmp_path):
    run = tmp_path / "runs" / "new"
    result = CliRunner().invoke(app, ["train", "--run", str(run), "--set", f"data.root={tmp_path / 'missing'}",
                                      "--set", f"data.cache={tmp_path / 'cache'}"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert not run.exists()


def test_a_yaml_error_says_the_parsers_reason_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, [])
    assert str(caught.value) == (f"{path}: not valid YAML at line 3, column 5: expected ',' or ']', but got ':' "
                                 "(while parsing a flow sequence that starts at line 2, column 7)")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_data_check_counts_the_unlabelled_cases_as_for_prediction_only(layout, tmp_path):
    from brats_swap.data.check import check_dataset, summary_line

    root, unlabelled = LAYOUTS[layout](tmp_path)
    results = check_dataset(root, progress=False)
    assert [r.case_id for r in results if r.unlabelled] == [unlabelled]
    line = summary_line(results)
    assert line.startswith("4 usable, 0 skipped") and "1 of the usable have no segmentation" in line
    assert "for prediction only" in line
