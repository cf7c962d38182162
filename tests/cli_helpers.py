"""The commands the CLI offers, read from the Typer app itself (what `--help` and each group's --help list)."""

from __future__ import annotations


def command_paths() -> list[list[str]]:
    """Every visible command and subcommand as its words, groups included: [["train"], ["cv"], ["cv", "run"],
    ...]."""
    import typer.main

    from brats_swap.cli.main import app

    paths: list[list[str]] = []

    def walk(command, prefix: list[str]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                paths.append([*prefix, name])
                walk(sub, [*prefix, name])

    walk(typer.main.get_command(app), [])
    return paths


def leaf_commands() -> list[str]:
    """The commands that run something (no subcommands), spelled as typed: "train", "cv run", ..."""
    paths = command_paths()
    groups = {tuple(path[:-1]) for path in paths if len(path) > 1}
    return [" ".join(path) for path in paths if tuple(path) not in groups]
