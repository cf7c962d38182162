"""Bad configuration: unknown keys, wrong types, impossible values, missing files.

Each is exit 2 with one `error:` line naming the dotted key (or the file), before anything is written;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import pytest
from failure_helpers import TINY, error_line, invoke

from brats_swap.errors import EXIT_USAGE, ConfigError

BAD_OVERRIDES = [
    # unknown keys
    ("train.bogus=1", "train.bogus"),
    ("bogus.key=1", "bogus"),
    ("memory.swap.lookahed=2", "memory.swap.lookahed"),
    # wrong types
    ("train.lr=fast", "train.lr"),
    ("train.max_epochs=1.5", "train.max_epochs"),
    ("train.deterministic=maybe", "train.deterministic"),
    ("data.cube=192", "data.cube"),
    ("data.cube=[192,192,abc]", "data.cube[2]"),
    ("train.mode=sideways", "train.mode"),
    ("data.edition=2016", "data.edition"),
    ("train=3", "train"),
    # impossible values
    ("train.lr=-0.001", "train.lr"),
    ("train.lr=0", "train.lr"),
    ("train.max_epochs=0", "train.max_epochs"),
    ("train.batch_size=-1", "train.batch_size"),
    ("model.dropout=1.5", "model.dropout"),
    ("data.cube=[100,100,100]", "data.cube"),  # not divisible by 2^(depth-1)
    ("data.cube=[0,192,192]", "data.cube"),
    ("data.clip_percentiles=[99,1]", "data.clip_percentiles"),
    ("cv.folds=1", "cv.folds"),
    ("memory.mode=auto", "memory.budget_gib"),  # auto needs a budget
    ("memory.budget_gib=-4", "memory.budget_gib"),
    ("evaluate.threshold=1.5", "evaluate.threshold"),
    ("train.lr=.inf", "train.lr"),
    ("train.device=gpu", "train.device"),  # torch.device("gpu") would fail deep inside training
    ("train.threads=0", "train.threads"),
    ("train.patch_foreground=2", "train.patch_foreground"),
    ("train.early_stop_patience=0", "train.early_stop_patience"),
    ("data.modalities=[t1,t1ce,t2,dwi]", "data.modalities"),
    ("data.modalities=[t1,t1,t2,flair]", "data.modalities"),
    ("name=../elsewhere", "name"),  # the run folder is runs/<name>
]


@pytest.mark.parametrize(("override", "key"), BAD_OVERRIDES, ids=[o for o, _ in BAD_OVERRIDES])
def test_config_show_names_the_key(override, key):
    error_line(invoke("config", "show", "--set", override), EXIT_USAGE, key)


def test_message_text_is_not_taken_for_markup():
    # rich would read "[low, high]" as a style tag and drop it from the line.
    line = error_line(invoke("config", "show", "--set", "data.clip_percentiles=[99,1]"), EXIT_USAGE,
                      "data.clip_percentiles")
    assert "[low, high]" in line and "[99.0, 1.0]" in line


def test_budget_below_the_planners_floor(prepared_cache, tmp_path):
    run = tmp_path / "run"
    args = [a for item in TINY for a in ("--set", item)]
    result = invoke("train", "--run", run, *args, "--set", f"data.cache={prepared_cache}",
                    "--set", "memory.mode=auto", "--set", "memory.budget_gib=0.0001")
    error_line(result, EXIT_USAGE, "memory.budget_gib", "floor")
    assert not list(run.rglob("*.pt"))


def test_patch_larger_than_the_cube():
    result = invoke("config", "show", "--set", "train.mode=patch", "--set", "data.cube=[64,64,64]",
                    "--set", "train.patch=[128,128,128]")
    error_line(result, EXIT_USAGE, "train.patch", "larger than the cube")


def test_malformed_override():
    error_line(invoke("config", "show", "--set", "train.lr"), EXIT_USAGE, "train.lr", "section.key=value")
    error_line(invoke("config", "show", "--set", "=3"), EXIT_USAGE, "empty key")
    error_line(invoke("config", "show", "--set", "train.lr.x=1"), EXIT_USAGE, "train.lr")


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("train:\n  lr: 1e-3\n  epochs: 5\n", ["train.epochs", "unknown config key"]),
        ("model:\n  base_filters: sixteen\n", ["model.base_filters", "expected an integer"]),
        ("data:\n  cube: [128, 128]\n", ["data.cube"]),
        ("- just\n- a list\n", ["a config must be a mapping"]),
        ("train: [1, 2\n", ["not valid YAML", "line"]),
        ("train:\n  lr: -5\n", ["train.lr", "must be positive"]),
    ],
    ids=["unknown", "type", "value", "not-a-mapping", "bad-yaml", "negative-lr"],
)
def test_bad_config_file(tmp_path, text, fragments):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    error_line(invoke("config", "show", "--config", path), EXIT_USAGE, *fragments)


def test_missing_config_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    error_line(invoke("config", "show", "--config", missing), EXIT_USAGE, str(missing), "not found")
    error_line(invoke("train", "--config", missing, "--run", tmp_path / "run"), EXIT_USAGE, str(missing))
    assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback():
    quiet = invoke("config", "show", "--set", "train.bogus=1")
    error_line(quiet, EXIT_USAGE, "train.bogus")
    loud = invoke("--debug", "config", "show", "--set", "train.bogus=1")
    assert loud.exit_code == EXIT_USAGE
    assert "Traceback" in loud.output and "ConfigError" in loud.output and "train.bogus" in loud.output
    # --debug does not stick: the next call is quiet again.
    error_line(invoke("config", "show", "--set", "train.bogus=1"), EXIT_USAGE, "train.bogus")


@pytest.mark.parametrize(
    "override",
    ["train.lr=-1", "train.bogus=1", "train.mode=patch", "memory.mode=auto"],
)
def test_train_rejects_bad_config_before_writing_anything(tmp_path, override):
    run = tmp_path / "run"
    extra = ["--set", "train.patch=[64,64,64]"] if override == "train.mode=patch" else []
    result = invoke("train", "--run", run, "--set", "data.cube=[32,32,32]", "--set", override, *extra)
    key = {"train.mode=patch": "train.patch", "memory.mode=auto": "memory.budget_gib"}.get(override,
                                                                                             override.split("=")[0])
    error_line(result, EXIT_USAGE, key)
    assert not run.exists()


def test_unknown_option_is_a_usage_error():
    result = invoke("train", "--epochs", "3")
    assert result.exit_code == EXIT_USAGE and "Traceback" not in result.output
    assert "--epochs" in result.output


def test_folds_more_than_cases_is_rejected():
    from brats_swap.splits import make_splits

    with pytest.raises(ConfigError, match=r"cv\.folds: 5 folds but only 4 subjects"):
        make_splits([f"BraTS2021_{i:05d}" for i in range(4)], folds=5, seed=0)


def test_train_with_more_folds_than_cases(prepared_cache, tmp_path):
    run = tmp_path / "run"
    args = [a for item in TINY for a in ("--set", item)]
    result = invoke("train", "--run", run, *args, "--set", f"data.cache={prepared_cache}", "--set", "cv.folds=5")
    error_line(result, EXIT_USAGE, "cv.folds", "only 4")
    assert not list(run.rglob("*.pt"))


def test_fold_out_of_range(prepared_cache, tmp_path):
    run = tmp_path / "run"
    args = [a for item in TINY for a in ("--set", item)]
    result = invoke("train", "--run", run, *args, "--set", f"data.cache={prepared_cache}", "--fold", "7")
    error_line(result, EXIT_USAGE, "--fold 7")
    assert not list(run.rglob("*.pt"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [(["model.base_filters=8"], "model.base_filters"), (["model.depth=4", "model.segmentation_levels=3"], "model.depth")],
    ids=["filters", "depth"],
)
def test_resume_with_another_architecture(run_copy, prepared_cache, overrides, key):
    """--resume with a model that cannot load the checkpoint: one line naming the key, nothing overwritten
    (other config changes are allowed, with a warning)."""
    latest = run_copy / "fold_0" / "checkpoint_latest.pt"
    before = latest.read_bytes()
    args = [a for item in [*TINY, f"data.cache={prepared_cache}", "train.max_epochs=4", *overrides]
            for a in ("--set", item)]
    error_line(invoke("train", "--run", run_copy, "--resume", *args), EXIT_USAGE, key, "checkpoint")
    assert latest.read_bytes() == before


def test_every_command_maps_errors_to_exit_codes():
    """Each command is wrapped by handle_errors (one line + exit code); a new command without it would
    print tracebacks for every foreseeable failure."""
    from brats_swap.cli.common import handle_errors
    from brats_swap.cli.main import app

    wrapper_code = handle_errors(lambda: None).__code__
    commands = [(info.name, info.callback) for info in app.registered_commands]
    for group in app.registered_groups:
        commands += [(f"{group.name} {info.name}", info.callback) for info in group.typer_instance.registered_commands]
    assert len(commands) >= 9
    unwrapped = [name for name, callback in commands if getattr(callback, "__code__", None) is not wrapper_code]
    assert unwrapped == []
