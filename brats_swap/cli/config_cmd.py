"""`brats-swap config show`: print the resolved configuration."""

from __future__ import annotations

import typer

from brats_swap.cli.common import ConfigOption, SetOption, console, handle_errors, resolve_config
from brats_swap.config import config_to_yaml

app = typer.Typer(help="Inspect configurations.", no_args_is_help=True)


@app.command("show")
@handle_errors
def show(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Print the resolved YAML: schema defaults <- --config file <- --set overrides."""
    resolved = resolve_config(config, set_)
    console.print(config_to_yaml(resolved), end="", markup=False, highlight=False, soft_wrap=True)
