"""Label-trained (softmax) nnU-Net models: the oracle against nnunetv2 2.8.1's own predictor, and what every
command that takes such a run does.

The model folder is written here with nnU-Net's own code: the test fixture's plans (tests/fixtures/
nnunet_results, nnU-Net's planner: PlainConvUNet, 4-16 features, patch (z, y, x) 20 x 28 x 24) with a
dataset.json of one value per label and no regions (nnU-Net's default: a softmax over background + 3
labels), the network from nnU-Net's `get_network_from_plans` (through the bench script's `FixtureTrainer`,
nnUNetTrainer's `build_network_architecture`) with its random initialisation, and nnU-Net's checkpoint
layout. The dataset's labels are numbered as nnU-Net's BraTS 2021 conversion numbers them (1 edema, 2
necrosis, 3 enhancing), not in the table's order (1 NCR/NET, 2 ED, 4 ET), so the channel order the import
records (`model.label_order`) is on the path. The heads' weights are scaled and their biases set so that every label wins
somewhere (a random network's argmax would otherwise be nearly one class).

What remains different from nnU-Net, and why: the float16 sums of the tiles run in another order (see
tests/test_nnunet_predict.py), which moves probabilities by far less than 1e-2. Exact ties of two channels
are frequent here (float16 logits: ~0.1% of the voxels); the argmax keeps the first channel on both sides
because the channels keep nnU-Net's order (with the table's order instead, 0.002-0.03% of the labels
differed, every one at such a tie).
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from layout_helpers import nnunet_phantoms, to_nnunet_brats21
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.errors import ConfigError
from brats_swap.model.targets import labels_from_probs, output_names, targets_from_labels
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.trained import load_trained_model
from brats_swap.train.losses import training_loss

pytest.importorskip("dynamic_network_architectures")
pytest.importorskip("nnunetv2.inference.predict_from_raw_data")

import test_nnunet_predict as oracle  # noqa: E402 (after the skips: it needs nnunetv2)
from test_nnunet_predict import SHAPES, _bench, assert_like_nnunet  # noqa: E402

FIXTURE = (Path(__file__).resolve().parent / "fixtures" / "nnunet_results" / "Dataset991_BraTSPhantoms"
           / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres")
# nnU-Net's BraTS 2021 numbering, one value per label: channel k of the model is label k.
LABELS = {"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 3}
LABEL_ORDER = [2, 1, 4]  # the 2021 table's values of those channels: ED, NCR/NET, ET
HEAD_SCALE = 4.0
HEAD_BIAS = (0.0, -0.3, 0.2, 0.1)  # tuned so that each label wins on some voxels of the phantoms


def write_label_model(out: Path, dataset_labels: dict | None = None) -> Path:
    """An nnU-Net v2 results folder of a label-trained model (module docstring)."""
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    results = out / "Dataset993_BraTSLabels" / "nnUNetTrainer__nnUNetPlans__3d_fullres"
    (results / "fold_0").mkdir(parents=True)
    plans = json.loads((FIXTURE / "plans.json").read_text())
    plans["dataset_name"] = "Dataset993_BraTSLabels"
    dataset = json.loads((FIXTURE / "dataset.json").read_text())
    dataset.pop("regions_class_order")
    dataset["labels"] = dataset_labels or LABELS
    (results / "plans.json").write_text(json.dumps(plans, indent=2))
    (results / "dataset.json").write_text(json.dumps(dataset, indent=2))
    manager = PlansManager(plans)
    heads = manager.get_label_manager(dataset).num_segmentation_heads  # nnU-Net's own count: background + labels
    torch.manual_seed(0)
    network = _bench().FixtureTrainer.build_network_architecture(
        manager, manager.get_configuration("3d_fullres"), 4, heads, enable_deep_supervision=True)
    weights = network.state_dict()
    for name in weights:
        if name.startswith("decoder.seg_layers.") and name.endswith(".weight"):
            weights[name] *= HEAD_SCALE
        if name.startswith("decoder.seg_layers.") and name.endswith(".bias") and heads == len(HEAD_BIAS):
            weights[name] += torch.tensor(HEAD_BIAS)
    checkpoint = {"network_weights": weights, "trainer_name": "nnUNetTrainer",
                  "init_args": {"configuration": "3d_fullres", "fold": 0},
                  "inference_allowed_mirroring_axes": (0, 1, 2), "current_epoch": 0}
    torch.save(checkpoint, results / "fold_0" / "checkpoint_final.pth")
    return results


@pytest.fixture(scope="module")
def label_model(tmp_path_factory):
    """The label-trained model folder, the phantoms in nnU-Net's layout and the imported run."""
    root = tmp_path_factory.mktemp("softmax")
    results = write_label_model(root / "results")
    data = nnunet_phantoms(root, SHAPES, seed=5, id_offset=500)  # its labels: 1 edema, 2 necrosis, 3 ET
    run = root / "run"
    imported = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(run)])
    assert imported.exit_code == 0, imported.output
    return results, data, run, root


def _nnunet(results: Path, data: Path, mirroring: bool, monkeypatch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """nnUNetPredictor on the case files (nnUNetv2_predict's settings), in brats-swap's (x, y, z) axes: the
    region oracle's own call (tests/test_nnunet_predict.py), pointed at this model folder."""
    monkeypatch.setattr(oracle, "RESULTS", results)
    return oracle._nnunet(data, mirroring)


def _ours(data: Path, run: Path, out: Path, *options: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(data), "--out", str(out),
                                      "--save-probabilities", "--dataset-labels", "--no-postprocessing", *options])
    assert result.exit_code == 0, result.output
    found = {}
    for path in sorted(out.glob("*.nii.gz")):
        case = path.name.removesuffix(".nii.gz")
        with np.load(out / f"{case}.npz") as saved:
            assert str(saved["outputs"]) == "softmax"
            assert list(saved["channels"]) == ["background", "ED", "NCR/NET", "ET"]  # nnU-Net's channel order
            found[case] = (np.asarray(nib.load(str(path)).dataobj), saved["probabilities"])
    return found


@pytest.mark.parametrize("mirroring", [False, True], ids=["no-mirroring", "mirroring"])
def test_predict_on_an_imported_label_model_is_nnunets_prediction(label_model, mirroring, monkeypatch):
    results, data, run, root = label_model
    theirs = _nnunet(results, data, mirroring, monkeypatch)
    ours = _ours(data, run, root / f"ours-{mirroring}", "--tta" if mirroring else "--no-tta")
    seen = assert_like_nnunet(ours, theirs, len(SHAPES))
    assert seen == {0, 1, 2, 3}  # every label wins somewhere: not a comparison of two one-class maps


def test_the_import_writes_softmax_outputs_in_the_models_channel_order(label_model):
    results, _, run, _ = label_model
    state = load_checkpoint(run / "fold_0" / "checkpoint_best.pt")
    config = state["config"]
    assert (config["model"]["outputs"], config["model"]["label_order"], config["model"]["regions"]) == (
        "softmax", LABEL_ORDER, [])
    assert config["train"]["loss"] == "dice_ce" and config["evaluate"]["inference"] == "nnunet"
    theirs = torch.load(results / "fold_0" / "checkpoint_final.pth", map_location="cpu", weights_only=False)
    heads = [name for name in theirs["network_weights"] if name.startswith("decoder.seg_layers.")]
    assert heads
    for name in heads:  # 1x1x1 kernels: the axis permutation leaves them as they are, and the channels stay
        assert torch.equal(state["model"][name], theirs["network_weights"][name])
    # The loaded network's eval output is the softmax of its logits; fine-tuning trains it with nnU-Net's loss.
    model, trained_config, _ = load_trained_model(run, 0, "best")
    x = torch.randn(1, 4, *trained_config.train.patch)
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.softmax(model.logits(x), 1))
    assert training_loss(trained_config.train.loss, model).softmax


def test_every_command_on_a_softmax_run(label_model, tmp_path):
    """predict with brats-swap's own inference (--set evaluate.inference=brats_swap): softmax probabilities,
    background 1 outside the brain; fine-tuning: train --resume on the imported run takes a step of nnU-Net's
    Dice + CE from the imported weights."""
    _, data, run, _ = label_model
    out = tmp_path / "own"
    ours = _ours(data, run, out, "--set", "evaluate.inference=brats_swap")
    for labels, probs in ours.values():
        np.testing.assert_allclose(probs.sum(axis=0), 1.0, atol=1e-5)
        outside = np.all(probs[1:] == 0, axis=0) & (probs[0] == 1)
        assert outside.any() and np.all(labels[outside] == 0)
    brats = tmp_path / "brats"
    synthesize_dataset(brats, 5, seed=2, edition="2021", shape=(40, 40, 24))
    train_data = to_nnunet_brats21(brats, tmp_path / "Dataset137_BraTS2021")
    tiny = [f"data.root={train_data}", f"data.cache={tmp_path / 'cache'}", "train.max_epochs=1",
            "train.steps_per_epoch=1", "train.device=cpu", "train.batch_size=1", "data.loader_workers=0", "data.prepare_workers=1",
            "evaluate.hd95=false", "train.lr=1e-12"]
    copy = tmp_path / "run"
    copy.mkdir()
    for path in run.rglob("*"):
        if path.is_file():
            (copy / path.relative_to(run)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(run)).write_bytes(path.read_bytes())
    # The imported config's train.init_from names the original run's fold_0/checkpoint_nnunet.pt: the same weights.
    trained = CliRunner().invoke(app, ["train", "--run", str(copy), "--resume",
                                       *(arg for item in tiny for arg in ("--set", item))])
    assert trained.exit_code == 0, trained.output
    start = load_checkpoint(copy / "fold_0" / "checkpoint_nnunet.pt")["model"]
    after = load_checkpoint(copy / "fold_0" / "checkpoint_latest.pt")
    # A step of lr 1e-12 from nnU-Net's weights: still those weights.
    assert after["epoch"] == 1 and all(torch.allclose(start[k], after["model"][k], atol=1e-8) for k in start)
    # evaluate --run scores the fold's validation case from the prepared cubes with the softmax decoding.
    scored = CliRunner().invoke(app, ["evaluate", "--run", str(copy)])
    assert scored.exit_code == 0, scored.output
    # export -> predict --model (and serve-challenge, which predicts through it) writes what predict --run does.
    bundle = tmp_path / "model.zip"
    exported = CliRunner().invoke(app, ["export", "--run", str(run), "--out", str(bundle)])
    assert exported.exit_code == 0, exported.output
    from_bundle = CliRunner().invoke(app, ["predict", "--model", str(bundle), "--input", str(data), "--out",
                                           str(tmp_path / "bundle"), "--dataset-labels", "--no-postprocessing"])
    assert from_bundle.exit_code == 0, from_bundle.output
    from_run = _ours(data, run, tmp_path / "run-nnunet")
    for case, (labels, _) in from_run.items():
        assert np.array_equal(np.asarray(nib.load(str(tmp_path / "bundle" / f"{case}.nii.gz")).dataobj), labels)


def test_the_softmax_loss_is_nnunets_dice_and_ce():
    """train.loss dice_ce on softmax outputs against nnU-Net's DC_and_CE_loss as nnUNetTrainer builds it (batch
    Dice, smooth 1e-5, no background, ddp off): the same gradients; the value is nnU-Net's + 1 (MONAI's Dice
    is 1 - Dice, nnU-Net's -Dice)."""
    from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    from brats_swap.train.losses import SegmentationLoss

    theirs_loss = DC_and_CE_loss({"batch_dice": True, "smooth": 1e-5, "do_bg": False, "ddp": False}, {},
                                 weight_ce=1, weight_dice=1, ignore_label=None, dice_class=MemoryEfficientSoftDiceLoss)
    ours_loss = SegmentationLoss("dice_ce", from_logits=True, softmax=True)
    generator = torch.Generator().manual_seed(3)
    label = torch.tensor([0, 1, 2, 4])[torch.randint(0, 4, (2, 9, 8, 7), generator=generator)]
    logits = torch.randn(2, 4, 9, 8, 7, generator=generator)
    ours_in, theirs_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = ours_loss(ours_in, targets_from_labels(label, "2021", "softmax", label_order=LABEL_ORDER))
    # nnU-Net's target: the label map of its channel indices (b, 1, ...).
    index = torch.tensor([0, 2, 1, 0, 3])[label][:, None].float()  # table value -> channel of LABEL_ORDER
    theirs = theirs_loss(theirs_in, index)
    ours.backward(), theirs.backward()
    torch.testing.assert_close(ours, theirs + 1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-4, atol=1e-7)


def test_softmax_labels_round_trip_and_decode_by_argmax():
    for table in ("2021", "gli", "ped"):
        names = output_names(table, "softmax")
        assert names[0] == "background" and len(names) == len(output_names(table, "labels")) + 1
        values = np.array([0, *sorted(int(v) for v in _table_values(table))], dtype=np.uint8)
        label = values[np.random.default_rng(1).integers(0, len(values), (6, 5, 4))]
        targets = targets_from_labels(label, table, "softmax")
        assert targets.shape == (len(values), 6, 5, 4) and np.all(targets.sum(axis=0) == 1)
        assert np.array_equal(labels_from_probs(targets, table, "softmax"), label)
        assert torch.equal(labels_from_probs(torch.from_numpy(targets), table, "softmax"), torch.from_numpy(label))
    # No threshold: a background probability of 0.4 still wins over smaller ones; a channel order moves the labels,
    # and an exact tie goes to the first channel.
    probs = np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32).reshape(4, 1, 1, 1)
    assert labels_from_probs(probs, "2021", "softmax").item() == 0
    tie = np.array([0.1, 0.45, 0.45, 0.0], dtype=np.float32).reshape(4, 1, 1, 1)
    assert labels_from_probs(tie, "2021", "softmax").item() == 1
    assert labels_from_probs(tie, "2021", "softmax", label_order=LABEL_ORDER).item() == 2
    assert output_names("2021", "softmax", label_order=LABEL_ORDER) == ["background", "ED", "NCR/NET", "ET"]
    with pytest.raises(ConfigError, match="^model.label_order: "):
        output_names("2021", "softmax", label_order=[1, 2, 3])


def _table_values(table: str):
    from brats_swap.data.challenges import get_challenge

    return get_challenge(table).label_values


@pytest.mark.parametrize(("labels", "code", "message"), [
    ({"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 4}, 2, "consecutive values"),
    ({"background": 0, "edema": 1, "enhancing tumour": 2}, 2, "no channel for NCR/NET"),
    ({"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 3, "cavity": 4}, 2,
     "label value 4 names a tissue"),
    ({"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 3, "ignore": 4}, 2, "ignore label"),
    # Two values of one label: the dataset's label names themselves do not tell the values apart (DataError).
    ({"background": 0, "edema": 1, "ED": 2, "non-enhancing tumor": 3, "enhancing tumour": 4}, 1,
     "the labels do not tell which class"),
])
def test_what_cannot_be_imported_is_one_line(labels, code, message, tmp_path):
    results = write_label_model(tmp_path / "results", labels)
    result = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(tmp_path / "run")])
    assert result.exit_code == code, result.output
    assert result.output.startswith("error: ") and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.outputs=softmax", "train.loss=dice_ce"], "model.outputs: softmax needs a network that returns logits"),
    (["model.name=nnunet", "model.outputs=softmax", "train.loss=dice_bce"], "train.loss=dice_ce"),
    (["model.name=nnunet", "model.outputs=softmax", "train.loss=dice"], "train.loss=dice_ce"),
    (["model.name=nnunet", "model.outputs=regions", "train.loss=dice_bce", "model.label_order=[2,1,4]"],
     "orders softmax outputs only"),
])
def test_softmax_configs_that_cannot_train_are_refused(overrides, message):
    with pytest.raises(ConfigError, match="^model.(outputs|label_order): ") as refused:
        load_config(None, overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)
