"""`brats-swap config show`: print the resolved configuration."""

from __future__ import annotations

import typer

from brats_swap.cli.common import ConfigOption, SetOption, handle_errors, resolve_config
from brats_swap.config import config_to_yaml
from brats_swap.run.console import line_console

app = typer.Typer(help="Inspect configurations.", no_args_is_help=True)


@app.command("show")
@handle_errors
def show(config: ConfigOption = None, set_: SetOption = None) -> None:
    """Print the resolved YAML: schema defaults <- --config file <- --set overrides."""
    resolved = resolve_config(config, set_)
    line_console.print(config_to_yaml(resolved), end="")
