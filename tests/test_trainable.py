"""A challenge image the organisers retrain (BraTS 2026 GoAT): the trainable build folder's `train` entry run as
the challenge would (another uid, no network, read-only data) trains the bundle's recipe and writes a bundle that
serves; two cards get two plans; the time budget shortens the schedule up front; the all-cases model (nnU-Net's
fold `all`) trains, exports and predicts. (SIGKILL and a restart: tests/test_trainable_stop.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from ship_helpers import NON_ROOT, challenge_input, namespaces_permitted, reachable_interpreter
from trainable_helpers import RECIPE, goat_training_data, recipe_bundle

from brats_swap.config import load_config
from brats_swap.errors import ConfigError
from brats_swap.memory.planner import GIB
from brats_swap.run.fold_selection import ALL_CASES, parse_fold_selection, resolve_folds
from brats_swap.run.folder import ALL_CASES_FOLD, RunFolder
from brats_swap.ship.bundle import METADATA, TRAINING_PLAN, open_bundle
from brats_swap.ship.container import write_container
from brats_swap.ship.retrain import (
    DEVICE_MEMORY_VARIABLE,
    Card,
    device_memory_override,
    plan_training,
    retrain,
)
from brats_swap.ship.submission import check_submission
from brats_swap.splits import fold_cases, make_splits


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("goat") / "data"
    ids = goat_training_data(folder)
    assert all(i.startswith("BraTS-GoAT-") for i in ids)
    return folder


def _weights(bundle: Path, fold: int) -> dict:
    return open_bundle(bundle).state_dict(fold)


@pytest.mark.skipif(not namespaces_permitted(), reason="needs root with unshare -m -n and setpriv")
def test_the_trainable_image_trains_as_another_uid_without_network_and_its_bundle_serves(data, tmp_path):
    work = Path(tempfile.mkdtemp(prefix="brats-swap-trainable-"))
    try:
        work.chmod(0o755)
        image = write_container(open_bundle(recipe_bundle(tmp_path, "goat-recipe", [0])), work / "image", "goat",
                                trainable=True).folder
        assert " train --time-budget" in (image / "README.md").read_text()  # how the organisers retrain it
        shutil.copytree(data, work / "data")
        challenge_input(work / "input", "goat", 2, seed=5)
        out, predictions, scratch = work / "out", work / "predictions", work / "tmp"
        for folder in (out, predictions, scratch):
            folder.mkdir(mode=0o700)
            os.chown(folder, NON_ROOT, NON_ROOT)
        script = ["mount --make-rprivate /", *reachable_interpreter(work / "interpreter")]
        script += [f"mount --bind {folder} {folder}" for folder in (out, predictions, scratch)]
        for folder in (work / "data", work / "input"):
            script += [f"mount --bind {folder} {folder}", f"mount -o remount,bind,ro {folder}"]
        script.append("mount -o remount,bind,ro /")
        user = (f"setpriv --reuid {NON_ROOT} --regid {NON_ROOT} --clear-groups env HOME=/nonexistent-home "
                f"TMPDIR={scratch} PATH={Path(sys.executable).parent}:/usr/bin:/bin {DEVICE_MEMORY_VARIABLE}=12")
        train = f"{user} {image}/entrypoint.sh train --model {image}/model.zip --data {work}/data --output {out}"
        serve = f"{user} {image}/entrypoint.sh --model {out}/model.zip --input {work}/input --output {predictions}"
        done = subprocess.run(["unshare", "-m", "-n", "--", "sh", "-c", " && ".join(script) +
                               f"; {train}; echo train-exit=$?; {serve}; echo serve-exit=$?"],
                              capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert "train-exit=0" in output and "serve-exit=0" in output, output
        assert "training: full 16x16x16, batch 1, memory.mode" in output  # the plan, printed at the start
        with zipfile.ZipFile(out / "model.zip") as archive:
            names = set(archive.namelist())
            plan = json.loads(archive.read(TRAINING_PLAN))
        assert {"models/fold_0/model.pt", "models/fold_0/train.log", "figures/fold_curves.png"} <= names
        assert plan["card"]["memory_bytes"] == 12 * GIB and plan["card"]["source"] == DEVICE_MEMORY_VARIABLE
        assert (out / "model.zip").stat().st_uid == NON_ROOT
        report = check_submission(predictions, work / "input", "goat")
        assert report.problems == [] and report.checked == 2
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_12_and_a_24_gb_card_get_different_plans():
    # A whole-volume recipe at a real size (planned on the meta device, nothing allocated).
    config = load_config(None, ["model.depth=3", "model.segmentation_levels=2", "data.cube=[128,128,128]",
                                "train.batch_size=4"])
    plans = {gb: plan_training(config, Card("cpu", "simulated", int(gb * GIB), DEVICE_MEMORY_VARIABLE), [0], 100, 25)
             for gb in (12, 24)}
    assert plans[24].memory["mode"] == "none" and plans[12].memory["mode"] != "none"
    assert plans[12].peak_gib < 12 < plans[24].peak_gib < 24
    assert plans[12].batch == plans[24].batch == 4 and not plans[12].changes  # within the recipe
    assert "memory.mode " + plans[12].memory["mode"] in plans[12].screen()[1]


def test_the_card_memory_variable_is_read_or_refused_in_one_line():
    assert device_memory_override({DEVICE_MEMORY_VARIABLE: "24GB"}) == 24 * GIB
    assert device_memory_override({}) is None
    with pytest.raises(ConfigError, match=DEVICE_MEMORY_VARIABLE):
        device_memory_override({DEVICE_MEMORY_VARIABLE: "lots"})


def test_the_time_budget_shortens_epochs_then_folds_up_front_and_says_so():
    config = load_config(None, ["train.max_epochs=100", *RECIPE])
    card = Card("cpu", "CPU", 8 * int(GIB), "host memory")
    free = plan_training(config, card, [0, 1], 40, 10)
    epoch_s = free.projected_hours * 3600 / (100 * 2)
    assert free.epochs == 100 and free.folds == [0, 1] and not free.changes
    # Room for 1.5 folds of 50 epochs: epochs go to half the recipe's, then a fold goes.
    tight = plan_training(config, card, [0, 1], 40, 10, time_budget_s=75 * epoch_s / 0.95)
    assert tight.epochs == 50 and tight.folds == [0] and tight.projected_hours * 3600 <= 75 * epoch_s * 1.01
    assert tight.changes[0].startswith("epochs 100 -> 50") and tight.changes[1].startswith("folds 2 -> 1")
    assert any(line.startswith("changed: folds 2 -> 1") for line in tight.screen())


def test_the_all_cases_model_trains_on_every_case_exports_and_predicts(data, tmp_path):
    assert parse_fold_selection("all-cases") == [ALL_CASES_FOLD] != parse_fold_selection("all")
    assert resolve_folds("all-cases", 5) == [ALL_CASES_FOLD]
    splits = make_splits([f"BraTS-GoAT-{i:05d}-000" for i in range(4)], 2, seed=0)
    train, val = fold_cases(splits, ALL_CASES_FOLD)
    assert len(train) == 4 and val == train
    bundle = recipe_bundle(tmp_path, "goat-all", [ALL_CASES_FOLD], epochs=1)
    assert open_bundle(bundle).folds == [ALL_CASES_FOLD]
    report = retrain(open_bundle(bundle), data, tmp_path / "out", device="cpu", say=lambda line: None)
    run = RunFolder(report.run)
    assert run.fold(ALL_CASES_FOLD).root.name == "fold_all" and run.existing_folds() == []
    assert "4 train / 4 val cases" in run.fold(ALL_CASES_FOLD).train_log.read_text()
    with zipfile.ZipFile(report.bundle) as archive:
        assert "models/fold_all/model.pt" in archive.namelist()
    from brats_swap.ship.bundle import bundle_predictor

    predictor = bundle_predictor(open_bundle(report.bundle), ALL_CASES, device="cpu")
    assert len(predictor.members) == 1
    from brats_swap.evaluate.predicting import predict_with

    inputs = tmp_path / "input"
    challenge_input(inputs, "goat", 1, seed=9)
    written = predict_with(predictor, inputs, tmp_path / "predicted")
    assert len(written) == 1 and written[0].name.startswith("BraTS-GoAT-")


def test_a_bundle_names_monais_version_without_importing_it(tmp_path, monkeypatch):
    """Every retrain ends in an export; importing MONAI only for its version cost that process seconds of CPU."""
    monkeypatch.setitem(sys.modules, "monai", None)  # any `import monai` now raises ImportError
    bundle = recipe_bundle(tmp_path, "goat-versions", [0], epochs=1)
    with zipfile.ZipFile(bundle) as archive:
        metadata = json.loads(archive.read(METADATA))
    assert metadata["monai_version"] == importlib.metadata.version("monai")

