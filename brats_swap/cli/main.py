"""The `brats-swap` command line: a thin Typer shell over importable functions.

Each command parses its options, resolves one config, calls a plain function from the package and maps
the project's errors to exit codes (see brats_swap/errors.py and docs/failures.md).
"""

from __future__ import annotations

from typing import Annotated

import typer

from brats_swap import __version__
from brats_swap.cli import config_cmd
from brats_swap.cli import cv as cv_cmd
from brats_swap.cli import data as data_cmd
from brats_swap.cli import nnunet as nnunet_cmd
from brats_swap.cli import plan as plan_cmd
from brats_swap.cli import predict as predict_cmd
from brats_swap.cli import ship as ship_cmd
from brats_swap.cli import train as train_cmd
from brats_swap.cli.common import DEBUG, HonestHelpGroup
from brats_swap.process_env import configure_process

app = typer.Typer(
    name="brats-swap",
    cls=HonestHelpGroup,
    help="Train and evaluate 3D U-Nets for BraTS on whole volumes, swapping activations to host memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"brats-swap {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    DEBUG["enabled"] = debug


# Listed in --help in the order of a project's life: data, training, planning, cross-validation, shipping.
app.add_typer(data_cmd.app, name="data")
app.add_typer(config_cmd.app, name="config")
train_cmd.register(app)  # train, evaluate
predict_cmd.register(app)  # predict
app.command("plan", context_settings=plan_cmd.CONTEXT)(plan_cmd.plan)
app.add_typer(cv_cmd.app, name="cv")
app.command("compare")(cv_cmd.compare)
ship_cmd.register(app)  # export, container, serve-challenge, check-submission
app.command("import-nnunet")(nnunet_cmd.import_nnunet)


def main() -> None:
    configure_process()  # before anything imports torch (the CLI imports it lazily)
    app()


if __name__ == "__main__":
    main()
