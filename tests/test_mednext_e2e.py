"""MedNeXt-L end to end on phantoms at a tiny size (32³, 4 initial filters, one block per stage, one step):
trained under `memory.mode: none` and `auto` to bitwise-equal weights, evaluated, exported and predicted from
the bundle (`predict --model`), and a 5³-kernel network started from the 3³ run by UpKern (`train.init_from`)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import prepared_dataset, tiny_config
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import ConfigError
from brats_swap.data.discovery import discover_cases
from brats_swap.evaluate.scoring import evaluate_fold
from brats_swap.memory.planner import BUDGET_HEADROOM, Planner
from brats_swap.model import build_model
from brats_swap.model.upkern import initial_weights, upkern
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import RunFolder
from brats_swap.ship.bundle import export_bundle
from brats_swap.train.loop import train_fold
from brats_swap.train.losses import training_loss
from brats_swap.train.planning import optimizer_state_factor

TINY = ("model.name=mednext_l", "model.features=[4]", "model.blocks=[1,1,1,1,1,1,1,1,1]",
        "train.optimizer=adamw", "train.lr=0.001", "train.adam_eps=1e-4", "train.weight_decay=3e-5",
        "train.schedule=poly", "train.loss=dice_ce", "train.grad_clip=12", "memory.swap.min_bytes=0",
        "train.steps_per_epoch=1", "cv.folds=4")


def mednext_config(data, *extra: str):
    return tiny_config(*data, *TINY, *extra)


def auto_keys(config) -> tuple[str, ...]:
    """`memory.mode=auto` with a budget 1% under the network's no-policy peak: it must swap or recompute."""
    model = build_model(config.model, 3)
    shape = (config.train.batch_size, config.model.in_channels, *config.data.cube)
    planner = Planner(model, shape, loss_fn=training_loss(config.train.loss, model),
                      optimizer_state_factor=optimizer_state_factor(config))
    limit = 0.99 * planner.memory(config.memory).peak_bytes
    return ("memory.mode=auto", f"memory.budget_gib={limit / BUDGET_HEADROOM / 2**30}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = prepared_dataset(tmp_path_factory)  # the 32³ cube
    made = {}
    for policy in ("none", "auto"):
        config = mednext_config(data)
        if policy == "auto":
            config = mednext_config(data, *auto_keys(config))
        run = tmp_path_factory.mktemp(f"mednext-{policy}") / "run"
        made[policy] = (run, train_fold(config, run, 0, progress=False))
    return data, made


def test_mednext_l_trains_bitwise_equal_under_auto_and_evaluates(runs):
    data, made = runs
    (plain_run, plain), (auto_run, auto) = made["none"], made["auto"]
    assert [r["train_loss"] for r in auto.history] == [r["train_loss"] for r in plain.history]
    expected = load_checkpoint(RunFolder.of(plain_run).fold(0).latest)["model"]
    tested = load_checkpoint(RunFolder.of(auto_run).fold(0).latest)["model"]
    assert all(torch.equal(tested[key], value) for key, value in expected.items())
    plan = RunFolder.of(auto_run).fold(0).memory_plan.read_text(encoding="utf-8")
    assert '"mode": "none"' not in plan.split('"report"')[0]  # auto had to swap or recompute
    scores = evaluate_fold(mednext_config(data), plain_run, 0, progress=False)
    assert scores, "no case scored"


def test_mednext_l_exports_and_predicts_from_the_bundle(runs, tmp_path):
    data, made = runs
    bundle = export_bundle(made["none"][0], tmp_path / "mednext.zip").path
    case = discover_cases(data[0])[0]
    result = CliRunner().invoke(app, ["predict", "--model", str(bundle), "--input", str(case.seg.parent),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / f"{case.case_id}.nii.gz").is_file()


def test_upkern_keeps_the_centre_and_corner_taps_and_interpolates_between():
    weight = torch.randn(6, 1, 3, 3, 3)
    resampled = upkern(weight, (5, 5, 5))
    assert resampled.shape == (6, 1, 5, 5, 5)
    assert torch.equal(resampled[..., 2, 2, 2], weight[..., 1, 1, 1])
    for corner in ((0, 0, 0), (4, 4, 4), (0, 4, 0)):
        source = tuple(0 if c == 0 else 2 for c in corner)
        assert torch.equal(resampled[(..., *corner)], weight[(..., *source)])
    # Between taps the values are trilinear blends: (1, 2, 2) lies 0.2 of the way from tap 0 to tap 1 on the
    # first axis (align_corners off: 1.5 * 3/5 - 0.5 = 0.4, i.e. 0.6 of tap 0 and 0.4 of tap 1).
    blend = 0.6 * weight[..., 0, 1, 1] + 0.4 * weight[..., 1, 1, 1]
    assert torch.allclose(resampled[..., 1, 2, 2], blend, atol=1e-6)


def test_a_k5_run_starts_from_the_k3_run_by_upkern(runs, tmp_path):
    data, made = runs
    source = RunFolder.of(made["none"][0]).fold(0).best
    trained = load_checkpoint(source)["model"]
    config = mednext_config(data, "model.kernel_size=5", f"train.init_from={source}", "train.max_epochs=1")
    network = build_model(config.model, 3)
    fitted = initial_weights(network, trained, str(source))
    depthwise = [key for key, value in trained.items() if value.dim() == 5 and value.shape[2:] == (3, 3, 3)]
    assert depthwise and all(fitted[key].shape[2:] == (5, 5, 5) for key in depthwise)
    assert all(torch.equal(fitted[key][..., 2, 2, 2], trained[key][..., 1, 1, 1]) for key in depthwise)
    assert all(torch.equal(fitted[key], value) for key, value in trained.items() if key not in depthwise)
    result = train_fold(config, tmp_path / "k5", 0, progress=False)
    assert result.history and result.history[0]["train_loss"] == result.history[0]["train_loss"]
    other = build_model(mednext_config(data, "model.name=mednext_s", "model.blocks=[1,1,1,1,1,1,1,1,1]").model, 3)
    with pytest.raises(ConfigError, match=r"^train\.init_from: .*: weight '.*' has shape .* only convolution"):
        initial_weights(other, trained, str(source))  # MedNeXt-S expands less: its 1x1x1 layers are narrower
