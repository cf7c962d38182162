"""Issue 54.3: validation was silent. A patch run validating whole cubes by sliding window printed nothing for
minutes, right after a line that gave the run one second left. Validation now has its own progress (a bar on a
terminal; without one, lines on stderr and in train.log, the first at once and then a line a minute, also while
one case's windows run), and the run's estimate says which validations it does not count yet."""

from __future__ import annotations

import pytest
from train_helpers import SMALL, small_dataset, tiny_config

from brats_swap import progress
from brats_swap.train.loop import train_fold


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


def test_validation_prints_progress_lines_while_windows_run_and_the_run_estimate_names_it(data, tmp_path,
                                                                                          monkeypatch, capsys):
    # Every line due at once: the test sees the lines a minute-long validation would print.
    monkeypatch.setattr(progress.ProgressLines.__init__, "__kwdefaults__",
                        {**progress.ProgressLines.__init__.__kwdefaults__, "every_s": 0.0})
    config = tiny_config(*data, *SMALL, "model.base_filters=2", "train.mode=patch", "train.patch=[8,8,8]",
                         "train.max_epochs=2", "train.steps_per_epoch=2")
    run = tmp_path / "run"
    train_fold(config, run, 0, progress=True)
    err = capsys.readouterr().err.splitlines()  # no terminal here: the lines of long work go to stderr
    # rich's bar, disabled off a terminal, still printed an empty line as each epoch's and validation's bar stopped.
    assert "" not in err, err
    log = (run / "fold_0" / "train.log").read_text().splitlines()
    for out in (err, log):
        first_step = next(line for line in out if "epoch 1/2 step 1/2," in line)
        # Before any validation ran, the run's estimate says what it leaves out.
        assert "in the run, plus 2 validation(s) not timed yet" in first_step
        validating = [line for line in out if "epoch 1/2 validation case " in line]
        # 2 validation cases of 27 windows each (16³ cube, 8³ patches, half overlap): lines during the first case,
        # then after it, with the time left in the validation and in the run.
        assert sum("validation case 0/2, " in line for line in validating) > 1
        after_one = next(line for line in validating if "validation case 1/2, " in line)
        assert "left in this validation" in after_one and "in the run" in after_one
        epoch_line = next(i for i, line in enumerate(out) if "epoch 1/2  train_loss" in line)
        assert out.index(validating[-1]) < epoch_line
        # Once the first validation is timed, the run's estimate counts the later ones.
        second = next(line for line in out if "epoch 2/2 step 1/2," in line)
        assert "in the run" in second and "not timed yet" not in second
