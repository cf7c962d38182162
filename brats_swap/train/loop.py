"""The training recipe: one explicit loop that trains one fold of a run (torchtune style, no framework).

`train_fold(config, run, fold)` sets up a `FoldRecipe` and runs `FoldRecipe.fit`, readable top to bottom:

    setup                        run folder, splits, model, memory engine, optimiser, data, logs
                                 (and `restore` of the checkpoint's state when resuming)
    while epochs are left:
        train_epoch              memory engine wraps forward + loss, backward outside, AMP optional
        validate (when due)      val loss and Dice per region (WT/TC/ET, + RC/CC/GTV where the challenge
                                 has them) on whole cubes (sliding window for patch models); reduce LR
                                 on plateau, early stopping, best mean val Dice
        end_epoch                log (train.log, TensorBoard), checkpoint_best.pt, checkpoint_latest.pt
    finish                       the TrainResult

The paper's recipe is the default, as Ellis's Keras `unet3d` training script (which the IBM fork ran)
sets it: weighted Dice loss, Adam (lr 5e-4, eps 1e-7), ReduceLROnPlateau(factor 0.5, patience 10) on the
validation loss, early stopping after 50 epochs without validation-loss improvement, at most 500 epochs,
batch size 1, the 48 cube symmetries as the only augmentation.

Every path comes from the run folder (`brats_swap.run.folder`): `config.yaml`, `env.json`, `splits.json`
and per fold `fold_<k>/` with `train.log`, `tb/`, the three checkpoints and `memory_plan.json` (mode auto).

Validation runs every `train.val_every` epochs (and after the last): the plateau scheduler counts
validations (epochs in the paper's setting, `val_every: 1`), early stopping counts epochs since the best
validation loss.

Resume is exact: the data stream is a pure function of (seed, epoch, position) (see `train/data.py`),
and checkpoints hold the model, optimiser, scheduler, scaler, every RNG state and the `LoopState` (the
position inside the epoch included), so the loss of the next step after `--resume` equals the
uninterrupted run's. Ctrl-C finishes the running step, saves `checkpoint_latest.pt` and raises
`TrainingInterrupted` (exit 130). SIGTERM and SIGUSR1 (a scheduler's warning before a time limit or a
preemption) finish the running step, save the mid-epoch checkpoint and return an interrupted result
(`stop_reason` names the signal); distributed, the ranks agree on the step (see `StopSignals`). A NaN/Inf
loss raises `NumericalError` before the optimiser step, so the checkpoints on disk stay the last good ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import TextColumn

from brats_swap import stop_signals
from brats_swap.atomic import atomic_write_json, atomic_write_text, remove_stale_temp_files
from brats_swap.config import (
    Config,
    MemoryConfig,
    config_from_saved,
    config_to_dict,
    config_to_yaml,
    diff_configs,
)
from brats_swap.config.networks import architecture_record
from brats_swap.distributed import (
    DistContext,
    all_reduce_max,
    all_reduce_mean,
    broadcast_object,
    gather_objects,
    init_distributed,
    run_on_main,
    wrap_ddp,
)
from brats_swap.errors import BratsSwapError, ConfigError, NumericalError, TrainingInterrupted, user_message
from brats_swap.memory import MemoryEngine, cuda_device
from brats_swap.model import build_model
from brats_swap.model.targets import labels_from_probs, run_output_count, run_regions, targets_from_labels
from brats_swap.model.upkern import initial_weights
from brats_swap.progress import CountedProgress, ProgressLines, progress_bar
from brats_swap.run.checkpoint import (
    capture_rng_states,
    load_checkpoint,
    load_latest,
    restore_rng_states,
    save_checkpoint,
)
from brats_swap.run.compiling import StepCompilation
from brats_swap.run.console import console, warn
from brats_swap.run.device import (
    amp_dtype,
    amp_on_device,
    autocast_context,
    peak_memory_bytes,
    seed_everything,
    torch_settings,
)
from brats_swap.run.dice import dice_column, region_dice
from brats_swap.run.environment import environment_record
from brats_swap.run.folder import FoldFolder, RunFolder
from brats_swap.run.inference import predict_cube
from brats_swap.splits import fold_cases, labelled_case_ids, load_run_splits
from brats_swap.stop_reasons import StopReason
from brats_swap.train.data import LoaderBatch, TrainData, build_train_data, run_table
from brats_swap.train.losses import SegmentationLoss, training_loss, weighted_dice_loss
from brats_swap.train.optim import (
    Scheduler,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    step_after_epoch,
    step_after_validation,
)
from brats_swap.train.planning import (
    out_of_memory_error,
    plan_memory,
    prediction_out_of_memory_error,
    swap_arena_bytes,
    training_input_shape,
)
from brats_swap.train.report import TrainLog


@dataclass
class TrainResult:
    """What `train_fold` did. `epochs_completed`, `best_*` and `finished` describe the whole fold;
    `train_seconds` and `epoch_seconds` only the epochs trained by this call (the cv runner sums them)."""

    fold: int
    epochs_completed: int = 0
    best_epoch: int | None = None  # 1-based epoch of checkpoint_best.pt
    best_val_dice: float | None = None  # mean over the run's regions (WT/TC/ET for 2017-2021) of the best validation
    stopped_early: bool = False
    finished: bool = False  # max_epochs reached or early stopping: nothing left to train
    interrupted: bool = False  # stop_requested() at an epoch boundary, or SIGTERM/SIGUSR1: latest saved, resume later
    stop_reason: str | None = None  # "SIGTERM" / "SIGUSR1" when a signal stopped this call (mid-epoch or not)
    train_seconds: float = 0.0
    epoch_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0  # CUDA: peak allocated; CPU: peak resident set size of the process
    history: list[dict] = field(default_factory=list)  # one record per epoch of the fold (all calls)
    fold_dir: Path | None = None
    device: str = ""  # where this call trained ("cpu", "cuda:0"): what `peak_memory_bytes` measures


@dataclass
class LoopState:
    """Where the training of a fold stands. Checkpoints hold these fields as top-level keys (the format)."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # steps done in the running epoch (> 0 only in a mid-epoch checkpoint)
    global_step: int = 0
    epoch_loss_sum: float = 0.0  # sum of the running epoch's step losses
    epoch_elapsed: float = 0.0  # seconds of the running epoch's steps, waiting for data included
    epoch_data_wait: float = 0.0  # seconds of the running epoch's steps spent waiting for their batches
    epoch_start_loader_state: torch.Tensor | None = None  # loader generator at the running epoch's start
    best_val_dice: float | None = None  # best mean val Dice (selects checkpoint_best.pt)
    best_epoch: int | None = None
    best_val_loss: float = math.inf  # early stopping watches the val loss, as Keras' EarlyStopping
    last_improved_epoch: int = 0
    stopped_early: bool = False
    finished: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per completed epoch
    peak_memory_bytes: int = 0

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> LoopState:
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls) if f.name in state})

    def as_checkpoint(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_result(self, fold: int, fold_dir: Path, **this_call: Any) -> TrainResult:
        """The fold's result; `this_call` sets what only this call knows (interrupted, timings)."""
        return TrainResult(fold=fold, epochs_completed=self.epoch, best_epoch=self.best_epoch,
                           best_val_dice=self.best_val_dice, stopped_early=self.stopped_early, finished=self.finished,
                           peak_memory_bytes=self.peak_memory_bytes, history=list(self.history), fold_dir=fold_dir,
                           **this_call)


class StopSignals:
    """Ctrl-C, SIGTERM and SIGUSR1 set a flag; the loop stops after the running step.

    Ctrl-C means "stop and tell me" (TrainingInterrupted, exit 130); SIGTERM and SIGUSR1 are a scheduler's
    warning (SLURM's `--signal=B:USR1@N`, a preemption, a time limit): the loop saves its mid-epoch state and
    returns an interrupted result (exit 0), which a requeued job resumes. A second Ctrl-C raises
    KeyboardInterrupt at once. Handlers can only be installed from the main thread; elsewhere the flag
    simply never turns on. Distributed, `agreed` takes the strongest request of any rank at the same step.
    """

    NONE, STOP, INTERRUPT = 0, 1, 2  # ordered: the max over ranks is what every rank does

    def __init__(self) -> None:
        # A StopReason's value, as a plain string: the result carries it out (a torch.save of it must load
        # with weights_only, which refuses the enum's class).
        self.requested: str | None = None
        self._installed = contextlib.ExitStack()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.requested == StopReason.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested is not None and signum != signal.SIGINT:
            return  # already stopping
        self.requested = StopReason.from_signal(signum).value
        hint = " (Ctrl-C again to abort without saving)" if signum == signal.SIGINT else ""
        stop_signals.say(f"{self.requested}: finishing this step and saving checkpoint_latest.pt{hint}")

    @property
    def level(self) -> int:
        if self.requested is None:
            return self.NONE
        return self.INTERRUPT if StopReason(self.requested).is_interrupt else self.STOP

    def agreed(self, ctx: DistContext) -> int:
        """This step's decision, the same on every rank (a collective when distributed)."""
        return int(all_reduce_max(self.level, ctx)) if ctx.is_distributed else self.level

    def __enter__(self) -> StopSignals:
        self._installed.enter_context(stop_signals.handled(stop_signals.STOP_SIGNALS, self._handle))
        return self

    def __exit__(self, *exc) -> None:
        self._installed.close()


# A data wait above this share of an epoch's steps is worth one warning (the GPU idles for its batches), once it
# means something: an epoch of several steps that waited seconds. A 1-2 step epoch's wait is mostly its first
# batch, which every epoch waits for (0.2-0.4 s on a CPU), not a starved device.
DATA_WAIT_WARN_SHARE = 0.10
DATA_WAIT_WARN_MIN_STEPS = 5
DATA_WAIT_WARN_MIN_SECONDS = 5.0


class _StopAtStep(Exception):
    """Raised inside `fit` when SIGTERM/SIGUSR1 stopped training with the state saved."""


# --------------------------------------------------------------------------------------------------
# The entry point


def train_fold(
    config: Config, run_dir: Path | RunFolder, fold: int = 0, *, resume: bool = False,
    stop_requested: Callable[[], bool] | None = None, progress: bool = True,
) -> TrainResult:
    """Train fold `fold` of the run folder `run_dir` with `config` (see the module docstring for the recipe).

    Args:
        config: resolved configuration.
        run_dir: run folder (or its path); `config.yaml`, `env.json`, `splits.json` are written there,
            the fold's checkpoints and logs into its `fold_<fold>/`.
        fold: which fold of `splits.json` (made from the cases prepared in data.cache if absent). The cache must
            be prepared (`brats-swap train` / `cv` first call `train.data.prepare_run_data`).
        resume: continue from `fold_<k>/checkpoint_latest.pt` (falling back to `checkpoint_prev.pt`);
            start fresh with a warning if there is none; return at once if the fold already finished.
        stop_requested: polled at each epoch boundary; when it returns True, the latest checkpoint is
            saved and the result comes back with `interrupted=True`. SIGTERM and SIGUSR1 stop at the next
            step either way (see `StopSignals`).
        progress: show a rich progress bar per epoch.

    Returns:
        TrainResult.

    Raises:
        ConfigError: the fold already has checkpoints and `resume` is False; bad device.
        DataError: no prepared cases / unusable cache.
        CheckpointError: the checkpoints exist but none is readable.
        NumericalError: the loss became NaN/Inf (names epoch and step).
        DeviceOutOfMemoryError: CUDA out of memory (suggests memory.mode=auto).
        TrainingInterrupted: Ctrl-C; checkpoint_latest.pt holds the state at the last finished step.
    """
    run = RunFolder.of(run_dir)
    folder = run.fold(fold)
    # Under torchrun: join the process group, one device per rank (see brats_swap/distributed.py).
    ctx = init_distributed(config.train.device)
    config = _amp_that_runs(config, ctx)
    # Read before anything is written; rank 0 reads, every rank gets the same state.
    state = run_on_main(ctx, _resume_state, config, folder, resume)
    if state is not None and state["finished"] and not _can_extend(state, config):
        return LoopState.from_checkpoint(state).to_result(folder.fold, folder.root)
    with torch_settings(config, ctx.device) as nondeterministic, StopSignals() as signals:
        recipe = FoldRecipe(config, run, folder, ctx, signals, show_progress=progress)
        if nondeterministic is not None:
            nondeterministic.on_new = recipe.note_nondeterministic_op
        return recipe.fit(state, stop_requested)


def _amp_that_runs(config: Config, ctx: DistContext) -> Config:
    """`config` with the `train.amp` this device runs (`amp_on_device`), said in one line when it changed; the
    run's config, checkpoints and env.json then record what ran."""
    amp, reason = amp_on_device(config.train.amp, ctx.device)
    if reason is None:
        return config
    if ctx.is_main:
        warn(reason)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, amp=amp))


def _resume_state(config: Config, folder: FoldFolder, resume: bool) -> dict[str, Any] | None:
    """The checkpoint state to continue from (None = start fresh); raises if the fold must not be overwritten."""
    if not resume:
        if folder.latest.exists():
            raise ConfigError(f"{folder.root}: already holds checkpoints; pass --resume to continue it, "
                              "or choose another --run folder")
        return None
    loaded = load_latest(folder, warn=warn)
    if loaded is None:
        warn(f"{folder.root}: no checkpoint to resume from; starting the fold from scratch")
        return None
    state, used = loaded
    changed = diff_configs(config_from_saved(state["config"]), config)
    _check_same_architecture(state, config, changed, used)
    _check_same_network(state, config, used)
    if changed:
        warn(f"{used}: config differs from the checkpoint's in {', '.join(changed)}; continuing with the new values")
    return state


def _check_same_architecture(state: dict[str, Any], config: Config, changed: list[str], used: Path) -> None:
    """Refuse, before anything is written, a --resume whose model cannot load the checkpoint's weights."""
    out_channels = run_output_count(state["edition"], config.model)
    expected = {k: tuple(v.shape) for k, v in build_model(config.model, out_channels).state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in state["model"].items()}
    if expected != saved:
        keys = [k for k in changed if k.startswith(("model.", "data.modalities"))] or ["model"]
        raise ConfigError(f"{used}: {', '.join(keys)} differs from the checkpoint's model; the architecture "
                          "cannot change on --resume (train it in a new --run folder)")


def _check_same_network(state: dict[str, Any], config: Config, used: Path) -> None:
    """Refuse a --resume that names another network, even one whose weights would load (resenc_m into l)."""
    saved, now = state.get("architecture"), architecture_record(config.model)
    if saved is not None and saved != now:
        keys = [f"model.{k}" for k in now if saved.get(k) != now[k]]
        raise ConfigError(f"{used}: {', '.join(keys)} differs from the checkpoint's network "
                          f"({saved['name']}); the architecture cannot change on --resume (train it in a new --run folder)")


def _can_extend(state: dict[str, Any], config: Config) -> bool:
    # A fold that ran out of epochs (not early-stopped) continues when max_epochs was raised.
    return not state["stopped_early"] and config.train.max_epochs > state["epoch"]


# --------------------------------------------------------------------------------------------------
# The recipe


class FoldRecipe:
    """The training of one fold, in the steps `fit` runs: `setup` (with `restore` when resuming), then per
    epoch `train_epoch`, `validate` when due and `end_epoch`, and `finish`.

    Distributed, every rank runs the same steps; rank 0 alone writes files, and every decision that must
    agree (stop? which state?) is taken on rank 0 and broadcast (see `brats_swap.distributed`).
    """

    # Built by `setup`.
    edition: str  # label table of the prepared data ("2021", "gli-post", "ped", ...)
    regions: tuple[str, ...]  # the run's regions (`run_regions`): validation Dice per region
    out_channels: int  # the network's outputs (`run_output_count`)
    model: torch.nn.Module  # the plain module: state dicts and validation
    train_model: torch.nn.Module  # `model`, or DDP around it when distributed
    memory_cfg: MemoryConfig  # the resolved policy the engine runs and the checkpoint records
    engine: MemoryEngine
    compilation: StepCompilation  # train.compile: the network's blocks and the loss compiled, or eager
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    loss: SegmentationLoss
    scaler: torch.amp.GradScaler
    data: TrainData
    sample_shape: tuple[int, ...]
    log: TrainLog

    def __init__(self, config: Config, run: RunFolder, folder: FoldFolder, ctx: DistContext, signals: StopSignals,
                 *, show_progress: bool) -> None:
        self.config, self.run, self.folder, self.ctx, self.signals = config, run, folder, ctx, signals
        self.device = ctx.device
        self.show_progress = show_progress and ctx.is_main  # rank 0 draws; the other ranks show nothing
        self.loop = LoopState()
        self.environment: dict[str, Any] | None = None  # env.json's record (rank 0)
        self.interrupted = False
        self.stop_reason: str | None = None  # the signal that ended this call (SIGTERM/SIGUSR1)
        self.train_seconds = 0.0
        self.epoch_seconds: list[float] = []
        self.warned_data_wait = False

    def fit(self, state: dict[str, Any] | None, stop_requested: Callable[[], bool] | None) -> TrainResult:
        """The recipe, top to bottom. `state` is the checkpoint to resume from (None: start fresh)."""
        try:
            return self._fit(state, stop_requested)
        except BratsSwapError as exc:
            if not isinstance(exc, TrainingInterrupted):
                self._record_failure(user_message(exc))
            raise

    def _record_failure(self, message: str) -> None:
        """The error's line in `fold_<k>/failed.txt` (what `cv --status` shows) and train.log; a fold folder
        that does not exist yet stays absent."""
        if not (self.ctx.is_main and self.folder.root.is_dir()):
            return
        atomic_write_text(self.folder.failure, " ".join(message.split()) + "\n")
        with contextlib.suppress(OSError), self.folder.train_log.open("a", encoding="utf-8") as log:
            log.write(f"error: {' '.join(message.split())}\n")

    def _fit(self, state: dict[str, Any] | None, stop_requested: Callable[[], bool] | None) -> TrainResult:
        if self.ctx.is_main:
            self.folder.failure.unlink(missing_ok=True)  # this call's outcome replaces the last one's
        self.setup(state)
        started = time.perf_counter()
        try:
            while self.loop.epoch < self.config.train.max_epochs and not self.loop.finished:
                if self.loop.step_in_epoch == 0:
                    if self._stop_before_epoch(stop_requested):
                        self.interrupted = True
                        break
                    self.loop.epoch_start_loader_state = self.data.generator.get_state()
                record, memory_stats = self.train_epoch()
                if self._validation_due():
                    record.update(self.validate())
                self.end_epoch(record, memory_stats)
        except _StopAtStep:
            self.interrupted = True
        finally:
            self.train_seconds = time.perf_counter() - started
            self.data.close()  # an error leaves loader workers running (`WorkerLoader`): end them now
            self.engine.close()  # hooks and recompute wrappers off: the model is plain again
            self.log.close()
        return self.finish()

    # ---- set-up ----

    def setup(self, state: dict[str, Any] | None) -> None:
        """Run folder and splits, model, memory engine, optimiser and data; the checkpoint's state when
        resuming; DDP, and the logs."""
        train_ids, val_ids = self._prepare_run_folder()
        self._build(train_ids, val_ids, resumed=state is not None)
        if state is not None:
            self.restore(state)
        # DDP averages the gradients in backward; `self.model` stays the plain module (state dicts, validation).
        self.train_model = wrap_ddp(self.model, self.ctx)
        if self.ctx.rank > 0 and state is None:
            torch.manual_seed(self.config.seed + 7919 * self.ctx.rank)  # own dropout masks (weights come from rank 0)
        self.log = TrainLog(self.folder, write=self.ctx.is_main,
                            purge_step=self.loop.epoch + 1 if state is not None else None,
                            train_loss=self.config.train.loss)
        self.compilation.log = self.log.line
        self._note_compilation()
        swap_ran, swap_planned = self.engine.cfg.swap, self.memory_cfg.swap
        if (swap_ran.include, swap_ran.exclude) != (swap_planned.include, swap_planned.exclude):
            self.log.line(f"train.compile: swap globs inside compiled blocks name the blocks (docs/memory.md): include "
                          f"{swap_ran.include}, exclude {swap_ran.exclude}")
        self.log.line(self._start_line(resumed=state is not None))
        if state is not None and self.show_progress:  # on screen too (train.log has the start line)
            console.print(f"{self.folder.root}: resuming fold {self.folder.fold} at epoch {self.loop.epoch + 1} "
                          f"step {self.loop.step_in_epoch} of {self.config.train.max_epochs} epoch(s)")

    def _prepare_run_folder(self) -> tuple[list[str], list[str]]:
        """Rank 0 writes config.yaml (once), env.json and the fold folder; the splits; the data's edition."""
        cache = Path(self.config.data.cache)
        case_ids = labelled_case_ids(cache)  # unlabelled cases are for prediction only
        # Outputs and regions follow the cases' label table; a bad model.regions stops here, before any write.
        self.edition = run_table(cache, case_ids, self.config.data)
        self.regions = run_regions(self.edition, self.config.model)
        self.out_channels = run_output_count(self.edition, self.config.model)
        if self.ctx.is_main:
            self.folder.root.mkdir(parents=True, exist_ok=True)
            # A run killed mid-write (SIGKILL, power loss) leaves checkpoint-sized temp files; their writer is gone.
            remove_stale_temp_files(self.run.root)
            remove_stale_temp_files(self.folder.root)
            if not self.run.config.exists():
                atomic_write_text(self.run.config, config_to_yaml(self.config))
            self.environment = {**environment_record(self.device), "world_size": self.ctx.world_size,
                                "amp": self.config.train.amp,  # what ran (`_amp_that_runs`)
                                "deterministic": self.config.train.deterministic,
                                "cudnn_benchmark": torch.backends.cudnn.benchmark}
            self._write_environment()
        splits = run_on_main(self.ctx, load_run_splits, self.config, self.run, case_ids)
        return fold_cases(splits, self.folder.fold)

    def _write_environment(self) -> None:
        """env.json in the fold's folder (what produced this fold) and in the run's (the process that trained a
        fold last: each process that trains a fold rewrites it, and parallel folds or SLURM's array tasks
        run on other hosts and devices, as nnU-Net keeps its debug.json per fold)."""
        for path in (self.folder.env, self.run.env):
            atomic_write_json(path, self.environment)

    def note_nondeterministic_op(self, op: str) -> None:
        """`train.deterministic` on CUDA ran an op that has no deterministic kernel: said once per op, in the
        log and env.json (`nondeterministic_ops`), as such a run is not bitwise repeatable."""
        if not self.ctx.is_main:
            return
        message = f"train.deterministic: {op} has no deterministic CUDA kernel; this run is not bitwise repeatable"
        warn(message)
        self.log.line(f"warning: {message}")  # ops run in steps, after the log is opened
        if self.environment is not None:
            self.environment.setdefault("nondeterministic_ops", []).append(op)
            self._write_environment()

    def _build(self, train_ids: list[str], val_ids: list[str], resumed: bool) -> None:
        """Model, memory engine (mode auto planned once per fold), optimiser, scheduler, scaler, loaders."""
        config, train_cfg, device = self.config, self.config.train, self.device
        seed_everything(config.seed)
        self.model = build_model(config.model, out_channels=self.out_channels).to(device)
        if train_cfg.init_from and not resumed:
            weights = load_checkpoint(Path(train_cfg.init_from))["model"]
            self.model.load_state_dict(initial_weights(self.model, weights, train_cfg.init_from))
        # The weighted Dice looked up here, when the fold is built: the tests' seam for a faulty loss.
        self.loss = training_loss(train_cfg.loss, self.model, dice=weighted_dice_loss,
                                  distributed=self.ctx.is_distributed)
        input_shape = training_input_shape(config)
        self.sample_shape = input_shape[2:]
        # The one resolved policy: what the engine runs, the checkpoint saves and train.log records.
        self.memory_cfg = run_on_main(self.ctx, plan_memory, config, self.model, self.folder, input_shape, device,
                                      reuse=resumed, table=self.edition)
        # The host arena sized from the plan and allocated now: a host that cannot hold one step's swapped
        # activations is a one-line error here, before the first epoch, not an out-of-memory kill mid-step.
        self.arena_bytes = run_on_main(self.ctx, swap_arena_bytes, self.model, self.memory_cfg, input_shape,
                                       amp_dtype(train_cfg.amp), self.loss)
        # Compiled before the engine is built: the engine then keeps its hooks at the compiled blocks' edges.
        self.compilation = StepCompilation(self.model, train_cfg.compile, device, loss=self.loss,
                                           say=warn if self.ctx.is_main else None)
        self.engine = MemoryEngine(self.model, self.memory_cfg, device, arena_bytes=self.arena_bytes)
        self.engine_compiled = self.compilation.compiled
        self.optimizer = build_optimizer(self.model.parameters(), train_cfg)
        self.scheduler = build_scheduler(self.optimizer, train_cfg)
        self.scaler = torch.amp.GradScaler(device.type, enabled=train_cfg.amp == "fp16")
        self.data = build_train_data(config, train_ids, val_ids, edition=self.edition, fold=self.folder.fold,
                                     device=device, ctx=self.ctx)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: weights, optimiser, scheduler, scaler, loop state and every RNG."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when saved with fp16 off; loading {} into an enabled scaler raises
            self.scaler.load_state_dict(state["scaler"])
        self.loop = LoopState.from_checkpoint(state)
        self.loop.finished = False  # only reached when max_epochs was raised (see _can_extend)
        rng_ranks = state.get("rng_ranks") or []
        own_rng = rng_ranks[self.ctx.rank] if len(rng_ranks) == self.ctx.world_size else state["rng"]
        restore_rng_states(own_rng, self.data.generator)
        if self.loop.step_in_epoch > 0 and self.loop.epoch_start_loader_state is not None:
            # Mid-epoch: the loader iterator is re-created, so it must draw from the epoch's starting state.
            self.data.generator.set_state(self.loop.epoch_start_loader_state)

    def _start_line(self, resumed: bool) -> str:
        train_cfg, ctx = self.config.train, self.ctx
        n_params = sum(p.numel() for p in self.model.parameters())
        line = (f"{'resume' if resumed else 'start'} fold {self.folder.fold} at epoch {self.loop.epoch + 1}"
                f" step {self.loop.step_in_epoch}: {len(self.data.train_dataset.case_ids)} train / "
                f"{len(self.data.val_dataset.case_ids)} val cases, {self.data.steps_per_epoch} steps/epoch, "
                f"mode {train_cfg.mode} {list(self.sample_shape)}, {n_params:,} parameters, device {self.device}, "
                f"memory.mode {self.memory_cfg.mode}, amp {train_cfg.amp}, augment {train_cfg.augment} on the device, "
                f"{self.data.loader_workers} loader workers, {self.compilation.describe()}")
        if ctx.is_distributed:
            line += f", {ctx.world_size} ranks ({ctx.backend}), global batch {ctx.world_size * train_cfg.batch_size}"
        return line

    # ---- one epoch ----

    def train_epoch(self) -> tuple[dict[str, Any], dict[str, float]]:
        """One epoch (or the rest of one after a mid-epoch resume).

        Returns the epoch's record so far (epoch, mean train loss, lr, s/step) and the mean memory stats.
        """
        loop, train_cfg = self.loop, self.config.train
        self.epoch_compile_start = self.compilation.compile_seconds
        cuda_device.reset_peak(self.device)
        self.data.sampler.set_epoch(loop.epoch, start=loop.step_in_epoch * train_cfg.batch_size)
        self.train_model.train()
        memory_sums: dict[str, float] = {}
        step_times: list[float] = []
        progress = progress_bar(
            f"epoch {loop.epoch + 1}/{train_cfg.max_epochs}", TextColumn("{task.fields[info]}"),
            # Off when stderr is not a terminal (CI, SLURM logs): plain lines while the epoch runs, and
            # `end_epoch`'s line at its end.
            console=console, transient=True, disable=not (self.show_progress and console.is_terminal),
        )
        # The minute lines go to train.log always (a cluster's `tail -f`), to stderr when no bar is drawn there.
        lines = ProgressLines(f"epoch {loop.epoch + 1}/{train_cfg.max_epochs}", self.data.steps_per_epoch,
                              console=console if self.show_progress and not console.is_terminal else None,
                              log=self.log.line, scope="this epoch", rest=self._rest_of_the_run())
        with progress:
            task = progress.add_task("train", total=self.data.steps_per_epoch, completed=loop.step_in_epoch, info="")
            last_step_end = time.perf_counter()
            batches = iter(self.data.train_loader)
            while (batch := next(batches, None)) is not None:
                step_started = time.perf_counter()
                loop.epoch_data_wait += step_started - last_step_end  # this step's wait for its batch
                loss_value = self.train_step(batch)
                stats = self.engine.last_stats()
                if stats is not None:
                    for key, value in stats.as_dict().items():
                        memory_sums[key] = memory_sums.get(key, 0.0) + float(value)
                loop.step_in_epoch += 1
                loop.global_step += 1
                loop.epoch_loss_sum += loss_value
                step_end = time.perf_counter()
                step_times.append(step_end - step_started)
                loop.epoch_elapsed += step_end - last_step_end  # includes waiting for data
                last_step_end = step_end
                info = (f"loss {loop.epoch_loss_sum / loop.step_in_epoch:.4f}  {np.mean(step_times):.2f} s/step  "
                        f"mem {peak_memory_bytes(self.device) / 2**30:.2f} GiB")
                progress.update(task, advance=1, info=info)
                lines.update(loop.step_in_epoch, info)
                self._stop_within_epoch()
        record = {"epoch": loop.epoch + 1, "train_loss": loop.epoch_loss_sum / max(loop.step_in_epoch, 1),
                  "lr": self.optimizer.param_groups[0]["lr"],
                  "step_s": float(np.mean(step_times)) if step_times else 0.0,
                  "data_wait_s": loop.epoch_data_wait,
                  "data_wait_share": loop.epoch_data_wait / loop.epoch_elapsed if loop.epoch_elapsed > 0 else 0.0}
        self._warn_on_data_wait(record)
        return record, {k: v / max(len(step_times), 1) for k, v in memory_sums.items()}

    def _warn_on_data_wait(self, record: dict[str, Any]) -> None:
        """Once per call: the steps waited for their batches more than `DATA_WAIT_WARN_SHARE` of an epoch of at least
        `DATA_WAIT_WARN_MIN_STEPS` steps, and at least `DATA_WAIT_WARN_MIN_SECONDS`."""
        if (self.warned_data_wait or record["data_wait_share"] <= DATA_WAIT_WARN_SHARE
                or self.data.steps_per_epoch < DATA_WAIT_WARN_MIN_STEPS
                or record["data_wait_s"] < DATA_WAIT_WARN_MIN_SECONDS):
            return
        self.warned_data_wait = True
        message = (f"{self.folder.root}: epoch {record['epoch']} waited {record['data_wait_s']:.1f} s for data "
                   f"({record['data_wait_share']:.0%} of its steps' time): the device is starved; raise "
                   f"data.loader_workers (now {self.data.loader_workers}) or choose a lighter train.augment")
        self.log.line(f"warning: {message}")
        if self.ctx.is_main:
            warn(message)

    def train_step(self, batch: LoaderBatch) -> float:
        """Forward and loss under the memory engine (and AMP), backward, optimiser step; the global batch's loss."""
        where = f"{self.folder.root}: epoch {self.loop.epoch + 1} step {self.loop.step_in_epoch + 1}"
        self._engine_for_eager()
        try:
            # float16 batch -> float32, augmented and turned into targets on the device (train/device_augment.py)
            images, targets = self.data.device_batches.prepare(batch)

            def forward_backward() -> torch.Tensor:
                self.optimizer.zero_grad(set_to_none=True)  # a retry after a failed compiled backward starts clean
                with autocast_context(self.device, self.config.train.amp), self.engine.step():
                    loss = self.loss(self.train_model(images), targets)
                # Backward is queued before the loss is read: reading it (and the all-reduce) waits for the device.
                self.scaler.scale(loss).backward()
                return loss

            loss = self.compilation.run(forward_backward, "train step", module=self.model)
            self._note_compilation()
            loss_value = all_reduce_mean(float(loss.detach()), self.ctx)  # the same value on every rank
            if not math.isfinite(loss_value):
                raise NumericalError(
                    f"{self.folder.root}: loss is {loss_value} at epoch {self.loop.epoch + 1} step "
                    f"{self.loop.step_in_epoch + 1}; training stopped, the last good checkpoint is kept "
                    "(try train.amp=none or a lower train.lr)")
            clip_gradients(self.model, self.optimizer, self.scaler, self.config.train.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError exists from torch 2.5 only
            raise out_of_memory_error(self.device, self.config, where, self.memory_cfg,
                                      out_channels=self.out_channels) from None
        return loss_value

    def _engine_for_eager(self) -> None:
        """After a failed compilation the blocks run eager: the engine is rebuilt with its hooks inside them again
        (norm_act recipes, module events), as an eager run has it."""
        if self.engine_compiled and not self.compilation.compiled:
            self.engine.close()
            self.engine = MemoryEngine(self.model, self.memory_cfg, self.device, arena_bytes=self.arena_bytes)
            self.engine_compiled = False

    def _note_compilation(self) -> None:
        """env.json says whether steps run compiled and how long compiling took, once that changed."""
        record = self.compilation.record()
        if self.environment is not None and self.environment.get("compile") != record:
            self.environment["compile"] = record
            self._write_environment()

    def _rest_of_the_run(self) -> tuple[str, int, float]:
        """What the progress lines add for the run's time left: the later epochs' steps, and this epoch's and
        the later ones' validations at the mean time of those so far (none timed yet: the line says how many
        are not counted; the first validation's own lines count them)."""
        epoch, last = self.loop.epoch + 1, self.config.train.max_epochs
        timed = [record["val_seconds"] for record in self.loop.history if "val_seconds" in record]
        validations = self._validations_from(epoch)
        steps = (last - epoch) * self.data.steps_per_epoch
        if validations and not timed:
            return f"the run, plus {validations} validation(s) not timed yet", steps, 0.0
        return "the run", steps, validations * float(np.mean(timed or [0.0]))

    def _validations_from(self, first: int) -> int:
        """The validations of epochs `first` to train.max_epochs, by `_validation_due`'s rule."""
        last = self.config.train.max_epochs
        return sum(1 for e in range(first, last + 1) if e % self.config.train.val_every == 0 or e == last)

    def _validation_progress(self) -> CountedProgress:
        """Validation's bar (on a terminal) or its lines a minute (otherwise, and in train.log), with the run's
        time left: the later validations at this one's pace, the later epochs at this epoch's."""
        cases = len(self.data.val_loader.sampler)  # this rank's share (all of them on one process)
        epoch, last = self.loop.epoch + 1, self.config.train.max_epochs
        step_s = self.loop.epoch_elapsed / max(self.loop.step_in_epoch, 1)
        rest = ("the run", self._validations_from(epoch + 1) * cases, (last - epoch) * self.data.steps_per_epoch * step_s)
        return CountedProgress(f"epoch {epoch}/{last} validation", cases, console=console,
                               bar=self.show_progress and console.is_terminal,
                               lines_console=console if self.show_progress and not console.is_terminal else None,
                               log=self.log.line, scope="this validation", rest=rest)

    def _validation_due(self) -> bool:
        epoch = self.loop.epoch + 1
        return epoch % self.config.train.val_every == 0 or epoch >= self.config.train.max_epochs

    def validate(self) -> dict[str, Any]:
        """Whole-cube validation and what it decides: LR on plateau, early stopping, the best checkpoint."""
        started = time.perf_counter()
        def scores() -> dict[str, Any]:
            with self._validation_progress() as shown, _ticking(self.model, shown.tick):
                return validation_scores(self.config, self.model, self.data.val_loader, self.edition, self.device,
                                         self.ctx, on_cases=shown.done)

        try:
            val = self.compilation.run(scores, "validation")
        except torch.cuda.OutOfMemoryError:  # as a training step's: one line, failed.txt, exit 3 (`fit`)
            raise prediction_out_of_memory_error(
                self.device, self.config, f"{self.folder.root}: epoch {self.loop.epoch + 1} validation") from None
        self._note_compilation()
        record: dict[str, Any] = {**val, "val_seconds": time.perf_counter() - started}
        step_after_validation(self.scheduler, val["val_loss"])
        mean_dice = float(np.mean([val[dice_column(r)] for r in self.regions]))
        record["val_dice_mean"] = mean_dice
        loop, epoch = self.loop, self.loop.epoch + 1
        # Early stopping follows Keras' EarlyStopping(monitor=val_loss, min_delta=0, patience=50).
        if val["val_loss"] < loop.best_val_loss:
            loop.best_val_loss, loop.last_improved_epoch = val["val_loss"], epoch
        elif epoch - loop.last_improved_epoch >= self.config.train.early_stop_patience:
            loop.stopped_early = True
        if loop.best_val_dice is None or mean_dice > loop.best_val_dice:
            loop.best_val_dice, loop.best_epoch = mean_dice, epoch
            record["best"] = True
        return record

    def end_epoch(self, record: dict[str, Any], memory_stats: dict[str, float]) -> None:
        """Close the epoch: bookkeeping, logs, checkpoints; a Ctrl-C/SIGTERM during it stops training here."""
        loop, train_cfg = self.loop, self.config.train
        epoch_seconds = loop.epoch_elapsed + record.get("val_seconds", 0.0)
        peak = self._take_peak()
        record.update(epoch_s=epoch_seconds, peak_memory_gib=peak / 2**30, compiled=self.compilation.compiled,
                      compile_s=self.compilation.compile_seconds - self.epoch_compile_start)
        loop.history.append(record)
        loop.epoch += 1
        loop.step_in_epoch, loop.epoch_loss_sum, loop.epoch_elapsed, loop.epoch_data_wait = 0, 0.0, 0.0, 0.0
        loop.finished = loop.stopped_early or loop.epoch >= train_cfg.max_epochs
        step_after_epoch(self.scheduler)
        self.epoch_seconds.append(epoch_seconds)

        line = self.log.epoch(record, memory_stats, train_cfg.max_epochs)
        if self.show_progress and not console.is_terminal:
            console.print(line)
        if record.get("best"):
            self.save(self.folder.best)
        self.save_latest()
        if loop.stopped_early:
            self.log.line(f"early stopping: val loss has not improved for {train_cfg.early_stop_patience} epochs "
                          f"(best {loop.best_val_loss:.4f} at epoch {loop.last_improved_epoch})")
        if not loop.finished:
            self._leave_on_signal(self.signals.agreed(self.ctx), f"after epoch {loop.epoch}")

    def finish(self) -> TrainResult:
        """The fold's result, with this call's timings and whether a stop request ended it. Its peak is the
        largest the epoch lines said, or the steps of an epoch a stop cut short (`_stop_within_epoch`): not
        measured here, where a CPU's resident set also holds the checkpoints just written."""
        return self.loop.to_result(self.folder.fold, self.folder.root, interrupted=self.interrupted,
                                   stop_reason=self.stop_reason, train_seconds=self.train_seconds,
                                   epoch_seconds=self.epoch_seconds, device=str(self.device))

    # ---- stopping and checkpoints ----

    def _stop_before_epoch(self, stop_requested: Callable[[], bool] | None) -> bool:
        """The caller's stop request (rank 0 decides), checked at an epoch boundary; saves the state if so."""
        if stop_requested is None or not broadcast_object(stop_requested(), self.ctx):
            return False
        self.save_latest()
        self.log.line(f"stop requested at the start of epoch {self.loop.epoch + 1}; state saved")
        return True

    def _stop_within_epoch(self) -> None:
        """After a step: on Ctrl-C/SIGTERM/SIGUSR1 (on any rank) save the mid-epoch state and stop."""
        if self.loop.step_in_epoch >= self.data.steps_per_epoch:
            return  # the epoch is complete: `end_epoch` saves and stops
        agreed = self.signals.agreed(self.ctx)  # every rank stops at the same step
        if agreed != StopSignals.NONE:
            self._take_peak()  # the steps of this epoch, which no epoch line reports
            self.save_latest()  # resume continues with the next step of this epoch
            self._leave_on_signal(agreed, f"at epoch {self.loop.epoch + 1} step {self.loop.step_in_epoch}")

    def _take_peak(self) -> int:
        """The peak of the steps so far (the largest rank's), also kept as the fold's; taken where steps end, at
        an epoch's end or a stop inside one, so the epoch lines and the summary report the same number."""
        peak = int(all_reduce_max(peak_memory_bytes(self.device), self.ctx))
        self.loop.peak_memory_bytes = max(self.loop.peak_memory_bytes, peak)
        return peak

    def _leave_on_signal(self, agreed: int, where: str) -> None:
        """Leave training when some rank got a signal (the state is saved): Ctrl-C raises, SIGTERM/SIGUSR1
        end `fit` with an interrupted result."""
        if agreed == StopSignals.NONE:
            return
        self.stop_reason = self.signals.requested or "a signal on another rank"
        self.log.line(f"{self.stop_reason} {where}; state saved")
        if agreed == StopSignals.INTERRUPT:
            # No "how to continue" here: it depends on the command (`train --resume`, `cv run` again).
            raise TrainingInterrupted(f"{self.folder.root}: {self.stop_reason} {where}; state saved to "
                                      f"{self.folder.latest.name}")
        raise _StopAtStep

    def save_latest(self) -> None:
        """`checkpoint_latest.pt`; the file it replaces becomes `checkpoint_prev.pt`."""
        self.save(self.folder.latest, keep_previous=True)

    def save(self, path: Path, keep_previous: bool = False) -> None:
        """Checkpoint the whole training state. Every rank must call it (it gathers the ranks' RNG states);
        rank 0 writes."""
        rng = capture_rng_states(self.data.generator)
        state = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "rng": rng,
            "config": config_to_dict(self.config), "memory": dataclasses.asdict(self.memory_cfg),
            "architecture": architecture_record(self.config.model),
            "edition": self.edition, "fold": self.folder.fold, **self.loop.as_checkpoint(),
        }
        if self.ctx.is_distributed:
            state["rng_ranks"] = gather_objects(rng, self.ctx)
            state["world_size"] = self.ctx.world_size
        if self.ctx.is_main:
            save_checkpoint(state, path, keep_previous=keep_previous)


@contextlib.contextmanager
def _ticking(model: torch.nn.Module, tick: Callable[[], None]):
    """`tick()` after every forward of `model` in the block: each window of a sliding window, so that a case
    slid over for minutes still gets its progress line a minute."""
    handle = model.register_forward_hook(lambda *_: tick())
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def validation_scores(config: Config, model: torch.nn.Module, loader, edition: str, device: torch.device,
                      ctx: DistContext | None = None, on_cases: Callable[[int], None] | None = None,
                      ) -> dict[str, float]:
    """Mean val loss and Dice per region of the run (`run_regions`: `dice_wt`, `dice_tc`, `dice_et`, ...) on
    whole cubes (sliding window for patch models), BraTS empty rules. `on_cases(n)` after each batch: the
    cases this rank has scored.

    Means are over cases. Distributed, each rank scores its share of the cases and the per-case results are
    gathered; DistributedSampler pads the last share with repeated cases, which are counted once.
    """
    model.eval()
    regions = run_regions(edition, config.model)
    per_case: dict[str, tuple[float, ...]] = {}
    scored = 0
    for batch in loader:
        probs = predict_cube(model, batch.image, config, device)  # float16 as cached: converted on the device
        targets = targets_from_labels(batch.label.long(), edition, config.model.outputs, config.model.regions,
                                      config.model.label_order)
        labels = labels_from_probs(probs, edition, config.model.outputs, config.evaluate.threshold,
                                   regions=config.model.regions, label_order=config.model.label_order).numpy()
        for i, (case_id, pred, true) in enumerate(zip(batch.case_id, labels, batch.label.numpy(), strict=True)):
            dice = region_dice(pred, true, edition, regions)
            loss = float(weighted_dice_loss(probs[i:i + 1], targets[i:i + 1].float()))
            per_case[case_id] = (loss, *(float(dice[dice_column(r)]) for r in regions))
        scored += len(batch.case_id)
        if on_cases is not None:
            on_cases(scored)
    model.train()
    if ctx is not None and ctx.is_distributed:
        per_case = {case: row for part in gather_objects(per_case, ctx) for case, row in part.items()}
    rows = np.array([per_case[case] for case in sorted(per_case)], dtype=np.float64)
    out = {"val_loss": float(rows[:, 0].mean())}
    out.update({dice_column(r): float(rows[:, 1 + i].mean()) for i, r in enumerate(regions)})
    return out
