"""`brats-swap export`, `container`, `serve-challenge`, `train-challenge` and `check-submission`: thin shells over
brats_swap/ship/.

Exit codes: 0 ok; 1 bad input (a damaged bundle, a failed case, a submission problem); 2 usage/config;
130 train-challenge stopped (SIGTERM) with the checkpoint written: the same command continues.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from brats_swap.cli.common import FoldsOption, RuntimeOption, flag, handle_errors
from brats_swap.errors import ConfigError, DataError
from brats_swap.run.console import line_console, warn

TaskOption = Annotated[str | None, typer.Option("--task", help="The challenge task, i.e. its label table: gli, "
                                                "gli-post, met, men, men-rt, ped, ssa, goat (default: the "
                                                "bundle's; gli for a bundle trained on a 2017-2021 table).", show_default=False)]


def _say(line: str) -> None:
    line_console.print(line)


@handle_errors
def export(
    run: Annotated[Path, typer.Option("--run", help="Trained run folder.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The bundle to write, e.g. model.zip.")],
    folds: FoldsOption = "all",
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="best or latest.")] = "best",
    onnx: Annotated[bool, flag("--onnx/--no-onnx", "Also write each fold's network as ONNX (opset 18), checked "
                               "against torch, for predict --runtime onnxruntime (needs brats-swap[onnx]).")] = False,
) -> None:
    """Write a self-contained bundle of a run: each fold's weights (state dicts), the resolved config, the
    label table and modalities, postprocessing.json, the cv summary and metadata.json with versions and the
    sha256 of every file. Optimizer state and splits stay in the run.

    Example: brats-swap export --run runs/cv --out model.zip --onnx
    """
    from brats_swap.ship.bundle import export_bundle

    if onnx:
        _require_onnx()
    exported = export_bundle(run, out, folds, checkpoint, onnx=onnx)
    _say(f"wrote {exported.path} ({exported.size_bytes / 2**20:.1f} MiB): fold(s) "
         f"{', '.join(map(str, exported.folds))} ({checkpoint} checkpoint), {exported.challenge} table, "
         f"{len(exported.files)} files with their sha256{', ONNX networks checked against torch' if onnx else ''}")
    for note in exported.notes:
        warn(note)


def _require_onnx() -> None:
    """ConfigError (one line) when onnx or onnxruntime is not installed."""
    import importlib.util

    missing = [name for name in ("onnx", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} not installed: pip install 'brats-swap[onnx]' (or make install)")


@handle_errors
def container(
    model: Annotated[Path, typer.Option("--model", help="A bundle made by brats-swap export.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="A new folder for the image's build files.")],
    task: TaskOption = None,
    image: Annotated[str | None, typer.Option("--image", help="Image name:tag (default brats-swap-<task>:latest).",
                                              show_default=False)] = None,
    time_budget: Annotated[str, typer.Option("--time-budget", help="The entrypoint's budget for the whole "
                                             "test set.")] = "8h",
    trainable: Annotated[bool, flag("--trainable/--inference-only", "Also give the image a `train` entry that "
                                    "retrains the bundle's recipe on /data into /output/model.zip (BraTS "
                                    "GoAT: the organisers retrain every submission).")] = False,
    runtime: RuntimeOption = "torch",
    weights_record: Annotated[str | None, typer.Option("--weights-record", help="The bundle's Zenodo record: the "
                                                       "BrainLesion entry lists it as additional_files, which the "
                                                       "orchestrator mounts and passes as --weights.",
                                                       show_default=False)] = None,
) -> None:
    """Write a BraTS challenge image's build folder: Dockerfile, .dockerignore, entrypoint.sh, the bundle,
    pinned requirements, brats-swap's source and a README with the build, run and save commands; print the
    entry for the BrainLesion brats package.

    Example: brats-swap container --model model.zip --out image/ --task met
    """
    import yaml

    from brats_swap.ship.bundle import open_bundle
    from brats_swap.ship.container import write_container

    written = write_container(open_bundle(model), out, task, image, time_budget, trainable=trainable, runtime=runtime,
                              weights_record=weights_record)
    for note in (written.task_note, written.wheel_note):
        if note is not None:
            _say(note)
    _say(f"wrote {written.folder}: Dockerfile, .dockerignore, entrypoint.sh, README.md (task {written.task}); "
         f"build with: docker build -t {written.image} {written.folder}")
    _say("entry for the BrainLesion brats package (also in brainlesion.yml; add authors, paper, rank to meta):")
    _say(yaml.safe_dump(written.entry, sort_keys=False).rstrip())


@handle_errors
def serve_challenge(
    model: Annotated[Path, typer.Option("--model", help="A bundle made by brats-swap export.")],
    mlcube_task: Annotated[str | None, typer.Argument(help="MLCube's task name, `infer` (the 2023-2024 form); "
                                                      "optional.", show_default=False)] = None,
    input_dir: Annotated[Path, typer.Option("--input", "--data_path", "--data-path", help="One folder per case "
                                            "(read only).")] = Path("/input"),
    output_dir: Annotated[Path, typer.Option("--output", "--output_path", "--output-path", help="Flat output "
                                             "folder: <case id>.nii.gz.")] = Path("/output"),
    parameters_file: Annotated[Path | None, typer.Option("--parameters_file", "--parameters-file", help="MLCube's "
                                                         "parameters file: accepted and not read (the bundle "
                                                         "holds every setting).", show_default=False)] = None,
    task: TaskOption = None,
    folds: FoldsOption = "all",
    tta: Annotated[bool, flag("--tta/--no-tta", "Average the 8 mirrorings (dropped first when over the "
                                                "time budget).")] = True,
    time_budget: Annotated[str | None, typer.Option("--time-budget", help="The whole test set's time, e.g. 8h: "
                                                    "when the cases so far project past it, drop TTA, then "
                                                    "folds.", show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu, cuda, cuda:N.")] = "auto",
    runtime: RuntimeOption = "torch",
    weights: Annotated[Path | None, typer.Option("--weights", help="A bundle (or a folder holding model.zip) "
                                                 "served instead of --model: the BrainLesion orchestrator's "
                                                 "weights mount.", show_default=False)] = None,
) -> None:
    """The BraTS challenge entrypoint (the image's; works without a container too): segment every case
    folder of --input into a flat --output/<case id>.nii.gz, case by case, under any uid and with an
    unwritable HOME. Exits 1 naming the cases that failed, after writing the others.

    Example: brats-swap serve-challenge --model model.zip --input in/ --output out/ --time-budget 8h
    """
    from brats_swap.ship.time_budget import parse_duration
    from brats_swap.ship.writable_folders import writable_home

    for variable, (folder, why) in writable_home().items():  # before matplotlib could read them
        _say(f"{variable}: {why}, using {folder}")
    if mlcube_task not in (None, "infer"):
        raise ConfigError(f"serve-challenge: unknown task {mlcube_task!r}; the only MLCube task is infer")
    if parameters_file is not None:
        _say(f"--parameters_file {parameters_file}: not read, the bundle holds every setting")
    budget = parse_duration(time_budget) if time_budget is not None else None
    from brats_swap.ship.bundle import open_bundle
    from brats_swap.ship.container import resolve_task
    from brats_swap.ship.onnx_runtime import runtime_predictor
    from brats_swap.ship.serve import serve, serving_compile

    if weights is not None:
        model = weights / "model.zip" if weights.is_dir() else weights
        _say(f"--weights: serving {model}")
    bundle = open_bundle(model)
    task, task_note = resolve_task(bundle, task)
    if task_note is not None:
        _say(task_note)
    predictor = runtime_predictor(bundle, runtime, folds, device=device, challenge=task,
                                  evaluate_compile=serving_compile(bundle.config().evaluate.compile))
    report = serve(predictor, input_dir, output_dir, tta=tta, time_budget_s=budget, say=_say)
    _say(f"wrote {len(report.written)} of {report.cases} segmentation(s) to {output_dir}")
    report.failures.raise_if_any(f"serve-challenge {input_dir}", report.cases)


@handle_errors
def train_challenge(
    model: Annotated[Path, typer.Option("--model", help="The bundle whose recipe is trained (its weights are "
                                        "not used).")],
    data: Annotated[Path, typer.Option("--data", help="The training cases (BraTS-format folder, nnU-Net raw or "
                                       "Decathlon; read only).")] = Path("/data"),
    output: Annotated[Path, typer.Option("--output", help="Run folder, cache and the new bundle model.zip.")]
    = Path("/output"),
    time_budget: Annotated[str | None, typer.Option("--time-budget", help="The whole training's time, e.g. 72h: "
                                                    "the schedule is shortened up front (epochs, then folds) and made again "
                                                    "from the measured first epoch.",
                                                    show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when available), cpu, cuda, cuda:N.")] = "auto",
) -> None:
    """The trainable image's `train` entry (works without a container too): measure the card, plan memory
    policy, batch and patch-or-whole within the bundle's recipe, print and record the plan, train the
    recipe's folds from scratch on --data and write --output/model.zip (with the plan, logs and figures).
    Run again after a stop or a restart: it continues where it stopped, exactly.
    BRATS_SWAP_DEVICE_MEMORY=<GB> plans for another card's memory.

    Example: brats-swap train-challenge --model model.zip --data data/GoAT --output out/ --time-budget 72h
    """
    from brats_swap.ship.time_budget import parse_duration
    from brats_swap.ship.writable_folders import writable_home

    for variable, (folder, why) in writable_home().items():  # before matplotlib could read them
        _say(f"{variable}: {why}, using {folder}")
    budget = parse_duration(time_budget) if time_budget is not None else None
    from brats_swap.ship.bundle import open_bundle
    from brats_swap.ship.retrain import retrain, user_name_for_any_uid

    if (name := user_name_for_any_uid()) is not None:
        _say(f"USER: uid {name[3:]} has no user name, using {name}")

    retrain(open_bundle(model), data, output, time_budget_s=budget, device=device, say=_say)


@handle_errors
def check_submission(
    output_dir: Annotated[Path, typer.Argument(help="The output folder to check.")],
    input_dir: Annotated[Path, typer.Option("--input", help="The input folder (one folder per case).")],
    task: Annotated[str | None, typer.Option("--task", help="Force the label table (default: each case's own, "
                                             "from its id).", show_default=False)] = None,
) -> None:
    """The organisers' checks of an output folder: flat, one <case id>.nii.gz per input case, the name rule
    (\\d{5}-\\d{3})\\.nii\\.gz$, every case present, the grid of the case's images, labels of the task's table;
    warns on an all-zero segmentation. One line per problem; exit 1 if any.

    Example: brats-swap check-submission out/ --input in/ --task met
    """
    from brats_swap.data.challenges import MODERN_CHALLENGES
    from brats_swap.ship.submission import check_submission as check

    if task is not None and task not in MODERN_CHALLENGES:
        raise ConfigError(f"--task {task!r}: expected one of {', '.join(MODERN_CHALLENGES)}")
    report = check(output_dir, input_dir, task)
    for line in report.warnings:
        warn(line)
    for line in report.problems:
        line_console.print(f"problem: {line}")
    if report.problems:
        unnamed = (f" ({len(report.unnamed)} could not be named: {', '.join(report.unnamed[:3])}"
                   f"{', ...' if len(report.unnamed) > 3 else ''})" if report.unnamed else "")
        raise DataError(f"{output_dir}: {len(report.problems)} problem(s) for {report.cases} input case(s)"
                        f"{unnamed}; fix them before submitting")
    _say(f"{output_dir}: ok, {report.checked} segmentation(s) for {report.cases} input case(s)")


def register(app: typer.Typer) -> None:
    """Add the five commands to the top-level app (called from cli/main.py)."""
    app.command("export")(export)
    app.command("container")(container)
    app.command("serve-challenge")(serve_challenge)
    app.command("train-challenge")(train_challenge)
    app.command("check-submission")(check_submission)
