"""`import-nnunet` on a results folder made by nnU-Net v2's own code (tests/fixtures/nnunet_results, made by
scripts/make_nnunet_fixture.py: nnU-Net's BraTS 2021 conversion, planner, preprocessing and trainer, with
4-16 features): the imported network gives the logits of the checkpoint's network as nnU-Net builds it with
dynamic-network-architectures, `predict` and `evaluate` run on it, and fine-tuning under `memory.mode: auto`
starts from its weights and resumes.
"""

from __future__ import annotations

import json
import pydoc
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from layout_helpers import to_nnunet_brats21
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.trained import load_trained_model
from brats_swap.ship.nnunet_import import import_nnunet

pytest.importorskip("dynamic_network_architectures")
RESULTS = (Path(__file__).parent / "fixtures" / "nnunet_results" / "Dataset991_BraTSPhantoms"
           / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres")


def _nnunet_network() -> torch.nn.Module:
    """The fold's network as nnU-Net's get_network_from_plans builds it, with the checkpoint's weights."""
    plans = json.loads((RESULTS / "plans.json").read_text())
    architecture = plans["configurations"]["3d_fullres"]["architecture"]
    kwargs = dict(architecture["arch_kwargs"])
    for name in architecture["_kw_requires_import"]:
        if kwargs[name] is not None:
            kwargs[name] = pydoc.locate(kwargs[name])
    network = pydoc.locate(architecture["network_class_name"])(input_channels=4, num_classes=3,
                                                                deep_supervision=False, **kwargs)
    checkpoint = torch.load(RESULTS / "fold_0" / "checkpoint_final.pth", map_location="cpu", weights_only=False)
    network.load_state_dict(checkpoint["network_weights"])
    return network.eval()


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The library network's own forward (brats-swap's eval forward adds the sigmoid)."""
    library = next(base for base in type(model).__mro__ if base.__module__.startswith("dynamic_network_architectures"))
    return library.forward(model, x)


def test_the_imported_network_gives_nnunets_logits(tmp_path):
    imported = import_nnunet(RESULTS, tmp_path / "run")
    assert imported.folds == [0]
    config = imported.config
    assert (config.model.outputs, tuple(config.model.regions)) == ("regions", ("WT", "TC", "ET"))
    assert config.data.modalities == ["t1", "t1ce", "t2", "flair"] and config.data.clip_percentiles == [0, 100]
    model, _, _ = load_trained_model(tmp_path / "run", 0, "best")
    nnunet = _nnunet_network()
    x = torch.randn(1, 4, *config.train.patch)  # brats-swap's axes: the file's (x, y, z)
    with torch.no_grad():
        ours = _logits(model, x)
        theirs = nnunet(x.permute(0, 1, 4, 3, 2)).permute(0, 1, 4, 3, 2)  # nnU-Net reads (z, y, x)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert config.train.patch == [24, 28, 20]  # nnU-Net's (z, y, x) patch [20, 28, 24], in the file's axis order


def test_predict_evaluate_and_fine_tune_under_memory_auto(tmp_path):
    runner = CliRunner()
    brats = tmp_path / "brats"
    synthesize_dataset(brats, 5, seed=2, edition="2021", shape=(40, 40, 24))  # cv.folds stays nnU-Net's 5
    data = to_nnunet_brats21(brats, tmp_path / "Dataset137_BraTS2021")
    run = tmp_path / "run"
    imported = runner.invoke(app, ["import-nnunet", str(RESULTS), "--out", str(run)])
    assert imported.exit_code == 0, imported.output
    predicted = runner.invoke(app, ["predict", "--run", str(run), "--input", str(data), "--out", str(tmp_path / "pred")])
    assert predicted.exit_code == 0, predicted.output
    scored = runner.invoke(app, ["evaluate", "--predictions", str(tmp_path / "pred"), "--data", str(data)])
    assert scored.exit_code == 0, scored.output
    assert (tmp_path / "pred" / "official.csv").is_file()

    tiny = [f"data.root={data}", f"data.cache={tmp_path / 'cache'}", "memory.mode=auto", "memory.budget_gib=4",
            "memory.bandwidth_gbs=10", "train.max_epochs=1", "train.steps_per_epoch=1", "train.device=cpu",
            "train.batch_size=1", "data.loader_workers=0", "data.prepare_workers=1",
            "evaluate.hd95=false", "train.lr=1e-12"]
    sets = [arg for item in tiny for arg in ("--set", item)]
    # --resume on the imported run: its config.yaml (with train.init_from) is the base; no fold checkpoint yet.
    first = runner.invoke(app, ["train", "--run", str(run), "--resume", *sets])
    assert first.exit_code == 0, first.output
    fold = run / "fold_0"
    assert json.loads((fold / "memory_plan.json").read_text())["memory"]["mode"] in ("none", "swap", "recompute", "hybrid")
    start = load_checkpoint(fold / "checkpoint_nnunet.pt")["model"]
    after = load_checkpoint(fold / "checkpoint_latest.pt")["model"]
    # A step of lr 1e-12 from nnU-Net's weights: still those weights (a fresh initialisation would be far off).
    assert all(torch.allclose(start[k], after[k], atol=1e-8) for k in start)
    resumed = runner.invoke(app, ["train", "--run", str(run), "--resume", *sets, "--set", "train.max_epochs=2"])
    assert resumed.exit_code == 0, resumed.output
    assert load_checkpoint(fold / "checkpoint_latest.pt")["epoch"] == 2
    assert "resume fold 0 at epoch 2" in (fold / "train.log").read_text()
    # evaluate --run scores what predict writes: nnU-Net's rules on the validation cases' own files (steps of lr
    # 1e-12 leave nnU-Net's float32 weights as they were), not the cache's float16 cubes.
    evaluated = runner.invoke(app, ["evaluate", "--run", str(run)])
    assert evaluated.exit_code == 0, evaluated.output
    assert "nnU-Net's inference rules" in (fold / "summary.md").read_text()
    saved = sorted((fold / "predictions").glob("*.nii.gz"))
    assert saved
    for path in saved:
        assert np.array_equal(np.asarray(nib.load(path).dataobj), np.asarray(nib.load(tmp_path / "pred" / path.name).dataobj))


@pytest.mark.parametrize(("edit", "message"), [
    # Regions without their class order: nnU-Net itself cannot train or predict them (label-trained models, one
    # value per label, import as softmax: tests/test_nnunet_softmax.py).
    (lambda plans, dataset: dataset.pop("regions_class_order"), "no regions_class_order"),
    (lambda plans, dataset: plans.update(image_reader_writer="NibabelIOWithReorient"), "reorients the images"),
    (lambda plans, dataset: plans["configurations"]["3d_fullres"].update(normalization_schemes=["CTNormalization"] * 4),
     "normalization"),
    # nnU-Net would paint head k with label regions_class_order[k]; brats-swap paints each region's own label.
    (lambda plans, dataset: dataset.update(regions_class_order=[3, 2, 1]), "regions_class_order"),
])
def test_what_cannot_be_imported_is_a_one_line_error(edit, message, tmp_path):
    results = tmp_path / RESULTS.name
    (results / "fold_0").mkdir(parents=True)
    plans, dataset = (json.loads((RESULTS / name).read_text()) for name in ("plans.json", "dataset.json"))
    edit(plans, dataset)
    (results / "plans.json").write_text(json.dumps(plans))
    (results / "dataset.json").write_text(json.dumps(dataset))
    (results / "fold_0" / "checkpoint_final.pth").symlink_to(RESULTS / "fold_0" / "checkpoint_final.pth")
    result = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_the_import_writes_nnunets_inference_rules_and_mirroring_axes(tmp_path):
    results = tmp_path / RESULTS.name
    (results / "fold_0").mkdir(parents=True)
    for name in ("plans.json", "dataset.json"):
        (results / name).write_text((RESULTS / name).read_text())
    checkpoint = torch.load(RESULTS / "fold_0" / "checkpoint_final.pth", map_location="cpu", weights_only=False)
    torch.save({**checkpoint, "inference_allowed_mirroring_axes": (0,)}, results / "fold_0" / "checkpoint_final.pth")
    evaluate = import_nnunet(results, tmp_path / "run").config.evaluate
    # nnU-Net's axis 0 is SimpleITK's z, the file's third voxel axis: brats-swap's axis 2.
    assert (evaluate.inference, evaluate.mirror_axes, evaluate.sw_overlap, evaluate.sw_blend) == ("nnunet", [2], 0.5,
                                                                                                 "gaussian")
    assert import_nnunet(RESULTS, tmp_path / "run2").config.evaluate.mirror_axes == [0, 1, 2]


def test_a_patch_larger_than_the_default_cube_imports(tmp_path):
    """A plans' patch past the default 192³ cube on an axis (a whole-case patch) is imported with a cube that
    holds it (the cube used to be checked against the patch before it was chosen: 'larger than the cube')."""
    results = tmp_path / RESULTS.name
    (results / "fold_0").mkdir(parents=True)
    plans = json.loads((RESULTS / "plans.json").read_text())
    entry = plans["configurations"]["3d_fullres"]
    entry["patch_size"] = [*entry["patch_size"][:2], entry["patch_size"][2] * 9]
    (results / "plans.json").write_text(json.dumps(plans))
    (results / "dataset.json").write_text((RESULTS / "dataset.json").read_text())
    (results / "fold_0" / "checkpoint_final.pth").symlink_to(RESULTS / "fold_0" / "checkpoint_final.pth")
    config = import_nnunet(results, tmp_path / "run").config
    assert max(config.train.patch) == entry["patch_size"][2] > 192
    assert all(p <= c for p, c in zip(config.train.patch, config.data.cube, strict=True))
