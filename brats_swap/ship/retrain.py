"""`brats-swap train-challenge`: the training entry of a trainable challenge image (BraTS 2026 GoAT's organisers
retrain every submission on the complete dataset, on a card the participant never sees).

A thin composition of what exists: measure the card -> plan within the bundle's recipe -> shorten the schedule
to the time budget -> train the recipe's folds from scratch (`cv`'s sequential runner: fold locks, exact resume,
evaluation, the cv-tuned postprocessing) -> export the new bundle (`ship.bundle.export_bundle`).

- The recipe is the bundle's config: network, augmentation, schedule, loss, postprocessing rule, and its folds
  (the cross-validation folds it shipped, or the all-cases model). What the card decides is only what leaves
  the trained weights' recipe alone: the memory policy (swap and recompute are bitwise-neutral), the batch
  (lowered only when even the leanest policy cannot hold the recipe's) and, last, patches of the recipe's
  `train.patch` instead of whole volumes.
- The card: a CUDA device's memory (and its link, measured); `BRATS_SWAP_DEVICE_MEMORY` (GB) simulates another
  card's memory; without CUDA, training runs on the CPU within the host's available memory, slowly.
- `--time-budget 72h`: the schedule is shortened up front from the planner's predicted step time: fewer
  epochs (down to half the recipe's), then fewer folds, then fewer epochs again; each change is printed and
  recorded. After the first epoch of the first fold it is made again from the measured steps
  (`check_plan_with_first_epoch`); a change of epochs starts that fold again. Nothing is cut mid-way.
- The output and the data are apart: an output inside the data (or equal to it), or data inside the output, is
  refused before anything is written.
- The run folder is `<output>/run` and its cache `<output>/cache`: a restart of the same command reads the
  recorded plan back (the card is not measured again, so the config is the same) and resumes each fold
  exactly as `train --resume` does.
- Stops (`_SignalsOutsideTraining`; exit 130, the same command continues; SIGTERM's and SIGUSR1's line is
  `stopped: ...` (`PlannedStop`), Ctrl-C's `error: ...`): SIGTERM or SIGUSR1 (the organisers' runner, a
  scheduler) or Ctrl-C while a fold trains stops at the end of the running step with the checkpoint written
  (the training loop's own handling); SIGTERM or SIGUSR1 before training (the card measured) stops once that
  phase is done, and while the data is prepared at once (the cases prepared so far are kept); once every fold
  is trained, model.zip is
  finished first (a temporary file renamed onto it: the model already in the output stays whole until then)
  and the call ends as done (exit 0). Ctrl-C outside training stops at once (exit 130); every write is atomic.
- The plan is `<output>/run/training_plan.json` and goes into the bundle (`configs/training_plan.json`), with
  every fold's train.log and the run's figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from brats_swap import stop_signals
from brats_swap.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temp_files,
)
from brats_swap.config import Config, TrainConfig, config_from_saved, config_to_dict, config_to_yaml
from brats_swap.errors import ConfigError, DataError, PlannedStop, TrainingInterrupted
from brats_swap.memory.arena import available_host_bytes
from brats_swap.memory.planner import GIB
from brats_swap.progress import duration_text
from brats_swap.run.figures import pyplot, savefig_deterministic
from brats_swap.run.fold_selection import ALL_CASES
from brats_swap.run.folder import ALL_CASES_FOLD, RunFolder
from brats_swap.ship.bundle import Bundle, export_bundle
from brats_swap.stop_reasons import StopReason

DEVICE_MEMORY_VARIABLE = "BRATS_SWAP_DEVICE_MEMORY"
PLAN_FORMAT_VERSION = 1
RUN_FOLDER, CACHE_FOLDER, BUNDLE_FILE = "run", "cache", "model.zip"
# Epochs are shortened to this share of the recipe's before folds are dropped (then epochs again).
EPOCHS_KEPT_BEFORE_FOLDS = 0.5
# Of the time budget, this share is kept for preparing the data, evaluating the folds and exporting.
BUDGET_RESERVE = 0.05
FOLD_CURVES = "fold_curves.png"
_MEMORY = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?:g|gb|gib)?\s*$", re.IGNORECASE)


@dataclass
class Card:
    """The device training will run on: what kind, its memory, and where that number came from."""

    kind: str  # "cuda" or "cpu"
    name: str
    memory_bytes: int  # the card's memory, or the host's available memory on a CPU
    source: str  # "measured", "BRATS_SWAP_DEVICE_MEMORY", "host memory"
    bandwidth_gbs: float | None = None  # host<->device, slower direction (measured on CUDA)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def line(self) -> str:
        link = f", link {self.bandwidth_gbs:.1f} GB/s" if self.bandwidth_gbs else ""
        return f"card: {self.name} ({self.kind}), {self.memory_gib:.1f} GiB ({self.source}){link}"


def user_name_for_any_uid(environ: dict | None = None) -> str | None:
    """Set `USER` when this uid has no passwd entry (a container run with `--user 4242`) and no name variable is
    set: MONAI reads the user name at import (`getpass.getuser`) and fails without one. Returns the name set."""
    environ = os.environ if environ is None else environ
    if any(environ.get(variable) for variable in ("LOGNAME", "USER", "LNAME", "USERNAME")):
        return None
    import pwd

    try:
        pwd.getpwuid(os.getuid())
        return None
    except KeyError:
        environ["USER"] = f"uid{os.getuid()}"
        return environ["USER"]


def device_memory_override(environ: dict | None = None) -> int | None:
    """Bytes of `BRATS_SWAP_DEVICE_MEMORY` ("12", "12GB", "24 GiB": GB as `memory.budget_gib` counts them), None
    when unset; ConfigError for anything else."""
    text = (os.environ if environ is None else environ).get(DEVICE_MEMORY_VARIABLE)
    if text is None or not text.strip():
        return None
    match = _MEMORY.match(text)
    if match is None or float(match["number"]) <= 0:
        raise ConfigError(f"{DEVICE_MEMORY_VARIABLE}={text!r}: expected a positive memory size like 12 or 24GB")
    return int(float(match["number"]) * GIB)


def measure_card(device: str = "auto", environ: dict | None = None) -> Card:
    """The card of this machine (`device`: auto, cpu, cuda, cuda:N), its memory replaced by
    `BRATS_SWAP_DEVICE_MEMORY` when that is set."""
    override = device_memory_override(environ)
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: CUDA is not available on this machine")
        from brats_swap.memory.device_profile import measure_bandwidth

        target = torch.device(device if device != "auto" else "cuda")
        props = torch.cuda.get_device_properties(target)
        bandwidth = min(measure_bandwidth(target)) / 1e9
        memory, source = (override, DEVICE_MEMORY_VARIABLE) if override else (int(props.total_memory), "measured")
        return Card(str(target), props.name, memory, source, bandwidth)
    if device not in ("auto", "cpu"):
        raise ConfigError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if override:
        return Card("cpu", "CPU (simulated card)", override, DEVICE_MEMORY_VARIABLE)
    available = available_host_bytes()
    if available is None:
        raise DataError(f"this machine's available memory is unknown; set {DEVICE_MEMORY_VARIABLE}=<GB>")
    return Card("cpu", "CPU", available, "host memory")


@dataclass
class TrainingPlan:
    """What `train-challenge` chose, recorded in `training_plan.json` and the output bundle."""

    card: dict
    mode: str  # "full" or "patch"
    batch: int
    sample: list[int]
    memory: dict  # the concrete memory policy (memory.* keys)
    peak_gib: float
    step_s: float  # the planner's predicted step time
    folds: list[int]  # fold numbers, or [ALL_CASES_FOLD]
    epochs: int
    recipe: dict  # what the bundle's recipe asked for: mode, batch, folds, epochs
    projected_hours: float
    time_budget_hours: float | None
    changes: list[str] = field(default_factory=list)  # each departure from the recipe, said in one line
    format_version: int = PLAN_FORMAT_VERSION
    measured_step_s: float | None = None  # the first epoch's mean step time, once the plan was checked with it

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: dict, where: Path) -> TrainingPlan:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(record, dict) or record.get("format_version") != PLAN_FORMAT_VERSION or \
                not names - {"changes", "format_version", "measured_step_s"} <= set(record):
            raise DataError(f"{where}: not a training plan of this brats-swap; remove it to plan again")
        return cls(**{k: v for k, v in record.items() if k in names})

    def _measured(self) -> str:
        return "" if self.measured_step_s is None else f"; measured {self.measured_step_s:.3f} s/step"

    def fold_text(self) -> str:
        return "the all-cases model" if self.folds == [ALL_CASES_FOLD] else \
            f"fold(s) {', '.join(map(str, self.folds))}"

    def screen(self) -> list[str]:
        """The plan on one screen: the lines printed at the start."""
        budget = duration_text(self.time_budget_hours * 3600) if self.time_budget_hours is not None else "none"
        lines = [
            Card(**self.card).line(),
            f"training: {self.mode} {'x'.join(map(str, self.sample))}, batch {self.batch}, "
            f"memory.mode {self.memory['mode']} (predicted peak {self.peak_gib:.2f} GiB, "
            f"{self.step_s:.3f} s/step{self._measured()})",
            f"schedule: {self.fold_text()}, {self.epochs} epoch(s) each; projected "
            f"{duration_text(self.projected_hours * 3600)}, time budget {budget}",
            f"recipe: {self.recipe['mode']}, batch {self.recipe['batch']}, {self.recipe['epochs']} epoch(s), "
            f"{len(self.recipe['folds'])} fold(s)",
        ]
        return lines + [f"changed: {change}" for change in self.changes]


def recipe_folds(bundle: Bundle) -> list[int]:
    """The folds the bundle's recipe trains: its own fold numbers (the all-cases model is [ALL_CASES_FOLD])."""
    return sorted(bundle.folds)


def _sample(config: Config) -> list[int]:
    return list(config.train.patch if config.train.mode == "patch" else config.data.cube)


def _fit(config: Config, card: Card, time_model: str):
    """The planner's report for `config` on `card` (fastest policy under the card's memory)."""
    from brats_swap.train.planning import plan_for_config

    memory = dataclasses.replace(config.memory, mode="auto", budget_gib=card.memory_gib)
    if card.bandwidth_gbs and memory.bandwidth_gbs is None:
        memory.bandwidth_gbs = card.bandwidth_gbs
    planned = dataclasses.replace(config, memory=memory)
    # Priced compiled only where the run will compile: a simulated card's run trains on this machine's CPU.
    report, _ = plan_for_config(planned, budget_gib=card.memory_gib, device=time_model, run_device=card.kind)
    return report


def _layouts(config: Config):
    """The recipe's batch first, then halved down to 1; then, for a whole-volume recipe, its `train.patch`."""
    batch = config.train.batch_size
    while batch >= 1:
        yield dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=batch))
        batch //= 2
    if config.train.mode == "full":
        patch = dataclasses.replace(config.train, mode="patch")
        batch = config.train.batch_size
        while batch >= 1:
            yield dataclasses.replace(config, train=dataclasses.replace(patch, batch_size=batch))
            batch //= 2


def _epoch_seconds(train: TrainConfig, train_cases: int, val_cases: int, step_s: float,
                   val_s: float | None = None) -> float:
    """One epoch's time at `step_s` per step: its steps, and its share of a validation every `val_every` epochs
    (`val_s` measured, else a forward pass per case, about a third of a training step)."""
    steps = train.steps_per_epoch or math.ceil(train_cases / train.batch_size)
    if val_s is None:
        val_s = val_cases * step_s / (3 * train.batch_size)
    return steps * step_s + val_s / max(train.val_every, 1)


def shorten_schedule(epochs: int, folds: list[int], epoch_s: float, time_budget_s: float | None
                     ) -> tuple[int, list[int], list[str]]:
    """(epochs, folds, what changed) that fit `time_budget_s` at `epoch_s` per epoch (module docstring: epochs
    down to half, then folds, then epochs again)."""
    changes: list[str] = []
    kept = list(folds)

    def projected(n_epochs: int, n_folds: int) -> float:
        return n_epochs * n_folds * epoch_s

    if time_budget_s is None:
        return epochs, kept, changes
    usable = time_budget_s * (1 - BUDGET_RESERVE)
    if projected(epochs, len(kept)) > usable:
        floor = max(1, math.ceil(epochs * EPOCHS_KEPT_BEFORE_FOLDS))
        fitting = max(floor, int(usable // (len(kept) * epoch_s)))
        if fitting < epochs:
            changes.append(f"epochs {epochs} -> {fitting}: {len(kept)} fold(s) of {epochs} epochs project to "
                           f"{duration_text(projected(epochs, len(kept)))}, over the time budget")
            epochs = fitting
        if projected(epochs, len(kept)) > usable and len(kept) > 1:
            n_folds = max(1, int(usable // (epochs * epoch_s)))
            changes.append(f"folds {len(kept)} -> {n_folds} ({', '.join(map(str, kept[:n_folds]))}): "
                           f"{epochs} epochs of {len(kept)} folds still project past the time budget")
            kept = kept[:n_folds]
        if projected(epochs, len(kept)) > usable:
            fitting = max(1, int(usable // (len(kept) * epoch_s)))
            if fitting < epochs:
                changes.append(f"epochs {epochs} -> {fitting}: one fold of {epochs} epochs projects past "
                               "the time budget")
                epochs = fitting
    return epochs, kept, changes


def plan_training(config: Config, card: Card, folds: list[int], train_cases: int, val_cases: int,
                  time_budget_s: float | None = None) -> TrainingPlan:
    """The plan for `config` (the bundle's recipe) on `card` within `time_budget_s` (module docstring).

    `train_cases` / `val_cases`: cases of one fold (the all-cases model: every case, and as many "validated").
    ConfigError when even one sample of the recipe's patch does not fit the card."""
    time_model = "cuda" if card.kind == "cuda" else ("gpu" if card.source == DEVICE_MEMORY_VARIABLE else "cpu")
    changes: list[str] = []
    chosen = report = None
    for layout in _layouts(config):
        report = _fit(layout, card, time_model)
        if report.chosen is not None:
            chosen = layout
            break
    if chosen is None:
        raise ConfigError(f"the {card.memory_gib:.1f} GiB card cannot train this recipe even with batch 1 "
                          f"{'patches' if config.train.mode == 'full' else ''}: {report.reason}")
    if chosen.train.batch_size != config.train.batch_size:
        changes.append(f"batch {config.train.batch_size} -> {chosen.train.batch_size}: the recipe's batch does "
                       f"not fit {card.memory_gib:.1f} GiB with any memory policy")
    if chosen.train.mode != config.train.mode:
        changes.append(f"whole volumes -> patches of {'x'.join(map(str, chosen.train.patch))}: a whole "
                       f"volume does not fit {card.memory_gib:.1f} GiB with any memory policy")
    step_s = float(report.chosen.step_s)
    batch = chosen.train.batch_size
    epoch_s = _epoch_seconds(chosen.train, train_cases, val_cases, step_s)
    epochs, kept, shortened = shorten_schedule(chosen.train.max_epochs, list(folds), epoch_s, time_budget_s)
    changes += shortened
    return TrainingPlan(
        card=dataclasses.asdict(card), mode=chosen.train.mode, batch=batch, sample=_sample(chosen),
        memory=dataclasses.asdict(report.chosen.policy), peak_gib=report.chosen.peak_bytes / GIB, step_s=step_s,
        folds=kept, epochs=epochs,
        recipe={"mode": config.train.mode, "batch": config.train.batch_size, "folds": list(folds),
                "epochs": config.train.max_epochs},
        projected_hours=epochs * len(kept) * epoch_s / 3600,
        time_budget_hours=time_budget_s / 3600 if time_budget_s is not None else None, changes=changes)


def planned_config(recipe: Config, plan: TrainingPlan) -> Config:
    """The recipe with what the plan chose: batch, mode, memory policy, epochs and the card's device."""
    from brats_swap.config import MemoryConfig
    from brats_swap.config.loader import from_dict

    train = dataclasses.replace(recipe.train, batch_size=plan.batch, mode=plan.mode, max_epochs=plan.epochs,
                                device=plan.card["kind"], init_from=None)
    return dataclasses.replace(recipe, train=train, memory=from_dict(MemoryConfig, plan.memory, "memory"))


def recipe_config(bundle: Bundle, data: Path, output: Path) -> Config:
    """The bundle's config pointed at `data`, its cache under `output`."""
    config = bundle.config()
    raw = config_to_dict(config)
    raw["data"].update(root=str(data), cache=str(Path(output) / CACHE_FOLDER))
    return config_from_saved(raw)


@dataclass
class RetrainReport:
    plan: TrainingPlan
    run: Path
    bundle: Path | None  # None when a stop (SIGTERM) ended the call first
    resumed: bool


def _fold_counts(config: Config, run: RunFolder, folds: list[int]) -> tuple[int, int]:
    from brats_swap.splits import fold_cases, load_run_splits

    train, val = fold_cases(load_run_splits(config, run), folds[0])
    return len(train), len(val)


class _SignalsOutsideTraining:
    """SIGTERM and SIGUSR1 while no fold trains: noted (one line on stderr, saying what happens next), and acted on
    by `retrain` where its phase ends. While `run_sequential` runs, its own handlers (and the training loop's,
    at a step) take them instead; those of this object come back after it."""

    def __init__(self) -> None:
        self.reason: StopReason | None = None
        self.then = "stopping before training, once the data is prepared; the same command continues"
        self.stopping_now: str | None = None  # while set: the message of the stop raised at once

    def __call__(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.reason is None:
            self.reason = StopReason.from_signal(signum)
            if self.stopping_now is None:
                stop_signals.say(f"{self.reason}: {self.then}")
        if self.stopping_now is not None:
            raise PlannedStop(f"{self.reason} {self.stopping_now}")

    @contextlib.contextmanager
    def stop_at_once(self, message: str):
        """In the block, a signal stops the call at once (PlannedStop "<signal> <message>", exit 130):
        preparing the data may wait on reading many cases, every write of it is atomic, and the next call
        prepares what is missing. A failure the signal caused (a pool whose workers it ended) is that stop too."""
        self.stopping_now = message
        try:
            yield
        except Exception:
            if self.reason is not None:
                raise PlannedStop(f"{self.reason} {message}") from None
            raise
        finally:
            self.stopping_now = None


def retrain(bundle: Bundle, data: Path, output: Path, *, time_budget_s: float | None = None, device: str = "auto",
            say: Callable[[str], None] = print, console=None) -> RetrainReport:
    """Train `bundle`'s recipe from scratch on `data` into `output` and export `output/model.zip` (module
    docstring); a second call with the same arguments continues where the first stopped.

    TrainingInterrupted (exit 130) when a signal stopped it first (module docstring, "Stops")."""
    signals = _SignalsOutsideTraining()
    with stop_signals.handled(stop_signals.SCHEDULER_SIGNALS, signals):
        return _retrain(bundle, Path(data), Path(output), signals, time_budget_s=time_budget_s, device=device,
                        say=say, console=console)


def _retrain(bundle: Bundle, data: Path, output: Path, signals: _SignalsOutsideTraining, *,
             time_budget_s: float | None, device: str, say: Callable[[str], None], console) -> RetrainReport:
    from brats_swap.cv.lock import shared_files
    from brats_swap.cv.runner import run_sequential
    from brats_swap.train.data import prepare_run_data

    if not data.is_dir():
        raise DataError(f"{data}: training data folder not found")
    _check_apart(data, output)
    output.mkdir(parents=True, exist_ok=True)
    if not os.access(output, os.W_OK | os.X_OK):
        raise DataError(f"{output}: output folder is not writable by uid {os.getuid()}")
    remove_stale_temp_files(output)  # a model.zip whose writer was killed (SIGKILL) before its rename
    run = RunFolder(output / RUN_FOLDER)
    run.root.mkdir(exist_ok=True)
    recipe = recipe_config(bundle, data, output)
    folds = recipe_folds(bundle)
    resumed = run.training_plan.is_file()
    if resumed:
        plan = TrainingPlan.from_dict(_read_json(run.training_plan), run.training_plan)
        say(f"{run.training_plan}: continuing with the recorded plan (the card is not measured again)")
    else:
        card = measure_card(device)  # its line is the plan's first (`TrainingPlan.screen`)
        with shared_files(run.root), signals.stop_at_once(
                f"while the data was prepared ({output}/{CACHE_FOLDER} keeps the cases done); run the same command "
                "again to continue"):
            prepare_run_data(recipe.data, progress=console is not None)
        train_cases, val_cases = _fold_counts(recipe, run, folds)
        plan = plan_training(recipe, card, folds, train_cases, val_cases, time_budget_s)
        atomic_write_json(run.training_plan, plan.as_dict())
    for line in plan.screen():
        say(line)
    if signals.reason is not None:  # the end of the phase before training: the plan and the data are kept
        raise PlannedStop(f"{output}: {signals.reason} before training started (the data is prepared, the plan "
                          "recorded); run the same command again to continue")
    # run_sequential's handlers take the signals once it holds the run's lock (at once: nothing else runs in
    # the output folder); one in the moment before is noted by `signals` only, and the folds train on.
    try:
        if plan.time_budget_hours is not None and plan.measured_step_s is None:
            plan = check_plan_with_first_epoch(plan, recipe, run, say, console)
        selection = ALL_CASES if plan.folds == [ALL_CASES_FOLD] else ",".join(map(str, plan.folds))
        outcome = run_sequential(planned_config(recipe, plan), run.root, selection, console=console)
    except PlannedStop:
        raise
    except TrainingInterrupted:  # Ctrl-C in a step: the loop saved it; say where and how to continue
        raise TrainingInterrupted(f"{output}: Ctrl-C during training, the state saved at the end of the step "
                                  f"(see {RUN_FOLDER}/fold_*/train.log); run the same command again to "
                                  "continue") from None
    if not outcome.complete:
        raise PlannedStop(f"{output}: {outcome.describe()}; run the same command again to continue")
    signals.then = f"every fold is trained; finishing {BUNDLE_FILE} first, then done"
    fold_curves(run, plan.folds)
    if not run.postprocessing.is_file() and bundle.postprocessing() is not None:
        from brats_swap.ship.bundle import POSTPROCESSING

        atomic_write_bytes(run.postprocessing, bundle.members[POSTPROCESSING])  # a rerun trusts a file there
        say(f"{run.postprocessing}: the bundle's postprocessing rule (not tuned again: "
            f"{'no fold validates' if plan.folds == [ALL_CASES_FOLD] else 'not every fold was trained'})")
    checkpoint = "latest" if plan.folds == [ALL_CASES_FOLD] else bundle.checkpoint
    exported = export_bundle(run, output / BUNDLE_FILE, selection, checkpoint)
    say(f"wrote {exported.path}: {plan.fold_text()} ({checkpoint} checkpoint), the plan, logs and figures")
    return RetrainReport(plan, run.root, exported.path, resumed)


def check_plan_with_first_epoch(plan: TrainingPlan, recipe: Config, run: RunFolder, say: Callable[[str], None],
                                console=None) -> TrainingPlan:
    """The time budget's schedule made again from the first epoch of the first fold, measured: the planner's
    step time can be far off (a CPU, another card), and nothing else would notice before the budget is gone.

    The epoch trains as part of the fold (a stop during it is a stop of the fold, continued by the next call).
    When the measured schedule keeps the plan's epochs, the fold goes on; when it changes them, the fold
    starts again from scratch with the new number (the learning-rate schedule follows it), so the weights are
    those of a run planned that way from the start. The new plan is recorded and said."""
    from brats_swap.cv.lock import fold_work
    from brats_swap.train.loop import train_fold

    fold = plan.folds[0]
    folder = run.fold(fold)
    resumed = folder.latest.is_file()
    polls = []

    def after_the_first_epoch() -> bool:  # polled at each epoch's start; a resumed call is past the first
        polls.append(None)
        return resumed or len(polls) > 1

    with fold_work(run.root, [fold]):
        result = train_fold(planned_config(recipe, plan), run.root, fold, resume=resumed,
                            stop_requested=after_the_first_epoch, progress=console is not None)
    if result.stop_reason is not None:
        raise PlannedStop(f"{run.root.parent}: {result.stop_reason} during the first epoch (the state saved); run "
                          "the same command again to continue")
    first = result.history[0]
    if len(result.history) > 1:  # trained past its first epoch before (a plan recorded without this check)
        kept = dataclasses.replace(plan, measured_step_s=float(first["step_s"]))
        atomic_write_json(run.training_plan, kept.as_dict())
        say(f"{folder.root}: past its first epoch already; the recorded plan is kept")
        return kept
    train_cases, val_cases = _fold_counts(recipe, run, plan.folds)
    epoch_s = _epoch_seconds(planned_config(recipe, plan).train, train_cases, val_cases, first["step_s"],
                             first.get("val_seconds"))
    epochs, folds, shortened = shorten_schedule(plan.recipe["epochs"], list(plan.recipe["folds"]), epoch_s,
                                                plan.time_budget_hours * 3600)
    checked = (f"checked after the first epoch: {first['step_s']:.3f} s/step measured (the planner predicted "
               f"{plan.step_s:.3f}), one epoch about {duration_text(epoch_s)}")
    if epochs == plan.epochs and folds == plan.folds:
        say(f"{checked}; the plan holds")
    else:
        say(f"{checked}; re-planned: {epochs} epoch(s) of {len(folds)} fold(s) instead of {plan.epochs} of "
            f"{len(plan.folds)}" + ("; the fold starts again with that schedule" if epochs != plan.epochs else ""))
    replanned = dataclasses.replace(
        plan, epochs=epochs, folds=folds, measured_step_s=float(first["step_s"]),
        projected_hours=epochs * len(folds) * epoch_s / 3600,
        changes=[c for c in plan.changes if not c.startswith(("epochs ", "folds "))] + [checked] + shortened)
    if epochs != plan.epochs:  # first the fold goes (a restart in between measures again), then the plan is kept
        import shutil

        shutil.rmtree(folder.root)  # our own run folder's fold, trained one epoch of the old schedule
        atomic_write_text(run.config, config_to_yaml(planned_config(recipe, replanned)))
    atomic_write_json(run.training_plan, replanned.as_dict())
    for line in replanned.screen()[1:]:
        say(line)
    return replanned


def _check_apart(data: Path, output: Path) -> None:
    """ConfigError unless the output and the data are apart: the run, cache and model.zip written inside the data
    would be read as data (and the data is read only), the data inside the output would be the run's to replace."""
    real_data, real_output = data.resolve(), output.resolve()
    if real_output == real_data or real_data in real_output.parents:
        raise ConfigError(f"{output}: the output folder is inside the data folder {data}, which is never written to; "
                          "give an output folder outside it")
    if real_output in real_data.parents:
        raise ConfigError(f"{data}: the data folder is inside the output folder {output}; give an output folder "
                          "that does not hold the data")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable ({exc.__class__.__name__}); remove it to plan again") from None


def fold_curves(run: RunFolder, folds: list[int]) -> Path | None:
    """`figures/fold_curves.png`: training loss and validation Dice per epoch of each fold (None: no history)."""
    from brats_swap.cv.fold_progress import read_fold_state

    histories = {k: read_fold_state(run.root, k).history for k in folds}
    if not any(histories.values()):
        return None
    plt = pyplot()
    fig, (loss_ax, dice_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    for k, history in histories.items():
        label = "all cases" if k == ALL_CASES_FOLD else f"fold {k}"
        epochs = [record["epoch"] for record in history]
        loss_ax.plot(epochs, [record["train_loss"] for record in history], label=label)
        scored = [(record["epoch"], record["val_dice_mean"]) for record in history if "val_dice_mean" in record]
        if scored:
            dice_ax.plot(*zip(*scored, strict=True), marker="o", label=label)
    loss_ax.set(xlabel="epoch", ylabel="training loss")
    dice_ax.set(xlabel="epoch", ylabel="mean validation Dice")
    loss_ax.legend(fontsize=8)
    fig.tight_layout()
    path = run.figure(FOLD_CURVES)
    path.parent.mkdir(parents=True, exist_ok=True)
    savefig_deterministic(fig, path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["Card", "TrainingPlan", "measure_card", "plan_training", "planned_config", "retrain"]
