"""`train-challenge` stopped by the organisers' runner or a scheduler (SIGTERM) or by Ctrl-C (SIGINT), for real:
a `python -m brats_swap train-challenge` subprocess on a tiny GoAT phantom sends itself the signal at a chosen
moment (tests/signal_hook.py). During training it stops at the end of the running step with the checkpoint
written and exits 130 with one line; the model already in the output folder is untouched and no temporary file
is left; the same command then resumes inside the epoch and ends with the uninterrupted run's weights
(`torch.equal`). A Ctrl-C before training (the data being prepared) stops at once, a SIGTERM there at the end of
that phase, both exit 130, and the same command then trains (and removes a killed export's temporary file),
and a SIGTERM while it writes the new model.zip lets the write finish (temp file + rename) and exits 0. SIGKILL
in the middle of an epoch, and a restart, end with the uninterrupted run's weights too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked_cli import run_forked
from trainable_helpers import goat_training_data, recipe_bundle

from brats_swap.atomic import TEMP_SUFFIX
from brats_swap.errors import EXIT_INTERRUPTED
from brats_swap.run.folder import LATEST
from brats_swap.ship.bundle import open_bundle
from brats_swap.ship.retrain import BUNDLE_FILE, DEVICE_MEMORY_VARIABLE, RetrainReport, retrain

HOOK = Path(__file__).with_name("signal_hook.py")
EPOCHS = 2
STEPS_PER_EPOCH = 2  # trainable_helpers.RECIPE: step 3 is the first step of epoch 2
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def card():
    # One simulated card for every run here (a CPU's free memory varies, and with it the plan).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEVICE_MEMORY_VARIABLE, "8")
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("goat-stop") / "data"
    goat_training_data(folder)
    return folder


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return recipe_bundle(tmp_path_factory.mktemp("goat-stop-recipe"), "goat-stop", [0], epochs=EPOCHS)


@pytest.fixture(scope="module")
def uninterrupted(card, data, bundle, tmp_path_factory) -> RetrainReport:
    """The recipe retrained straight through, in this process."""
    return retrain(open_bundle(bundle), data, tmp_path_factory.mktemp("whole") / "out", device="cpu",
                   say=lambda line: None)


def train_challenge(bundle: Path, data: Path, output: Path, signal_at: str | None = None
                    ) -> subprocess.CompletedProcess:
    """`brats-swap train-challenge` in a subprocess; with `signal_at`, through the hook (BRATS_SIGNAL_AT)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = [sys.executable, "-m", "brats_swap"]
    if signal_at is not None:
        env["BRATS_SIGNAL_AT"] = signal_at
        start = [sys.executable, str(HOOK)]
    return subprocess.run([*start, "train-challenge", "--model", str(bundle), "--data", str(data), "--output",
                           str(output), "--device", "cpu"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def stop_lines(done: subprocess.CompletedProcess, signum: signal.Signals) -> list[str]:
    """The last line of a stop: `error:` for Ctrl-C, `stopped:` for a planned SIGTERM (issue 44.4), never both."""
    planned = [line for line in done.stderr.splitlines() if line.startswith("stopped:")]
    errors = error_lines(done)
    assert not (planned and errors), done.stderr
    return planned if signum == signal.SIGTERM else errors


def temp_files(output: Path) -> list[Path]:
    return [p for p in output.rglob("*") if p.name.endswith(TEMP_SUFFIX)]


def same_weights(ours: dict, theirs: RetrainReport) -> bool:
    theirs = open_bundle(theirs.bundle).state_dict(0)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_during_training_saves_the_step_exits_130_keeps_the_model_and_the_rerun_ends_bitwise(
        card, data, bundle, uninterrupted, tmp_path, signum):
    output = tmp_path / "out"
    output.mkdir()
    earlier = output / BUNDLE_FILE  # a model already in the output folder (an earlier submission's)
    shutil.copyfile(bundle, earlier)
    before = earlier.read_bytes()
    stopped = train_challenge(bundle, data, output, f"{signum.name}:step:3")
    assert stopped.returncode == EXIT_INTERRUPTED, stopped.stdout + stopped.stderr
    assert f"{signum.name}: finishing this step and saving checkpoint_latest.pt" in stopped.stderr
    errors = stop_lines(stopped, signum)
    assert len(errors) == 1 and "run the same command again to continue" in errors[0], stopped.stderr
    assert "--resume" not in errors[0]  # not an option of train-challenge
    log = (output / "run" / "fold_0" / "train.log").read_text()
    assert f"{signum.name} at epoch 2 step 1; state saved" in log  # the step that got the signal, finished
    assert earlier.read_bytes() == before and temp_files(output) == []

    resumed = train_challenge(bundle, data, output)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "continuing with the recorded plan" in resumed.stdout
    assert "resume fold 0 at epoch 2 step 1" in (output / "run" / "fold_0" / "train.log").read_text()
    assert same_weights(open_bundle(earlier).state_dict(0), uninterrupted)
    assert temp_files(output) == []


# Ctrl-C outside training: at once (every write there is atomic). SIGTERM at once too (issue 43: `docker stop`
# waits seconds, preparing may take minutes), the cases done kept.
STOPS_WHILE_PREPARING = [(signal.SIGINT, "interrupted"),
                         (signal.SIGTERM, "/out/cache keeps the cases done); run the same command again to continue")]


def test_a_stop_while_the_data_is_prepared_ends_before_training_with_130_and_the_rerun_trains(
        card, data, bundle, uninterrupted, tmp_path):
    # A Ctrl-C, then the same command stopped by a SIGTERM (it prepares what the Ctrl-C left), then the same command
    # again (one rerun checks what follows both stops; each rerun is a whole training).
    output = tmp_path / "out"
    for signum, said in STOPS_WHILE_PREPARING:
        stopped = train_challenge(bundle, data, output, f"{signum.name}:call:brats_swap.train.data.prepare_run_data")
        assert stopped.returncode == EXIT_INTERRUPTED, stopped.stdout + stopped.stderr
        errors = stop_lines(stopped, signum)
        assert len(errors) == 1 and errors[0].endswith(said), stopped.stderr
        assert not (output / "run" / "fold_0").exists()  # stopped before training
        assert not (output / BUNDLE_FILE).exists() and temp_files(output) == []

    # What a SIGKILL during an earlier export would have left (atomic_path's name, a writer that is gone).
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale = output / f".{BUNDLE_FILE}.{int(gone.stdout)}.x1y2z3{TEMP_SUFFIX}"
    stale.write_bytes(b"half a zip")
    # The rerun trains to the end and gets a SIGTERM while it writes the new model.zip: the write finishes
    # (temp file + rename) and the command exits 0 (one rerun checks both; each is a whole training).
    resumed = train_challenge(bundle, data, output, f"SIGTERM:replace:{BUNDLE_FILE}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "SIGTERM" in resumed.stderr + resumed.stdout
    assert same_weights(open_bundle(output / BUNDLE_FILE).state_dict(0), uninterrupted)
    assert temp_files(output) == []


def test_sigkill_mid_epoch_then_the_same_command_resumes_to_the_uninterrupted_weights(card, data, bundle,
                                                                                     uninterrupted, tmp_path):
    killed = tmp_path / "killed"
    # SIGKILL leaves a process no last word: forked from this one (tests/forked_cli.py), killed during the first step
    # of epoch 2, with epoch 1's checkpoint written.
    done = run_forked(["train-challenge", "--model", bundle, "--data", data, "--output", killed, "--device", "cpu"],
                      signal_at=f"SIGKILL:step:{STEPS_PER_EPOCH + 1}", timeout=TIMEOUT_S)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert (killed / "run" / "fold_0" / LATEST).exists() and not (killed / BUNDLE_FILE).exists()
    resumed = retrain(open_bundle(bundle), data, killed, device="cpu", say=lambda line: None)
    log = (killed / "run" / "fold_0" / "train.log").read_text()
    assert resumed.resumed and "resume fold 0 at epoch 2 step 0" in log
    assert resumed.plan == uninterrupted.plan
    assert same_weights(open_bundle(resumed.bundle).state_dict(0), uninterrupted)
