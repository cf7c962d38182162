from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from brats_swap.cli.data import app as data_app
from brats_swap.data.challenges import CHALLENGES, get_challenge, region_masks
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.data.phantom import synthesize_case, synthesize_dataset

SHAPE = (32, 32, 24)
ROOT = Path(__file__).resolve().parents[1]


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = synthesize_case(SHAPE, seed=3, index=1)
    b = synthesize_case(SHAPE, seed=3, index=1)
    assert a.images.tobytes() == b.images.tobytes() and a.seg.tobytes() == b.seg.tobytes()
    assert not np.array_equal(a.images, synthesize_case(SHAPE, seed=4, index=1).images)
    first = synthesize_dataset(tmp_path / "a", cases=2, seed=7, shape=SHAPE)
    second = synthesize_dataset(tmp_path / "b", cases=2, seed=7, shape=SHAPE)
    assert first == second == ["BraTS2021_00000", "BraTS2021_00001"]
    for file in (tmp_path / "a").rglob("*.nii.gz"):
        assert file.read_bytes() == (tmp_path / "b" / file.relative_to(tmp_path / "a")).read_bytes()


@pytest.mark.parametrize(("edition", "case_id", "t1ce_name"), [
    ("2017", "Brats17_SYN_001_1", "Brats17_SYN_001_1_t1ce.nii.gz"),
    ("2020", "BraTS20_Training_001", "BraTS20_Training_001_t1ce.nii.gz"),
    ("2021", "BraTS2021_00000", "BraTS2021_00000_t1ce.nii.gz"),
    ("2023", "BraTS-GLI-00000-000", "BraTS-GLI-00000-000-t1c.nii.gz"),
    ("gli-post", "BraTS-GLI-00000-100", "BraTS-GLI-00000-100-t1c.nii.gz"),
    ("met", "BraTS-MET-00000-000", "BraTS-MET-00000-000-t1c.nii.gz"),
    ("men", "BraTS-MEN-00000-000", "BraTS-MEN-00000-000-t1c.nii.gz"),
    ("men-rt", "BraTS-MEN-RT-0001-1", "BraTS-MEN-RT-0001-1_t1c.nii.gz"),
    ("ped", "BraTS-PED-00000-000", "BraTS-PED-00000-000-t1c.nii.gz"),
    ("ssa", "BraTS-SSA-00000-000", "BraTS-SSA-00000-000-t1c.nii.gz"),
    ("goat", "BraTS-GoAT-00000", "BraTS-GoAT-00000-t1c.nii.gz"),
])
def test_phantoms_use_real_brats_names_and_pass_validation(tmp_path, edition, case_id, t1ce_name):
    assert synthesize_dataset(tmp_path, cases=1, seed=0, edition=edition, shape=SHAPE) == [case_id]
    (case,) = discover_cases(tmp_path)
    assert case.edition == get_challenge(edition).key and case.images["t1ce"].name == t1ce_name
    shipped = list(get_challenge(edition).modality_suffixes)
    assert sorted(p.name for p in (tmp_path / case_id).iterdir()) == sorted(
        [*(p.name for p in case.images.values()), case.seg.name])  # no other file
    loaded = load_case(case, shipped)  # validates shapes, affines, labels against the table
    assert loaded.shape == SHAPE and loaded.spacing == (1.0, 1.0, 1.0)
    assert set(np.unique(loaded.seg)) - {0} <= set(get_challenge(edition).label_values)
    assert np.allclose(loaded.affine[:3, :3], np.diag([-1, -1, 1]))


def test_tumour_is_nested_inside_the_brain_with_plausible_contrasts():
    spec = get_challenge("2021")
    found_enhancing = 0
    for index in range(4):
        case = synthesize_case((48, 48, 36), seed=11, index=index)
        brain = case.images[0] > 0
        assert all(np.array_equal(brain, case.images[c] > 0) for c in range(4))  # one skull-stripped mask
        assert 0.1 < brain.mean() < 0.5
        tumour = case.seg > 0
        assert tumour.any() and not (tumour & ~brain).any()
        masks = region_masks(case.seg, spec)
        assert not (masks["ET"] & ~masks["TC"]).any() and not (masks["TC"] & ~masks["WT"]).any()
        t1, t1ce, t2, flair = (case.images[c].astype(float) for c in range(4))
        edema = case.seg == spec.edema
        healthy = brain & ~tumour
        if edema.sum() > 20:
            assert flair[edema].mean() > 1.3 * flair[healthy].mean()  # edema is FLAIR-bright
            assert t2[edema].mean() > t2[healthy].mean()
        enhancing = case.seg == spec.enhancing
        if enhancing.sum() > 20:
            found_enhancing += 1
            ratio_t1ce = t1ce[enhancing].mean() / t1ce[healthy].mean()
            ratio_t1 = t1[enhancing].mean() / t1[healthy].mean()
            assert ratio_t1ce > 1.3 * ratio_t1  # the rim lights up with contrast only
    assert found_enhancing >= 1


def test_large_tumours_span_more_than_half_the_volume():
    shape = (64, 64, 40)
    case = synthesize_case(shape, seed=1, index=0, large_tumour=True)
    tumour = case.seg > 0
    extents = [np.ptp(np.flatnonzero(tumour.any(axis=tuple(a for a in range(3) if a != axis)))) + 1
               for axis in range(3)]
    # at 240x240x155 the same fraction is > 128 voxels (128 / 240 = 0.53)
    assert max(e / s for e, s in zip(extents, shape, strict=True)) > 128 / 240


def test_csf_is_dark_on_flair_and_bright_on_t2():
    case = synthesize_case((64, 64, 48), seed=2, index=0, large_tumour=False)
    t2, flair = case.images[2].astype(float), case.images[3].astype(float)
    healthy = (case.images[0] > 0) & (case.seg == 0)
    bright_t2 = healthy & (t2 > np.percentile(t2[healthy], 97))  # mostly CSF
    assert flair[bright_t2].mean() < 0.6 * flair[healthy].mean()


def test_synth_command_and_bench_script_run_tiny(tmp_path, monkeypatch):
    result = CliRunner().invoke(data_app, ["synth", "--out", str(tmp_path / "ph"), "--cases", "2", "--seed", "5",
                                           "--edition", "2023", "--shape", "24", "24", "16"])
    assert result.exit_code == 0, result.output
    # Seed 5 numbers its cases from 5000 (data synth offsets the ids by the seed).
    assert [c.case_id for c in discover_cases(tmp_path / "ph")] == ["BraTS-GLI-05000-000", "BraTS-GLI-05001-000"]
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_data.py", "--shape", "32", "32", "24", "--cube", "16", "16", "16",
                                      "--repeats", "1", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "scripts" / "bench_data.py"), run_name="__main__")
    assert exit_info.value.code == 0
    result = json.loads(out.read_text())
    assert result["cube"] == [16, 16, 16] and result["decode_preprocess_seconds"] > 0
    assert result["cache_load_seconds"] > 0 and result["speedup"] > 0


def _components(mask: np.ndarray) -> int:
    from scipy import ndimage

    return int(ndimage.label(mask, structure=np.ones((3, 3, 3)))[1])


def test_every_challenge_draws_its_own_labels():
    shape = (56, 56, 40)
    found: dict[str, set[int]] = {}
    lesions = []
    for key in CHALLENGES:
        for index in range(3):
            case = synthesize_case(shape, seed=0, index=index, edition=key)
            found.setdefault(key, set()).update(np.unique(case.seg).tolist())
            if key == "met":
                lesions.append(_components(case.seg > 0))
    for key, values in found.items():
        assert values == {0, *get_challenge(key).label_values}, key  # every label of the table, nothing else
    assert min(lesions) >= 2  # metastases come several to a case
    # The glioma of a GLI phantom is the same in every challenge; what they add or relabel is the difference.
    gli, men, post = (synthesize_case(shape, seed=0, index=0, edition=k) for k in ("gli", "men", "gli-post"))
    assert np.array_equal(gli.seg, men.seg) and np.array_equal(gli.images, men.images)
    assert ((post.seg == 4) & (gli.seg == 0)).sum() < (post.seg == 4).sum()  # the cavity replaces tumour


def test_challenge_tissues_have_their_contrasts():
    case = synthesize_case((64, 64, 48), seed=1, index=0, edition="ped", large_tumour=True)
    t1, t1ce, t2 = (case.images[c].astype(float) for c in range(3))
    ped = get_challenge("ped")
    enhancing, cyst = case.seg == ped.tissues["enhancing"], case.seg == ped.tissues["cyst"]
    assert enhancing.sum() > 20 and cyst.sum() > 5
    assert t1ce[enhancing].mean() / t1[enhancing].mean() > 1.5  # PED's label 1 lights up with contrast
    assert t2[cyst].mean() > t2[enhancing].mean()  # fluid is T2-bright
    post = synthesize_case((64, 64, 48), seed=1, index=0, edition="gli-post", large_tumour=True)
    cavity, snfh = post.seg == 4, post.seg == 2
    assert cavity.sum() > 20
    post_flair = post.images[3].astype(float)
    assert post_flair[cavity].mean() < post_flair[snfh].mean()  # a cavity is FLAIR-dark, the edema bright


@pytest.mark.parametrize("challenge", ["ped", "men-rt", "gli-post"])
def test_synth_challenge_option_names_and_labels_the_files(tmp_path, challenge):
    result = CliRunner().invoke(data_app, ["synth", "--out", str(tmp_path), "--cases", "2", "--challenge", challenge,
                                           "--shape", "24", "24", "16"])
    assert result.exit_code == 0, result.output
    cases = discover_cases(tmp_path)
    assert [c.case_id for c in cases] == [get_challenge(challenge).example_id(i) for i in range(2)]
    assert all(c.edition == challenge for c in cases)
