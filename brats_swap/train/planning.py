"""Memory planning for the project's model and configs: the memory policy of a fold (`memory.mode: auto`
planned once), `brats-swap plan`, its timeline figure, and the out-of-memory advice.

`brats_swap.memory` plans any model given its loss and the dtype its activations are saved in; it knows
nothing about config files, the U-Net or AMP settings. This module is where the two meet: it builds
the project's model, passes the training loss, and prices activations in `amp_dtype(train.amp)`, the one
answer to which dtype training computes in.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from brats_swap.atomic import atomic_write_json
from brats_swap.config import Config, ConfigError, DataConfig, MemoryConfig, validate_memory_config
from brats_swap.config.loader import from_dict
from brats_swap.data.challenges import get_challenge
from brats_swap.data.discovery import check_forced_convention, resolve_convention
from brats_swap.errors import DeviceOutOfMemoryError
from brats_swap.memory.arena import arena_bytes, available_host_bytes, check_host_memory
from brats_swap.memory.budget import BUDGET_HEADROOM, with_inflight_window, with_overhead
from brats_swap.memory.compiled import compile_wanted
from brats_swap.memory.planner import GIB, Planner, PlanReport, choose_policy, plan_report, resolve_cost_model
from brats_swap.memory.presets import named_policies
from brats_swap.memory.records import SWAP_MODES, effective_memory_config
from brats_swap.memory.rulebook import transfer_bytes
from brats_swap.memory.stages import check_globs
from brats_swap.model import build_model
from brats_swap.model.targets import run_output_count
from brats_swap.run.console import console
from brats_swap.run.device import amp_dtype
from brats_swap.run.figures import pyplot, savefig_deterministic
from brats_swap.run.folder import FoldFolder
from brats_swap.train.data import LOADER_PREFETCH_FACTOR, loader_worker_count
from brats_swap.train.device_augment import arrived_batch_bytes, augment_buffers
from brats_swap.train.losses import training_loss, weighted_dice_loss
from brats_swap.train.shared_batches import BATCH_SLOTS

# `brats-swap plan --dtype`: the dtype activations are priced in (default: the one `train.amp` trains in).
PLAN_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16}
# Device bytes of optimizer state per parameter byte: Adam keeps two moments, SGD with momentum one buffer.
OPTIMIZER_STATE_FACTOR = {"adam": 2, "adamw": 2, "sgd": 1}
GLIOMA_LABEL_VALUES = 4  # background and the three tumour labels of every glioma table (2017-2021, GLI)


def optimizer_state_factor(config: Config) -> int:
    """What `train.optimizer` keeps on the device per parameter, in parameters."""
    return OPTIMIZER_STATE_FACTOR[config.train.optimizer]


def training_input_shape(config: Config) -> tuple[int, ...]:
    """(batch, channels, D, H, W) of one training step: the cube, or the patch in `train.mode: patch`."""
    sample = config.train.patch if config.train.mode == "patch" else config.data.cube
    return (config.train.batch_size, config.model.in_channels, *sample)


def augmentation_bytes(config: Config, table: str | None = None) -> int:
    """Device bytes the batch's augmentation holds before each forward (`train.augment` on the device, freed
    when the forward starts): the planner's `prelude_bytes`. The label values are those of `table` (the
    run's), else of the table the config forces, else of the glioma tables (0 and three tumour labels)."""
    table = table or configured_table(config.data)
    num_labels = 1 + len(get_challenge(table).label_values) if table else GLIOMA_LABEL_VALUES
    batch, channels, *sample = training_input_shape(config)
    return augment_buffers(config.train.augment, batch, channels, sample, num_labels,
                           patch_mode=config.train.mode == "patch")


def configured_table(data_cfg: DataConfig) -> str | None:
    """The label table the config itself forces (`data.challenge`, else `data.edition`), or None when both are
    auto and only the prepared cases can say (training reads it from them)."""
    if data_cfg.challenge == "auto" and data_cfg.edition == "auto":
        return None
    check_forced_convention(data_cfg.edition, data_cfg.challenge)
    return resolve_convention("", None, data_cfg.edition, data_cfg.challenge)


def config_model(config: Config, out_channels: int | None = None) -> torch.nn.Module:
    """The run's network without its cases at hand (`brats-swap plan`, the OOM advice): `out_channels`
    outputs, else `run_output_count` of the table the config forces (4 for PED, 1 for MEN-RT), else
    `build_model`'s default (the 3 of every glioma table with the default `model` section)."""
    if out_channels is None:
        table = configured_table(config.data)
        if table is None:
            return build_model(config.model)
        out_channels = run_output_count(table, config.model)
    return build_model(config.model, out_channels)


def swap_arena_bytes(model: torch.nn.Module, memory_cfg: MemoryConfig, input_shape: tuple[int, ...],
                     dtype: torch.dtype, loss_fn=weighted_dice_loss) -> int:
    """Host bytes of the arena that holds one step's swapped storages under the resolved policy `memory_cfg`
    (`MemoryEngine(arena_bytes=...)`); 0 for a mode that does not swap.

    The planner traces one step of `model` on the meta device (seconds, no memory) and predicts exactly the
    storages the engine swaps; each takes its size on the link (`rulebook.transfer_bytes`: half of an fp32
    storage with `swap.compress: bf16`), rounded as the arena hands out slices. Sized up front, the arena is
    allocated before the first step, so a host without the memory fails then with a one-line error.
    Under torchrun every rank on this host (`LOCAL_WORLD_SIZE`) holds such an arena: the host is checked
    here for all of them at once, before any allocates (this runs on rank 0, the others wait for it).
    """
    if memory_cfg.mode not in SWAP_MODES:
        return 0
    planner = Planner(model, input_shape, dtype=dtype, loss_fn=loss_fn)
    swapped = planner.swapped(memory_cfg)
    nbytes = arena_bytes(transfer_bytes(record, memory_cfg.swap) for record in planner.records(memory_cfg)
                         if record.index in swapped)
    check_host_memory(nbytes, ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return nbytes


@dataclasses.dataclass
class HostMemory:
    """Host memory one training process needs beyond its own code: the pinned swap arena of its memory
    policy, the batches its loader workers hold ahead (pinned on CUDA) and each worker's reusable
    shared-memory batch buffers (`train/shared_batches.py`)."""

    arena_bytes: int
    loader_bytes: int
    loader_workers: int
    batch_bytes: int  # one batch: float16 images and uint8 labels
    available_bytes: int | None  # what this machine has available now (None: unknown)

    @property
    def total_bytes(self) -> int:
        return self.arena_bytes + self.loader_bytes

    def line(self) -> str:
        loader = (f"{self.loader_workers} loader workers x ({LOADER_PREFETCH_FACTOR} pinned batches ahead + "
                  f"{BATCH_SLOTS} shared-memory buffers) x "
                  f"{self.batch_bytes / GIB:.2f} GiB" if self.loader_workers else "no loader workers")
        text = (f"host memory: {self.total_bytes / GIB:.2f} GiB = {self.arena_bytes / GIB:.2f} GiB pinned swap arena "
                f"+ {self.loader_bytes / GIB:.2f} GiB of loader batches ({loader}; float16 images + labels)")
        if self.available_bytes is not None:
            text += f"; this machine has {self.available_bytes / GIB:.2f} GiB available"
        return text

    @property
    def exceeds_machine(self) -> bool:
        return self.available_bytes is not None and self.total_bytes > self.available_bytes


def batch_host_bytes(config: Config) -> int:
    """Bytes of one training batch as the loader hands it over: `train.batch_size` samples of float16
    images (`model.in_channels` channels) and uint8 labels, each the crop a worker reads (the cube, the patch,
    or nnU-Net's enlarged patch: the recipe's `crop_size`)."""
    batch, channels, *sample = training_input_shape(config)
    return arrived_batch_bytes(config.train.augment, batch, channels, sample, config.train.mode == "patch")


def host_memory(config: Config, arena: int, workers: int | None = None) -> HostMemory:
    """What one process of `config` holds in host memory besides itself, given its swap arena's bytes;
    `workers`: its loader workers where they are not this machine's (`data.loader_workers` resolved here)."""
    workers = loader_worker_count(config.data) if workers is None else workers
    batch = batch_host_bytes(config)
    return HostMemory(arena_bytes=int(arena), loader_bytes=workers * (LOADER_PREFETCH_FACTOR + BATCH_SLOTS) * batch,
                      loader_workers=workers, batch_bytes=batch, available_bytes=available_host_bytes())


def arena_bound_bytes(config: Config) -> int:
    """The swap arena `config.memory` will allocate, before any device is at hand (`cv --submit`): the
    arena of its policy; for `memory.mode: auto`, whose policy is chosen on the device, that of swapping
    every eligible storage (no plan swaps more); 0 for a mode that never swaps."""
    memory = config.memory
    if memory.mode == "auto":
        memory = named_policies(memory)["swap_all"]
    if memory.mode not in SWAP_MODES:
        return 0
    model = config_model(config)
    planner = Planner(model, training_input_shape(config), dtype=amp_dtype(config.train.amp),
                      loss_fn=training_loss(config.train.loss, model))
    return planner.arena_bytes(effective_memory_config(memory))


def priced_compiled(config: Config, device: torch.device | str) -> tuple[bool, str]:
    """Whether the planner prices the compiled step for a run of `config` on `device` ("gpu": a GPU's time model
    without one at hand), and why in words: exactly when `train.compile` compiles the step there
    (`compile_wanted`: `auto` compiles on CUDA). docs/planner.md#compiled-steps."""
    device = torch.device("cuda" if device == "gpu" else device)
    setting = config.train.compile
    compiled = compile_wanted(setting, device)
    if setting == "auto":
        return compiled, f"train.compile auto {'compiles on CUDA' if compiled else 'runs eager on the CPU'}"
    return compiled, f"train.compile {str(setting).lower()}"


def plan_memory(config: Config, model: torch.nn.Module, folder: FoldFolder, input_shape: tuple[int, ...],
                device: torch.device, reuse: bool, table: str | None = None) -> MemoryConfig:
    """The fold's memory policy, resolved once: what the engine runs, the checkpoint saves and the run records.

    `memory.mode: auto` asks the planner for the fastest policy that fits `memory.budget_gib` and
    records the plan in the fold's `memory_plan.json`; a resumed fold (`reuse`) reads it back instead of
    planning again. Every mode then goes through `effective_memory_config` (e.g. `recompute` with nothing
    to recompute means norm_act), so the result is the concrete policy, never `auto`. The plan counts the
    augmentation's device buffers (`augmentation_bytes`, labels of the run's `table`). A step that
    `train.compile` compiles on `device` is priced compiled (docs/planner.md#compiled-steps).
    """
    check_globs(model, config.memory)
    if config.memory.mode != "auto":
        return with_inflight_window(effective_memory_config(config.memory), device)
    plan_path = folder.memory_plan
    if reuse and plan_path.exists():
        saved = json.loads(plan_path.read_text(encoding="utf-8"))
        return effective_memory_config(from_dict(MemoryConfig, saved["memory"], "memory"))
    compiled, step_reason = priced_compiled(config, device)
    chosen, report = choose_policy(model, config.memory, input_shape, amp_dtype(config.train.amp), device,
                                   loss_fn=training_loss(config.train.loss, model),
                                   optimizer_state_factor=optimizer_state_factor(config),
                                   prelude_bytes=augmentation_bytes(config, table), compiled=compiled)
    report.step_reason = step_reason
    chosen = effective_memory_config(chosen)
    atomic_write_json(plan_path, {"memory": dataclasses.asdict(chosen), "report": report.as_dict(),
                                  "input_shape": list(input_shape), "device": str(device)})
    console.print(f"memory.mode=auto: planner chose mode={chosen.mode} (plan in {plan_path})")
    return chosen


def out_of_memory_error(device: torch.device, config: Config, where: str,
                        memory_cfg: MemoryConfig | None = None, *,
                        out_channels: int | None = None) -> DeviceOutOfMemoryError:
    """The OOM message with the planner's advice for this model, size and device: what the running policy
    `memory_cfg` (the one `plan_memory` resolved; default `config.memory`) needs, and (on CUDA) the policy
    the planner would pick for this card. `out_channels`: the trained network's outputs (None: those of the
    table the config forces, `config_model`)."""
    memory_cfg = memory_cfg or config.memory
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    budget = f"{total:.0f}" if total else "N"  # the card: the planner leaves the device overhead and headroom
    shape = training_input_shape(config)
    needs = pick = ""
    try:  # advice only: whatever goes wrong here must not hide the out-of-memory error itself
        model = config_model(config, out_channels)
        dtype = amp_dtype(config.train.amp)
        # Priced for the device that ran out: on CUDA a GPU's time model (assumed, not measured: the device
        # is full), on the configured link when `memory.bandwidth_gbs` names one.
        loss_fn = training_loss(config.train.loss, model)
        cost = resolve_cost_model(model, "gpu" if device.type == "cuda" else "cpu", dtype, loss_fn=loss_fn,
                                  bandwidth_gbs=memory_cfg.bandwidth_gbs)
        planner = Planner(model, shape, dtype=dtype, loss_fn=loss_fn, cost=cost,
                          optimizer_state_factor=optimizer_state_factor(config),
                          prelude_bytes=augmentation_bytes(config))
        peak = planner.memory(memory_cfg).peak_bytes
        needs = f" the planner predicts it needs about {peak / GIB:.2f} GiB for input {list(shape)}"
        needs += f" on this {total:.0f} GiB device;" if total else ";"
        if total:
            best, _ = planner.auto(total * GIB, with_overhead(memory_cfg, device))
            if best is not None:
                pick = f" (its pick: {best.name}, about {best.peak_bytes / GIB:.2f} GiB)"
    except Exception:  # noqa: BLE001 - see above
        needs = ";"
    mode = memory_cfg.mode if config.memory.mode != "auto" else f"auto (planned {memory_cfg.mode})"
    if config.memory.mode == "auto":
        advice = "the planned policy did not fit; lower memory.budget_gib, or a smaller data.cube / train.patch"
    else:
        advice = (f"try --set memory.mode=auto --set memory.budget_gib={budget}{pick} (the planner picks what to "
                  "swap or recompute), or a smaller data.cube / train.patch")
    return DeviceOutOfMemoryError(f"{where}: {device} ran out of memory with memory.mode={mode};{needs} {advice}")


def prediction_out_of_memory_error(device: torch.device, config: Config, where: str) -> DeviceOutOfMemoryError:
    """The OOM message of validation's prediction, in the form of a training step's (`out_of_memory_error`). It
    runs without gradients, so nothing is saved for backward and the memory policy has nothing to act on: the
    advice is the prediction's own sizes (the whole `data.cube` at once, or `evaluate.sw_batch_size` windows of
    `train.patch` for patch models) and, where it is off, `train.amp`."""
    train = config.train
    if train.mode == "patch":
        what = f"the sliding window ({config.evaluate.sw_batch_size} window(s) of {list(train.patch)} at once)"
        advice = "try a smaller evaluate.sw_batch_size or train.patch"
    else:
        what = f"the whole cube {list(config.data.cube)} in one pass"
        advice = "try a smaller data.cube, or train.mode=patch (sliding-window validation)"
    if train.amp == "none":
        advice += ", or train.amp=bf16 (fp16 before Ampere: half the activation bytes)"
    return DeviceOutOfMemoryError(f"{where}: {device} ran out of memory predicting {what}; validation keeps no "
                                  f"activations for backward, so memory.mode does not change its peak; {advice}")


def plan_for_config(config: Config, *, batch: int | None = None,
                    budget_gib: float | None = None, dtype: str | None = None,
                    bandwidth_gbs: float | None = None, device: str = "auto",
                    profile: dict | None = None, run_device: str | None = None) -> tuple[PlanReport, Planner]:
    """`brats-swap plan`: the run's model at its training sample (the patch in `train.mode: patch`, else the
    cube; `plan --size` sets the cube, so the network's stages adapt to it) and batch, every policy priced.

    Activations are priced in `dtype` (fp32, bf16, fp16), by default in the dtype `train.amp` trains in.
    `budget_gib` and `bandwidth_gbs` replace `memory.budget_gib` / `memory.bandwidth_gbs` and are checked
    as those keys are. `device` picks the time model: "cuda" measures this machine's GPU (a short profile
    and a pinned copy loop), "cpu" uses CPU constants, "gpu" uses H200-class constants without measuring,
    and "auto" measures when CUDA is available and otherwise assumes an H200-class GPU. `profile` is a
    saved cost model (`--save-profile`) used instead of measuring. The network has the run's outputs
    (`config_model`: 4 for a PED run, 1 for MEN-RT). Peaks include the device overhead
    (`memory.device_overhead_gib`, default: the device's); the optimizer state is `train.optimizer`'s.
    The step is priced compiled where `train.compile` compiles on the device the run trains on: `run_device`
    ("cpu", "cuda"), by default the one `device` prices (a GPU for "gpu" and "auto").
    """
    cube = list(training_input_shape(config)[2:])
    batch = batch if batch is not None else config.train.batch_size
    if batch < 1:
        raise ConfigError(f"plan --batch: must be positive, got {batch}")
    if dtype is not None and dtype not in PLAN_DTYPES:
        raise ConfigError(f"plan --dtype: {dtype!r} is not one of fp32, bf16, fp16")
    torch_dtype = PLAN_DTYPES[dtype] if dtype is not None else amp_dtype(config.train.amp)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "gpu"
    if device not in ("cpu", "cuda", "gpu") and not device.startswith("cuda:"):
        raise ConfigError(f"plan --device: {device!r} is not one of auto, cpu, cuda, gpu")
    if device.startswith("cuda") and profile is None and not torch.cuda.is_available():
        raise ConfigError("plan --device cuda: CUDA is not available on this machine")
    memory = copy.deepcopy(config.memory)
    memory.budget_gib = budget_gib if budget_gib is not None else memory.budget_gib
    memory.bandwidth_gbs = bandwidth_gbs if bandwidth_gbs is not None else memory.bandwidth_gbs
    validate_memory_config(memory)
    memory = with_inflight_window(with_overhead(memory, device), device)
    model = config_model(config)
    check_globs(model, memory)
    loss_fn = training_loss(config.train.loss, model)
    cost = resolve_cost_model(model, device, torch_dtype, loss_fn=loss_fn, profile=profile,
                              bandwidth_gbs=memory.bandwidth_gbs)
    prelude = augmentation_bytes(dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=batch)))
    compiled, step_reason = priced_compiled(config, run_device or device)
    report, planner = plan_report(model, memory, (batch, config.model.in_channels, *cube), dtype=torch_dtype,
                                  cost=cost, loss_fn=loss_fn, optimizer_state_factor=optimizer_state_factor(config),
                                  prelude_bytes=prelude, compiled=compiled)
    report.step_reason = step_reason
    if report.chosen is None and report.budget_gib is not None:
        report.reason += "; " + no_fit_advice(config, report, smallest_fitting_budget(planner, memory, report), batch)
    return report, planner


# Tries of `smallest_fitting_budget` past the first estimate (a larger budget widens the in-flight window, so a
# swap plan's peak can grow with it), each this much larger.
_BUDGET_TRIES, _BUDGET_STEP = 4, 1.1


def smallest_fitting_budget(planner: Planner, memory: MemoryConfig, report: PlanReport) -> float | None:
    """The smallest budget (GiB, rounded up to 0.1) the auto-tuner finds a plan for, from the leanest priced
    policy's peak (its tensors are what `memory.budget.tensor_limit` must hold); None if none of the tries
    does."""
    overhead = report.device_overhead_gib
    leanest = min(p.peak_bytes for p in report.policies) / GIB
    budget = math.ceil(((leanest - overhead) / BUDGET_HEADROOM + overhead) * 10) / 10
    for _ in range(_BUDGET_TRIES):
        if planner.auto(budget * GIB, dataclasses.replace(memory, budget_gib=budget))[0] is not None:
            return budget
        budget = math.ceil(budget * _BUDGET_STEP * 10) / 10
    return None


def no_fit_advice(config: Config, report: PlanReport, smallest: float | None, batch: int) -> str:
    """What to change when nothing fits `report.budget_gib`: the smallest budget that does, and what to shrink."""
    fits = (f"the smallest budget that fits is {smallest:g} GiB (--budget {smallest:g}, memory.budget_gib: "
            f"{smallest:g})" if smallest is not None else "no budget tried up to the leanest plan's peak fits")
    if report.budget_gib <= report.device_overhead_gib:
        return (f"{fits}; {report.budget_gib:g} GiB is not above the device overhead of "
                f"{report.device_overhead_gib:g} GiB (memory.device_overhead_gib: what the card holds before a step), "
                "so no step fits it")
    sample = "train.patch" if config.train.mode == "patch" else "data.cube"
    shape = "x".join(map(str, training_input_shape(config)[2:]))
    lower = [f"{sample} (now {shape})"] + ([f"--batch / train.batch_size (now {batch})"] if batch > 1 else [])
    if config.train.amp == "none":
        lower.append("train.amp (bf16 halves the saved activations)")
    return f"{fits}; to fit {report.budget_gib:g} GiB, shrink {', '.join(lower)}"


_TIMELINE_COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "recompute": "#55A868", "stall": "#C44E52",
                    "d2h": "#8172B3", "h2d": "#937860"}


def _merged_bars(intervals: list[tuple[float, float, str]], gap: float, scale: float) -> list[tuple[float, float]]:
    """Touching intervals joined, as (start, width) bars in `scale` units: a thousand kernels draw as a few."""
    out: list[list[float]] = []
    for start, end, _ in sorted(intervals):
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s * scale, (e - s) * scale) for s, e in out]


def write_timeline_png(planner: Planner, cfg: MemoryConfig, path: str | Path, title: str = "") -> Path:
    """The predicted timeline of one step under `cfg` as a PNG (written atomically): compute, device-to-host
    and host-to-device lanes plus device memory over time, the layout of the IBM data-swapping paper's
    Figure 2."""
    plt = pyplot()
    timing = planner.time(cfg, keep_lanes=True)
    memory = planner.memory(cfg, keep_timeline=True)
    lanes, scale, gap = timing.lanes, 1e3, timing.step_s * 1e-4  # milliseconds
    fig, (ax_lanes, ax_mem) = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True,
                                           gridspec_kw={"height_ratios": [1.4, 1]})
    rows = [([i for i in lanes["compute"] if i[2] == "fwd"], "fwd", 3),
            ([i for i in lanes["compute"] if i[2] == "bwd"], "bwd", 3),
            ([i for i in lanes["compute"] if i[2] == "recompute"], "recompute", 3),
            (lanes["stall"], "stall", 3), (lanes["d2h"], "d2h", 2), (lanes["h2d"], "h2d", 1)]
    for intervals, kind, y in rows:
        bars = _merged_bars(intervals, gap, scale)
        if bars:
            ax_lanes.broken_barh(bars, (y - 0.35, 0.7), facecolors=_TIMELINE_COLORS[kind], label=kind)
    ax_lanes.set_yticks([1, 2, 3], ["H2D", "D2H", "compute"])
    ax_lanes.legend(loc="upper right", ncol=6, fontsize=8)
    ax_lanes.set_title(title or f"predicted step: {timing.step_s * 1e3:.1f} ms, "
                                f"exposed transfer {timing.exposed_transfer_s * 1e3:.1f} ms")

    times = [t * scale for t in timing.op_start[: len(memory.timeline)]]
    usage = [(used + memory.persistent_bytes) / GIB for used in memory.timeline]
    ax_mem.plot(times, usage, color="#333333", linewidth=1, drawstyle="steps-post")
    ax_mem.axhline(memory.peak_gib, color=_TIMELINE_COLORS["stall"], linestyle="--", linewidth=0.8,
                   label=f"peak {memory.peak_gib:.2f} GiB")
    if planner.budget_gib is not None:
        ax_mem.axhline(planner.budget_gib, color="black", linestyle=":", linewidth=0.8,
                       label=f"budget {planner.budget_gib:g} GiB")
    ax_mem.set_ylabel("device GiB")
    ax_mem.set_xlabel("time (ms)")
    ax_mem.set_ylim(bottom=0, top=max(max(usage), planner.budget_gib or 0) * 1.1)
    ax_mem.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    savefig_deterministic(fig, path, dpi=120)
    plt.close(fig)
    return path
