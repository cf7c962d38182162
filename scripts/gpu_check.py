"""GPU acceptance check of the memory engine, one shot: at most 8 minutes on one H100/H200, JSON written after
every stage, a single summary line last, exit code 1 when a stage failed. Sizes below are the largest; before
any stage they are fitted to the card's memory and the host's available memory (`fit_sizes`, down to the
A10G 24 GB / 32 GiB host floor), and what that changed or skipped is printed and written (docs/gpu.md).

    .venv/bin/python scripts/gpu_check.py                       # one CUDA GPU -> docs/benchmarks/gpu/
    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gc   # the same stages, tiny, on the CPU

Stages (each adds its section to `<out>/gpu_check.json`, or `gpu_check_dry_run.json`, as soon as it ends;
a stage that would start past `--time-limit` is recorded as skipped, and each stage stops starting new
measurements at the deadline and lists what it skipped):

1. `environment`: date, GPU, driver, torch and CUDA versions, the deterministic settings used.
2. `bandwidth`: pinned host<->device copies each way through the engine's own path (`memory.link` copy
   streams into the run's one `memory.arena.HostArena`), 256 MiB x 5.
3. `bitwise`: 3 SGD steps (2 in the dry run; dropout on) of the U-Net at 128³ under every preset, compared with
   `torch.equal` to plain PyTorch: losses, gradients, parameters; once as is and once with a random delay
   injected before every copy on the copy streams (`torch.cuda._sleep`), which widens the window in which
   a missing wait would read unfinished data. Deterministic kernels are asked for explicitly
   (`torch.use_deterministic_algorithms`, cuDNN deterministic, `CUBLAS_WORKSPACE_CONFIG`) for this stage
   only; if plain PyTorch does not repeat itself bit for bit the stage is "inconclusive", not failed.
4. `peak`: under a cap of at most 16 GiB (`cuda_device.memory_cap`), each row planned for the cap,
   192³ batch 1 and 2, every policy (none, the presets, the planner's auto plan for 16 GiB):
   `torch.cuda.max_memory_allocated` and `max_memory_reserved` after a warm-up step against the
   planner's prediction, with the default allocator and with `expandable_segments:True`; out of memory
   is recorded as such. Training's own settings (cuDNN benchmark as configured, no determinism). Each row also measures
   the device overhead (`device_overhead_gib`: context, libraries, allocator reserve beyond the predicted
   tensors), the quantity `memory.device_overhead_gib` defaults to 2 GiB for.
5. `step_time`: 192³ batch 1, no policy (no hooks), `torch.autograd.graph.save_on_cpu(pin_memory=True)`,
   per-block checkpointing (every block of `discover_blocks`), swap_all, hybrid and the auto plan.
6. `pinned`: swap_all at 192³ batch 2 in the one arena sized from the plan: pinned host bytes against
   the step's swapped bytes (target <= 1.2x), and what PyTorch's own caching host allocator holds.
7. `augment`: the training data path of `train.augment: nnunet` on the device: 2 phantom cases prepared to
   192³ (float16), read by the training DataLoader (`data.loader_workers: auto`, pinned) and fed to U-Net
   steps at batch 2; per step the data wait (the loader's `next`) and the device-side augmentation
   (`DeviceBatches.prepare`, synchronised) beside the step's forward + backward.
8. `mednext`: MedNeXt-L with 5³ kernels at 128³ batch 2, fp16: the plan `auto` chooses for the 16 GiB cap,
   its measured step time and peak against the plan's prediction, and the no-policy step (uncapped).
9. `compile`: compiled against eager training, `train.compile=true|false` passed as a dotted override as
   `--set` does, each row a real fold (`train_fold`) of the U-Net at 128³ batch 1, fp16, under no policy and
   under auto planned for a budget that makes it act: the timed second epoch's step and peak, the first
   epoch's (compilation included), compiled/eager ratios. A build without `train.compile` skips the stage in
   one line; the dry run measures the eager rows only.

Every swapping engine borrows one host arena, pinned once from the largest plan and reused (so no
step pins or unpins memory); every global setting the script changes is restored when it is done.

`--dry-run` runs every stage at 16³ (batch 1) with 2 base filters on the CPU, copies going through the emulated
link (`memory.swap.emulate_gbs`), so the script itself is tested without a GPU (tests/test_gpu_check.py);
there the peak compared is the engine's peak resident saved bytes and nothing is pinned. Its caps and card
readings go to a rehearsed A10G (`cuda_device.rehearsal`, torch's device-index rule kept), so the capping code
of a GPU run runs; it records the sizes a GPU run would fit to that floor machine (not applied).
`--fail-stage NAME` makes a stage raise (a test of the failure path).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # validate_plan.py, next to this script

from validate_plan import SAVE_ON_CPU, measure, relative_error, torch_threads  # noqa: E402

from brats_swap.atomic import atomic_write_json  # noqa: E402
from brats_swap.config.schema import MemoryConfig, ModelConfig  # noqa: E402
from brats_swap.memory import cuda_device  # noqa: E402
from brats_swap.memory.arena import HostArena, available_host_bytes  # noqa: E402
from brats_swap.memory.budget import tensor_limit, with_inflight_window, with_overhead  # noqa: E402
from brats_swap.memory.cost import bytes_per_second  # noqa: E402
from brats_swap.memory.device_profile import resolve_cost_model  # noqa: E402
from brats_swap.memory.engine import MemoryEngine, discover_blocks, memory_config_from  # noqa: E402
from brats_swap.memory.link import open_link  # noqa: E402
from brats_swap.memory.planner import BUDGET_HEADROOM, Planner  # noqa: E402
from brats_swap.memory.presets import PRESET_NAMES, named_policies  # noqa: E402
from brats_swap.memory.simulate import GIB  # noqa: E402
from brats_swap.model import build_model  # noqa: E402
from brats_swap.train.losses import weighted_dice_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PINNED_TARGET = 1.2  # pinned host bytes per swapped byte
# The smallest machine the check fits itself to: the BraTS challenge's card, an A10G 24 GB (torch reports
# 23028 MiB), on a host with 32 GiB of memory (28 GiB available). The dry run rehearses this card (`cuda_device.rehearsal`).
FLOOR_CARD_BYTES = 23028 << 20
FLOOR_HOST_BYTES = 28 << 30  # available of the 32 GiB (the system and its services hold the rest)
# Of the host's available memory, the share that pinned memory may take in all: the run's arena, plus
# save_on_cpu's pinned copies in the step_time stage. The rest is for the loader's workers, the prepared
# phantoms and the page cache.
HOST_PIN_SHARE = 0.6


@dataclass(frozen=True)
class Sizes:
    """What each stage runs at: the real check on a GPU, or the tiny CPU rehearsal."""

    base_filters: int
    bandwidth_bytes: int
    bandwidth_repeats: int
    bitwise_cube: int
    bitwise_steps: int
    peak_cube: int
    peak_batches: tuple[int, ...]
    cap_gib: float | None
    time_cube: int
    time_steps: int
    delay_s: float
    min_bytes: int | None  # None: the presets' default (1 MiB)
    emulate_gbs: float | None
    augment_cube: int
    augment_steps: int
    augment_phantom: tuple[int, int, int]
    augment_prepare_workers: int
    mednext_cube: int
    mednext_batch: int
    mednext_tiny: bool  # 2 initial filters and one block per stage instead of MedNeXt-L's 32 and 3-4-8-8-8-8-8-4-3
    mednext_half: bool  # fp16 autocast (its paper's setting); fp32 on the CPU
    compile_cube: int = 128
    compile_steps: int = 4  # per epoch, of 2 epochs: the first compiles, the second is timed
    augment_batch: int = 2
    card_limit_bytes: int | None = None  # what a step's tensors may use on the card (None: not checked)


GPU_SIZES = Sizes(base_filters=16, bandwidth_bytes=256 << 20, bandwidth_repeats=5, bitwise_cube=128, bitwise_steps=3,
                  peak_cube=192, peak_batches=(1, 2), cap_gib=16.0, time_cube=192, time_steps=3, delay_s=2e-3,
                  min_bytes=None, emulate_gbs=None, augment_cube=192, augment_steps=8, augment_phantom=(240, 240, 155),
                  augment_prepare_workers=2, mednext_cube=128, mednext_batch=2, mednext_tiny=False, mednext_half=True)
DRY_SIZES = Sizes(base_filters=2, bandwidth_bytes=512 << 10, bandwidth_repeats=4, bitwise_cube=16, bitwise_steps=2,
                  peak_cube=16,
                  peak_batches=(1,), cap_gib=16.0, time_cube=16, time_steps=1, delay_s=1e-3, min_bytes=0,
                  emulate_gbs=1.0, augment_cube=16, augment_steps=3, augment_phantom=(24, 24, 20),
                  augment_prepare_workers=1, mednext_cube=32, mednext_batch=1, mednext_tiny=True, mednext_half=False,
                  compile_cube=16, compile_steps=1)


FALLBACK_CUBES = (192, 160, 128)  # what a stage steps down to when its size does not fit the machine


def fit_sizes(sizes: Sizes, card_bytes: int, host_bytes: int) -> tuple[Sizes, dict]:
    """`sizes` fitted to a card of `card_bytes` on a host with `host_bytes` available, and what was changed
    or skipped and why. From the planner's meta traces of the U-Net (no device work):

    - the cap of the capped rows: at most `sizes.cap_gib`, at most what the card's tensors may use;
    - `peak`/`pinned` batches: those whose swap_all arena fits the host's pinned share (the run pins one
      arena, sized from the largest of them), at the largest of `FALLBACK_CUBES` where batch 1 does;
    - `step_time`: the largest cube whose no-policy step fits the card and whose save_on_cpu copies fit
      the pinned share beside the arena;
    - `augment`: the largest (cube, batch) whose no-policy step (it runs uncapped) fits the card.
    MedNeXt's uncapped row is checked in its stage (its own planner): `card_limit_bytes`."""
    card_limit = int(tensor_limit(card_bytes, with_overhead(MemoryConfig(), "cuda")))
    pin_limit = int(HOST_PIN_SHARE * host_bytes)
    model = build_model(ModelConfig(base_filters=sizes.base_filters))  # on the CPU: traced on meta tensors
    policies = named_policies(MemoryConfig())
    planned: dict[tuple[int, int], tuple[int, int]] = {}

    def plan(cube: int, batch: int) -> tuple[int, int]:
        """(no-policy peak, swap_all arena) of the U-Net step at cube³, batch."""
        if (cube, batch) not in planned:
            planner = Planner(model, (batch, 4, cube, cube, cube), loss_fn=weighted_dice_loss)
            planned[cube, batch] = (planner.memory(policies["none"]).peak_bytes,
                                    planner.arena_bytes(policies["swap_all"]))
        return planned[cube, batch]

    gib = lambda nbytes: round(nbytes / GIB, 2)  # noqa: E731
    skipped: list[str] = []
    cubes = [c for c in FALLBACK_CUBES if c <= sizes.peak_cube] or [sizes.peak_cube]
    peak_cube = next((c for c in cubes if plan(c, 1)[1] <= pin_limit), cubes[-1])
    batches = tuple(b for b in sizes.peak_batches if plan(peak_cube, b)[1] <= pin_limit) or (1,)
    skipped += [f"peak/pinned batch {b} at {peak_cube}³: swap_all's arena {gib(plan(peak_cube, b)[1])} GiB > "
                f"{HOST_PIN_SHARE:.0%} of the host's available {gib(host_bytes)} GiB" for b in sizes.peak_batches
                if b not in batches]
    arena = max(plan(peak_cube, b)[1] for b in batches)
    time_cube = next((c for c in cubes if plan(c, 1)[0] <= card_limit and arena + plan(c, 1)[1] <= pin_limit),
                     cubes[-1])
    augment = next(((c, b) for c, b in [(sizes.augment_cube, sizes.augment_batch)] + [(c, 1) for c in cubes]
                    if plan(c, b)[0] <= card_limit), (cubes[-1], 1))
    cap_gib = min(sizes.cap_gib, card_limit / GIB) if sizes.cap_gib is not None else None
    fitted = replace(sizes, peak_cube=peak_cube, peak_batches=batches, time_cube=time_cube, cap_gib=cap_gib,
                     augment_cube=augment[0], augment_batch=augment[1], card_limit_bytes=card_limit)
    changed = {name: [getattr(sizes, name), getattr(fitted, name)] for name in
               ("peak_cube", "peak_batches", "time_cube", "augment_cube", "augment_batch", "cap_gib")
               if getattr(sizes, name) != getattr(fitted, name)}
    return fitted, {"card_gib": gib(card_bytes), "host_available_gib": gib(host_bytes),
                    "card_tensor_limit_gib": gib(card_limit), "pin_limit_gib": gib(pin_limit),
                    "arena_gib": gib(arena), "changed": changed, "skipped": skipped}


class Check:
    """The run's state: device, sizes, deadline, the one host arena, and the JSON document written after
    every stage."""

    def __init__(self, device: torch.device, sizes: Sizes, path: Path, time_limit_s: float,
                 fail_stage: str | None = None, rehearsed: cuda_device.RehearsedCuda | None = None):
        self.device = device
        # The card whose memory is capped and read: the GPU, or in the dry run the rehearsed floor card, so
        # that the dry run runs the capping code of a GPU run (`cuda_device`), with torch's argument rules.
        self.card = torch.device("cuda")
        self.rehearsed = rehearsed
        self.sizes = sizes
        self.path = path
        self.deadline = time.monotonic() + time_limit_s
        self.fail_stage = fail_stage
        self.document: dict = {"dry_run": device.type != "cuda", "sizes": asdict(sizes), "stages": {}}
        self._cost = None
        self._arena: HostArena | None = None
        self._record_planners: dict[tuple[int, ...], Planner] = {}
        self._priced_planners: dict[tuple[int, ...], Planner] = {}
        self._auto_plans: dict[tuple[int, float], MemoryConfig | None] = {}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def arena(self, nbytes: int) -> HostArena:
        """The run's one host arena (pinned on CUDA), at least `nbytes`: pinned once, at the size of the
        largest plan of the run (swap_all at the largest peak batch), and lent to every engine; only a
        plan larger still would replace it."""
        if self._arena is None:
            nbytes = max(nbytes, self.largest_plan_bytes())
        if self._arena is None or self._arena.capacity < nbytes:
            if self._arena is not None:
                self._arena.close()
            self._arena = HostArena(nbytes, pin=self.device.type == "cuda")
        return self._arena

    def records_planner(self, shape: tuple[int, ...]) -> Planner:
        """A planner of the run's model at `shape` for what the engine will save and swap (arena sizes; its
        time model is not used), one per shape."""
        if shape not in self._record_planners:
            self._record_planners[shape] = Planner(self.model(), shape, loss_fn=weighted_dice_loss)
        return self._record_planners[shape]

    def largest_plan_bytes(self) -> int:
        sizes = self.sizes
        shape = (max(sizes.peak_batches), 4, sizes.peak_cube, sizes.peak_cube, sizes.peak_cube)
        return self.records_planner(shape).arena_bytes(named_policies(self.base_policy())["swap_all"])

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def base_policy(self, budget_gib: float | None = None) -> MemoryConfig:
        """The policies' common settings; with `budget_gib` (a capped row), planned for that budget rather
        than the whole card (the in-flight window is a share of it, as a card of that size would run)."""
        base = MemoryConfig(budget_gib=budget_gib)
        if self.sizes.min_bytes is not None:
            base.swap.min_bytes = self.sizes.min_bytes
        base.swap.emulate_gbs = self.sizes.emulate_gbs
        return with_inflight_window(base, self.device)  # the planner prices the window the engine runs here

    def cap(self, budget_gib: float | None):
        """The block under a cap of `budget_gib` on the card (`cuda_device.memory_cap`; rehearsed in the dry
        run, where the tensors stay on the CPU)."""
        return cuda_device.memory_cap(self.card, None if budget_gib is None else budget_gib * GIB)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(ModelConfig(base_filters=self.sizes.base_filters)).to(self.device)

    def batch(self, cube: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, 4, cube, cube, cube, generator=generator)
        y = (torch.rand(batch, 3, cube, cube, cube, generator=generator) > 0.8).float()
        return x.to(self.device), y.to(self.device)

    def run_stage(self, name: str, stage) -> None:
        started = time.perf_counter()
        calls_before = len(self.rehearsed.calls) if self.rehearsed is not None else 0
        if self.time_left() <= 0:
            section = {"status": "skipped", "reason": "past --time-limit before it started"}
        else:
            try:
                if name == self.fail_stage:
                    raise RuntimeError(f"stage {name} forced to fail (--fail-stage)")
                section = stage(self)
                section["status"] = section.get("status", "ok")
            except Exception as error:  # noqa: BLE001 - one failing stage must not hide the others
                section = {"status": "error", "error": f"{type(error).__name__}: {error}"}
        section["seconds"] = round(time.perf_counter() - started, 2)
        if self.rehearsed is not None:  # what the stage asked of the (rehearsed) card, in order
            section["rehearsed_cuda_calls"] = [list(call) for call in self.rehearsed.calls[calls_before:]]
        self.document["stages"][name] = section
        atomic_write_json(self.path, self.document)
        reason = f": {section['reason']}" if "reason" in section else ""
        print(f"{name}: {section['status']}{reason} in {section['seconds']} s", flush=True)


# --------------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic kernels for a bitwise comparison, every setting restored afterwards (the other
    stages measure what training runs): cuDNN deterministic without benchmark, torch's deterministic
    algorithms, and the cuBLAS workspace that makes cuBLAS deterministic (read when a handle is made)."""
    cudnn = torch.backends.cudnn
    saved = (cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    cudnn.deterministic, cudnn.benchmark = True, False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved[0], saved[1]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])
        if saved[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[4]


@contextlib.contextmanager
def allocator_settings(settings: str | None):
    """The CUDA caching allocator configured with `settings` (e.g. "expandable_segments:True") for the
    block, then back to the defaults; None changes nothing."""
    if settings is None:
        yield
        return
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings(settings)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings(settings.replace("True", "False"))


def stage_environment(check: Check) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
           "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_deterministic": torch.backends.cudnn.deterministic,
           "bitwise_stage": "torch.use_deterministic_algorithms(True), cudnn deterministic, "
                            "CUBLAS_WORKSPACE_CONFIG=:4096:8 (restored after the stage)"}
    if check.device.type == "cuda":
        props = torch.cuda.get_device_properties(check.device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), driver=_driver_version())
    else:
        env.update(gpu=None, note="dry run on the CPU: copies go through the emulated link")
    return env


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def stage_bandwidth(check: Check) -> dict:
    """GB/s of each direction through the engine's link into a pinned (on CUDA) arena slab."""
    sizes, device = check.sizes, check.device
    nbytes = sizes.bandwidth_bytes
    arena = check.arena(nbytes)
    arena.reset()
    link = open_link(device, check.base_policy().swap)
    try:
        host = arena.alloc(nbytes)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        rates = {}
        for direction in ("d2h", "h2d"):
            copy_once = ((lambda: link.copy_out(host, on_device)) if direction == "d2h"
                         else (lambda: link.copy_in(on_device, host)))
            copy_once()
            link.synchronize()  # the first copy pays for lazy setup
            started = time.perf_counter()
            for _ in range(sizes.bandwidth_repeats):
                copy_once()
            link.synchronize()
            rates[f"{direction}_gbs"] = round(nbytes * sizes.bandwidth_repeats / (time.perf_counter() - started) / 1e9, 2)
        rates.update(bytes_per_copy=nbytes, pinned=arena.pinned_bytes == arena.capacity and arena.pin)
        return rates
    finally:
        link.close()


def _train(model: torch.nn.Module, policy: MemoryConfig | None, x, y, steps: int = 3, host_arena=None) -> list:
    """(loss, gradients, parameters) after each of `steps` SGD steps; dropout masks seeded per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = MemoryEngine(model, policy, x.device, host_arena=host_arena) if policy is not None else None
    history = []
    try:
        for step in range(steps):
            torch.manual_seed(step)
            if engine is not None:
                with engine.step():
                    loss = weighted_dice_loss(model(x), y)
            else:
                loss = weighted_dice_loss(model(x), y)
            loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append((loss.detach().clone(), grads, [p.detach().clone() for p in model.parameters()]))
        stats = engine.last_stats().as_dict(prefix="") if engine is not None else {}
        return history, stats
    finally:
        if engine is not None:
            engine.close()


def _first_difference(history: list, reference: list) -> str | None:
    for step, ((loss, grads, params), (ref_loss, ref_grads, ref_params)) in enumerate(zip(history, reference, strict=True)):
        if not torch.equal(loss, ref_loss):
            return f"loss differs at step {step}"
        for i, (grad, ref) in enumerate(zip(grads, ref_grads, strict=True)):
            if not torch.equal(grad, ref):
                return f"gradient {i} differs at step {step}"
        if not all(torch.equal(p, r) for p, r in zip(params, ref_params, strict=True)):
            return f"parameters differ after step {step}"
    return None


def stage_bitwise(check: Check) -> dict:
    """Every preset, with and without random copy delays, bitwise against plain PyTorch (deterministic
    kernels; "inconclusive" when plain PyTorch itself does not repeat)."""
    cube = check.sizes.bitwise_cube
    x, y = check.batch(cube, 1)
    planner = check.records_planner(tuple(x.shape))
    rows, skipped = [], []
    with deterministic_kernels():
        steps = check.sizes.bitwise_steps
        reference, _ = _train(check.model(), None, x, y, steps)
        repeatable = _first_difference(_train(check.model(), None, x, y, steps)[0], reference) is None
        for name in PRESET_NAMES:
            for delay in (0.0, check.sizes.delay_s):
                if check.time_left() < 0:
                    skipped.append(f"{name} delay {delay}")
                    continue
                policy = copy.deepcopy(named_policies(check.base_policy())[name])
                policy.swap.copy_delay_s = delay
                history, stats = _train(check.model(), policy, x, y, steps,
                                        host_arena=check.arena(planner.arena_bytes(policy)))
                difference = _first_difference(history, reference)
                rows.append({"policy": name, "copy_delay_s": delay, "bitwise_equal": difference is None,
                             "difference": difference, "swapped_out_bytes": stats.get("swapped_out_bytes"),
                             "prefetch_misses": stats.get("prefetch_misses"),
                             "late_reloads": stats.get("late_reloads")})
    equal = all(row["bitwise_equal"] for row in rows)
    status = "ok" if equal else "failed" if repeatable else "inconclusive"
    return {"cube": cube, "reference_repeatable": repeatable, "all_equal": equal, "rows": rows, "skipped": skipped,
            "status": status}


def _planner(check: Check, model, shape: tuple[int, ...]) -> Planner:
    """A planner for `shape` with the time model of this device (profiled once: ops and pinned link), one
    per shape (the stages that share a shape share its traces and its auto plan)."""
    if shape in check._priced_planners:
        return check._priced_planners[shape]
    if check._cost is None:
        check._cost = resolve_cost_model(model, check.device, torch.float32, loss_fn=weighted_dice_loss)
        if check.sizes.emulate_gbs is not None:
            check._cost.sync_copies = False
            check._cost.h2d_bytes_per_s = check._cost.d2h_bytes_per_s = bytes_per_second(check.sizes.emulate_gbs)
        check.document["cost_model"] = check._cost.as_dict()
    planner = Planner(model, shape, loss_fn=weighted_dice_loss, dtype=torch.float32, cost=copy.deepcopy(check._cost))
    check._priced_planners[shape] = planner
    return planner


def _policies(check: Check, planner: Planner, budget_gib: float) -> dict[str, MemoryConfig]:
    """none, the presets and (when one fits) the auto plan for `budget_gib`; the search runs once per planner."""
    key = (id(planner), budget_gib)
    base = check.base_policy(budget_gib)
    if key not in check._auto_plans:
        best, _ = planner.auto(budget_gib * GIB, base)
        check._auto_plans[key] = best.policy if best is not None else None
    policies = named_policies(base)
    if check._auto_plans[key] is not None:
        policies["auto"] = copy.deepcopy(check._auto_plans[key])
    return policies


def stage_peak(check: Check) -> dict:
    """Measured against predicted peak for every policy under the cap, at each batch size, with the default
    allocator and (CUDA) with expandable segments."""
    sizes, cuda = check.sizes, check.device.type == "cuda"
    rows, skipped = [], []
    for allocator in (None, "expandable_segments:True") if cuda else (None,):
        for batch in sizes.peak_batches:
            if check.time_left() < 0:  # before the planner too: tracing and pricing take seconds
                skipped.append(f"batch {batch} {allocator or 'default allocator'}")
                continue
            model = check.model()
            shape = (batch, 4, sizes.peak_cube, sizes.peak_cube, sizes.peak_cube)
            planner = _planner(check, model, shape)
            x, y = check.batch(sizes.peak_cube, batch)
            for name, cfg in _policies(check, planner, sizes.cap_gib).items():
                if check.time_left() < 0:
                    skipped.append(f"{name} batch {batch} {allocator or 'default allocator'}")
                    continue
                with allocator_settings(allocator), check.cap(sizes.cap_gib):
                    rows.append({**_peak_row(check, planner, model, name, cfg, x, y, batch),
                                 "allocator": allocator or "default"})
    return {"cube": sizes.peak_cube, "cap_gib": sizes.cap_gib,
            "peak": "torch.cuda.max_memory_allocated" if cuda else "engine peak resident saved bytes",
            "rows": rows, "skipped": skipped}


def _peak_row(check: Check, planner: Planner, model, name: str, cfg: MemoryConfig, x, y, batch: int) -> dict:
    cuda = check.device.type == "cuda"
    prediction = planner.predict(name, cfg, check.sizes.cap_gib * GIB)
    predicted = prediction.peak_bytes if cuda else prediction.peak_resident_saved_bytes
    row = {"policy": name, "batch": batch, "predicted_peak_bytes": predicted, "predicted_fits": prediction.fits,
           "predicted_step_s": prediction.step_s}
    try:
        measured = measure(model, cfg, x, y, check.device, 1, torch.float32, hooks_for_none=not cuda,
                           host_arena=check.arena(planner.arena_bytes(cfg)))
    except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError exists from torch 2.5 only
        row.update(status="oom", measured_peak_bytes=None, peak_error=None)
        return row
    row.update(status="ok", measured_peak_bytes=measured["peak_bytes"], measured_step_s=measured["step_s"],
               measured_peak_reserved_bytes=measured.get("peak_reserved_bytes"),
               peak_error=relative_error(predicted, measured["peak_bytes"]),
               peak_within_bound=measured["peak_bytes"] <= predicted)
    if cuda:
        # `memory.device_overhead_gib` measured: what the card held beyond the planner's tensors, i.e. the CUDA
        # context and libraries (used, not the allocator's) plus the allocator's peak reserve (all processes
        # on the card count: run it alone).
        device = check.device
        held = (cuda_device.total_bytes(device) - cuda_device.free_bytes(device) - cuda_device.reserved_bytes(device)
                + cuda_device.peak_reserved_bytes(device))
        row["device_overhead_gib"] = round((held - predicted) / GIB, 3)
    return row


def stage_step_time(check: Check) -> dict:
    """The engine's policies against no policy, save_on_cpu and per-block checkpointing."""
    sizes, device = check.sizes, check.device
    model = check.model()
    shape = (1, 4, sizes.time_cube, sizes.time_cube, sizes.time_cube)
    planner = _planner(check, model, shape)
    base = check.base_policy()
    named = _policies(check, planner, sizes.cap_gib)
    blocks = memory_config_from({"mode": "recompute",
                                 "recompute": {"modules": [name for name, _ in discover_blocks(model)]}})
    candidates = {"none": named["none"], SAVE_ON_CPU: SAVE_ON_CPU, "checkpoint_blocks": blocks,
                  "swap_all": named["swap_all"], "hybrid": named["hybrid"]}
    if "auto" in named:
        candidates["auto"] = named["auto"]
    x, y = check.batch(sizes.time_cube, 1)
    rows, skipped = [], []
    for name, policy in candidates.items():
        if check.time_left() < 0:
            skipped.append(name)
            continue
        arena = None
        if isinstance(policy, MemoryConfig):
            policy = copy.deepcopy(policy)
            policy.swap.emulate_gbs = base.swap.emulate_gbs
            arena = check.arena(planner.arena_bytes(policy))
        try:
            measured = measure(model, policy, x, y, device, sizes.time_steps, torch.float32, hooks_for_none=False,
                               host_arena=arena)
        except torch.cuda.OutOfMemoryError:
            rows.append({"policy": name, "status": "oom"})
            continue
        rows.append({"policy": name, "status": "ok", "step_s": round(measured["step_s"], 4),
                     "peak_bytes": measured.get("peak_bytes")})
    baseline = next((r["step_s"] for r in rows if r["policy"] == "none" and r["status"] == "ok"), None)
    for row in rows:
        if baseline and row["status"] == "ok":
            row["vs_none"] = round(row["step_s"] / baseline, 3)
    return {"cube": sizes.time_cube, "batch": 1, "rows": rows, "skipped": skipped}


def stage_pinned(check: Check) -> dict:
    """Pinned host bytes of swap_all at the largest peak batch, the arena sized from the plan."""
    sizes, device = check.sizes, check.device
    batch = max(sizes.peak_batches)
    model = check.model()
    shape = (batch, 4, sizes.peak_cube, sizes.peak_cube, sizes.peak_cube)
    planner = _planner(check, model, shape)
    cfg = named_policies(check.base_policy())["swap_all"]
    planned = planner.arena_bytes(cfg)
    x, y = check.batch(sizes.peak_cube, batch)
    arena = check.arena(planned)
    measured = measure(model, cfg, x, y, device, 1, torch.float32, host_arena=arena)
    swapped = measured["swapped_bytes"]
    row = {"cube": sizes.peak_cube, "batch": batch, "policy": "swap_all", "swapped_bytes": swapped,
           "planned_arena_bytes": planned, "arena_bytes": measured["arena_bytes"], "arena_used_bytes": arena.used,
           "arena_per_swapped_byte": round(measured["arena_bytes"] / swapped, 4) if swapped else None,
           "pinned": device.type == "cuda"}
    if device.type == "cuda":
        stats = torch.cuda.host_memory_stats()
        row["caching_host_allocator_bytes"] = stats.get("allocated_bytes.current", stats.get("allocated_bytes"))
    row["within_target"] = row["arena_per_swapped_byte"] is not None and row["arena_per_swapped_byte"] <= PINNED_TARGET
    return row


def stage_augment(check: Check) -> dict:
    """Data wait and device-side nnunet augmentation per training step, on prepared phantoms."""
    import tempfile

    from brats_swap.config import DataConfig
    from brats_swap.data.cache import list_prepared
    from brats_swap.train.data import (
        CubeDataset,
        EpochSampler,
        loader_collate,
        loader_worker_count,
        seed_worker,
    )
    from brats_swap.train.device_augment import DeviceBatches

    sizes, device = check.sizes, check.device
    cube, batch, steps = sizes.augment_cube, sizes.augment_batch, sizes.augment_steps
    workers = loader_worker_count(DataConfig())
    model = check.model()
    waits, augments, computes = [], [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_augment_") as tmp:
        cache = _prepared_phantoms(Path(tmp), cube, sizes)
        dataset = CubeDataset(cache, list_prepared(cache), augment="nnunet", batch_size=batch, channels=4)
        pinned = device.type == "cuda"  # the pin thread copies each batch out of its worker's slot
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=EpochSampler(len(dataset), batch * steps, 0),
                                             num_workers=workers, collate_fn=loader_collate(reuse_slots=pinned),
                                             pin_memory=pinned, worker_init_fn=seed_worker)
        to_device = DeviceBatches("nnunet", device, edition="2021", outputs="labels", regions=(),
                                  sample_size=(cube,) * 3)
        batches = iter(loader)
        while True:
            started = time.perf_counter()
            loaded = next(batches, None)
            if loaded is None:
                break
            waits.append(time.perf_counter() - started)
            started = time.perf_counter()
            x, y = to_device.prepare(loaded)
            _synchronize(device)
            augments.append(time.perf_counter() - started)
            started = time.perf_counter()
            weighted_dice_loss(model(x), y).backward()
            model.zero_grad(set_to_none=True)
            _synchronize(device)
            computes.append(time.perf_counter() - started)
    steady = slice(1, None) if len(waits) > 1 else slice(None)  # the first batch waits for the workers to start
    mean = lambda values: round(sum(values[steady]) / len(values[steady]), 4)  # noqa: E731
    return {"cube": cube, "batch": batch, "steps": len(waits), "loader_workers": workers, "pinned": device.type == "cuda",
            "data_wait_s": [round(v, 4) for v in waits], "augment_s": [round(v, 4) for v in augments],
            "step_s": [round(v, 4) for v in computes], "mean_data_wait_s": mean(waits),
            "mean_augment_s": mean(augments), "mean_step_s": mean(computes),
            "augment_over_step": round(mean(augments) / mean(computes), 4) if mean(computes) else None,
            "note": "the U-Net of the other stages (not ResEnc L); scripts/bench_pipeline.py has ResEnc L"}


def _prepared_phantoms(folder: Path, cube: int, sizes: Sizes) -> Path:
    """2 phantom cases of `sizes.augment_phantom` prepared to cube³ (float16) in `folder`; the cache's path."""
    from brats_swap.config import DataConfig
    from brats_swap.data.cache import prepare_dataset
    from brats_swap.data.phantom import synthesize_dataset

    root, cache = folder / "raw", folder / "cache"
    synthesize_dataset(root, cases=2, seed=0, edition="2021", shape=sizes.augment_phantom)
    workers = sizes.augment_prepare_workers  # the dry run's pool would cost more than its cases
    prepare_dataset(root, cache, DataConfig(cube=[cube] * 3, prepare_workers=workers), workers=workers, progress=False)
    return cache


# What the auto rows of the compile stage plan for: the first of these shares of the no-policy step's planned
# tensors that the planner finds a plan for, so that auto must swap or recompute where it can (at the whole card
# it would pick no policy; at 1.0 no policy fits, the dry run's tiny network, whose in-flight window is large).
COMPILE_AUTO_SHARES = (0.6, 0.8, 1.0)


def _compile_row_overrides(check: Check, cache: Path, policy: str, compiled: bool,
                           budget_gib: float | None) -> list[str]:
    """The dotted overrides (`--set` keys) of one compile-stage fold: the U-Net of the other stages at
    `compile_cube`³, batch 1, fp16 (fp32 in the dry run), no augmentation, 2 epochs of `compile_steps`, under
    `policy` (none or auto for `budget_gib`), `train.compile` on or off."""
    sizes, cuda = check.sizes, check.device.type == "cuda"
    cube = sizes.compile_cube
    overrides = [f"data.cache={cache}", "data.cache_only=true", f"data.cube=[{cube},{cube},{cube}]", "cv.folds=2",
                 f"model.base_filters={sizes.base_filters}", f"train.device={check.device.type}",
                 f"train.amp={'fp16' if cuda else 'none'}", "train.augment=none", "train.batch_size=1",
                 "train.max_epochs=2", f"train.steps_per_epoch={sizes.compile_steps}", "train.val_every=2",
                 f"memory.mode={policy}", f"train.compile={'true' if compiled else 'false'}"]
    if budget_gib is not None:
        overrides.append(f"memory.budget_gib={budget_gib}")
    if not cuda:
        overrides += ["data.loader_workers=0", "train.threads=1",
                      f"memory.swap.emulate_gbs={sizes.emulate_gbs}", f"memory.swap.min_bytes={sizes.min_bytes}"]
    return overrides


def _compile_auto_budget(config) -> float | None:
    """GiB for the auto rows: the budget whose tensor limit (`tensor_limit`: the budget less the device overhead,
    times the planner's headroom) is the first of `COMPILE_AUTO_SHARES` of the no-policy step's planned tensors
    that the planner of `plan` finds a policy for (None: none of them)."""
    import math

    from brats_swap.train.planning import plan_for_config

    device = "gpu" if config.train.device.startswith("cuda") else "cpu"  # peaks do not depend on the time model
    report, planner = plan_for_config(config, device=device)
    memory = with_inflight_window(with_overhead(config.memory, device), device)  # as `plan_for_config` prices
    tensors = planner.memory(named_policies(memory)["none"]).peak_bytes
    for share in COMPILE_AUTO_SHARES:
        # Rounded up to 1e-4 GiB (100 KiB): fine enough for the dry run's tiny network.
        budget = math.ceil((report.device_overhead_gib + share * tensors / BUDGET_HEADROOM / GIB) * 1e4) / 1e4
        if planner.auto(budget * GIB, replace(memory, budget_gib=budget))[0] is not None:
            return budget
    return None


def stage_compile(check: Check) -> dict:
    """Compiled against eager training (`train.compile`, a dotted override as `--set` passes it) at 128³,
    batch 1, fp16, under no policy and under auto planned for a budget that makes it act: each row a real
    fold (`train_fold`, 2 epochs): the second epoch's mean step time and peak (its validation included), the
    first epoch's (compilation included), the policy auto chose and what env.json records about compiling.
    The dry run measures the eager rows only: compiling on a CPU takes minutes, and the stage is about a GPU."""
    import tempfile

    from brats_swap.config import load_config
    from brats_swap.errors import ConfigError
    from brats_swap.train.loop import train_fold

    try:
        load_config(None, ["train.compile=false"])
    except ConfigError:
        return {"status": "skipped", "reason": "this build has no train.compile"}
    sizes, cuda = check.sizes, check.device.type == "cuda"
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="gpu_check_compile_") as tmp:
        cache = _prepared_phantoms(Path(tmp), sizes.compile_cube, sizes)
        budget = _compile_auto_budget(load_config(None, _compile_row_overrides(check, cache, "none", False, None)))
        for policy in ("none", "auto"):
            for compiled in (False, True):
                name = f"{policy} {'compiled' if compiled else 'eager'}"
                row = {"policy": policy, "compiled": compiled, "budget_gib": budget if policy == "auto" else None}
                if compiled and not cuda:
                    row.update(status="skipped", reason="dry run: compiling is measured on a GPU only")
                elif policy == "auto" and budget is None:
                    row.update(status="no plan", reason=f"no plan at {COMPILE_AUTO_SHARES} of the no-policy tensors")
                elif check.time_left() < 0:
                    row.update(status="skipped", reason="past --time-limit")
                if "reason" in row:
                    skipped.append(f"{name}: {row['reason']}")
                    rows.append(row)
                    continue
                run = Path(tmp) / name.replace(" ", "_")
                config = load_config(None, _compile_row_overrides(check, cache, policy, compiled, row["budget_gib"]))
                try:
                    result = train_fold(config, run, 0, progress=False)
                except torch.cuda.OutOfMemoryError:
                    row.update(status="oom")
                    rows.append(row)
                    continue
                except Exception as error:  # noqa: BLE001 - one failing row (a compile error) must not hide the others
                    row.update(status="error", error=f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
                    rows.append(row)
                    continue
                first, timed = result.history[0], result.history[-1]
                environment = json.loads((run / "env.json").read_text())
                plan = run / "fold_0" / "memory_plan.json"
                row.update(status="ok", step_s=round(timed["step_s"], 4), first_epoch_step_s=round(first["step_s"], 4),
                           peak_bytes=int(timed["peak_memory_gib"] * GIB),
                           mode=json.loads(plan.read_text())["memory"]["mode"] if plan.exists() else policy,
                           compile_record={key: value for key, value in environment.items() if "compil" in key})
                rows.append(row)
                print(f"compile: {name}: {row['step_s']} s/step, peak {timed['peak_memory_gib']:.2f} GiB, "
                      f"first epoch {row['first_epoch_step_s']} s/step", flush=True)
    eager = {row["policy"]: row for row in rows if not row["compiled"] and row["status"] == "ok"}
    for row in rows:
        base = eager.get(row["policy"])
        if row["compiled"] and row["status"] == "ok" and base is not None:
            row["step_vs_eager"] = round(row["step_s"] / base["step_s"], 3)
            row["peak_vs_eager"] = round(row["peak_bytes"] / base["peak_bytes"], 3) if base["peak_bytes"] else None
    return {"cube": sizes.compile_cube, "batch": 1, "dtype": "fp16" if cuda else "fp32",
            "steps_per_epoch": sizes.compile_steps, "rows": rows, "skipped": skipped,
            "status": "failed" if any(row["status"] in ("oom", "no plan", "error") for row in rows) else "ok"}


def stage_mednext(check: Check) -> dict:
    """MedNeXt-L with 5³ kernels at its paper's 128³ patch, batch 2, fp16, under the plan `auto` chooses for the
    16 GiB cap: step time and peak measured against the plan's prediction, and the no-policy step (uncapped) the
    plan's step ratio is relative to. Deep supervision off (its four small heads aside, the same network) so that
    the stage's loss is the other stages' Dice of one output."""
    sizes, device, cuda = check.sizes, check.device, check.device.type == "cuda"
    dtype = torch.float16 if sizes.mednext_half and cuda else torch.float32
    overrides = {"name": "mednext_l", "kernel_size": 5, "deep_supervision": False, "features": [32],
                 "blocks": [3, 4, 8, 8, 8, 8, 8, 4, 3]}
    if sizes.mednext_tiny:
        overrides.update(features=[2], blocks=[1] * 9)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**overrides)).to(device)
    shape = (sizes.mednext_batch, 4, *(sizes.mednext_cube,) * 3)
    cost = resolve_cost_model(model, device, dtype, loss_fn=weighted_dice_loss)
    if sizes.emulate_gbs is not None:
        cost.sync_copies = False
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = bytes_per_second(sizes.emulate_gbs)
    planner = Planner(model, shape, loss_fn=weighted_dice_loss, dtype=dtype, cost=cost)
    none_cfg = check.base_policy()
    none_prediction = planner.predict("none", none_cfg)
    budget = sizes.cap_gib
    if not cuda:  # the dry run's cap: 1% under the tiny network's no-policy peak, so that auto must act
        budget = 0.99 * planner.memory(none_cfg).peak_bytes / BUDGET_HEADROOM / GIB
    best, _ = planner.auto(budget * GIB, check.base_policy(budget))
    x, y = check.batch(sizes.mednext_cube, sizes.mednext_batch)
    rows = []
    for name, cfg, capped in (("none", none_cfg, False), ("auto", best.policy if best else None, True)):
        if cfg is None or check.time_left() < 0:
            rows.append({"policy": name, "status": "no plan" if cfg is None else "skipped"})
            continue
        prediction = planner.predict(name, cfg, budget * GIB)
        predicted = prediction.peak_bytes if cuda else prediction.peak_resident_saved_bytes
        row = {"policy": name, "mode": cfg.mode, "norm_act": cfg.recompute.norm_act, "capped": capped,
               "predicted_peak_bytes": predicted, "predicted_step_s": round(prediction.step_s, 4)}
        if not capped and sizes.card_limit_bytes is not None and prediction.peak_bytes > sizes.card_limit_bytes:
            row.update(status="skipped", reason=f"planned peak {prediction.peak_bytes / GIB:.1f} GiB > the card's "
                                                f"{sizes.card_limit_bytes / GIB:.1f} GiB for tensors")
            rows.append(row)
            continue
        try:
            with check.cap(budget) if capped else contextlib.nullcontext():
                measured = measure(model, cfg, x, y, device, sizes.time_steps, dtype, hooks_for_none=not cuda,
                                   host_arena=check.arena(planner.arena_bytes(cfg)))
        except torch.cuda.OutOfMemoryError:
            row.update(status="oom")
            rows.append(row)
            continue
        row.update(status="ok", measured_peak_bytes=measured["peak_bytes"], measured_step_s=round(measured["step_s"], 4),
                   peak_error=relative_error(predicted, measured["peak_bytes"]),
                   step_error=relative_error(prediction.step_s, measured["step_s"]))
        rows.append(row)
    measured = {row["policy"]: row.get("measured_step_s") for row in rows}
    return {"network": "mednext_l k5" + (" (tiny)" if sizes.mednext_tiny else ""), "input": list(shape),
            "dtype": str(dtype).split(".")[-1], "budget_gib": round(budget, 4),
            "predicted_step_ratio": round(best.step_s / none_prediction.step_s, 3) if best else None,
            "measured_step_ratio": (round(measured["auto"] / measured["none"], 3)
                                    if measured.get("auto") and measured.get("none") else None),
            "rows": rows, "status": "failed" if any(row["status"] in ("oom", "no plan") for row in rows) else "ok",
            "skipped": [f"{row['policy']}: {row['reason']}" for row in rows if "reason" in row]}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STAGES = {"environment": stage_environment, "bandwidth": stage_bandwidth, "bitwise": stage_bitwise,
          "peak": stage_peak, "step_time": stage_step_time, "pinned": stage_pinned, "augment": stage_augment,
          "mednext": stage_mednext, "compile": stage_compile}


def summary(document: dict) -> tuple[str, int]:
    """The run in one line, and the exit code: 1 when a stage failed or errored, else 0."""
    statuses = {name: stage["status"] for name, stage in document["stages"].items()}
    failed = [name for name, status in statuses.items() if status in ("error", "failed")]
    overall = "failed" if failed else "inconclusive" if "inconclusive" in statuses.values() else "ok"
    if overall == "ok" and any(status == "skipped" for status in statuses.values()):
        overall = "incomplete"
    line = {"gpu_check": overall, "failed_stages": failed, "stages": statuses, "json": document.get("path")}
    return json.dumps(line), 1 if failed else 0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage, tiny, on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "gpu")
    parser.add_argument("--time-limit", type=float, default=400.0, help="seconds; later measurements are skipped")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    parser.add_argument("--fail-stage", choices=list(STAGES), default=None, help="test: make this stage raise")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or use --dry-run")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")
    # The dry run rehearses the floor card: its stages call the card as a GPU run does (caps, readings).
    with cuda_device.rehearsal(FLOOR_CARD_BYTES) if args.dry_run else contextlib.nullcontext() as rehearsed:
        return _run(args, path, rehearsed)


def _run(args: argparse.Namespace, path: Path, rehearsed: cuda_device.RehearsedCuda | None) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:  # the sizes a GPU run would fit to the floor machine (recorded; the stages run tiny)
        sizes = DRY_SIZES
        _, fit = fit_sizes(GPU_SIZES, FLOOR_CARD_BYTES, FLOOR_HOST_BYTES)
        fit["applied"] = False
    else:
        cuda_device.use_device(device)
        sizes, fit = fit_sizes(GPU_SIZES, cuda_device.total_bytes(device), available_host_bytes() or FLOOR_HOST_BYTES)
        fit["applied"] = True
    check = Check(device, sizes, path, args.time_limit, fail_stage=args.fail_stage, rehearsed=rehearsed)
    check.document.update(path=str(path), fit=fit, sizes=asdict(sizes))
    for reason in fit["skipped"]:
        print(f"fit: skipped {reason}", flush=True)
    # Dry run: one compute thread, as a second one stalls whenever a copy thread takes its core.
    try:
        with torch_threads(1 if args.dry_run else None):
            for name in args.stages:
                check.run_stage(name, STAGES[name])
    finally:
        check.close()
    line, check.document["exit_code"] = summary(check.document)
    atomic_write_json(path, check.document)
    print(line, flush=True)  # the last line: the whole run
    return check.document


if __name__ == "__main__":
    sys.exit(main()["exit_code"])
