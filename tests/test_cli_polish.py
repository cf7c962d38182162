"""The command line's small promises: boolean flags read as flags, tables that never cut a number, phantom
case ids that differ between seeds, and one spelling of fold selection."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.errors import ConfigError
from brats_swap.evaluate.tables import print_results_table
from brats_swap.run.fold_selection import compare_fold_selection, parse_fold_selection


@pytest.mark.parametrize("command", [["predict"], ["evaluate"], ["train"], ["data", "check"]])
def test_boolean_flags_show_both_spellings_and_no_value(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    flags = [line for line in result.output.splitlines()
             if any(f"--no-{name}" in line for name in ("tta", "postprocessing", "resume", "strict"))]
    assert flags and all("<bool>" not in line for line in flags), result.output


@pytest.mark.parametrize("command", [[], ["train"], ["data", "synth"], ["plan"], ["cv"], ["serve-challenge"]])
def test_no_flag_and_not_help_shows_a_value(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "--help" in line or "--debug" in line]
    assert lines and all("<bool>" not in line for line in lines), result.output


def test_an_option_of_three_values_shows_the_spelling_it_reads(tmp_path):
    result = CliRunner().invoke(app, ["data", "synth", "--help"], env={"COLUMNS": "200"})
    assert "<int> <int> <int>" in result.output and "<int,int,int>" not in result.output
    synth = CliRunner().invoke(app, ["data", "synth", "--out", str(tmp_path / "p"), "--cases", "1",
                                     "--shape", "16", "16", "16"])
    assert synth.exit_code == 0, synth.output


def test_help_paragraphs_wrap_at_the_console_width_only():
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert "so this works straight from a download." in result.output, result.output
    listing = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert "on the original grid and affine" in listing, listing


def test_a_flag_given_a_value_is_a_usage_error_naming_the_value(tmp_path):
    result = CliRunner().invoke(app, ["predict", "--run", str(tmp_path), "--input", str(tmp_path), "--out",
                                      str(tmp_path), "--tta", "true"])
    assert result.exit_code == 2 and "true" in result.output


def test_result_tables_wrap_headers_but_never_cut_a_number():
    out = io.StringIO()
    header = ["Group", "Lesion Dice", "Lesion NSD", "Lesion HD95 (mm)", "Global Dice", "HD95 (mm)", "TP", "FP"]
    body = [["WT", "0.123 ± 0.456", "0.789", "373.13 ± 0.00", "0.500", "373.130", "12345", "678"]]
    print_results_table(Console(file=out, width=60), header, body, title="a wide table")
    text = out.getvalue()
    assert "…" not in text
    for number in ("0.123", "0.456", "0.789", "373.13", "0.00", "0.500", "373.130", "12345", "678"):
        assert number in text, (number, text)


def test_phantom_case_ids_depend_on_the_seed_or_the_offset(tmp_path):
    def synth(folder, *extra):
        result = CliRunner().invoke(app, ["data", "synth", "--out", str(tmp_path / folder), "--cases", "2",
                                          "--shape", "16", "16", "16", *extra])
        assert result.exit_code == 0, result.output
        return sorted(path.name for path in (tmp_path / folder).iterdir())

    assert synth("seed0", "--seed", "0") == ["BraTS2021_00000", "BraTS2021_00001"]
    assert synth("seed7", "--seed", "7") == ["BraTS2021_07000", "BraTS2021_07001"]
    assert synth("offset", "--seed", "7", "--id-offset", "40") == ["BraTS2021_00040", "BraTS2021_00041"]


def test_one_spelling_of_fold_selection():
    assert parse_fold_selection("all") == parse_fold_selection(" ALL ") == "all"
    assert parse_fold_selection("2") == parse_fold_selection(2) == [2]
    assert parse_fold_selection("3,1,3") == parse_fold_selection([1, 3]) == [1, 3]
    for bad in ("", "one", "-1", "1,x"):
        with pytest.raises(ConfigError, match="--folds"):
            parse_fold_selection(bad)
    # compare: a bare K keeps its old meaning (the first K folds) for a release, with a notice naming the
    # spelling in the one meaning; lists and "K," name folds as everywhere, without a notice.
    first, notice = compare_fold_selection("2")
    assert first == [0, 1] and "write --folds 0,1" in notice and "fold 2, as in cv" in notice
    first, notice = compare_fold_selection("1")
    assert first == [0] and "write --folds 0," in notice
    assert compare_fold_selection("2,") == ([2], None) and compare_fold_selection("0,2") == ([0, 2], None)
    assert compare_fold_selection("all") == ("all", None)
    with pytest.raises(ConfigError, match="--folds '0'") as zero:
        compare_fold_selection("0")
    assert "for fold 0 write --folds 0," in str(zero.value)  # the fix, not "expected a fold number"
