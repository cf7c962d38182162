"""brats_swap.names: the one rule for names and paths read from someone else's files."""

import os

import pytest

from brats_swap.errors import DataError
from brats_swap.names import checked_name, path_inside, relative_path_inside, script_text, shell_word

REAL_IDS = ["BraTS-GLI-00000-000", "BraTS2021_00000", "Brats17_CBICA_AAB_1", "BraTS-MEN-RT-0000-1",
            "glioma_007", "BRATS_001", "BraTS20_Training_001"]
BAD = ["", "..", "../x", "a/b", "a\\b", "/etc", "x\ny", "x\x00", "-rf", ".hidden", "a..b", "a b", "x" * 201, 7]


@pytest.mark.parametrize("name", REAL_IDS)
def test_real_case_ids_are_names(name):
    assert checked_name(name, "case id", "dataset.json") == name


@pytest.mark.parametrize("name", BAD)
def test_bad_names_are_one_line_naming_the_source(name):
    with pytest.raises(DataError) as caught:
        checked_name(name, "case id", "/data/dataset.json")
    message = str(caught.value)
    assert message.startswith("/data/dataset.json: case id") and "\n" not in message


def test_paths_stay_inside_their_folder_after_resolution(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    assert path_inside(tmp_path / "out", "case_1", "case id", "x", ".nii.gz") == (
        tmp_path / "out" / "case_1.nii.gz").resolve()
    os.symlink(tmp_path / "elsewhere", tmp_path / "out" / "link")
    with pytest.raises(DataError, match="leads outside"):
        path_inside(tmp_path / "out", "link", "case id", "x")
    assert relative_path_inside(tmp_path / "out", "./a/b.nii.gz", "image", "x") == (
        tmp_path / "out" / "a" / "b.nii.gz").resolve()
    for bad in ["../elsewhere/b.nii.gz", "/etc/passwd", "link/b.nii.gz", "a\nb"]:
        with pytest.raises(DataError):
            relative_path_inside(tmp_path / "out", bad, "image", "x")


def test_script_text_refuses_newlines_and_shell_words_are_quoted():
    assert script_text("8h", "time budget", "cli") == "8h"
    with pytest.raises(DataError, match="newline or control"):
        script_text("x\nRUN touch /PWNED", "name", "metadata.json")
    assert shell_word("8h; touch x", "time budget", "cli") == "'8h; touch x'"
