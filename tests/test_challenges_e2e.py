"""Every 2023+ challenge end to end through the CLI, straight from a download: phantoms named and labelled
like GLI post-treatment, PED 2024, MET and MEN-RT pass `data check --strict`, `train` prepares the empty
cache itself and trains on the challenge's regions, `evaluate` scores those regions and writes predictions
in the challenge's label values.

Tiny on purpose (4 cases of 40x40x24, a 24³ cube, 4 base filters, depth 4, one epoch of one step).
`cv` and `compare` prepare the cache the same way, once, before their first fold.
"""

from __future__ import annotations

import csv
import json

import nibabel as nib
import numpy as np
import pytest
from cv_helpers import CASE_IDS, install_fake_training
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.cv import run_cv, runner
from brats_swap.cv.compare import run_compare
from brats_swap.data.cache import PrepareReport
from brats_swap.data.challenges import get_challenge
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.train import data as train_data

# challenge -> (model.outputs, data.modalities (None: unset), the regions its metrics must report, in column order)
CASES = {
    "gli-post": ("labels", "[t1,t1ce,t2,flair]", ("WT", "TC", "ET", "RC")),
    "ped": ("regions", "[t1,t1ce,t2,flair]", ("WT", "TC", "ET", "CC")),
    "met": ("regions", "[t1,t1ce,t2,flair]", ("WT", "TC", "ET", "RC")),
    "men-rt": ("labels", None, ("GTV",)),  # no data.modalities: the challenge's images (t1ce only)
}
TINY = ["data.cube=[24,24,24]", "model.depth=4", "model.base_filters=4", "train.max_epochs=1",
        "train.steps_per_epoch=1", "train.device=cpu", "cv.folds=2", "data.loader_workers=0",
        "data.prepare_workers=1", "evaluate.hd95=false"]


def _sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def _invoke(args: list[str]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{' '.join(args[:2])}: exit {result.exit_code}\n{result.output}"
    return result


@pytest.mark.parametrize("challenge", sorted(CASES))
def test_check_train_evaluate_on_a_challenge_from_an_empty_cache(challenge, tmp_path):
    outputs, modalities, regions = CASES[challenge]
    spec = get_challenge(challenge)
    root, cache, run = tmp_path / "download", tmp_path / "cache", tmp_path / "run"
    _invoke(["data", "synth", "--challenge", challenge, "--cases", "4", "--shape", "40", "40", "24",
             "--out", str(root)])
    chosen = [f"data.modalities={modalities}"] if modalities else []
    # One process: the pool's answers are tests/test_data_scale.py's (two spawned workers cost ~3 s of CPU here).
    checked = _invoke(["data", "check", str(root), "--strict", "--workers", "1", *_sets(*chosen)])
    assert "4 usable, 0 skipped" in checked.output
    assert not cache.exists()

    data = [f"data.root={root}", f"data.cache={cache}", *chosen, f"model.outputs={outputs}"]
    trained = _invoke(["train", "--run", str(run), *_sets(*data, *TINY)])
    assert "prepared 4 case(s)" in " ".join(trained.output.split())  # no `data prepare` needed first
    assert sorted(json.loads((cache / "index.json").read_text())["cases"]) == [spec.example_id(i) for i in range(4)]
    saved = load_config(run / "config.yaml").data.modalities
    assert saved == (["t1ce"] if challenge == "men-rt" else ["t1", "t1ce", "t2", "flair"])  # recorded in the run
    train_log = (run / "fold_0" / "train.log").read_text()
    assert all(f"dice_{region.lower()}" in train_log for region in regions)

    _invoke(["evaluate", "--run", str(run)])
    fold = run / "fold_0"
    with open(fold / "metrics.csv", newline="") as handle:
        header = next(csv.reader(handle))
    assert [column for column in header if column.startswith("dice_")] == [f"dice_{r.lower()}" for r in regions]
    summary = json.loads((fold / "summary.json").read_text())
    assert {f"dice_{r.lower()}" for r in regions} <= set(summary)

    predictions = sorted((fold / "predictions").glob("*.nii.gz"))
    val_ids = json.loads((run / "splits.json").read_text())["folds"][0]["val"]
    assert [p.name for p in predictions] == [f"{case}.nii.gz" for case in val_ids]
    values = set()
    for path in predictions:
        values |= set(np.unique(np.asarray(nib.load(path).dataobj)).tolist())
    assert values <= {0, *spec.label_values}, f"{challenge} predictions hold {sorted(values)}"
    assert values - {0}, "the untrained model predicts some tumour, so the label mapping was exercised"


def test_a_folder_mixing_two_label_tables_is_refused_before_training(tmp_path):
    root, cache, run = tmp_path / "download", tmp_path / "cache", tmp_path / "run"
    synthesize_dataset(root, 2, seed=0, edition="gli", shape=(40, 40, 24))
    synthesize_dataset(root, 2, seed=1, edition="gli-post", shape=(40, 40, 24))
    result = CliRunner().invoke(app, ["train", "--run", str(run),
                                      *_sets(f"data.root={root}", f"data.cache={cache}", *TINY)])
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "several label tables" in message and "gli-post" in message and "data.challenge" in message
    assert not (run / "config.yaml").exists()  # refused before the run folder was written


def test_regions_that_cannot_give_back_the_labels_are_a_config_error_naming_the_key(tmp_path):
    root, cache, run = tmp_path / "download", tmp_path / "cache", tmp_path / "run"
    synthesize_dataset(root, 2, seed=0, edition="ped", shape=(40, 40, 24))
    result = CliRunner().invoke(app, ["train", "--run", str(run), *_sets(
        f"data.root={root}", f"data.cache={cache}", "model.outputs=regions", "model.regions=[WT,TC,ET]", *TINY)])
    # WT/TC/ET alone cannot tell PED's NETC from its CC, so labels could not be recovered.
    assert result.exit_code == 2, result.output
    assert "model.regions" in result.output and not (run / "config.yaml").exists()


@pytest.mark.parametrize("command", ["cv", "compare"])
def test_cv_and_compare_prepare_the_cache_once_before_any_fold(command, monkeypatch, tmp_path):
    # The folds are the scripted stand-ins of cv_helpers; what is checked is the order of the calls.
    fake = install_fake_training(monkeypatch, tmp_path)
    events: list[str] = []

    def prepare_missing(data_cfg, **_):
        events.append(f"prepare {data_cfg.root}")
        return PrepareReport(cache=tmp_path / "cache", up_to_date=list(CASE_IDS))

    monkeypatch.setattr(train_data, "prepare_missing", prepare_missing)
    trained = fake.train_fold
    monkeypatch.setattr(runner, "train_fold", lambda *args, **kwargs: events.append("train") or trained(*args, **kwargs))
    config = load_config(None, [f"data.root={tmp_path / 'download'}", f"data.cache={tmp_path / 'cache'}",
                                "cv.folds=2", "train.max_epochs=1", "data.cube=[64,64,64]", "train.patch=[32,32,32]"])
    if command == "cv":
        assert run_cv(config, tmp_path / "run").complete
    else:
        assert run_compare(config, tmp_path / "run").complete
    assert events[0] == f"prepare {tmp_path / 'download'}" and events.count(events[0]) == 1
    assert events[1:] == ["train"] * (2 if command == "cv" else 4)


def test_the_challenges_images_are_the_default_modalities_and_an_explicit_list_wins(tmp_path):
    from brats_swap.data.discovery import challenge_images

    root = tmp_path / "download"
    synthesize_dataset(root, 1, seed=0, shape=(8, 8, 8), edition="men-rt")
    assert challenge_images(root) == ["t1ce"]  # detected from the case id
    assert challenge_images(tmp_path / "missing", "men-rt") == ["t1ce"]  # forced
    assert challenge_images(tmp_path / "missing") is None  # nothing to read: the config keeps its list

    def images_of(data):
        return challenge_images(data.root, data.challenge)

    config = load_config(None, [f"data.root={root}"], images_of=images_of)
    assert (config.data.modalities, config.model.in_channels) == (["t1ce"], 1)
    explicit = load_config(None, [f"data.root={root}", "data.modalities=[t1,t1ce]"], images_of=images_of)
    assert explicit.data.modalities == ["t1", "t1ce"]
