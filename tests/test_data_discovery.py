from __future__ import annotations

import numpy as np
import pytest
from data_helpers import SCHEMES, write_case, write_volume

from brats_swap.data.challenges import (
    CANONICAL_MODALITIES,
    CHALLENGES,
    FORCED_EDITIONS,
    get_challenge,
    region_masks,
)
from brats_swap.data.discovery import detect_edition, discover_cases, parse_file_name
from brats_swap.errors import DataError


def test_every_challenge_has_a_naming_example():
    assert set(SCHEMES) | {"2018", "2019"} == set(CHALLENGES)


@pytest.mark.parametrize("edition", sorted(SCHEMES))
def test_each_naming_scheme_is_found_with_its_edition(tmp_path, edition):
    case_id = SCHEMES[edition]
    paths = write_case(tmp_path, case_id, edition)
    (case,) = discover_cases(tmp_path)
    assert case.case_id == case_id
    assert case.edition == edition
    shipped = [m for m in CANONICAL_MODALITIES if m in get_challenge(edition).modality_suffixes]
    assert case.images == {m: paths[m] for m in shipped} and len(shipped) == (1 if edition == "men-rt" else 4)
    assert case.seg == paths["seg"] and case.ignored == []
    assert case.expected_name("t1ce") == paths["t1ce"].name


def test_men_rt_ships_t1c_and_gtv_with_underscores(tmp_path):
    paths = write_case(tmp_path, "BraTS-MEN-RT-0060-1", "men-rt")
    assert sorted(p.name for p in paths.values()) == ["BraTS-MEN-RT-0060-1_gtv.nii.gz",
                                                       "BraTS-MEN-RT-0060-1_t1c.nii.gz"]
    (case,) = discover_cases(tmp_path, modalities=["t1ce"])
    assert case.edition == "men-rt" and case.seg.name.endswith("_gtv.nii.gz")
    assert parse_file_name("BraTS-MEN-RT-0328-1-t1c.nii.gz") == ("BraTS-MEN-RT-0328-1", "t1c")  # "-" works too


def test_forced_challenge_and_its_checks(tmp_path):
    write_case(tmp_path, "BraTS-GLI-00000-000", "gli")
    assert discover_cases(tmp_path)[0].edition == "gli"
    assert discover_cases(tmp_path, challenge="gli-post")[0].edition == "gli-post"
    assert discover_cases(tmp_path, edition="2023")[0].edition == "gli"  # the 2023 table is GLI pre-op's
    assert discover_cases(tmp_path, edition="2023", challenge="ssa")[0].edition == "ssa"  # the challenge wins
    with pytest.raises(DataError, match="data.challenge: unknown challenge 'gbm'"):
        discover_cases(tmp_path, challenge="gbm")
    with pytest.raises(DataError, match="data.challenge: the ped challenge .* contradicts data.edition=2021"):
        discover_cases(tmp_path, edition="2021", challenge="ped")


def test_2023_suffixes_map_to_canonical_modalities(tmp_path):
    write_case(tmp_path, "BraTS-GLI-00001-000", "2023")
    (case,) = discover_cases(tmp_path)
    assert {m: p.name for m, p in case.images.items()} == {
        "t1": "BraTS-GLI-00001-000-t1n.nii.gz", "t1ce": "BraTS-GLI-00001-000-t1c.nii.gz",
        "t2": "BraTS-GLI-00001-000-t2w.nii.gz", "flair": "BraTS-GLI-00001-000-t2f.nii.gz"}


def test_flat_layout_mixed_extensions_and_hgg_lgg_folders(tmp_path):
    write_case(tmp_path / "HGG", "Brats17_TCIA_105_1", "2017")
    write_case(tmp_path / "LGG", "Brats17_2013_0_1", "2017", ext=".nii")
    write_case(tmp_path / "flat", "BraTS2021_00007", "2021", per_case_folder=False)
    write_case(tmp_path / "flat", "BraTS2021_00008", "2021", per_case_folder=False, ext=".nii")
    cases = discover_cases(tmp_path)
    assert [c.case_id for c in cases] == ["BraTS2021_00007", "BraTS2021_00008", "Brats17_2013_0_1",
                                          "Brats17_TCIA_105_1"]
    by_id = {c.case_id: c for c in cases}
    assert by_id["Brats17_2013_0_1"].images["flair"].name == "Brats17_2013_0_1_flair.nii"
    assert by_id["BraTS2021_00008"].seg.name == "BraTS2021_00008_seg.nii"
    assert all(len(c.images) == 4 and c.seg is not None for c in cases)


@pytest.mark.parametrize(("case_id", "edition"), [
    ("BraTS18_Training_001", "2018"), ("Brats18_CBICA_AAB_1", "2018"), ("BraTS19_2013_0_1", "2019"),
    ("BraTS20_Validation_001", "2020"), ("BraTS2021_01146", "2021"), ("BraTS-MET-00132-000", "met"),
    ("Brats17_CBICA_AAB_1", "2017"), ("TCGA-02-0006", "2017"), ("BraTS-GLI-00000-000", "gli"),
    ("BraTS-GLI-00000-001", "gli"), ("BraTS-GLI-02143-102", "gli-post"), ("BraTS-GLI-03021-100", "gli-post"),
    ("brats-gli-00001-000", "gli"), ("BraTS-MEN-00004-000", "men"), ("BraTS-MEN-RT-0004-1", "men-rt"),
    ("BraTS-PED-00030-000", "ped"), ("BraTS-SSA-00002-000", "ssa"), ("BraTS-GoAT-02610", "goat"),
    ("BraTS-XYZ-00001-000", "2017"),
])
def test_edition_from_id_prefix(case_id, edition):
    assert detect_edition(case_id) == edition
    # The id patterns of the table never overlap: one key per id at most.
    unmatched = case_id in ("TCGA-02-0006", "BraTS-XYZ-00001-000")  # found by the fallback instead
    assert sum(spec.matches(case_id) for spec in CHALLENGES.values()) == (0 if unmatched else 1)


def test_unknown_prefixes_fall_back_on_the_suffix_family():
    assert detect_edition("BraTS-XYZ-00001-000", {"t1c": [], "seg": []}) == "gli"
    assert detect_edition("meningioma_7", {"t1c": [], "gtv": []}) == "men-rt"
    assert detect_edition("TCGA-02-0006", {"t1gd": []}) == "2017"


def test_validation_case_without_seg_and_forced_edition(tmp_path):
    write_case(tmp_path, "BraTS20_Validation_001", "2020", seg=False)
    (case,) = discover_cases(tmp_path)
    assert case.seg is None and case.edition == "2020" and len(case.images) == 4
    (forced,) = discover_cases(tmp_path, edition="2018")
    assert forced.edition == "2018"


def test_tcia_release_spellings(tmp_path):
    images = np.ones((4, 4, 4), dtype=np.float32)
    for suffix in ("t1", "t1Gd", "t2", "flair", "GlistrBoost", "GlistrBoost_ManuallyCorrected"):
        write_volume(tmp_path / "TCGA-02-0006" / f"TCGA-02-0006_{suffix}.nii.gz", images)
    (case,) = discover_cases(tmp_path)
    assert case.edition == "2017"
    assert case.images["t1ce"].name == "TCGA-02-0006_t1Gd.nii.gz"
    # ManuallyCorrected is preferred over the raw GlistrBoost output, as in Ellis's reader.
    assert case.seg.name == "TCGA-02-0006_GlistrBoost_ManuallyCorrected.nii.gz"
    assert [p.name for p in case.ignored] == ["TCGA-02-0006_GlistrBoost.nii.gz"]


def test_parse_file_name_prefers_the_longest_suffix():
    assert parse_file_name("Brats17_TCIA_105_1_t1ce.nii.gz") == ("Brats17_TCIA_105_1", "t1ce")
    assert parse_file_name("Brats17_TCIA_105_1_t1.nii") == ("Brats17_TCIA_105_1", "t1")
    assert parse_file_name("BraTS-GLI-00000-000-t2f.nii.gz") == ("BraTS-GLI-00000-000", "t2f")
    assert parse_file_name("notes.txt") is None
    assert parse_file_name("template.nii.gz") is None


def test_duplicate_case_across_folders_names_both_files(tmp_path):
    write_case(tmp_path / "HGG", "Brats17_TCIA_105_1", "2017")
    write_case(tmp_path / "LGG", "Brats17_TCIA_105_1", "2017")
    with pytest.raises(DataError, match=r"case Brats17_TCIA_105_1: duplicate t1 files .*HGG.* and .*LGG"):
        discover_cases(tmp_path)


def test_duplicate_nii_and_nii_gz(tmp_path):
    paths = write_case(tmp_path, "BraTS2021_00000", "2021")
    write_volume(paths["t2"].with_name("BraTS2021_00000_t2.nii"), np.ones((3, 3, 3), dtype=np.float32))
    with pytest.raises(DataError, match=r"duplicate t2 files .*BraTS2021_00000_t2\.nii.* and .*_t2\.nii\.gz"):
        discover_cases(tmp_path)


def test_missing_empty_and_unrecognised_folders(tmp_path):
    with pytest.raises(DataError, match="dataset folder not found"):
        discover_cases(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty folder"):
        discover_cases(tmp_path / "empty")
    write_volume(tmp_path / "other" / "brain.nii.gz", np.ones((3, 3, 3), dtype=np.float32))
    with pytest.raises(DataError, match="no BraTS-named NIfTI files.*brain.nii.gz"):
        discover_cases(tmp_path / "other")
    with pytest.raises(DataError, match="data.edition: unknown edition"):
        discover_cases(tmp_path / "other", edition="2016")


def test_label_table_per_edition():
    for year in ("2017", "2018", "2019", "2020", "2021"):
        spec = get_challenge(year)
        assert spec.label_values == (1, 2, 4)
        assert spec.region_labels == {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}
    spec = get_challenge("2023")
    assert spec is get_challenge("gli") and spec.label_values == (1, 2, 3)
    assert spec.region_labels == {"WT": (1, 2, 3), "TC": (1, 3), "ET": (3,)}
    assert set(FORCED_EDITIONS) == {"2017", "2018", "2019", "2020", "2021", "2023"}
    label = np.array([0, 1, 2, 3, 4])
    masks = region_masks(label, "2023")
    assert masks["ET"].tolist() == [False, False, False, True, False]
    assert region_masks(label, "2021")["TC"].tolist() == [False, True, False, False, True]
