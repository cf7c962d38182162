"""The one table of label conventions: its entries, its invariants, the config keys that choose an entry,
and `data check --strict` on the phantoms of every challenge."""

from __future__ import annotations

import typing

import pytest
from typer.testing import CliRunner

from brats_swap.cli.data import app as data_app
from brats_swap.config import load_config
from brats_swap.config.schema import Challenge, Edition
from brats_swap.data.challenges import (
    CANONICAL_MODALITIES,
    CHALLENGES,
    FORCED_EDITIONS,
    LEGACY_CHALLENGES,
    MODERN_CHALLENGES,
    REGIONS,
    TISSUES,
    evaluation_groups,
    get_challenge,
)
from brats_swap.errors import ConfigError
from brats_swap.model.targets import region_tree

# The official evaluation groups, as the BraTS evaluation package configures them (issue 13).
OFFICIAL_GROUPS = {
    "gli-post": {"ET": (3,), "NETC": (1,), "SNFH": (2,), "RC": (4,), "TC": (1, 3), "WT": (1, 2, 3)},
    "met": {"ET": (3,), "RC": (4,), "TC": (1, 3), "WT": (1, 2, 3)},
    "men": {"ET": (3,), "TC": (1, 3), "WT": (1, 2, 3)},
    "goat": {"ET": (3,), "TC": (1, 3), "WT": (1, 2, 3)},
    "ssa": {"ET": (3,), "TC": (1, 3), "WT": (1, 2, 3)},
    "men-rt": {"GTV": (1,)},
    "ped": {"ET": (1,), "NETC": (2,), "CC": (3,), "ED": (4,), "TC": (1, 2, 3), "WT": (1, 2, 3, 4)},
    # GLI pre-op: the GLI groups without RC (its table has no label 4).
    "gli": {"ET": (3,), "NETC": (1,), "SNFH": (2,), "TC": (1, 3), "WT": (1, 2, 3)},
    **{year: {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)} for year in LEGACY_CHALLENGES},
}


@pytest.mark.parametrize("key", list(CHALLENGES))
def test_groups_are_the_official_ones_in_report_order(key):
    groups = evaluation_groups(key)
    assert list(groups.items()) == list(OFFICIAL_GROUPS[key].items())
    groups["ET"] = (99,)  # a copy: nobody can change the table through it
    assert evaluation_groups(key) == OFFICIAL_GROUPS[key]


@pytest.mark.parametrize("key", list(CHALLENGES))
def test_table_invariants(key):
    spec = get_challenge(key)
    for name, values in spec.groups.items():
        assert set(values) <= set(spec.labels), name
    assert set(spec.regions) <= set(spec.groups)
    assert set(spec.tissues) <= set(TISSUES) and set(spec.tissues.values()) == set(spec.labels)
    assert set(spec.modality_suffixes) <= set(CANONICAL_MODALITIES)
    assert spec.matches(spec.example_id(7)) and not any(
        other.matches(spec.example_id(7)) for other in CHALLENGES.values() if other is not spec)
    region_tree(spec)  # the default regions recover every label
    assert list(spec.region_labels) == ([r for r in REGIONS if r in spec.groups] or list(spec.groups))


def test_labels_of_the_2024_tables():
    assert get_challenge("ped").labels == {1: "ET", 2: "NETC", 3: "CC", 4: "ED"}
    assert get_challenge("gli-post").labels == {1: "NETC", 2: "SNFH", 3: "ET", 4: "RC"}
    assert get_challenge("met").labels[4] == "RC" and get_challenge("gli").label_values == (1, 2, 3)
    men_rt = get_challenge("men-rt")
    assert men_rt.labels == {1: "GTV"} and men_rt.modality_suffixes == {"t1ce": "t1c"} and men_rt.seg_suffix == "gtv"
    assert get_challenge("2023") is get_challenge("gli")
    with pytest.raises(KeyError, match="unknown BraTS edition or challenge 'brats'"):
        get_challenge("brats")


def test_one_module_holds_the_table_and_the_keys_data_edition_may_force():
    import importlib.util

    assert importlib.util.find_spec("brats_swap.data.editions") is None  # the alias layer is gone
    assert set(typing.get_args(Edition)) == {"auto", *FORCED_EDITIONS}
    assert FORCED_EDITIONS == ("2017", "2018", "2019", "2020", "2021", "2023")
    assert all(spec.legacy for spec in map(get_challenge, LEGACY_CHALLENGES))


def test_config_challenge_key_matches_the_table_and_is_validated():
    assert set(typing.get_args(Challenge)) == {"auto", *MODERN_CHALLENGES}
    assert load_config(None, ["data.challenge=ped"]).data.challenge == "ped"
    with pytest.raises(ConfigError, match="data.challenge: 'pediatric' is not one of"):
        load_config(None, ["data.challenge=pediatric"])
    with pytest.raises(ConfigError, match="data.challenge: the 2023\\+ challenge met contradicts data.edition=2020"):
        load_config(None, ["data.challenge=met", "data.edition=2020"])


def test_input_channels_follow_the_modalities_unless_set():
    assert load_config(None, []).model.in_channels == 4
    assert load_config(None, ["data.modalities=[t1ce]"]).model.in_channels == 1
    assert load_config(None, ["data.modalities=[t1ce,flair]", "model.in_channels=2"]).model.in_channels == 2
    with pytest.raises(ConfigError, match="data.modalities: 1 modalities but model.in_channels is 4"):
        load_config(None, ["data.modalities=[t1ce]", "model.in_channels=4"])
    with pytest.raises(ConfigError, match="data.modalities: needs at least one modality"):
        load_config(None, ["data.modalities=[]"])


@pytest.mark.parametrize(("challenge", "extra"), [
    ("gli-post", []), ("ped", []), ("met", []), ("men-rt", ["--set", "data.modalities=[t1ce]"]), ("goat", []),
])
def test_check_strict_passes_on_the_phantoms_of_each_challenge(tmp_path, challenge, extra):
    runner = CliRunner()
    made = runner.invoke(data_app, ["synth", "--challenge", challenge, "--out", str(tmp_path), "--cases", "2",
                                    "--shape", "32", "32", "24"])
    assert made.exit_code == 0, made.output
    # One process: the pool's answers are tests/test_data_scale.py's (two spawned workers cost ~3 s of CPU here).
    checked = runner.invoke(data_app, ["check", "--strict", "--workers", "1", str(tmp_path), *extra])
    assert checked.exit_code == 0, checked.output
    text = " ".join(checked.output.split())
    assert "2 usable, 0 skipped" in text and get_challenge(challenge).title.split()[0] in text
