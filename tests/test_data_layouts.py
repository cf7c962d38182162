"""nnU-Net raw and Decathlon folders read by the meaning their dataset.json gives each label; tumour voxels
that fitting to the cube removes are reported; no table is ever chosen from the values a case holds.

Phantoms (3 cases of 40x40x28) are written BraTS-named, then converted the way nnU-Net's BraTS 2021
conversion and the Decathlon's Task01 store them: the prepared label volumes must equal the original's.
"""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
from layout_helpers import to_msd_task01, to_nnunet_brats21, to_nnunet_kept, write_json
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.data.cache import load_prepared, prepare_dataset
from brats_swap.data.challenges import get_challenge, label_map_from_names
from brats_swap.data.check import check_dataset
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import from_table_values, load_case
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.errors import DataError

SHAPE = (40, 40, 28)


def _data_cfg(**overrides):
    cfg = load_config(None, [f"data.{key}={value}" for key, value in
                             {"cube": "[32,32,32]", "prepare_workers": 1, **overrides}.items()])
    return cfg.data


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    synthesize_dataset(root / "brats21", 3, seed=3, edition="2021", shape=SHAPE)
    synthesize_dataset(root / "gli", 2, seed=3, edition="gli", shape=SHAPE)
    return root


def _prepared(root, cache, **overrides):
    report = prepare_dataset(root, cache, _data_cfg(**overrides), progress=False)
    assert not report.failed, report.failed
    return {case_id: load_prepared(cache, case_id) for case_id in report.cases}


def test_nnunet_brats21_conversion_reads_as_the_original(originals, tmp_path):
    converted = to_nnunet_brats21(originals / "brats21", tmp_path / "Dataset137_BraTS2021")
    cases = discover_cases(converted)
    assert [c.edition for c in cases] == ["2021"] * 3
    assert cases[0].label_map == {1: 2, 2: 1, 3: 4}  # 1 edema, 2 necrosis, 3 enhancing (nnU-Net's renumbering)
    assert cases[0].relabelled  # so readers of raw label files (cv's postprocessing tuning) must not use them
    original = _prepared(originals / "brats21", tmp_path / "cache-a")
    read = _prepared(converted, tmp_path / "cache-b")
    assert sorted(read) == sorted(original)
    for case_id, case in original.items():
        assert np.array_equal(read[case_id].label, case.label)
        assert np.array_equal(read[case_id].image, case.image)
        assert read[case_id].meta["edition"] == "2021"


def test_msd_task01_4d_images_split_into_modalities(originals, tmp_path):
    names = to_msd_task01(originals / "brats21", tmp_path / "Task01_BrainTumour")
    cases = discover_cases(tmp_path / "Task01_BrainTumour")
    assert [c.case_id for c in cases] == sorted(names)
    assert cases[0].channels == {"flair": 0, "t1": 1, "t1ce": 2, "t2": 3}
    assert cases[0].edition == "2017"  # the Decathlon's BraTS 2016/2017 cases: the legacy table
    original = _prepared(originals / "brats21", tmp_path / "cache-a")
    read = _prepared(tmp_path / "Task01_BrainTumour", tmp_path / "cache-b")
    for msd_id, case_id in names.items():
        assert np.array_equal(read[msd_id].label, original[case_id].label)
        assert np.array_equal(read[msd_id].image, original[case_id].image)  # channels back in t1, t1ce, t2, flair


def test_a_2023_conversion_keeps_the_challenge_values(originals, tmp_path):
    converted = to_nnunet_kept(originals / "gli", tmp_path / "Dataset226_GLI")
    cases = discover_cases(converted)
    assert {c.edition for c in cases} == {"gli"}
    assert cases[0].label_map == {1: 1, 2: 2, 3: 3, 4: None}  # RC: a class the pre-operative table lacks
    assert not cases[0].relabelled
    original = _prepared(originals / "gli", tmp_path / "cache-a")
    read = _prepared(converted, tmp_path / "cache-b")
    for case_id, case in original.items():
        assert np.array_equal(read[case_id].label, case.label)


def test_labels_read_by_meaning_when_a_value_never_occurs(originals, tmp_path):
    """A case without enhancing tumour (no value 3 in nnU-Net's numbering) is still read with 1 = edema and
    2 = necrosis: what the BraTS-named copy read with the 2021 table silently swapped."""
    source = tmp_path / "no-et"
    synthesize_dataset(source, 1, seed=3, edition="2021", shape=SHAPE)
    seg_path = next(source.rglob("*_seg.nii.gz"))
    seg_image = nib.load(str(seg_path))
    seg = np.asarray(seg_image.dataobj).copy()
    seg[seg == 4] = 1  # the enhancing rim becomes necrosis: labels 1 and 2 only
    nib.save(nib.Nifti1Image(seg, seg_image.affine, seg_image.header), str(seg_path))
    converted = to_nnunet_brats21(source, tmp_path / "Dataset137_noET")
    file_values = set(np.unique(np.asarray(nib.load(str(next(converted.rglob("labelsTr/*.nii.gz")))).dataobj)))
    assert file_values == {0, 1, 2}
    loaded = load_case(discover_cases(converted)[0])
    assert np.array_equal(loaded.seg, seg)


def test_a_dataset_json_whose_values_mean_other_classes(tmp_path):
    spec = get_challenge("2021")
    # Values declared in an unusual order, by name; a region entry; background under another name.
    declared = {"healthy": (0,), "enhancing tumour": (1,), "Necrotic_core": (2,), "peritumoral edema": (5,)}
    assert label_map_from_names(spec, declared, "x") == {1: 4, 2: 1, 5: 2}
    assert label_map_from_names(get_challenge("ped"), {"ET": (1,), "NETC": (2,), "CC": (3,), "ED": (4,)},
                                "x") == {1: 1, 2: 2, 3: 3, 4: 4}
    with pytest.raises(DataError, match="label 'tumour' names no tumour class"):
        label_map_from_names(spec, {"background": (0,), "tumour": (1,)}, "x")
    with pytest.raises(DataError, match="do not tell which class of the 2021 table value 1 is"):
        label_map_from_names(spec, {"whole tumor": (1, 2, 3)}, "x")


def test_predictions_go_back_to_the_dataset_values():
    label_map = {1: 2, 2: 1, 3: 4}
    table = np.array([0, 1, 2, 4], dtype=np.uint8)
    assert from_table_values(table, label_map).tolist() == [0, 2, 1, 3]
    assert from_table_values(table, None).tolist() == [0, 1, 2, 4]


def test_unknown_meaning_is_a_one_line_error(originals, tmp_path):
    converted = to_nnunet_brats21(originals / "brats21", tmp_path / "Dataset137")
    with pytest.raises(DataError, match="give that folder"):
        discover_cases(converted / "imagesTr")
    (converted / "dataset.json").rename(tmp_path / "kept.json")
    with pytest.raises(DataError, match="imagesTr/ without a dataset.json: the channel order and the meaning"):
        discover_cases(converted)
    content = json.loads((tmp_path / "kept.json").read_text())
    write_json(converted / "dataset.json", {**content, "channel_names": {"0": "T1", "1": "ADC", "2": "T2", "3": "FLAIR"}})
    with pytest.raises(DataError, match="channel 1 'ADC' is none of"):
        discover_cases(converted)
    write_json(converted / "dataset.json", {**content, "labels": {"background": 0, "tumor": [1, 2, 3]}})
    with pytest.raises(DataError, match="label 'tumor' names no tumour class"):
        discover_cases(converted)


def test_a_4d_image_is_refused_where_one_volume_is_expected(originals, tmp_path):
    folder = tmp_path / "brats"
    for path in (originals / "brats21").rglob("BraTS2021_00000_*"):
        target = folder / path.relative_to(originals / "brats21")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    t1 = next(folder.rglob("*_t1.nii.gz"))
    image = nib.load(str(t1))
    nib.save(nib.Nifti1Image(np.stack([np.asarray(image.dataobj)] * 2, axis=-1), image.affine), str(t1))
    with pytest.raises(DataError, match="4D image of shape 40x40x28x2, expected one 3D volume"):
        load_case(discover_cases(folder)[0])


def test_cropped_tumour_voxels_are_reported(originals, tmp_path):
    cfg = _data_cfg(cube="[16,16,16]", fit="pad_crop")
    report = prepare_dataset(originals / "brats21", tmp_path / "cache", cfg, progress=False)
    assert report.cropped  # a 16³ cube cuts into a 40x40x28 phantom's tumour
    names = get_challenge("2021").labels
    for case_id in report.cases:  # what is reported is what the cube lacks of the case's labels
        prepared = load_prepared(tmp_path / "cache", case_id, mmap=False)
        counts, kept = prepared.meta["label_counts"], np.bincount(prepared.label.ravel(), minlength=5)
        lost = {names[int(v)]: counts[v] - int(kept[int(v)]) for v in counts if counts[v] > kept[int(v)]}
        assert prepared.meta["cropped_labels"] == lost
        assert (case_id in report.cropped) == bool(lost)
    case_id, line = next(iter(report.cropped.items()))
    assert line.startswith(f"case {case_id}: fitting to the cube 16x16x16 (pad_crop) removes tumour voxels: ")
    settings = {"cube": [16, 16, 16], "fit": "pad_crop"}
    checked = check_dataset(originals / "brats21", progress=False, fit_to=settings)
    assert [c.cropped for c in checked] == [report.cropped.get(c.case_id) for c in checked]
    assert all(c.cropped is None for c in check_dataset(originals / "brats21", progress=False,
                                                          fit_to={"cube": [16, 16, 16], "fit": "resample"}))

    runner = CliRunner()
    strict = runner.invoke(app, ["data", "check", str(originals / "brats21"), "--strict", "-j", "1",
                                 "--set", "data.cube=[16,16,16]", "--set", "data.fit=pad_crop"])
    assert strict.exit_code == 1
    assert "lose tumour voxels, --strict" in " ".join(strict.output.split())
    relaxed = runner.invoke(app, ["data", "prepare", str(originals / "brats21"), "--out", str(tmp_path / "c2"),
                                  "--set", "data.cube=[16,16,16]", "--set", "data.fit=pad_crop", "-j", "1"])
    assert relaxed.exit_code == 0, relaxed.output
    assert "removes tumour voxels" in " ".join(relaxed.output.split())


def test_train_says_the_preparation_warnings_data_prepare_says(originals, tmp_path, monkeypatch):
    """issue 44.2: the preparation inside `train` printed none of `data prepare`'s per-case warnings."""
    from cv_helpers import fake_train_command

    from brats_swap.train import data as train_data

    trained = fake_train_command(monkeypatch, prepare=True)
    args = ["train", "--run", str(tmp_path / "run"), "--set", f"data.root={originals / 'brats21'}",
            "--set", f"data.cache={tmp_path / 'cache'}", "--set", "data.cube=[16,16,16]", "--set",
            "data.fit=pad_crop", "--set", "train.patch=[16,16,16]", "--set", "data.prepare_workers=1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert said.count("(pad_crop) removes tumour voxels") >= 1 and len(trained) == 1
    cropped = prepare_dataset(originals / "brats21", tmp_path / "cache", trained[0][0].data, progress=False).cropped
    assert said.count("(pad_crop) removes tumour voxels") == len(cropped)  # one line per case that loses some
    monkeypatch.setattr(train_data, "PREPARATION_WARNINGS_SHOWN", 0)  # more than shown: a count, not a flood
    again = " ".join(CliRunner().invoke(app, args).output.split())
    assert "removes tumour voxels" not in again and f"{len(cropped)} more warning(s) like these" in again


def test_a_hand_renamed_folder_warns_that_accepted_cases_may_be_mislabelled(originals, tmp_path):
    """nnU-Net's files renamed to BraTS names by hand: the cases holding label 3 are refused by the 2021
    table, and the one without it is accepted; `data check` says that one may be mislabelled."""
    folder = tmp_path / "renamed"
    for index, case in enumerate(discover_cases(originals / "brats21")):
        for role, path in case.files.items():
            target = folder / case.case_id / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            image = nib.load(str(path))
            data = np.asarray(image.dataobj)
            if role == "seg":
                data = np.where(data == 4, 3 if index else 1, np.where(data == 2, 1, np.where(data == 1, 2, 0)))
                data = data.astype(np.uint8)
            nib.save(nib.Nifti1Image(data, image.affine, image.header), str(target))
    result = CliRunner().invoke(app, ["data", "check", str(folder), "-j", "1"])
    text = " ".join(result.output.split())
    assert "of 3 cases read with the 2021 table (e.g. BraTS2021_00001) hold labels outside it" in text
    assert "(e.g. BraTS2021_00000) may be mislabelled" in text
