"""The oracle for nnU-Net's inference rules: `brats-swap predict` on an imported nnU-Net run against nnunetv2
2.8.1's own `nnUNetPredictor` on the same files, with and without mirroring.

The model folder is tests/fixtures/nnunet_results (made by nnU-Net's planner, preprocessing and trainer:
scripts/make_nnunet_fixture.py; patch (z, y, x) 20 x 28 x 24, 4-16 features, nearly untrained weights). The
phantoms are 57 x 46 x 35 voxels: non-cubic, and neither they nor their brain crop a multiple of the patch,
so tiles overlap unevenly and the steps matter; the second case is small enough that one crop axis is
shorter than the patch (padding).

What remains different, and why: both sum the weighted logits and the weights in float16, but brats-swap
visits the tiles in (x, y, z) order and nnU-Net in its (z, y, x) order, so the float16 sums round in another
order (brats_swap.evaluate.nnunet_inference); and nnU-Net runs the network on its (z, y, x) axis order with
the kernels as trained where brats-swap runs the permuted kernels on (x, y, z); both are roundings of the
same sums. They move probabilities by well under 1e-2 and flip only voxels whose probability is within
that of 0.5. (The predict before nnU-Net's rules, which slid MONAI's window over the case zero-padded to
data.cube and blended probabilities, agreed on 64-68% of these voxels.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from layout_helpers import nnunet_phantoms
from typer.testing import CliRunner

from brats_swap.cli.main import app

pytest.importorskip("dynamic_network_architectures")
pytest.importorskip("nnunetv2.inference.predict_from_raw_data")

REPO = Path(__file__).resolve().parents[1]
RESULTS = (REPO / "tests" / "fixtures" / "nnunet_results" / "Dataset991_BraTSPhantoms"
           / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres")
SHAPES = ((57, 46, 35), (41, 33, 30))


def _bench():
    """scripts/bench_nnunet_predict.py, which holds how nnU-Net's predictor is set up on these model folders."""
    spec = importlib.util.spec_from_file_location("bench_nnunet_predict", REPO / "scripts" / "bench_nnunet_predict.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The phantoms in nnU-Net's layout (dataset.json values), and the imported run folder."""
    root = tmp_path_factory.mktemp("oracle")
    data = nnunet_phantoms(root, SHAPES, seed=5, id_offset=500)
    run = root / "run"
    imported = CliRunner().invoke(app, ["import-nnunet", str(RESULTS), "--out", str(run)])
    assert imported.exit_code == 0, imported.output
    return data, run, root


def _nnunet(data: Path, mirroring: bool, step: float = 0.5,
            gaussian: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """nnUNetPredictor (nnUNetv2_predict's defaults: step 0.5, Gaussian) on the case files: per case id, the
    labels and probabilities in brats-swap's (x, y, z) axes (nnU-Net's arrays are SimpleITK's (z, y, x)). The
    fixture's trainer, `nnUNetTrainerTiny` (scripts/make_nnunet_fixture.py), changes only nnUNetTrainer's epoch
    counts; the bench script's `FixtureTrainer` stands in for it (nnUNetTrainer's network, without importing
    its training-only dependencies)."""
    predictor = _bench().nnunet_predictor(RESULTS, mirroring=mirroring, step=step, gaussian=gaussian)
    images = sorted((data / "imagesTr").glob("*_0000.nii.gz"))
    ids = [path.name.removesuffix("_0000.nii.gz") for path in images]
    lists = [[str(data / "imagesTr" / f"{case}_{k:04d}.nii.gz") for k in range(4)] for case in ids]
    results = predictor.predict_from_files_sequential(lists, None, save_probabilities=True)
    return {case: (labels.transpose(2, 1, 0), probs.transpose(0, 3, 2, 1))
            for case, (labels, probs) in zip(ids, results, strict=True)}


def _ours(data: Path, run: Path, out: Path, mirroring: bool,
          options: tuple[str, ...] = ()) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(data), "--out", str(out),
                                      "--save-probabilities", "--dataset-labels", "--no-postprocessing",
                                      "--tta" if mirroring else "--no-tta", *options])
    assert result.exit_code == 0, result.output
    found = {}
    for path in sorted(out.glob("*.nii.gz")):
        case = path.name.removesuffix(".nii.gz")
        with np.load(out / f"{case}.npz") as saved:
            found[case] = (np.asarray(nib.load(str(path)).dataobj), saved["probabilities"])
    return found


@pytest.mark.parametrize(("mirroring", "step", "gaussian", "options"), [
    (False, 0.5, True, ()),
    (True, 0.5, True, ()),
    # predict's options against nnU-Net's own: its step size and constant weights; tiles batched by 3.
    (False, 0.7, False, ("--step-size", "0.7", "--no-gaussian", "--tile-batch", "3", "--device", "cpu")),
], ids=["no-mirroring", "mirroring", "step-0.7-no-gaussian-tile-batch-3"])
def test_predict_on_an_imported_run_is_nnunets_prediction(cases, mirroring, step, gaussian, options):
    data, run, root = cases
    theirs = _nnunet(data, mirroring, step, gaussian)
    ours = _ours(data, run, root / f"ours-{mirroring}-{step}-{gaussian}", mirroring, options)
    assert_like_nnunet(ours, theirs, len(SHAPES))


def assert_like_nnunet(ours: dict, theirs: dict, cases: int) -> set[int]:
    """The issue's bounds, per case: labels equal on >= 99.9% of the voxels, probabilities within 1e-3 on
    average and 1e-2 at most; each of nnU-Net's label maps holds more than one label (not two empty maps).
    Returns the labels nnU-Net wrote."""
    assert sorted(ours) == sorted(theirs) and len(ours) == cases
    seen: set[int] = set()
    for case, (labels, probs) in ours.items():
        their_labels, their_probs = theirs[case]
        assert labels.shape == their_labels.shape and probs.shape == their_probs.shape
        difference = np.abs(probs - their_probs.astype(np.float32))
        agree = float(np.mean(labels == their_labels))
        assert agree >= 0.999, f"{case}: labels agree in {agree:.5f} of the voxels"
        assert difference.mean() <= 1e-3 and difference.max() <= 1e-2, (case, difference.mean(), difference.max())
        assert len(np.unique(their_labels)) > 1
        seen |= set(np.unique(their_labels).tolist())
    return seen


def test_the_steps_and_the_gaussian_are_nnunets():
    import torch
    from nnunetv2.inference import sliding_window_prediction as theirs

    from brats_swap.evaluate.nnunet_inference import compute_steps, importance_map

    sizes = (((57, 46, 35), (24, 28, 20)), ((140, 172, 137), (128, 128, 128)), ((30, 31, 128), (30, 16, 7)))
    for size, patch in sizes:
        for step in (0.3, 0.5, 0.7, 1.0):
            assert compute_steps(size, patch, step) == theirs.compute_steps_for_sliding_window(size, patch, step)
    for patch in ((24, 28, 20), (128, 128, 128)):
        gaussian = theirs.compute_gaussian(patch, 1.0 / 8, value_scaling_factor=10, device=torch.device("cpu"))
        assert torch.equal(torch.from_numpy(importance_map(patch).copy()), gaussian)


def test_predict_set_takes_only_evaluate_keys(cases, tmp_path):
    data, run, _ = cases
    for item, message in (("train.lr=1", "predict takes only evaluate.*"), ("evaluate.nope=1", "unknown key"),
                          ("evaluate.mirror_axes=[0,3]", "evaluate.mirror_axes")):
        result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(data), "--out",
                                          str(tmp_path / "out"), "--set", item])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and message in result.output, result.output
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
