"""README.md keeps up with the program (issue 44, point 6): it names every `model.name` the config accepts and
the network registry builds, says how many there are, and its command table has a row for every command that
`--help` lists (and no row for a command that does not exist)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from cli_helpers import leaf_commands

from brats_swap.config.networks import NETWORK_NAMES
from brats_swap.config.schema import ModelConfig

README = Path(__file__).resolve().parents[1] / "README.md"
NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen twenty").split()


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _command_cells() -> list[list[str]]:
    """The code spans of the first cell of each row of the table under "## Commands", `brats-swap ` dropped: one list per
    row (a row may show two commands, `cv status --run DIR` / `cv summary --run DIR`)."""
    rows = []
    commands_section = _text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    for line in commands_section.splitlines():
        if line.startswith("| `brats-swap "):
            first_cell = re.split(r"(?<!\\)\|", line)[1]
            rows.append([span.removeprefix("brats-swap ").strip() for span in re.findall(r"`([^`]+)`", first_cell)])
    return rows


def _accepted_model_names() -> set[str]:
    """What `config show --set model.name=X` accepts: the Literal of ModelConfig.name (the loader checks it)."""
    return set(typing.get_args(typing.get_type_hints(ModelConfig)["name"]))


def test_the_readme_names_every_network_and_counts_them():
    names = _accepted_model_names()
    assert names == set(NETWORK_NAMES) and len(names) >= 11  # the schema and the registry agree
    text = _text()
    assert [name for name in NETWORK_NAMES if f"`{name}`" not in text] == []
    counted = re.search(r"It builds (\w+) networks", text)
    assert counted is not None and counted.group(1) == NUMBER_WORDS[len(names)]


def test_the_command_table_has_a_row_for_every_command_and_only_for_commands():
    commands = leaf_commands()
    assert {"train", "train-challenge", "container", "cv run", "data synth", "config show"} <= set(commands)
    spans = [span for row in _command_cells() for span in row]

    def lists(command: str) -> bool:
        return any(span == command or span.startswith(f"{command} ") for span in spans)

    assert [command for command in commands if not lists(command)] == []
    # Each row names a real command: the longest command its words start with.
    unknown = [span for span in spans if not any(span == c or span.startswith(f"{c} ") for c in commands)]
    assert unknown == []


def test_the_command_table_shows_the_trainable_container():
    assert any(span.startswith("container ") and "--trainable" in span.split()
               for row in _command_cells() for span in row)
