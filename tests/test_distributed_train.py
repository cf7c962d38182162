"""`train_fold` on 2 gloo ranks (CPU, 16³ phantoms, 4 base filters): one DDP step equals one single-process step
with the same global batch (memory engine off and swapping), only rank 0 writes, and a 2-rank `brats-swap
train --nproc 2` killed mid-run resumes from its checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import descendants, spawn_ranks
from train_helpers import SMALL, small_dataset, tensorboard_scalars, tiny_config

from brats_swap.cv import run_cv
from brats_swap.distributed import DistContext
from brats_swap.model import build_model
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST
from brats_swap.train.loop import train_fold

# One step of batch 1 per rank; dropout off (its masks are random per process, the one thing a DDP step and
# a single-process step cannot share). Adam's eps is raised for the comparison: the first Adam step moves a
# weight by lr * g / (|g| + eps), so with eps 1e-7 a gradient at float-noise level (a conv bias in front of
# an instance norm, whose true gradient is 0) turns 1e-10 of rounding into a difference of lr.
# tests/test_distributed.py compares the gradients themselves with the default eps.
STEP = [*SMALL, "train.steps_per_epoch=1", "train.max_epochs=1", "model.dropout=0.0", "train.adam_eps=1e-2",
        "train.threads=1"]
SWAP = ["memory.mode=swap", "memory.swap.min_bytes=0"]
WRITE_EVENTS = ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


def _record_writes(root: Path, sink: list[str]) -> None:
    """An audit hook: every file opened for writing, created, renamed or removed under `root`."""
    root_text = str(root)

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], str | Path):
            path, mode, flags = str(args[0]), args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and path.startswith(root_text):
                sink.append(f"open {path}")
        elif event in WRITE_EVENTS and args and str(args[0]).startswith(root_text):
            sink.append(f"{event} {args[0]}")

    sys.addaudithook(hook)
    # torch.save given a path writes from C++, past the audit hook: record its calls too.
    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, str | Path) and str(f).startswith(root_text):
            sink.append(f"torch.save {f}")
        return original_save(obj, f, *args, **kwargs)

    torch.save = save


def _two_rank_worker(ctx: DistContext, cache: str, root: str, runs: str, reports: str) -> None:
    writes: list[str] = []
    if ctx.rank == 1:
        _record_writes(Path(runs), writes)
    results = {}
    for name, extra in (("none", []), ("swap", SWAP)):
        config = tiny_config(Path(root), Path(cache), *STEP, "train.batch_size=1", *extra)
        result = train_fold(config, Path(runs) / name, 0, progress=False)
        results[name] = {"finished": result.finished, "history": result.history}
    # `brats-swap cv` under torchrun: rank 0 runs the cv runner, both ranks train each fold.
    config = tiny_config(Path(root), Path(cache), *STEP, "train.batch_size=1")
    outcome = run_cv(config, Path(runs) / "cv")  # under torchrun's environment: the distributed cv
    results["cv"] = None if outcome is None else {"complete": outcome.complete, "evaluated": outcome.evaluated}
    torch.save({"results": results, "writes": writes}, Path(reports) / f"rank{ctx.rank}.pt")


def test_a_two_rank_step_equals_a_single_process_step_and_only_rank_0_writes_also_in_cv(data, tmp_path):
    root, cache = data
    runs, reports = tmp_path / "runs", tmp_path / "reports"
    runs.mkdir()
    reports.mkdir()
    spawn_ranks(_two_rank_worker, 2, str(cache), str(root), str(runs), str(reports))

    single = train_fold(tiny_config(root, cache, *STEP, "train.batch_size=2"), tmp_path / "single", 0, progress=False)
    reference = load_checkpoint(tmp_path / "single" / "fold_0" / LATEST)["model"]
    torch.manual_seed(0)
    initial = build_model(tiny_config(root, cache, *STEP).model).state_dict()
    moved = max(float((reference[k] - initial[k]).abs().max()) for k in reference)
    assert moved > 1e-4

    rank0, rank1 = (torch.load(reports / f"rank{r}.pt") for r in range(2))
    for name in ("none", "swap"):
        state = load_checkpoint(runs / name / "fold_0" / LATEST)
        assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2
        worst = max(float((state["model"][k] - reference[k]).abs().max()) for k in reference)
        assert worst < 1e-6, f"memory.mode={name}: parameters differ from the single-process step by {worst}"
        for rank in (rank0, rank1):
            record, single_record = rank["results"][name]["history"][0], single.history[0]
            assert rank["results"][name]["finished"]
            # The global batch's loss, and validation over all cases (each rank scored half of them).
            assert record["train_loss"] == pytest.approx(single_record["train_loss"], abs=1e-6)
            assert record["val_loss"] == pytest.approx(single_record["val_loss"], abs=1e-5)
        assert "2 ranks (gloo), global batch 2" in (runs / name / "fold_0" / "train.log").read_text()
    assert rank0["results"]["cv"] == {"complete": True, "evaluated": [0, 1]} and rank1["results"]["cv"] is None
    for k in (0, 1):
        assert load_checkpoint(runs / "cv" / f"fold_{k}" / LATEST)["world_size"] == 2
        assert (runs / "cv" / f"fold_{k}" / "metrics.csv").exists()
    assert len((runs / "cv" / "cv.log").read_text().splitlines()) == 1
    assert (runs / "cv" / "cv_summary.json").exists()
    scalars = tensorboard_scalars(runs / "swap" / "fold_0" / "tb")
    assert scalars["memory/swapped_out_bytes"][0] > 0  # the engine did swap on rank 0
    assert rank1["writes"] == []  # rank 1 created, wrote, renamed and removed nothing in the run folders


def _train_command(root: Path, cache: Path, run: Path, *extra: str) -> list[str]:
    sets = [f"data.root={root}", f"data.cache={cache}", *SMALL, "data.loader_workers=0",
            "model.base_filters=4", "train.device=cpu", "cv.folds=2", "train.steps_per_epoch=4", "train.threads=1",
            "name=tiny"]
    return [sys.executable, "-m", "brats_swap", "train", "--nproc", "2", "--run", str(run),
            *[arg for item in sets for arg in ("--set", item)], *extra]


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_from_its_checkpoint(data, tmp_path):
    root, cache = data
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # torchrun and its 2 workers in a session of their own, so the whole job can be SIGKILLed at once.
    # 20 epochs of 4 steps: far more than can finish between the first checkpoint and the kill.
    job = subprocess.Popen(_train_command(root, cache, run, "--set", "train.max_epochs=20"), env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = run / "fold_0" / LATEST
    deadline = time.monotonic() + 120
    try:
        while not latest.exists():
            assert job.poll() is None, job.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.01)
    finally:
        # torchrun starts each worker in a session of its own, so kill the workers by pid, then torchrun and
        # the CLI (as when the node dies: all of them at once).
        for pid in [*reversed(descendants(job.pid)), job.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output = job.communicate()[0]
    assert job.returncode == -signal.SIGKILL, output[-3000:]
    killed_at = load_checkpoint(latest)["epoch"]
    assert 1 <= killed_at < 20

    # Resume, and finish one epoch later (max_epochs may change on resume).
    target = killed_at + 1
    done = subprocess.run(_train_command(root, cache, run, "--resume", "--set", f"train.max_epochs={target}"),
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (run / "fold_0" / "train.log").read_text()
    assert f"resume fold 0 at epoch {target} step 0" in log
    final = load_checkpoint(latest)
    assert final["epoch"] == target and final["finished"] and final["world_size"] == 2
    assert [record["epoch"] for record in final["history"]] == list(range(1, target + 1))
    assert done.stdout.count("training summary") == 1  # rank 0 printed it, rank 1 did not
