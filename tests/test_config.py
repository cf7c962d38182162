from __future__ import annotations

import pytest
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.errors import ConfigError


def test_defaults_are_the_paper_recipe():
    config = load_config()
    assert config.data.cube == [192, 192, 192]
    assert config.train.lr == 5e-4 and config.train.batch_size == 1
    assert config.model.base_filters == 16 and config.model.leaky_slope == 0.3


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  mode: patch\ndata:\n  cube: [64, 64, 64]\n  edition: 2021\n")
    config = load_config(path, ["train.patch=[32,32,32]", "memory.swap.exclude=['decoder.*']", "train.lr=2e-3"])
    assert config.name == "exp"
    assert config.train.lr == 2e-3
    assert config.train.patch == [32, 32, 32]
    assert config.data.edition == "2021"
    assert config.memory.swap.exclude == ["decoder.*"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.nope=1", "train.nope"),
        ("nope.x=1", "nope"),
        ("train.lr=fast", "train.lr"),
        ("train.max_epochs=1.5", "train.max_epochs"),
        ("train.mode=sideways", "train.mode"),
        ("data.cube=7", "data.cube"),
        ("train.lr=-1", "train.lr"),
        ("memory.mode=auto", "memory.budget_gib"),
        ("train.deterministic=maybe", "train.deterministic"),
    ],
)
def test_bad_overrides_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_patch_larger_than_cube_is_rejected():
    with pytest.raises(ConfigError, match="train.patch"):
        load_config(None, ["train.mode=patch", "data.cube=[64,64,64]", "train.patch=[128,128,128]"])


def test_cli_config_show_and_errors(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["config", "show", "--set", "train.lr=0.01"])
    assert ok.exit_code == 0, ok.output
    assert "lr: 0.01" in ok.output
    bad = runner.invoke(app, ["config", "show", "--set", "train.bogus=1"])
    assert bad.exit_code == 2
    assert "train.bogus" in bad.output and "Traceback" not in bad.output
    missing = runner.invoke(app, ["config", "show", "--config", str(tmp_path / "absent.yaml")])
    assert missing.exit_code == 2
    assert "absent.yaml" in missing.output


def test_augmentation_recipes_and_the_nnunet_foreground_rule_are_config_values():
    for recipe in ("cube48", "nnunet", "nnunet_brats2020", "mild", "none"):
        assert load_config(None, [f"train.augment={recipe}"]).train.augment == recipe
    assert load_config(None, ["train.patch_foreground=nnunet"]).train.patch_foreground == "nnunet"
    assert load_config(None, ["train.patch_foreground=0.5"]).train.patch_foreground == 0.5
    assert load_config(None, ["data.loader_workers=3"]).data.loader_workers == 3
    assert load_config().data.loader_workers == "auto"
    for bad, key in (("train.augment=strong", "train.augment"), ("train.patch_foreground=most", "train.patch_foreground"),
                     ("train.patch_foreground=1.5", "train.patch_foreground"),
                     ("data.loader_workers=many", "data.loader_workers")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])
    from pathlib import Path

    for path in ("configs/resenc_l.yaml", "configs/resenc_l_whole.yaml"):
        assert load_config(Path(__file__).parents[1] / path).train.augment == "nnunet", path
    assert load_config(Path(__file__).parents[1] / "configs/default.yaml").train.augment == "cube48"


def test_the_retired_monai_augment_key_says_what_replaced_it_and_old_runs_still_load(tmp_path):
    from brats_swap.config import config_from_saved, config_to_dict

    with pytest.raises(ConfigError, match=r"train\.monai_augment: replaced by train\.augment.*mild"):
        load_config(None, ["train.monai_augment=true"])
    saved = config_to_dict(load_config())
    del saved["train"]["augment"]
    old = {**saved, "train": {**saved["train"], "monai_augment": True}}
    assert config_from_saved(old).train.augment == "mild"
    old["train"]["monai_augment"] = False
    assert config_from_saved(old).train.augment == "cube48"


@pytest.mark.parametrize(("override", "message"), [
    ("train.compile=maybe", "train.compile: expected true, false or auto, got str 'maybe'"),
    ("data.loader_workers=many", "data.loader_workers: expected an integer or auto, got str 'many'"),
    ("train.patch_foreground=tumour", "train.patch_foreground: expected a number or nnunet, got str 'tumour'"),
])
def test_a_key_of_several_forms_names_every_form_it_takes(override, message):
    """A key that takes a value or a word (`auto`) names both in its error, not only the first form tried."""
    with pytest.raises(ConfigError) as raised:
        load_config(None, [override])
    assert str(raised.value) == message


def test_a_mistyped_evaluate_key_of_predict_says_what_was_meant():
    """`predict --set evaluate.sw_overlapp=0.5`: the line names the key meant, as the config loader does."""
    from brats_swap.evaluate.case_prediction import with_overrides

    with pytest.raises(ConfigError) as raised:
        with_overrides(load_config(None, []), ["evaluate.sw_overlapp=0.5"], ("evaluate.",))
    assert "unknown key (did you mean evaluate.sw_overlap? known: " in str(raised.value)
