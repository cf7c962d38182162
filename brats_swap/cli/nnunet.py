"""`brats-swap import-nnunet`: an nnU-Net v2 results folder as a brats-swap run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from brats_swap.cli.common import console, handle_errors


@handle_errors
def import_nnunet(
    results: Annotated[Path, typer.Argument(help="nnU-Net's Dataset<NNN>_<Name>/<Trainer>__<Plans>__<configuration>/ "
                                                 "folder (plans.json, dataset.json, fold_<k>/).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The run folder to write.")],
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="Checkpoint file of each fold.")] = "checkpoint_final.pth",
    edition: Annotated[str, typer.Option("--edition", help="Label table of the data it was trained on: 2017 ... "
                                                           "2021 (default: 2021, or gli for 2023+ channel names).")] = "auto",
    challenge: Annotated[str, typer.Option("--challenge", help="Or a 2023+ challenge: gli, gli-post, met, ...")] = "auto",
) -> None:
    """Make a run folder from a trained nnU-Net v2 model: its network and weights, its preprocessing as the
    data config. Then `predict --run OUT`, `evaluate --run OUT --data DIR` and fine-tuning with `train --run
    OUT` (which starts from the imported weights) work on it.

    Example: brats-swap import-nnunet nnUNet_results/Dataset137_BraTS2021/nnUNetTrainer__nnUNetPlans__3d_fullres --out runs/nnunet
    """
    from brats_swap.ship.nnunet_import import import_nnunet as run_import

    imported = run_import(results, out, checkpoint, edition=edition, challenge=challenge)
    model = imported.config.model
    outputs = (f"regions {', '.join(model.regions)}" if model.outputs == "regions"
               else "softmax over background + the table's labels")
    for note in imported.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(f"{imported.run.root}: imported fold(s) {', '.join(map(str, imported.folds))} as model.name="
                  f"{model.name} ({len(model.features)} stages, {outputs}), patch "
                  f"{'x'.join(map(str, imported.config.train.patch))}, cube {'x'.join(map(str, imported.config.data.cube))}",
                  highlight=False)
