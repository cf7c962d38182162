"""`brats-swap predict`: a thin shell over evaluate/predicting.py (a run folder's folds, or a bundle's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from brats_swap.cli.common import CheckpointOption, FoldsOption, RuntimeOption, SetOption, flag, handle_errors
from brats_swap.errors import ConfigError
from brats_swap.run.console import line_console, warn


@handle_errors
def predict(
    input_path: Annotated[Path, typer.Option("--input", "-i", help="A case folder or a dataset folder.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for <case id>.nii.gz.")],
    run: Annotated[Path | None, typer.Option("--run", help="Trained run folder.", show_default=False)] = None,
    model: Annotated[Path | None, typer.Option("--model", help="A bundle made by brats-swap export (instead of "
                                               "--run).", show_default=False)] = None,
    folds: FoldsOption = "all",
    checkpoint: CheckpointOption = "best",
    tta: Annotated[bool, flag("--tta/--no-tta", "Average the 8 mirrorings of each case (test-time augmentation; "
                                                "8x the inference time).")] = False,
    save_probabilities: Annotated[bool, flag("--save-probabilities/--no-save-probabilities", "Also write "
                                             "<case id>.npz: the probabilities on the original grid and their "
                                             "channel names.")] = False,
    postprocessing: Annotated[bool, flag("--postprocessing/--no-postprocessing", "Apply the run's "
                                         "postprocessing.json (tuned by cv) when there is one.")] = True,
    dataset_labels: Annotated[bool, flag("--dataset-labels/--table-labels", "Cases of an nnU-Net or Decathlon "
                                         "folder: write their dataset.json's own label values (as nnU-Net "
                                         "writes them) instead of the challenge's.")] = False,
    step_size: Annotated[float | None, typer.Option("--step-size", help="Sliding-window step as a fraction of the "
                                                   "patch (nnU-Net's -step_size; 0.5 = tiles overlap by half; "
                                                   "evaluate.sw_overlap = 1 - step).", show_default=False)] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda or cuda:N (default: the run's "
                                               "train.device).", show_default=False)] = None,
    gaussian: Annotated[bool | None, typer.Option("--gaussian/--no-gaussian", help="Weight tiles by the Gaussian "
                                                  "(default: the run's evaluate.sw_blend) or equally.",
                                                  show_default=False)] = None,
    tile_batch: Annotated[int | None, typer.Option("--tile-batch", min=1, help="Tiles per network call "
                                                   "(evaluate.sw_batch_size).", show_default=False)] = None,
    runtime: RuntimeOption = "torch",
    overrides: SetOption = None,
) -> None:
    """Segment new cases as the leaderboard expects: <case id>.nii.gz in the challenge's labels, on the
    original grid and affine; a fold ensemble (--folds all averages every fold), optional mirroring TTA and
    the cv-tuned postprocessing. A bad case is listed and skipped, the others are written, and the command
    exits 1 naming every failed case.

    Example: brats-swap predict --run runs/cv --input data/new_cases --out predictions/ --tta
    (or --model model.zip, a bundle of brats-swap export: the same segmentations without the run folder;
    --runtime onnxruntime runs its ONNX networks, exported with --onnx, without torch)
    """
    from brats_swap.evaluate.case_prediction import predict_with, with_evaluate_settings
    from brats_swap.evaluate.failures import CaseFailures

    if (run is None) == (model is None):
        raise ConfigError("predict: give either --run DIR (a trained run) or --model FILE (a bundle), one of them")
    if model is not None:
        from brats_swap.ship.bundle import open_bundle
        from brats_swap.ship.onnx_runtime import runtime_predictor

        if checkpoint != "best":
            raise ConfigError("predict --model: --checkpoint is chosen at export (brats-swap export --checkpoint)")
        predictor = runtime_predictor(open_bundle(model), runtime, folds, postprocess=postprocessing, device=device)
    elif runtime != "torch":
        raise ConfigError(f"predict --runtime {runtime}: runs a bundle's ONNX networks; give --model FILE (brats-swap "
                          "export --onnx)")
    else:
        from brats_swap.evaluate.predicting import run_predictor

        predictor = run_predictor(run, folds, checkpoint, postprocessing, device=device)
    predictor = with_evaluate_settings(predictor, evaluate_overrides(overrides, step_size, gaussian, tile_batch))
    if model is not None:  # someone else's file: one case priced before any case is read, as serve-challenge does
        from brats_swap.ship.inference_cost import check_case_cost

        check_case_cost(predictor, tta, str(model))
    failures = CaseFailures(say=warn)
    written = predict_with(predictor, input_path, out, tta=tta, probabilities=save_probabilities,
                           postprocess=postprocessing, failures=failures, dataset_labels=dataset_labels)
    line_console.print(f"wrote {len(written)} segmentation(s) to {out}")
    failures.raise_if_any(f"predict {input_path}", len(written) + len(failures))


def evaluate_overrides(overrides: list[str] | None, step_size: float | None, gaussian: bool | None,
                       tile_batch: int | None) -> list[str]:
    """--set items, then the evaluate.* keys the named options stand for (which win)."""
    items = list(overrides or [])
    if step_size is not None:
        if not 0 < step_size <= 1:
            raise ConfigError(f"--step-size {step_size}: must be in (0, 1] (a fraction of the patch)")
        items.append(f"evaluate.sw_overlap={round(1.0 - step_size, 10)}")
    if gaussian is not None:
        items.append(f"evaluate.sw_blend={'gaussian' if gaussian else 'constant'}")
    if tile_batch is not None:
        items.append(f"evaluate.sw_batch_size={tile_batch}")
    return items


def register(app: typer.Typer) -> None:
    """Add the command to the top-level app (called from cli/main.py)."""
    app.command("predict")(predict)
