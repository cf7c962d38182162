"""nnU-Net's resampling for imported models: brats_swap.evaluate.nnunet_resampling against nnunetv2 2.8.1's own
functions, and `brats-swap predict` against nnUNetPredictor on a model whose plans' spacing is not the cases'.

(a) The functions: `resample` equals nnunetv2's `resample_data_or_seg_to_shape` with the plans' default
    arguments bit for bit (np.array_equal, same dtype), for the image (float32, order 3) and the logits
    (float16, order 1), in 3D and with a separate z axis chosen from either grid, upsampling and downsampling
    (halving puts nnU-Net's nearest-slice coordinates exactly between two slices); the new shape and the
    separate-z rule equal nnU-Net's on many spacings; and a case on brats-swap's axes is resampled on nnU-Net's
    (`evaluate.nnunet_axes`), bit for bit too.
(b) End to end: the fixture's model folder (tests/fixtures/nnunet_results, made by nnU-Net's own code) with its
    plans' 3d_fullres spacing changed to (z, y, x) 2 x 1.25 x 1.1 mm (the network does not look at spacing),
    imported, and two phantom cases written with anisotropic voxels, (x, y, z) 1 x 1.5 x 3 mm (3D resampling:
    3 / 1 is not above nnU-Net's threshold of 3) and 0.8 x 1 x 3.5 mm (z resampled apart). `brats-swap predict`
    and nnUNetPredictor on the same files: labels equal in >= 99.9% of the voxels, probabilities within 1e-3
    on average and 1e-2 at most. What remains different is what tests/test_nnunet_predict.py bounds without
    resampling (the order of nnU-Net's float16 sums over tiles), carried through the resampling back.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml
from layout_helpers import nnunet_phantoms
from test_nnunet_predict import RESULTS, _bench, _ours, assert_like_nnunet
from typer.testing import CliRunner

from brats_swap.cli.main import app

pytest.importorskip("dynamic_network_architectures")
pytest.importorskip("nnunetv2.preprocessing.resampling.default_resampling")

# (C, ...) input shape, spacing, new spacing: nnU-Net's axes; the new shape is nnU-Net's compute_new_shape.
GRIDS = {
    "isotropic": ((3, 23, 17, 12), (1.0, 1.0, 1.0), (0.8, 1.3, 1.1)),
    "anisotropic-3d": ((2, 12, 20, 18), (3.0, 1.5, 1.0), (2.0, 1.25, 1.1)),  # 3 / 1 is not above 3: 3D
    "apart-from-old-grid": ((2, 9, 21, 19), (3.5, 1.0, 0.8), (2.0, 1.25, 1.1)),
    "apart-halved": ((2, 10, 16, 15), (4.0, 1.0, 1.0), (8.0, 1.0, 1.2)),  # nearest slice at 2k + 0.5: ties
    "apart-from-new-grid-middle-axis": ((2, 18, 14, 20), (1.0, 1.0, 1.0), (1.1, 3.6, 0.9)),
    "apart-last-axis": ((1, 20, 18, 6), (1.0, 1.0, 5.0), (0.9, 1.1, 3.0)),
    "apart-same-size-along-it": ((2, 7, 20, 16), (3.5, 1.0, 1.0), (3.5, 1.3, 0.9)),
    "two-coarse-axes-3d": ((2, 8, 8, 24), (4.0, 4.0, 1.0), (3.0, 3.0, 1.2)),
}


def _theirs(data, shape, spacing, new_spacing, order):
    from nnunetv2.preprocessing.resampling.default_resampling import resample_data_or_seg_to_shape

    return resample_data_or_seg_to_shape(data, shape, spacing, new_spacing, is_seg=False, order=order, order_z=0,
                                         force_separate_z=None)


def _inputs(size, seed):
    """A normalised image crop (float32, zeros around a blob, values of both signs) and float16 logits."""
    rng = np.random.default_rng(seed)
    image = rng.normal(size=size).astype(np.float32)
    image[:, :2] = 0  # nnU-Net's crops have zero (outside the mask) voxels at their edges
    logits = (rng.normal(size=size) * 6).astype(np.float16)
    return image, logits


@pytest.mark.parametrize("grid", GRIDS)
def test_resample_is_nnunets_resample_data_or_seg_to_shape(grid):
    from nnunetv2.preprocessing.resampling.default_resampling import compute_new_shape as their_shape

    from brats_swap.evaluate.nnunet_resampling import IMAGE_ORDER, LOGITS_ORDER, compute_new_shape, resample

    size, spacing, new_spacing = GRIDS[grid]
    shape = compute_new_shape(size[1:], spacing, new_spacing)
    assert list(shape) == list(their_shape(size[1:], spacing, new_spacing)) and shape != size[1:]
    image, logits = _inputs(size, seed=len(grid))
    for data, order in ((image, IMAGE_ORDER), (logits, LOGITS_ORDER)):
        ours, theirs = resample(data, shape, spacing, new_spacing, order), _theirs(data, shape, spacing, new_spacing, order)
        assert ours.dtype == theirs.dtype == data.dtype and ours.shape == theirs.shape == (size[0], *shape)
        assert np.array_equal(ours, theirs), (grid, order, np.abs(ours.astype(float) - theirs).max())
    # and back to the crop's voxels, as the logits go (the separate-z rule now tests the grids the other way round)
    ours = resample(logits, shape, spacing, new_spacing, LOGITS_ORDER)
    assert np.array_equal(resample(ours, size[1:], new_spacing, spacing, LOGITS_ORDER),
                          _theirs(ours, size[1:], new_spacing, spacing, LOGITS_ORDER)), grid


def test_the_same_shape_is_left_as_it_is():
    from brats_swap.evaluate.nnunet_resampling import resample

    image, _ = _inputs((2, 10, 11, 12), seed=0)
    assert resample(image, (10, 11, 12), (1.0, 1.0, 1.0), (1.02, 1.0, 1.0), 3) is image


def test_the_separate_z_rule_and_the_new_shape_are_nnunets():
    from nnunetv2.preprocessing.resampling import default_resampling as theirs

    from brats_swap.evaluate.nnunet_resampling import compute_new_shape, separate_z_axis

    values = (0.5, 0.8, 1.0, 1.5, 3.0, 3.1, 4.0, 5.0)
    for old, new in itertools.product(itertools.product(values, repeat=3), [(1.0, 1.0, 1.0), (3.2, 1.0, 1.0),
                                                                             (1.0, 0.9, 2.8), (0.5, 2.0, 2.0)]):
        do_separate, axis = theirs.determine_do_sep_z_and_axis(None, old, new)
        assert separate_z_axis(old, new) == (axis if do_separate else None), (old, new)
        assert list(compute_new_shape((57, 46, 35), old, new)) == list(theirs.compute_new_shape((57, 46, 35), old, new))


@pytest.mark.parametrize("grid", ["anisotropic-3d", "apart-from-old-grid", "apart-from-new-grid-middle-axis",
                                  "two-coarse-axes-3d"])
@pytest.mark.parametrize("axes", [(2, 1, 0), (0, 2, 1)], ids=["sitk-order", "transposed-plans"])
def test_a_case_on_brats_swaps_axes_is_resampled_on_nnunets(grid, axes):
    """brats-swap's arrays are (x, y, z), nnU-Net's (z, y, x) after transpose_forward (`axes`: for each of
    nnU-Net's axes, brats-swap's). Resampled on brats-swap's axes, the float16 logits would differ by one
    float16 step on ~0.1% of the voxels (ties of the linear interpolation, rounded by the float64 sums' last
    bits, which depend on the axis order); CaseResampling resamples on nnU-Net's axes: the same bits, both ways."""
    from brats_swap.evaluate.nnunet_resampling import CaseResampling, compute_new_shape

    size, spacing, new_spacing = GRIDS[grid]
    shape = compute_new_shape(size[1:], spacing, new_spacing)
    image, logits = _inputs(size, seed=7)
    forward = (0, *(1 + a for a in axes))
    back = tuple(np.argsort(forward))

    def ours_of(values):  # nnU-Net's axis j is brats-swap's axes[j]
        return tuple(values[int(b) - 1] for b in back[1:])

    plan = CaseResampling(ours_of(size[1:]), ours_of(spacing), ours_of(shape), ours_of(new_spacing), axes)
    ours_image = plan.image(np.ascontiguousarray(image.transpose(back)))
    assert np.array_equal(ours_image, _theirs(image, shape, spacing, new_spacing, 3).transpose(back)), grid
    their_logits = _theirs(logits, shape, spacing, new_spacing, 1)
    ours_logits = plan.logits_back(np.ascontiguousarray(their_logits.transpose(back)))
    assert ours_logits.flags.c_contiguous and ours_logits.dtype == np.float16
    assert np.array_equal(ours_logits, _theirs(their_logits, size[1:], new_spacing, spacing, 1).transpose(back)), grid


def test_a_case_is_priced_before_it_is_resampled():
    from brats_swap.errors import DataError
    from brats_swap.evaluate.nnunet_resampling import MAX_AXIS, case_resampling

    grid = ((1.1, 1.25, 2.0), (2, 1, 0))
    plan = case_resampling((40, 30, 10), (1.0, 1.5, 3.0), grid, 4, 3, available=2**40)
    assert (plan.shape, plan.crop_shape, plan.axes) == ((36, 36, 15), (40, 30, 10), (2, 1, 0))
    assert case_resampling((40, 30, 10), (1.0, 1.0, 1.0), None, 4, 3) is None  # not asked for
    assert case_resampling((40, 30, 10), (1.0, 1.0, 1.0), ((1.0, 1.0, 1.01), (2, 1, 0)), 4, 3) is None  # same shape
    for spacing, available, words in (((1e-6, 1.0, 1.0), 2**40, f"1 to {MAX_AXIS}"),
                                      ((1e-300, 1.0, 1.0), 2**40, f"1 to {MAX_AXIS}"),
                                      ((1e6, 1.0, 1.0), 2**40, f"1 to {MAX_AXIS}"),
                                      ((0.25, 0.25, 0.25), 2**20, "GiB of host memory")):
        with pytest.raises(DataError) as caught:
            case_resampling((200, 200, 150), (1.0, 1.0, 1.0), (spacing, (2, 1, 0)), 4, 3, available=available)
        assert words in str(caught.value) and "evaluate.resample_spacing" in str(caught.value), str(caught.value)
    with pytest.raises(DataError, match="header's voxel size"):
        case_resampling((40, 30, 10), (1.0, 0.0, 1.0), grid, 4, 3)


# ---- end to end: predict against nnUNetPredictor ---------------------------------------------------------------

PLANS_SPACING = [2.0, 1.25, 1.1]  # the copy's 3d_fullres spacing, nnU-Net's (z, y, x) (transpose_forward identity)
ZOOMS = {0: (1.0, 1.5, 3.0), 1: (0.8, 1.0, 3.5)}  # each case's voxel size, the file's (x, y, z)
SHAPES = ((50, 40, 18), (64, 56, 16))


def _model_folder(root: Path, edit=None) -> Path:
    """A copy of the fixture's results folder with its plans' 3d_fullres spacing PLANS_SPACING (and `edit`)."""
    results = root / RESULTS.parent.name / RESULTS.name
    shutil.copytree(RESULTS, results)
    plans = json.loads((results / "plans.json").read_text())
    plans["configurations"]["3d_fullres"]["spacing"] = PLANS_SPACING
    if edit is not None:
        edit(plans["configurations"]["3d_fullres"])
    (results / "plans.json").write_text(json.dumps(plans, indent=2))
    return results


def _with_voxel_size(path: Path, zooms) -> None:
    """Rewrite a NIfTI file with voxels of `zooms` mm along its (x, y, z) axes (same voxels, same axes)."""
    image = nib.load(str(path))
    affine = image.affine.copy()
    affine[:3, :3] = image.affine[:3, :3] * np.asarray(zooms)  # scales each voxel axis's column
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj), affine), str(path))


@pytest.fixture(scope="module")
def resampled(tmp_path_factory):
    """The phantoms (nnU-Net's layout) with anisotropic voxels, the model folder at PLANS_SPACING, imported."""
    import SimpleITK

    root = tmp_path_factory.mktemp("resampling")
    data = nnunet_phantoms(root, SHAPES, seed=11, id_offset=600)
    cases = sorted(p.name.removesuffix(".nii.gz") for p in (data / "labelsTr").glob("*.nii.gz"))
    for index, case in enumerate(cases):
        for path in [*sorted((data / "imagesTr").glob(f"{case}_*.nii.gz")), data / "labelsTr" / f"{case}.nii.gz"]:
            _with_voxel_size(path, ZOOMS[index])
        first = data / "imagesTr" / f"{case}_0000.nii.gz"
        # What each tool reads as the voxel size: nibabel's zooms (x, y, z, float32 as stored: 0.8 is
        # 0.800000011920929), SimpleITK's the same numbers (nnU-Net reverses them to its (z, y, x)).
        zooms = tuple(float(z) for z in nib.load(str(first)).header.get_zooms())
        assert np.allclose(zooms, ZOOMS[index]) and SimpleITK.ReadImage(str(first)).GetSpacing() == zooms
    results = _model_folder(root)
    run = root / "run"
    imported = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(run)])
    assert imported.exit_code == 0, imported.output
    return data, results, run, root


def _nnunets(data: Path, results: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """nnUNetPredictor (step 0.5, Gaussian, no mirroring) on the files: per case, labels and probabilities on
    brats-swap's (x, y, z) axes."""
    predictor = _bench().nnunet_predictor(results, mirroring=False)
    ids = sorted(p.name.removesuffix("_0000.nii.gz") for p in (data / "imagesTr").glob("*_0000.nii.gz"))
    lists = [[str(data / "imagesTr" / f"{case}_{k:04d}.nii.gz") for k in range(4)] for case in ids]
    found = predictor.predict_from_files_sequential(lists, None, save_probabilities=True)
    return {case: (labels.transpose(2, 1, 0), probs.transpose(0, 3, 2, 1))
            for case, (labels, probs) in zip(ids, found, strict=True)}


def test_predict_resamples_as_nnunet_does(resampled):
    data, results, run, root = resampled
    theirs = _nnunets(data, results)
    ours = _ours(data, run, root / "ours", False)
    assert_like_nnunet(ours, theirs, len(SHAPES))


def test_the_network_sees_nnunets_preprocessed_image(resampled):
    """What the sliding window gets, bit for bit: nnU-Net's DefaultPreprocessor on the case's files (SimpleITK's
    read, transpose, crop, z-score, resampling to the plans' spacing) against brats-swap's (nibabel's read, the
    crop and z-score of nnunet_inference, then nnunet_resampling with the run's resample_spacing/nnunet_axes)."""
    from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    from brats_swap.data.discovery import discover_cases
    from brats_swap.data.nifti import load_case
    from brats_swap.evaluate import nnunet_inference, nnunet_resampling
    from brats_swap.run.trained import load_run_config

    data, results, run, _ = resampled
    config = load_run_config(run)
    plans = PlansManager(str(results / "plans.json"))
    dataset = json.loads((results / "dataset.json").read_text())
    separate = []
    for case in discover_cases(data, modalities=config.data.modalities):
        files = [str(data / "imagesTr" / f"{case.case_id}_{k:04d}.nii.gz") for k in range(4)]
        theirs, _, _ = DefaultPreprocessor(verbose=False).run_case(files, None, plans,
                                                                     plans.get_configuration("3d_fullres"), dataset)
        loaded = load_case(case, config.data.modalities)
        bbox, mask = nnunet_inference.nonzero_crop(loaded.image)
        crop = nnunet_inference.zscore_in_mask(loaded.image[(slice(None), *(slice(a, b) for a, b in bbox))], mask,
                                               config.evaluate.nnunet_axes)
        plan = nnunet_resampling.case_resampling(crop.shape[1:], loaded.spacing,
                                                 nnunet_resampling.target_grid([(None, config)]), 4, 3)
        ours = plan.image(crop)
        assert ours.dtype == theirs.dtype == np.float32 and ours.shape != crop.shape
        assert np.array_equal(ours, theirs.transpose(0, 3, 2, 1)), case.case_id
        separate.append(nnunet_resampling.separate_z_axis(plan.case_spacing, plan.spacing))
    assert separate == [None, 2]  # 3D for the first case, z apart for the second


def test_the_import_writes_the_plans_spacing_on_brats_swaps_axes(resampled, tmp_path):
    _, _, run, _ = resampled
    evaluate = yaml.safe_load((run / "config.yaml").read_text())["evaluate"]
    # nnU-Net's (z, y, x) = (2, 1.25, 1.1) mm is the file's (x, y, z) = (1.1, 1.25, 2); its axes are (z, y, x).
    assert (evaluate["resample_spacing"], evaluate["nnunet_axes"]) == (PLANS_SPACING[::-1], [2, 1, 0])
    # transpose_forward [2, 0, 1]: nnU-Net's axes are SimpleITK's (x, z, y), the file's (0, 2, 1); the spacing is
    # given on those axes.
    results = _model_folder(tmp_path, lambda c: c.update(spacing=[1.1, 2.0, 1.25]))
    plans = json.loads((results / "plans.json").read_text())
    plans.update(transpose_forward=[2, 0, 1], transpose_backward=[1, 2, 0])
    for entry in plans["configurations"]["3d_fullres"]["architecture"]["arch_kwargs"]["strides"]:
        entry[:] = [entry[2], entry[0], entry[1]]
    plans["configurations"]["3d_fullres"]["patch_size"] = [24, 20, 28]
    (results / "plans.json").write_text(json.dumps(plans))
    imported = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(tmp_path / "run")])
    assert imported.exit_code == 0, imported.output
    evaluate = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["evaluate"]
    assert (evaluate["resample_spacing"], evaluate["nnunet_axes"]) == ([1.1, 1.25, 2.0], [0, 2, 1])


def test_a_hostile_spacing_is_refused_at_predict_in_one_line(resampled, tmp_path):
    data, _, run, _ = resampled
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(data), "--out", str(out),
                                      "--set", "evaluate.resample_spacing=[1e-6,1,1]"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "evaluate.resample_spacing" in errors[0] and "1 to 1024" in errors[0], result.output
    assert all(case in errors[0] for case in ("BraTS2021_00600", "BraTS2021_00601")), result.output
    assert not out.exists() or not list(out.glob("*.nii.gz"))


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c.update(resampling_fn_data="resample_torch_fornnunet"), ("resampling_fn_data",
                                                                         "resample_torch_fornnunet")),
    (lambda c: c["resampling_fn_probabilities_kwargs"].update(order=3), ("resampling_fn_probabilities_kwargs",
                                                                          "order=3")),
    (lambda c: c["resampling_fn_data_kwargs"].update(force_separate_z=True), ("resampling_fn_data_kwargs",
                                                                               "force_separate_z=True")),
    (lambda c: c.update(spacing=[1e-6, 1.0, 1.0]), ("spacing [1e-06, 1.0, 1.0]", "1 to 1024")),
], ids=["another function", "other kwargs", "forced separate z", "a spacing of 1e-6 mm"])
def test_a_resampling_brats_swap_does_not_reproduce_is_refused_at_import(edit, words, tmp_path):
    results = _model_folder(tmp_path, edit)
    result = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "plans.json" in errors[0] and all(w in errors[0] for w in words), result.output
    assert not (tmp_path / "run" / "config.yaml").exists()
