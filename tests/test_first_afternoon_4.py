"""Issue 54, the first afternoon's fourth round: a cache shared by runs of two cubes, an evaluation against
the wrong dataset, a stopped `data prepare`, and errors that say the fix.

(Point 3, validation's progress, is tested in tests/test_validation_progress.py; point 9, the data-wait
warning, in tests/test_data_wait.py.)"""

from __future__ import annotations

import shutil

import pytest
from train_helpers import SMALL, prepared_dataset, small_dataset, tiny_config
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.data import cache as cache_module
from brats_swap.data.cache import list_prepared, prepare_dataset, prepare_missing
from brats_swap.data.discovery import discover_cases
from brats_swap.errors import ConfigError, DataError


def one_line(text: str) -> str:
    return " ".join(text.split())


def _entry_times(cache) -> dict[str, int]:
    return {case_id: (cache / case_id / "meta.json").stat().st_mtime_ns for case_id in list_prepared(cache)}


def test_a_run_with_another_cube_refuses_the_cache_of_another_run_naming_both_cubes(tmp_path_factory, tmp_path):
    """issue 54.5: run B at another cube on run A's cache prepared every case again, and A's --resume prepared
    them all back, silently. A run's prepare step now refuses in one line naming both cubes; `data prepare`
    (asked for) replaces them, saying so."""
    root, small = small_dataset(tmp_path_factory)
    cache = tmp_path / "cache"
    shutil.copytree(small, cache)  # run A's cache, at the 16³ cube of SMALL
    before = _entry_times(cache)
    with pytest.raises(DataError) as refused:
        prepare_missing(tiny_config(root, cache).data, progress=False)
    message = str(refused.value)
    assert f"cache {cache} holds 4 case(s) prepared with data.cube [16, 16, 16], not [32, 32, 32]" in message
    assert "its own data.cache" in message and "data prepare" in message
    assert _entry_times(cache) == before  # nothing prepared again
    # Run A itself goes on with the cache as it is.
    assert prepare_missing(tiny_config(root, cache, *SMALL).data, progress=False).prepared == []

    said: list[str] = []
    console = type("Lines", (), {"print": lambda self, line, **_: said.append(line)})()
    report = prepare_dataset(root, cache, tiny_config(root, cache).data, workers=1,
                             progress=False, console=console)
    assert len(report.prepared) == 4
    assert any("data.cube [16, 16, 16], not [32, 32, 32]: preparing them again" in line for line in said)


def test_evaluating_predictions_against_another_dataset_says_so_naming_both_folders(tmp_path_factory, tmp_path):
    """issue 54.7: `--data` of another dataset advised `--missing empty`, which scores an all-zero report."""
    root, _ = prepared_dataset(tmp_path_factory)
    predictions = tmp_path / "predictions"
    predictions.mkdir()
    for case in discover_cases(root)[:2]:
        shutil.copy(case.seg, predictions / f"{case.case_id}.nii.gz")
    other = tmp_path / "other"
    from brats_swap.data.phantom import synthesize_dataset

    other_ids = synthesize_dataset(other, 2, seed=3, shape=(24, 24, 16), id_offset=3000)
    for missing in ("error", "empty"):
        result = CliRunner().invoke(app, ["evaluate", "--predictions", str(predictions), "--data", str(other),
                                          "--out", str(tmp_path / "report"), "--missing", missing],
                                    env={"COLUMNS": "300"})
        assert result.exit_code == 1, result.output
        error = one_line(result.output)
        assert f"none of the 2 prediction(s) in {predictions}" in error and f"reference case of {other}" in error
        assert other_ids[0] in error and "--missing empty" not in error
        assert not (tmp_path / "report").exists()


def test_a_stopped_data_prepare_says_how_many_cases_are_kept_and_that_it_continues(tmp_path_factory, tmp_path,
                                                                                    monkeypatch):
    """issue 54.8: Ctrl-C during `data prepare` said only `error: interrupted`."""
    root, _ = prepared_dataset(tmp_path_factory)
    cache = tmp_path / "cache"
    real, calls = cache_module.prepare_one, []

    def ctrl_c_at_the_third_case(*args):
        calls.append(args[0].case_id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(cache_module, "prepare_one", ctrl_c_at_the_third_case)
    command = ["data", "prepare", str(root), "--out", str(cache), "--workers", "1", "--set", "data.cube=[16,16,16]"]
    stopped = CliRunner().invoke(app, command, env={"COLUMNS": "300"})
    assert stopped.exit_code == 130, stopped.output
    assert (f"error: {cache}: interrupted; 2 of 4 case(s) are prepared and kept (2 by this call), 2 not yet: run the "
            "same command again") in one_line(stopped.output)
    assert list_prepared(cache) == sorted(calls[:2])
    monkeypatch.undo()
    again = CliRunner().invoke(app, command, env={"COLUMNS": "300"})
    assert again.exit_code == 0, again.output
    assert "2 prepared, 2 up to date" in one_line(again.output)


def test_config_and_checkpoint_mistakes_say_the_fix(tmp_path):
    """issue 54.10: a mistyped --checkpoint name, a scalar for a list key, a mistyped key."""
    with pytest.raises(ConfigError) as scalar:
        load_config(None, ["data.cube=64"])
    assert str(scalar.value) == ("data.cube: expected a list, got int 64; write a list: --set data.cube=[64,64,64] "
                                 "(in a YAML file: cube: [64, 64, 64])")
    with pytest.raises(ConfigError) as modalities:
        load_config(None, ["data.modalities=t1"])
    assert "--set data.modalities=[t1] " in str(modalities.value)
    with pytest.raises(ConfigError, match=r"unknown config key 'train.lrr' \(did you mean 'train.lr'\? known: "):
        load_config(None, ["train.lrr=1e-3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trian' \(did you mean 'train'\? known: "):
        load_config(None, ["trian.lr=1e-3"])

    from brats_swap.evaluate.predicting import select_folds

    with pytest.raises(ConfigError) as checkpoint:
        select_folds(tmp_path, "all", "latets")
    assert str(checkpoint.value) == ("--checkpoint 'latets': not a checkpoint name nor a file (did you mean latest? "
                                     "expected best or latest, or the path of a checkpoint file)")
    from brats_swap.config import config_to_yaml

    (tmp_path / "config.yaml").write_text(config_to_yaml(load_config(None, [])))  # a run folder, no fold yet
    result = CliRunner().invoke(app, ["evaluate", "--run", str(tmp_path), "--checkpoint", "latets"])
    assert result.exit_code == 2 and "did you mean latest?" in one_line(result.output), result.output
