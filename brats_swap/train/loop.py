"""The training recipe: one explicit loop that trains one fold of a run (torchtune style, no framework).

`train_fold(config, run_dir, fold)` is the whole recipe, readable top to bottom:

    set up (device, seeds, run folder, splits, model, memory engine, optimiser, data)
    for epoch in range(start, max_epochs):
        train one epoch           (memory engine wraps forward + loss, backward outside, AMP optional)
        validate on whole cubes   (val loss, Dice WT/TC/ET; sliding window for patch models)
        reduce LR on plateau, early stopping, best checkpoint on mean val Dice
        log (train.log, TensorBoard), save checkpoint_latest.pt

The paper's recipe is the default (Ellis/IBM, see reference/model.md §1.9): weighted Dice loss, Adam
(lr 5e-4, eps 1e-7), ReduceLROnPlateau(factor 0.5, patience 10 in Keras semantics) on the validation
loss, early stopping after 50 epochs without validation-loss improvement, batch size 1, the 48 cube
symmetries as the only augmentation.

Run folder: `run_dir/{config.yaml, env.json, splits.json}` and per fold `fold_<k>/{train.log, tb/,
checkpoint_latest.pt, checkpoint_prev.pt, checkpoint_best.pt, memory_plan.json (mode auto)}`.

Validation runs every `train.val_every` epochs: the plateau scheduler counts validations (epochs in
the paper's setting, `val_every: 1`), early stopping counts epochs since the best validation loss.

Resume is exact: the data stream is a pure function of (seed, epoch, position) (see `train/data.py`),
and checkpoints hold the model, optimiser, scheduler, scaler, every RNG state and the position inside the
epoch, so the loss of the next step after `--resume` equals the uninterrupted run's. Ctrl-C (and SIGTERM
when the caller does not handle it) finishes the running step, saves `checkpoint_latest.pt` and raises
`TrainingInterrupted` (exit 130). A NaN/Inf loss raises `NumericalError` before the optimiser step, so
the checkpoints on disk stay the last good ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.panel import Panel
from rich.progress import TextColumn
from rich.table import Table

from brats_swap.atomic import atomic_write_json, atomic_write_text, remove_stale_temp_files
from brats_swap.config import Config, config_from_saved, config_to_dict, config_to_yaml, diff_configs
from brats_swap.config.loader import from_dict
from brats_swap.config.schema import MemoryConfig
from brats_swap.data.cache import list_prepared, load_prepared
from brats_swap.data.editions import REGIONS
from brats_swap.distributed import (
    DistContext,
    NullSummaryWriter,
    all_reduce_max,
    all_reduce_mean,
    any_rank,
    broadcast_object,
    gather_objects,
    init_distributed,
    run_on_main,
    wrap_ddp,
)
from brats_swap.errors import (
    ConfigError,
    DataError,
    DeviceOutOfMemoryError,
    NumericalError,
    TrainingInterrupted,
)
from brats_swap.evaluate.inference import autocast_context, predict_cube
from brats_swap.evaluate.metrics import case_metrics
from brats_swap.memory import MemoryEngine
from brats_swap.model import build_model
from brats_swap.model.targets import labels_from_probs
from brats_swap.progress import progress_bar
from brats_swap.splits import fold_cases, load_or_create_splits
from brats_swap.train.checkpoint import (
    BEST,
    LATEST,
    capture_rng_states,
    load_latest,
    restore_rng_states,
    save_checkpoint,
)
from brats_swap.train.data import build_train_data
from brats_swap.train.planning import out_of_memory_error, plan_memory
from brats_swap.train.losses import weighted_dice_loss

# Progress bars and warnings go to stderr so stdout stays clean for tables and piping.
console = Console(stderr=True, highlight=False)

TRAIN_LOG = "train.log"
MEMORY_PLAN = "memory_plan.json"
ENV_FILE = "env.json"
CONFIG_FILE = "config.yaml"


@dataclass
class TrainResult:
    """What `train_fold` did. `epochs_completed`, `best_*` and `finished` describe the whole fold;
    `train_seconds` and `epoch_seconds` only the epochs trained by this call (the cv runner sums them)."""

    fold: int
    epochs_completed: int = 0
    best_epoch: int | None = None  # 1-based epoch of checkpoint_best.pt
    best_val_dice: float | None = None  # mean over WT/TC/ET of the best validation
    stopped_early: bool = False
    finished: bool = False  # max_epochs reached or early stopping: nothing left to train
    interrupted: bool = False  # stop_requested() at an epoch boundary: latest saved, resume later
    train_seconds: float = 0.0
    epoch_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0  # CUDA: peak allocated; CPU: peak resident set size of the process
    history: list[dict] = field(default_factory=list)  # one record per epoch of the fold (all calls)
    fold_dir: Path | None = None


def fold_dir_of(run_dir: Path, fold: int) -> Path:
    return Path(run_dir) / f"fold_{fold}"


def warn(message: str) -> None:
    console.print(f"[bold yellow]warning:[/] {message}", markup=True, highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------------------------------
# Set-up helpers


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name!r} requested but CUDA is not available")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def torch_settings(config: Config, device: torch.device):
    """Threads and determinism for the duration of training, restored afterwards (tests share a process)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    if config.train.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


def environment_record(device: torch.device) -> dict[str, Any]:
    """env.json: versions, device and git commit, so a result can be traced to what produced it."""
    import monai
    import nibabel

    from brats_swap import __version__

    record: dict[str, Any] = {
        "brats_swap": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "monai": monai.__version__, "nibabel": nibabel.__version__, "numpy": np.__version__,
        "platform": platform.platform(), "hostname": platform.node(), "device": str(device),
        "cpu_threads": torch.get_num_threads(), "command": " ".join(sys.argv),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(cuda=torch.version.cuda, gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 2))
    try:
        repo = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=False).stdout.strip()
        record["git_commit"] = commit or None
    except (OSError, subprocess.SubprocessError):
        record["git_commit"] = None
    return record


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class StopSignals:
    """Ctrl-C (and SIGTERM if `handle_sigterm`) set a flag; the loop stops after the running step.

    A second Ctrl-C raises KeyboardInterrupt at once. Handlers can only be installed from the main
    thread; elsewhere the flag simply never turns on.
    """

    def __init__(self, handle_sigterm: bool) -> None:
        self.requested: str | None = None
        self.signals = [signal.SIGINT] + ([signal.SIGTERM] if handle_sigterm else [])
        self.previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        console.print(f"[bold yellow]{self.requested}:[/] finishing this step and saving checkpoint_latest.pt "
                      "(Ctrl-C again to abort without saving)", markup=True)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------------------------------
# The recipe


def train_fold(
    config: Config, run_dir: Path, fold: int = 0, *, resume: bool = False,
    stop_requested: Callable[[], bool] | None = None, progress: bool = True,
) -> TrainResult:
    """Train fold `fold` of `run_dir` with `config` (see the module docstring for the recipe).

    Args:
        config: resolved configuration.
        run_dir: run folder; `config.yaml`, `env.json`, `splits.json` are written there, the fold's
            checkpoints and logs into `run_dir/fold_<fold>/`.
        fold: which fold of `splits.json` (made from `list_prepared(data.cache)` if absent).
        resume: continue from `fold_<k>/checkpoint_latest.pt` (falling back to `checkpoint_prev.pt`);
            start fresh with a warning if there is none; return at once if the fold already finished.
        stop_requested: polled at each epoch boundary; when it returns True, the latest checkpoint is
            saved and the result comes back with `interrupted=True`. A caller that passes it owns
            SIGTERM; otherwise SIGTERM is handled like Ctrl-C.
        progress: show a rich progress bar per epoch.

    Returns:
        TrainResult.

    Raises:
        ConfigError: the fold already has checkpoints and `resume` is False; bad device.
        DataError: no prepared cases / unusable cache.
        CheckpointError: the checkpoints exist but none is readable.
        NumericalError: the loss became NaN/Inf (names epoch and step).
        DeviceOutOfMemoryError: CUDA out of memory (suggests memory.mode=auto).
        TrainingInterrupted: Ctrl-C/SIGTERM; checkpoint_latest.pt holds the state at the last finished step.
    """
    run_dir = Path(run_dir)
    fold_dir = fold_dir_of(run_dir, fold)
    # Under torchrun: join the process group, one device per rank (see brats_swap/distributed.py).
    ctx = init_distributed(config.train.device)
    device = ctx.device

    # ---- resume state (read before anything is written; rank 0 reads, every rank gets the same state) ----
    state = run_on_main(ctx, _resume_state, config, fold_dir, resume)
    if state is not None and state["finished"] and not _can_extend(state, config):
        return _result_from_state(state, fold, fold_dir)

    with torch_settings(config, device), StopSignals(handle_sigterm=stop_requested is None) as signals:
        return _train(config, run_dir, fold, fold_dir, device, state, stop_requested, signals, progress, ctx=ctx)


def _resume_state(config: Config, fold_dir: Path, resume: bool) -> dict[str, Any] | None:
    """The checkpoint state to continue from (None = start fresh); raises if the fold must not be overwritten."""
    state: dict[str, Any] | None = None
    if resume:
        loaded = load_latest(fold_dir, warn=warn)
        if loaded is None:
            warn(f"{fold_dir}: no checkpoint to resume from; starting the fold from scratch")
        else:
            state, used = loaded
            changed = diff_configs(config_from_saved(state["config"]), config)
            _check_same_architecture(state, config, changed, used)
            if changed:
                warn(f"{used}: config differs from the checkpoint's in {', '.join(changed)}; continuing with the new values")
    elif (fold_dir / LATEST).exists():
        raise ConfigError(f"{fold_dir}: already holds checkpoints; pass --resume to continue it, "
                          "or choose another --run folder")
    return state


def _check_same_architecture(state: dict[str, Any], config: Config, changed: list[str], used: Path) -> None:
    """Refuse, before anything is written, a --resume whose model cannot load the checkpoint's weights."""
    expected = {k: tuple(v.shape) for k, v in build_model(config.model, out_channels=3).state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in state["model"].items()}
    if expected != saved:
        keys = [k for k in changed if k.startswith(("model.", "data.modalities"))] or ["model"]
        raise ConfigError(f"{used}: {', '.join(keys)} differs from the checkpoint's model; the architecture "
                          "cannot change on --resume (train it in a new --run folder)")


def _can_extend(state: dict[str, Any], config: Config) -> bool:
    # A fold that ran out of epochs (not early-stopped) continues when max_epochs was raised.
    return not state["stopped_early"] and config.train.max_epochs > state["epoch"]


def _result_from_state(state: dict[str, Any], fold: int, fold_dir: Path) -> TrainResult:
    return TrainResult(
        fold=fold, epochs_completed=state["epoch"], best_epoch=state["best_epoch"],
        best_val_dice=state["best_val_dice"], stopped_early=state["stopped_early"], finished=state["finished"],
        peak_memory_bytes=state.get("peak_memory_bytes", 0), history=list(state.get("history", [])),
        fold_dir=fold_dir,
    )


def _train(config: Config, run_dir: Path, fold: int, fold_dir: Path, device: torch.device,
           state: dict[str, Any] | None, stop_requested: Callable[[], bool] | None, signals: StopSignals,
           show_progress: bool, ctx: DistContext | None = None) -> TrainResult:
    ctx = ctx if ctx is not None else DistContext(device=device)
    show_progress = show_progress and ctx.is_main  # rank 0 draws; the other ranks write nothing at all
    train_cfg = config.train
    cache = Path(config.data.cache)

    # ---- run folder ----
    case_ids = list_prepared(cache) if cache.exists() else []
    if not case_ids:
        raise DataError(f"{cache}: no prepared cases (data.cache); run `brats-swap data prepare` first")
    if ctx.is_main:
        fold_dir.mkdir(parents=True, exist_ok=True)
        # A run killed mid-write (SIGKILL, power loss) leaves checkpoint-sized temp files; their writer is gone.
        remove_stale_temp_files(run_dir)
        remove_stale_temp_files(fold_dir)
        if not (run_dir / CONFIG_FILE).exists():
            atomic_write_text(run_dir / CONFIG_FILE, config_to_yaml(config))
        atomic_write_json(run_dir / ENV_FILE, {**environment_record(device), "world_size": ctx.world_size})
    splits = run_on_main(ctx, load_or_create_splits, run_dir, case_ids, config.cv.folds, config.seed)
    train_ids, val_ids = fold_cases(splits, fold)
    edition = load_prepared(cache, train_ids[0]).meta["edition"]

    # ---- model, memory engine, optimiser ----
    seed_everything(config.seed)
    model = build_model(config.model, out_channels=3).to(device)
    sample_shape = tuple(train_cfg.patch if train_cfg.mode == "patch" else config.data.cube)
    input_shape = (train_cfg.batch_size, config.model.in_channels, *sample_shape)
    memory_cfg = config.memory
    if memory_cfg.mode == "auto":
        memory_cfg = run_on_main(ctx, plan_memory, config, model, fold_dir, input_shape, device, reuse=state is not None)
    engine = MemoryEngine(model, memory_cfg, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=train_cfg.lr, eps=train_cfg.adam_eps,
                                 weight_decay=train_cfg.weight_decay)
    # Keras reduces when `wait >= patience`, torch when `bad_epochs > patience`: patience - 1 matches Keras.
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=train_cfg.plateau_factor, patience=max(0, train_cfg.plateau_patience - 1),
        threshold=1e-4, threshold_mode="abs")
    scaler = torch.amp.GradScaler(device.type, enabled=train_cfg.amp == "fp16")
    data = build_train_data(config, train_ids, val_ids, edition=edition, fold=fold, device=device, ctx=ctx)

    # ---- counters (fresh, or from the checkpoint) ----
    counters: dict[str, Any] = {
        "epoch": 0, "step_in_epoch": 0, "global_step": 0, "epoch_loss_sum": 0.0, "epoch_elapsed": 0.0,
        "epoch_start_loader_state": None, "best_val_dice": None, "best_epoch": None, "best_val_loss": math.inf,
        "last_improved_epoch": 0, "stopped_early": False, "finished": False, "history": [],
        "peak_memory_bytes": 0,
    }
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty when saved with fp16 off; loading {} into an enabled scaler raises
            scaler.load_state_dict(state["scaler"])
        counters.update({k: state[k] for k in counters if k in state})
        counters["finished"] = False  # only reached when max_epochs was raised (see _can_extend)
        rng_ranks = state.get("rng_ranks") or []
        restore_rng_states(rng_ranks[ctx.rank] if len(rng_ranks) == ctx.world_size else state["rng"], data.generator)
        if counters["step_in_epoch"] > 0 and counters["epoch_start_loader_state"] is not None:
            # Mid-epoch: the loader iterator is re-created, so it must draw from the epoch's starting state.
            data.generator.set_state(counters["epoch_start_loader_state"])

    # DDP averages the gradients in backward; `model` stays the plain module (state dicts, validation).
    train_model = wrap_ddp(model, ctx)
    if ctx.rank > 0 and state is None:
        torch.manual_seed(config.seed + 7919 * ctx.rank)  # own dropout masks per rank (weights come from rank 0)

    def snapshot() -> dict[str, Any]:
        rng = capture_rng_states(data.generator)
        snap = {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng, "config": config_to_dict(config),
            "memory": dataclasses.asdict(memory_cfg), "edition": edition, "fold": fold, **counters,
        }
        if ctx.is_distributed:  # collective: every rank calls snapshot() at the same points
            snap["rng_ranks"] = gather_objects(rng, ctx)
            snap["world_size"] = ctx.world_size
        return snap

    def save(path: Path, keep_previous: bool = False) -> None:
        snap = snapshot()
        if ctx.is_main:
            save_checkpoint(snap, path, keep_previous=keep_previous)

    def save_latest() -> None:
        save(fold_dir / LATEST, keep_previous=True)

    # Ranks other than 0 log into nothing (os.devnull, a null TensorBoard writer).
    log = open(fold_dir / TRAIN_LOG if ctx.is_main else os.devnull, "a", encoding="utf-8")  # noqa: SIM115 - closed in finally
    from torch.utils.tensorboard import SummaryWriter

    # purge_step drops events a crashed run logged after the checkpoint we resume from.
    writer = (SummaryWriter(str(fold_dir / "tb"), purge_step=counters["epoch"] + 1 if state is not None else None)
              if ctx.is_main else NullSummaryWriter())
    n_params = sum(p.numel() for p in model.parameters())
    start_line = (f"{'resume' if state is not None else 'start'} fold {fold} at epoch {counters['epoch'] + 1}"
                  f" step {counters['step_in_epoch']}: {len(train_ids)} train / {len(val_ids)} val cases, "
                  f"{data.steps_per_epoch} steps/epoch, mode {train_cfg.mode} {list(sample_shape)}, "
                  f"{n_params:,} parameters, device {device}, memory.mode {memory_cfg.mode}, amp {train_cfg.amp}"
                  + (f", {ctx.world_size} ranks ({ctx.backend}), global batch {ctx.world_size * train_cfg.batch_size}"
                     if ctx.is_distributed else ""))
    _log_line(log, start_line)

    result = TrainResult(fold=fold, fold_dir=fold_dir)
    started = time.perf_counter()
    try:
        while counters["epoch"] < train_cfg.max_epochs and not counters["finished"]:
            epoch = counters["epoch"]
            if counters["step_in_epoch"] == 0:
                if stop_requested is not None and broadcast_object(stop_requested(), ctx):
                    save_latest()
                    result.interrupted = True
                    _log_line(log, f"stop requested at the start of epoch {epoch + 1}; state saved")
                    break
                counters["epoch_start_loader_state"] = data.generator.get_state()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

            # ---- train one epoch ----
            train_loss, step_seconds, memory_stats = _train_epoch(
                config, train_model, engine, optimizer, scaler, data, counters, device, signals, save_latest, show_progress,
                fold_dir, ctx=ctx)

            # ---- validate ----
            record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": train_loss,
                                      "lr": optimizer.param_groups[0]["lr"], "step_s": step_seconds}
            is_last = epoch + 1 >= train_cfg.max_epochs
            if (epoch + 1) % train_cfg.val_every == 0 or is_last:
                val_started = time.perf_counter()
                val = validate(config, model, data.val_loader, edition, device, ctx=ctx)
                record.update(val, val_seconds=time.perf_counter() - val_started)
                scheduler.step(val["val_loss"])
                mean_dice = float(np.mean([val[f"dice_{r.lower()}"] for r in REGIONS]))
                record["val_dice_mean"] = mean_dice
                # Early stopping follows Keras' EarlyStopping(monitor=val_loss, min_delta=0, patience=50).
                if val["val_loss"] < counters["best_val_loss"]:
                    counters["best_val_loss"] = val["val_loss"]
                    counters["last_improved_epoch"] = epoch + 1
                elif epoch + 1 - counters["last_improved_epoch"] >= train_cfg.early_stop_patience:
                    counters["stopped_early"] = True
                if counters["best_val_dice"] is None or mean_dice > counters["best_val_dice"]:
                    counters["best_val_dice"], counters["best_epoch"] = mean_dice, epoch + 1
                    record["best"] = True

            # ---- bookkeeping, logs, checkpoints ----
            epoch_seconds = counters["epoch_elapsed"] + record.get("val_seconds", 0.0)
            peak = int(all_reduce_max(peak_memory_bytes(device), ctx))  # the largest rank's
            counters["peak_memory_bytes"] = max(counters["peak_memory_bytes"], peak)
            record.update(epoch_s=epoch_seconds, peak_memory_gib=peak / 2**30)
            counters["history"].append(record)
            counters["epoch"] = epoch + 1
            counters["step_in_epoch"] = 0
            counters["epoch_loss_sum"] = 0.0
            counters["epoch_elapsed"] = 0.0
            counters["finished"] = counters["stopped_early"] or counters["epoch"] >= train_cfg.max_epochs
            result.epoch_seconds.append(epoch_seconds)

            line = _log_epoch(log, writer, record, memory_stats, train_cfg.max_epochs)
            if show_progress and not console.is_terminal:
                console.print(line, markup=False, soft_wrap=True)
            if record.get("best"):
                save(fold_dir / BEST)
            save_latest()
            if counters["stopped_early"]:
                _log_line(log, f"early stopping: val loss has not improved for {train_cfg.early_stop_patience} epochs "
                               f"(best {counters['best_val_loss']:.4f} at epoch {counters['last_improved_epoch']})")
            if not counters["finished"] and any_rank(signals.requested is not None, ctx):
                _log_line(log, f"{signals.requested} after epoch {epoch + 1}; state saved")
                raise TrainingInterrupted(f"{fold_dir}: {signals.requested} after epoch {epoch + 1}; state saved to "
                                          f"{LATEST}, continue with --resume")
    finally:
        result.train_seconds = time.perf_counter() - started
        engine.close()  # hooks and recompute wrappers off: the model is plain again
        writer.close()
        log.close()

    result.epochs_completed = counters["epoch"]
    result.best_epoch = counters["best_epoch"]
    result.best_val_dice = counters["best_val_dice"]
    result.stopped_early = counters["stopped_early"]
    result.finished = counters["finished"]
    result.peak_memory_bytes = counters["peak_memory_bytes"]
    result.history = list(counters["history"])
    return result


def _train_epoch(config: Config, model, engine, optimizer, scaler, data, counters: dict[str, Any],
                 device: torch.device, signals: StopSignals, save_latest: Callable[[], None], show_progress: bool,
                 fold_dir: Path, ctx: DistContext | None = None) -> tuple[float, float, dict[str, float]]:
    """One epoch (or the rest of one after a mid-epoch resume). Returns mean loss, s/step, mean memory stats."""
    ctx = ctx if ctx is not None else DistContext(device=device)
    epoch = counters["epoch"]
    batch_size = config.train.batch_size
    data.sampler.set_epoch(epoch, start=counters["step_in_epoch"] * batch_size)
    model.train()
    memory_sums: dict[str, float] = {}
    step_times: list[float] = []
    total = data.steps_per_epoch
    progress = progress_bar(
        f"epoch {epoch + 1}/{config.train.max_epochs}", TextColumn("{task.fields[info]}"),
        # Off when stderr is not a terminal (CI, SLURM logs): `train_fold` prints one line per epoch instead.
        console=console, transient=True, disable=not (show_progress and console.is_terminal),
    )
    with progress:
        task = progress.add_task("train", total=total, completed=counters["step_in_epoch"], info="")
        last_step_end = time.perf_counter()
        for batch in data.train_loader:
            step_started = time.perf_counter()
            images = batch["image"].to(device, non_blocking=True)
            targets = batch["target"].to(device, non_blocking=True)
            step = counters["step_in_epoch"]
            try:
                with autocast_context(device, config.train.amp), engine.step():
                    probs = model(images)
                    loss = weighted_dice_loss(probs, targets)
                loss_value = all_reduce_mean(float(loss.detach()), ctx)  # the global batch's loss, on every rank
                if not math.isfinite(loss_value):
                    raise NumericalError(
                        f"{fold_dir}: loss is {loss_value} at epoch {epoch + 1} step {step + 1}; training stopped, "
                        f"the last good checkpoint is kept (try train.amp=none or a lower train.lr)")
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            except torch.OutOfMemoryError:
                raise out_of_memory_error(device, config, f"{fold_dir}: epoch {epoch + 1} step {step + 1}",
                                          getattr(engine, "cfg", None)) from None

            stats = engine.last_stats()
            if stats is not None:
                for key, value in stats.as_dict().items():
                    memory_sums[key] = memory_sums.get(key, 0.0) + float(value)
            counters["step_in_epoch"] = step + 1
            counters["global_step"] += 1
            counters["epoch_loss_sum"] += loss_value
            step_end = time.perf_counter()
            step_times.append(step_end - step_started)
            counters["epoch_elapsed"] += step_end - last_step_end  # includes waiting for data
            last_step_end = step_end
            mean_loss = counters["epoch_loss_sum"] / counters["step_in_epoch"]
            progress.update(task, advance=1, info=(
                f"loss {mean_loss:.4f}  {np.mean(step_times):.2f} s/step  "
                f"mem {peak_memory_bytes(device) / 2**30:.2f} GiB"))

            if counters["step_in_epoch"] < total and any_rank(signals.requested is not None, ctx):
                save_latest()  # mid-epoch state: resume continues with the next step of this epoch
                raise TrainingInterrupted(
                    f"{fold_dir}: {signals.requested or 'stop on another rank'} at epoch {epoch + 1} "
                    f"step {counters['step_in_epoch']}; "
                    f"state saved to {LATEST}, continue with --resume")
    steps = max(counters["step_in_epoch"], 1)
    memory_means = {k: v / max(len(step_times), 1) for k, v in memory_sums.items()}
    return counters["epoch_loss_sum"] / steps, float(np.mean(step_times)) if step_times else 0.0, memory_means


@torch.no_grad()
def validate(config: Config, model: torch.nn.Module, loader, edition: str, device: torch.device,
             ctx: DistContext | None = None) -> dict[str, float]:
    """Mean val loss and Dice WT/TC/ET on whole cubes (sliding window for patch models), BraTS empty rules.

    Means are over cases. Distributed, each rank scores its share of the cases and the per-case results are
    gathered; DistributedSampler pads the last share with repeated cases, which are counted once.
    """
    model.eval()
    per_case: dict[str, tuple[float, ...]] = {}
    for batch in loader:
        probs = predict_cube(model, batch["image"], config, device)
        labels = labels_from_probs(probs, edition, config.model.outputs, config.evaluate.threshold).numpy()
        for i, (case_id, pred, true) in enumerate(zip(batch["case_id"], labels, batch["label"].numpy(), strict=True)):
            metrics = case_metrics(pred, true, edition, hd95=False)
            loss = float(weighted_dice_loss(probs[i:i + 1], batch["target"][i:i + 1]))
            per_case[case_id] = (loss, *(float(metrics[f"dice_{r.lower()}"]) for r in REGIONS))
    model.train()
    if ctx is not None and ctx.is_distributed:
        per_case = {case: row for part in gather_objects(per_case, ctx) for case, row in part.items()}
    rows = np.array([per_case[case] for case in sorted(per_case)], dtype=np.float64)
    out = {"val_loss": float(rows[:, 0].mean())}
    out.update({f"dice_{r.lower()}": float(rows[:, 1 + i].mean()) for i, r in enumerate(REGIONS)})
    return out


def _log_line(log, line: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    log.write(f"{stamp} {line}\n")
    log.flush()


def _log_epoch(log, writer, record: dict[str, Any], memory_stats: dict[str, float], max_epochs: int) -> str:
    epoch = record["epoch"]
    parts = [f"epoch {epoch}/{max_epochs}", f"train_loss {record['train_loss']:.4f}"]
    writer.add_scalar("train/loss", record["train_loss"], epoch)
    writer.add_scalar("lr", record["lr"], epoch)
    writer.add_scalar("time/step_s", record["step_s"], epoch)
    writer.add_scalar("time/epoch_s", record["epoch_s"], epoch)
    writer.add_scalar("memory/peak_gib", record["peak_memory_gib"], epoch)
    for key, value in memory_stats.items():
        writer.add_scalar(f"memory/{key.removeprefix('memory/')}", value, epoch)
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
        writer.add_scalar("val/loss", record["val_loss"], epoch)
        for region in REGIONS:
            key = f"dice_{region.lower()}"
            parts.append(f"{key} {record[key]:.4f}")
            writer.add_scalar(f"val/{key}", record[key], epoch)
    parts += [f"lr {record['lr']:.3g}", f"{record['step_s']:.2f} s/step", f"epoch {record['epoch_s']:.1f} s",
              f"peak {record['peak_memory_gib']:.2f} GiB"]
    if record.get("best"):
        parts.append("best")
    line = "  ".join(parts)
    _log_line(log, line)
    writer.flush()
    return line


def summary_panel(result: TrainResult, config: Config) -> Panel:
    """The one-screen summary printed after training."""
    table = Table(show_header=True, header_style="bold")
    table.add_column("epoch", justify="right")
    table.add_column("train loss", justify="right")
    table.add_column("val loss", justify="right")
    for region in REGIONS:
        table.add_column(f"Dice {region}", justify="right")
    table.add_column("s/step", justify="right")
    history = result.history
    shown = history if len(history) <= 12 else history[:3] + history[-9:]
    for record in shown:
        val = "val_loss" in record
        table.add_row(
            f"{record['epoch']}{' *' if record.get('best') else ''}", f"{record['train_loss']:.4f}",
            f"{record['val_loss']:.4f}" if val else "",
            *[f"{record[f'dice_{r.lower()}']:.3f}" if val else "" for r in REGIONS],
            f"{record['step_s']:.2f}",
        )
    if result.finished:
        status = "stopped early" if result.stopped_early else "finished"
    else:
        status = "interrupted (resume with --resume)" if result.interrupted else "not finished"
    best = (f"best mean val Dice {result.best_val_dice:.4f} at epoch {result.best_epoch} (*)"
            if result.best_val_dice is not None else "no validation yet")
    lines = (f"fold {result.fold}: {status} after {result.epochs_completed} epoch(s); {best}\n"
             f"time {result.train_seconds:.1f} s this call; peak memory {result.peak_memory_bytes / 2**30:.2f} GiB; "
             f"checkpoints in {result.fold_dir}")
    from rich.console import Group

    return Panel(Group(table, lines), title=f"[bold]{config.name}[/] training summary", expand=False)
