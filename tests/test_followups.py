"""`brats-swap plan` prices the run's own output count; `evaluate --predictions` takes a challenge name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.data.challenges import get_challenge
from brats_swap.data.discovery import discover_cases
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.evaluate.official import OFFICIAL_CSV, OFFICIAL_SUMMARY_JSON
from brats_swap.train import planning


def _planned_model_outputs(*overrides: str) -> int:
    # A 3-level U-Net: the output count does not depend on the depth, and pricing it costs half the default's.
    config = load_config(None, ["model.base_filters=4", "model.depth=3", "model.segmentation_levels=2",
                                "data.cube=[16,16,16]", *overrides])
    _, planner = planning.plan_for_config(config, batch=1, device="cpu")
    with torch.no_grad():
        out = planner.model(torch.zeros(1, config.model.in_channels, 16, 16, 16))
    return out.shape[1]


@pytest.mark.parametrize(("overrides", "outputs"), [
    (("data.challenge=men-rt",), 1),  # label GTV
    (("data.challenge=men-rt", "model.outputs=regions"), 1),  # region GTV
    (("data.challenge=ped",), 4),  # labels ET, NETC, CC, ED
    (("data.challenge=ped", "model.outputs=regions"), 4),  # regions WT, TC, ET + CC
    (("data.challenge=gli-post", "model.outputs=regions"), 4),  # regions WT, TC, ET + RC
    (("data.edition=2021",), 3),
    ((), 3),  # no table named: the glioma default
])
def test_plan_prices_the_network_with_the_runs_output_count(overrides, outputs):
    assert _planned_model_outputs(*overrides) == outputs


def test_plan_names_model_regions_that_the_forced_table_cannot_train():
    from brats_swap.errors import ConfigError

    with pytest.raises(ConfigError, match="model.regions: 'CC' is not an evaluation group of the men-rt table"):
        _planned_model_outputs("data.challenge=men-rt", "model.outputs=regions", "model.regions=[CC]")


@pytest.fixture(scope="module")
def ped_cases(tmp_path_factory):
    """Two PED phantom cases and their ground truth copied as a tool's predictions."""
    base = tmp_path_factory.mktemp("ped")
    root, predictions = base / "data", base / "predictions"
    synthesize_dataset(root, 2, seed=0, edition="ped", shape=(24, 24, 16))
    predictions.mkdir()
    for case in discover_cases(root):
        shutil.copy(case.seg, predictions / f"{case.case_id}.nii.gz")
    return root, predictions


def test_evaluate_predictions_accepts_a_challenge_as_edition(ped_cases, tmp_path):
    root, predictions = ped_cases
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["evaluate", "--predictions", str(predictions), "--data", str(root),
                                      "--out", str(out), "--edition", "ped"])
    assert result.exit_code == 0, result.output
    for name in ("metrics.csv", "summary.json", OFFICIAL_CSV, OFFICIAL_SUMMARY_JSON):
        assert (out / name).is_file(), name
    official = json.loads((out / OFFICIAL_SUMMARY_JSON).read_text())
    assert official["groups"] == {name: list(labels) for name, labels in get_challenge("ped").groups.items()}
    assert official["cases"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dice_wt"]["mean"] == 1.0 and summary["dice_wt"]["n"] == 2


def test_evaluate_refuses_an_edition_and_a_challenge_that_disagree(ped_cases, tmp_path):
    root, predictions = ped_cases
    result = CliRunner().invoke(app, ["evaluate", "--predictions", str(predictions), "--data", str(root),
                                      "--out", str(tmp_path / "report"), "--edition", "ped", "--challenge", "met"])
    assert result.exit_code == 2
    assert "edition 'ped' and challenge 'met' name two different label tables" in " ".join(result.output.split())
    assert not (tmp_path / "report").exists()
