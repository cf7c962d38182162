"""A scheduler's warning (SIGUSR1, SIGTERM) stops training at the next step with a mid-epoch checkpoint, and
resuming from it ends bitwise where a run that was never stopped ends: parameters and optimizer state
(`torch.equal`), in one process and on 2 gloo ranks that agree on the step at which they stop."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from dist_helpers import spawn_ranks
from train_helpers import SMALL, assert_same_training_state, small_dataset, tiny_config

from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST
from brats_swap.train import loop
from brats_swap.train.loop import train_fold

# 2 epochs of 3 steps: a signal during step 5 lands in the middle of epoch 2.
RECIPE = [*SMALL, "train.max_epochs=2", "train.steps_per_epoch=3"]
SIGNAL_AT_STEP = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """The reference: the fold trained straight through, never stopped."""
    result = train_fold(tiny_config(*data, *RECIPE), tmp_path_factory.mktemp("straight") / "run", 0, progress=False)
    assert result.finished and result.epochs_completed == 2
    return load_checkpoint(result.fold_dir / LATEST)


def signal_during_step(monkeypatch, signum: int, at_step: int, sink: list[float] | None = None) -> None:
    """Send `signum` to this process during training step `at_step` (1-based, counted over the call)."""
    real_loss = loop.weighted_dice_loss
    steps = []

    def loss_with_signal(probs, target):
        loss = real_loss(probs, target)
        if torch.is_grad_enabled():  # training steps only (validation runs under no_grad)
            steps.append(1)
            if len(steps) == at_step:
                os.kill(os.getpid(), signum)
        return loss

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_signal)


@pytest.mark.parametrize("signum, caller_stop", [(signal.SIGUSR1, False), (signal.SIGTERM, True)],
                         ids=["SIGUSR1-train", "SIGTERM-cv"])
def test_a_signal_stops_at_the_next_step_and_the_mid_epoch_resume_is_bitwise(data, straight, tmp_path, monkeypatch,
                                                                           signum, caller_stop):
    config = tiny_config(*data, *RECIPE)
    run = tmp_path / "run"
    previous = signal.getsignal(signum)
    signal_during_step(monkeypatch, signum, SIGNAL_AT_STEP)
    # cv passes its own stop control (epoch boundaries); the signal must still stop at the step.
    stopped = train_fold(config, run, 0, progress=False, stop_requested=(lambda: False) if caller_stop else None)
    assert stopped.interrupted and not stopped.finished and stopped.stop_reason == signal.Signals(signum).name
    assert signal.getsignal(signum) is previous
    saved = load_checkpoint(run / "fold_0" / LATEST)
    # Stopped within one step: the step running when the signal came is the last one done.
    assert (saved["epoch"], saved["step_in_epoch"], saved["global_step"]) == (1, 2, SIGNAL_AT_STEP)
    assert f"{signal.Signals(signum).name} at epoch 2 step 2; state saved" in (run / "fold_0" / "train.log").read_text()

    monkeypatch.undo()
    resumed = train_fold(config, run, 0, resume=True, progress=False)
    assert resumed.finished and resumed.epochs_completed == 2
    assert "resume fold 0 at epoch 2 step 2" in (run / "fold_0" / "train.log").read_text()
    assert_same_training_state(load_checkpoint(run / "fold_0" / LATEST), straight)


def _two_rank_stop_and_resume(ctx, cache: str, root: str, runs: str) -> None:
    config = tiny_config(Path(root), Path(cache), *RECIPE, "train.threads=1")
    train_fold(config, Path(runs) / "straight", 0, progress=False)
    if ctx.rank == 1:  # only rank 1 is warned; rank 0 must stop at the same step
        signal_during_step(_Patch(), signal.SIGUSR1, SIGNAL_AT_STEP)
    stopped = train_fold(config, Path(runs) / "stopped", 0, progress=False)
    loop.weighted_dice_loss = _REAL_LOSS
    torch.save({"interrupted": stopped.interrupted, "reason": stopped.stop_reason},
               Path(runs) / f"stopped_rank{ctx.rank}.pt")
    train_fold(config, Path(runs) / "stopped", 0, resume=True, progress=False)


_REAL_LOSS = loop.weighted_dice_loss


class _Patch:
    """monkeypatch's `setattr` in a forked rank (the rank process ends after the test's work)."""

    @staticmethod
    def setattr(target, name, value) -> None:
        setattr(target, name, value)


@pytest.mark.slow
def test_two_gloo_ranks_agree_on_the_stop_step_and_resume_bitwise(data, tmp_path):
    root, cache = data
    spawn_ranks(_two_rank_stop_and_resume, 2, str(cache), str(root), str(tmp_path))
    ranks = [torch.load(tmp_path / f"stopped_rank{r}.pt") for r in range(2)]
    assert [r["interrupted"] for r in ranks] == [True, True]
    assert ranks[1]["reason"] == "SIGUSR1" and ranks[0]["reason"] == "a signal on another rank"
    log = (tmp_path / "stopped" / "fold_0" / "train.log").read_text()
    assert "at epoch 2 step 2; state saved" in log and "resume fold 0 at epoch 2 step 2" in log
    final = load_checkpoint(tmp_path / "stopped" / "fold_0" / LATEST)
    assert final["finished"] and final["world_size"] == 2
    assert_same_training_state(final, load_checkpoint(tmp_path / "straight" / "fold_0" / LATEST))


def test_the_launcher_forwards_sigusr1_to_each_rank_and_not_to_their_children(tmp_path):
    """`train --nproc` / `cv --nproc` wrap torchrun in `forward_signals_to_workers`: a stand-in process tree
    (a launcher without LOCAL_RANK, two ranks with it, each with a child) shows who gets the signal."""
    import subprocess
    import time

    from brats_swap.distributed import forward_signals_to_workers, torchrun_workers

    rank = tmp_path / "rank.sh"
    rank.write_text(f"sleep 30 &\nchild=$!\necho $child > {tmp_path}/child.$LOCAL_RANK\n"
                    f"trap 'echo $$ > {tmp_path}/got.$LOCAL_RANK; kill $child' USR1\nwait\n")
    launcher = subprocess.Popen(["bash", "-c", f"LOCAL_RANK=0 bash {rank} & LOCAL_RANK=1 bash {rank} & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(workers := torchrun_workers(launcher.pid)) < 2:
            assert time.monotonic() < deadline, workers
            time.sleep(0.05)
        time.sleep(0.2)  # the ranks' traps are set before their `sleep` starts
        with forward_signals_to_workers(launcher.pid):
            os.kill(os.getpid(), signal.SIGUSR1)
        launcher.wait(timeout=10)
        assert sorted(int((tmp_path / f"got.{r}").read_text()) for r in (0, 1)) == sorted(workers)
        assert not {int((tmp_path / f"child.{r}").read_text()) for r in (0, 1)} & set(workers)
    finally:
        launcher.kill()


@pytest.mark.slow
def test_train_nproc_2_forwards_sigusr1_and_both_ranks_stop_at_the_same_step(data, tmp_path):
    """`brats-swap train --nproc 2` (torchrun, 2 gloo ranks): SIGUSR1 to the command stops both ranks after the
    same step with the mid-epoch checkpoint, exit 0 (torchrun alone would die of it, leaving the ranks)."""
    import subprocess
    import sys
    import time

    root, cache = data
    run = tmp_path / "run"
    sets = [f"data.root={root}", f"data.cache={cache}", *SMALL, "data.loader_workers=0", "model.base_filters=4",
            "train.device=cpu", "cv.folds=2", "train.steps_per_epoch=2000", "train.threads=1", "name=tiny"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = subprocess.Popen([sys.executable, "-m", "brats_swap", "train", "--nproc", "2", "--run", str(run),
                            *[arg for item in sets for arg in ("--set", item)]],
                           env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    log = run / "fold_0" / "train.log"
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and "start fold 0" in log.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:] if job.poll() else ""
            time.sleep(0.1)
        time.sleep(1.0)
        job.send_signal(signal.SIGUSR1)
        output = job.communicate(timeout=60)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    assert "SIGUSR1: stopped with the state saved" in output
    assert output.count("SIGUSR1: finishing this step") == 2, output[-3000:]  # each rank's handler got it
    saved = load_checkpoint(run / "fold_0" / LATEST)
    assert saved["world_size"] == 2 and saved["epoch"] == 0 and 0 < saved["step_in_epoch"] < 2000
    # Rank 0 writes the log; the ranks agreed on this step.
    assert f"SIGUSR1 at epoch 1 step {saved['step_in_epoch']}; state saved" in log.read_text()


# Each augmentation recipe (cube48, the default, is the test above): trained straight through, and stopped by a
# signal in the middle of the epoch and resumed; the resumed run ends bitwise where the straight one does, so
# every draw of the device-side augmentation comes from the sample's seed. nnunet also runs in patch mode, with
# nnU-Net's enlarged crops and foreground rule at batch 2.
PRESETS = {
    "nnunet-patch": ("train.augment=nnunet", "train.mode=patch", "train.patch=[8,8,8]", "model.depth=3",
                     "model.segmentation_levels=2", "train.batch_size=2", "train.patch_foreground=nnunet"),
    "nnunet_brats2020": ("train.augment=nnunet_brats2020",),
    "mild": ("train.augment=mild",),
    "none": ("train.augment=none",),
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_augmentation_recipe_resumes_bitwise_mid_epoch(data, tmp_path, monkeypatch, preset):
    config = tiny_config(*data, *SMALL, "train.max_epochs=1", "train.steps_per_epoch=3", "model.base_filters=2",
                         *PRESETS[preset])
    straight = train_fold(config, tmp_path / "straight", 0, progress=False)
    assert straight.finished
    signal_during_step(monkeypatch, signal.SIGUSR1, 2)
    stopped = train_fold(config, tmp_path / "run", 0, progress=False)
    assert stopped.interrupted and load_checkpoint(tmp_path / "run" / "fold_0" / LATEST)["step_in_epoch"] == 2
    monkeypatch.undo()
    resumed = train_fold(config, tmp_path / "run", 0, resume=True, progress=False)
    assert resumed.finished and resumed.history[-1]["train_loss"] == straight.history[-1]["train_loss"]
    assert_same_training_state(load_checkpoint(tmp_path / "run" / "fold_0" / LATEST),
                               load_checkpoint(straight.fold_dir / LATEST))
