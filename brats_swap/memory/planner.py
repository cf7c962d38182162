"""The planner: predict the device memory and step time of any memory policy, and auto-tune to a budget.

    trace (meta device, real size)  ->  placement of each saved record under a policy
        ->  simulate_memory (liveness walk: peak bytes)  +  simulate_time (copy-engine timeline: step s)

`choose_policy` is what training calls for `memory.mode: auto`; `plan_report` is what `brats-swap plan`
prints. Both search the policy space the engine can run (the knobs of `MemoryConfig`):

1. recompute variant: none, `recompute.norm_act` (rebuild instance norm + LeakyReLU outputs, no conv
   re-run), block checkpointing (`recompute.modules`);
2. swap: `swap.tensors = N` first eligible storages in forward order, which in a U-Net is "earliest
   produced, longest unused first" (the encoder's full-resolution tensors come first in forward and are
   needed last in backward), with and without the synthesis path (`swap.exclude: [decoder.*]`);
3. `swap.lookahead` (how many blocks ahead a reload is issued: the prefetch distance measured in
   accumulated backward time, which the time simulation prices) and, only when allowed, bf16 transport.

For each variant the smallest N that fits is found by bisection (memory falls as N grows), then the time
simulation ranks what fits. Nothing fits -> `ConfigError` naming `memory.budget_gib` and the floor.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from brats_swap.config.schema import MemoryConfig, RecomputeConfig, SwapConfig
from brats_swap.errors import ConfigError
from brats_swap.memory.policy import RECOMPUTE_MODES, SWAP_MODES, SavedRecord, select_swapped
from brats_swap.memory.simulate import (
    GIB,
    MemoryResult,
    OpCostModel,
    Placement,
    TimeResult,
    floor_bytes,
    phase_compute_seconds,
    schedule,
    simulate_memory,
)
from brats_swap.memory.trace import Trace, trace_step

# Fraction of the budget a plan may use: the rest is allocator slack (block rounding, fragmentation) and
# cuDNN workspace the trace does not see. TFLMS's simulator uses 0.9 for the same reason.
BUDGET_HEADROOM = 0.92
DEFAULT_BANDWIDTH_GBS = 25.0  # pinned PCIe 4 x16, per direction (reference/swap.md §7.1)
LOOKAHEADS = (1, 2, 3, 4, 6)

# Roofline constants when nothing was measured. CPU: this project's CI machine at 32³-48³ (about 60
# GFLOP/s per step for the U-Net). GPU: an H200-class card in fp32 (TF32 convolutions) and bf16.
DEFAULT_COSTS = {
    "cpu": OpCostModel(name="cpu (assumed)", flops_per_s=60e9, bytes_per_s=20e9, launch_s=20e-6,
                       h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9, sync_copies=True),
    "gpu-float32": OpCostModel(name="H200-class GPU, fp32/TF32 (assumed)", flops_per_s=60e12,
                               bytes_per_s=3.0e12, launch_s=6e-6),
    "gpu-bfloat16": OpCostModel(name="H200-class GPU, bf16 (assumed)", flops_per_s=150e12,
                                bytes_per_s=3.0e12, launch_s=6e-6),
}


# --------------------------------------------------------------------------------------------------------
# The named policies of the table (the presets in configs/ mirror these)
# --------------------------------------------------------------------------------------------------------


PRESET_NAMES = ("swap_all", "swap_first_n", "swap_no_decoder", "swap_no_decoder_lookahead", "recompute",
                "norm_act", "hybrid")
PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs"  # the repository's preset YAML files

# The same presets when the configs/ folder is not there (an installed package): the paper's four swap
# configurations, block checkpointing, norm_act and hybrid.
_BUILTIN_PRESETS: dict[str, dict] = {
    "swap_all": {"mode": "swap", "swap": {"tensors": -1, "lookahead": 1}},
    "swap_first_n": {"mode": "swap", "swap": {"tensors": 18, "lookahead": 1}},
    "swap_no_decoder": {"mode": "swap", "swap": {"tensors": -1, "exclude": ["decoder.*"], "lookahead": 1}},
    "swap_no_decoder_lookahead": {"mode": "swap", "swap": {"tensors": -1, "exclude": ["decoder.*"],
                                                           "lookahead": 3}},
    "recompute": {"mode": "recompute", "recompute": {"modules": ["encoder.level*", "decoder.level*"]}},
    "norm_act": {"mode": "recompute", "recompute": {"norm_act": True}},
    "hybrid": {"mode": "hybrid", "swap": {"include": ["encoder.level0", "encoder.level1"], "lookahead": 2},
               "recompute": {"norm_act": True}},
}


def _merged(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def named_policies(base: MemoryConfig | None = None, presets_dir: Path | None = PRESETS_DIR) -> dict[str, MemoryConfig]:
    """none and the presets of configs/ (their `memory:` section laid over `base`), in table order."""
    from brats_swap.config.loader import from_dict, read_yaml_mapping

    base = base or MemoryConfig()
    plain = asdict(base)
    plain["swap"], plain["recompute"] = asdict(base.swap), asdict(base.recompute)
    policies = {"none": from_dict(MemoryConfig, {**plain, "mode": "none"}, prefix="memory")}
    for name in PRESET_NAMES:
        file = presets_dir / f"{name}.yaml" if presets_dir is not None else None
        section = _BUILTIN_PRESETS[name]
        if file is not None and file.is_file():
            section = read_yaml_mapping(file).get("memory", {}) or {}
        fresh = {**plain, "swap": asdict(SwapConfig(min_bytes=base.swap.min_bytes,
                                                    max_inflight_bytes=base.swap.max_inflight_bytes)),
                 "recompute": asdict(RecomputeConfig())}
        policies[name] = from_dict(MemoryConfig, _merged(fresh, section), prefix="memory")
    return policies


# --------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------


@dataclass
class PolicyPrediction:
    name: str
    policy: MemoryConfig
    peak_bytes: int
    saved_bytes: int
    swapped_bytes: int
    recompute_flops: float
    peak_resident_saved_bytes: int
    step_s: float
    exposed_transfer_s: float
    prefetch_misses: int
    fits: bool

    def row(self) -> dict:
        return {
            "name": self.name,
            "predicted_peak_gib": round(self.peak_bytes / GIB, 4),
            "swapped_gib": round(self.swapped_bytes / GIB, 4),
            "recompute_gflop": round(self.recompute_flops / 1e9, 3),
            "predicted_step_s": round(float(self.step_s), 5),
            "fits": self.fits,
        }


@dataclass
class PlanReport:
    input_shape: tuple[int, ...]
    dtype: str
    budget_gib: float | None
    floor_gib: float
    bandwidth_gbs: float
    cost_model: dict
    policies: list[PolicyPrediction] = field(default_factory=list)
    chosen: PolicyPrediction | None = None
    reason: str = ""
    plan_seconds: float = 0.0

    @property
    def size(self) -> int:
        return int(self.input_shape[2])

    @property
    def batch(self) -> int:
        return int(self.input_shape[0])

    def baseline_step_s(self) -> float | None:
        for policy in self.policies:
            if policy.name == "none":
                return policy.step_s
        return None

    def as_dict(self) -> dict:
        chosen = None
        if self.chosen is not None:
            chosen = {**self.chosen.row(), "policy": memory_config_dict(self.chosen.policy)}
        return {
            "size": self.size,
            "batch": self.batch,
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "budget_gib": self.budget_gib,
            "floor_gib": round(self.floor_gib, 4),
            "bandwidth_gbs": self.bandwidth_gbs,
            "cost_model": self.cost_model,
            "policies": [p.row() for p in self.policies],
            "chosen": chosen,
            "reason": self.reason,
            "plan_seconds": round(self.plan_seconds, 3),
        }


def memory_config_dict(cfg: MemoryConfig) -> dict:
    return asdict(cfg)


# --------------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------------


class Planner:
    """Traces once per recompute variant, then prices any MemoryConfig in milliseconds."""

    def __init__(self, model: nn.Module, input_shape: Sequence[int], *, dtype: torch.dtype | str = torch.float32,
                 cost: OpCostModel | None = None, loss_fn: Callable | None = None, optimizer_state_factor: int = 2):
        self.model = model
        self.input_shape = tuple(int(v) for v in input_shape)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.cost = cost or default_cost_model("cpu", self.dtype)
        self.loss_fn = loss_fn
        self.optimizer_state_factor = optimizer_state_factor
        self.budget_gib: float | None = None  # set by plan_report; drawn in the timeline figure
        self._traces: dict[tuple, Trace] = {}
        self._durations: dict[tuple, object] = {}

    # ---- traces --------------------------------------------------------------------------------------
    @staticmethod
    def variant_key(cfg: MemoryConfig) -> tuple:
        """Policies that share a forward share a trace: the recompute part changes it, swapping does not."""
        if cfg.mode not in RECOMPUTE_MODES:
            return ((), False)
        return (tuple(cfg.recompute.modules), bool(cfg.recompute.norm_act))

    def trace(self, cfg: MemoryConfig | None = None) -> Trace:
        key = self.variant_key(cfg) if cfg is not None else ((), False)
        if key not in self._traces:
            recompute = RecomputeConfig(modules=list(key[0]), norm_act=key[1]) if key != ((), False) else None
            self._traces[key] = trace_step(self.model, self.input_shape, dtype=self.dtype, loss_fn=self.loss_fn,
                                           recompute=recompute)
        return self._traces[key]

    def records(self, cfg: MemoryConfig) -> list[SavedRecord]:
        """The records the engine will see under `cfg` (`MemoryEngine.last_records()` predicted)."""
        return self.trace(cfg).saved_records()

    def placement(self, cfg: MemoryConfig) -> Placement:
        trace = self.trace(cfg)
        records = trace.saved_records()
        swapped = select_swapped(records, cfg.swap) if cfg.mode in SWAP_MODES else set()
        return Placement(swapped=swapped, recomputed={r.index for r in records if r.recompute},
                         lookahead=cfg.swap.lookahead, compress_bf16=cfg.swap.compress == "bf16")

    @staticmethod
    def _inflight(cfg: MemoryConfig) -> int | None:
        return cfg.swap.max_inflight_bytes if cfg.mode in SWAP_MODES else None

    # ---- pricing -------------------------------------------------------------------------------------
    def _schedule(self, cfg: MemoryConfig, keep_lanes: bool = False):
        trace = self.trace(cfg)
        key = self.variant_key(cfg)
        if key not in self._durations:
            self._durations[key] = self.cost.durations(trace)
        return schedule(trace, self.placement(cfg), durations=self._durations[key],
                        d2h_bytes_per_s=self.cost.d2h_bytes_per_s, h2d_bytes_per_s=self.cost.h2d_bytes_per_s,
                        max_inflight_bytes=self._inflight(cfg), keep_lanes=keep_lanes,
                        sync_copies=self.cost.sync_copies)

    def memory(self, cfg: MemoryConfig, keep_timeline: bool = False) -> MemoryResult:
        """Predicted memory; on a GPU the release points come from the timed schedule."""
        trace = self.trace(cfg)
        placement = self.placement(cfg)
        plans = None
        if not self.cost.sync_copies and placement.swapped:
            plans = self._schedule(cfg)[0]
        return simulate_memory(trace, placement, max_inflight_bytes=self._inflight(cfg), plans=plans,
                               optimizer_state_factor=self.optimizer_state_factor, keep_timeline=keep_timeline)

    def time(self, cfg: MemoryConfig, keep_lanes: bool = False) -> TimeResult:
        return self._schedule(cfg, keep_lanes)[1]

    def recompute_flops(self, cfg: MemoryConfig) -> float:
        """FLOPs run again in backward (checkpointed modules re-run; norm_act recipes)."""
        return float(sum(op.flops for op in self.trace(cfg).ops if op.recompute))

    def predict(self, name: str, cfg: MemoryConfig, budget_bytes: float | None = None) -> PolicyPrediction:
        mem = self.memory(cfg)
        timing = self.time(cfg)
        return PolicyPrediction(
            name=name, policy=cfg, peak_bytes=mem.peak_bytes, saved_bytes=mem.saved_bytes,
            swapped_bytes=mem.swapped_bytes, recompute_flops=self.recompute_flops(cfg),
            peak_resident_saved_bytes=mem.peak_resident_saved_bytes, step_s=timing.step_s,
            exposed_transfer_s=timing.exposed_transfer_s, prefetch_misses=timing.prefetch_misses,
            fits=budget_bytes is None or mem.peak_bytes <= budget_bytes * BUDGET_HEADROOM,
        )

    def floor_bytes(self) -> int:
        return floor_bytes(self.trace(), optimizer_state_factor=self.optimizer_state_factor)

    # ---- search --------------------------------------------------------------------------------------
    def candidates(self, base: MemoryConfig, allow_compress: bool) -> list[MemoryConfig]:
        """Every policy worth pricing; swap counts are narrowed by bisection on memory in `auto`."""
        out = []
        recompute_variants = [RecomputeConfig(), RecomputeConfig(norm_act=True)]
        for recompute in recompute_variants:
            mode = "hybrid" if recompute.norm_act else "swap"
            for exclude in ([], ["decoder.*"], ["decoder.level0"]):
                for lookahead in LOOKAHEADS:
                    for compress in (("none", "bf16") if allow_compress else ("none",)):
                        cfg = copy.deepcopy(base)
                        cfg.mode = mode
                        cfg.recompute = copy.deepcopy(recompute)
                        cfg.swap = copy.deepcopy(base.swap)
                        cfg.swap.include = list(base.swap.include)
                        cfg.swap.exclude = list(exclude)
                        cfg.swap.lookahead = lookahead
                        cfg.swap.compress = compress
                        cfg.swap.tensors = -1
                        out.append(cfg)
        return out

    def auto(self, budget_bytes: float, base: MemoryConfig | None = None,
             allow_compress: bool | None = None) -> tuple[PolicyPrediction | None, list[PolicyPrediction]]:
        """The fastest policy whose predicted peak fits `budget_bytes * BUDGET_HEADROOM` (None if none)."""
        base = copy.deepcopy(base or MemoryConfig())
        if allow_compress is None:
            allow_compress = base.swap.compress == "bf16"
        limit = budget_bytes * BUDGET_HEADROOM
        fitting: list[PolicyPrediction] = []
        for name, cfg in named_policies(base).items():  # the simple policies first: often one is enough
            prediction = self.predict(name, cfg, budget_bytes)
            if prediction.fits:
                fitting.append(prediction)
        for cfg in self.candidates(base, allow_compress):
            eligible = len(select_swapped(self.records(cfg), cfg.swap))
            cfg.swap.tensors = -1
            if self.memory(cfg).peak_bytes > limit:
                continue  # even swapping every eligible storage does not fit
            low, high = 0, eligible  # smallest N that fits (memory is non-increasing in N)
            while low < high:
                mid = (low + high) // 2
                cfg.swap.tensors = mid
                if self.memory(cfg).peak_bytes <= limit:
                    high = mid
                else:
                    low = mid + 1
            cfg.swap.tensors = low if low < eligible else -1
            if low == 0:
                cfg.mode = "recompute" if cfg.recompute.norm_act else "none"
            fitting.append(self.predict("auto", copy.deepcopy(cfg), budget_bytes))
        if not fitting:
            return None, []
        best = min(fitting, key=lambda p: (p.step_s, p.peak_bytes))
        best = copy.copy(best)
        best.name = "auto"
        return best, fitting


# --------------------------------------------------------------------------------------------------------
# Cost models: measured profile, saved profile, defaults
# --------------------------------------------------------------------------------------------------------


def default_cost_model(device: str | torch.device, dtype: torch.dtype = torch.float32) -> OpCostModel:
    """Unmeasured constants: "cpu" for a CPU device, H200-class GPU constants otherwise."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    if kind == "cpu":
        return copy.deepcopy(DEFAULT_COSTS["cpu"])
    return copy.deepcopy(DEFAULT_COSTS["gpu-bfloat16" if dtype == torch.bfloat16 else "gpu-float32"])


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of pinned copies on CUDA (reference/swap.md §8.3 warm start)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)  # the copies run on `device`'s stream, not the current device's
        start.record(stream)
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
        torch.cuda.synchronize(device)
        rates.append(nbytes * repeats / (start.elapsed_time(end) / 1e3))
    return rates[0], rates[1]


def profile_device(model: nn.Module, device: torch.device, *, cube: int | None = None, batch: int = 1,
                   dtype: torch.dtype = torch.float32, loss_fn: Callable | None = None,
                   steps: int = 3) -> OpCostModel:
    """Time forward and backward of `model` on `device` at a small cube and fit the roofline's per-phase
    scale so the trace of the same cube predicts the measured times (then scaled by FLOPs and bytes)."""
    from brats_swap.memory.trace import default_loss

    device = torch.device(device)
    cost = default_cost_model(device.type, dtype)
    cube = cube or (96 if device.type == "cuda" else 32)
    in_channels = next(m for m in model.modules() if isinstance(m, nn.Conv3d)).in_channels
    shape = (batch, in_channels, cube, cube, cube)
    loss_fn = loss_fn or default_loss()
    trace = trace_step(model, shape, dtype=dtype, loss_fn=loss_fn)
    raw_fwd, raw_bwd = phase_compute_seconds(trace, cost)

    work = copy.deepcopy(model).to(device).train()
    x = torch.randn(shape, device=device)
    fwd_times, bwd_times = [], []
    autocast = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    for step in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            probs = work(x)
            loss = loss_fn(probs, torch.rand_like(probs))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mid = time.perf_counter()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        work.zero_grad(set_to_none=True)
        if step:  # the first step warms caches and picks cuDNN algorithms
            fwd_times.append(mid - start)
            bwd_times.append(end - mid)
    fwd_times.sort()
    bwd_times.sort()
    cost.fwd_scale = fwd_times[len(fwd_times) // 2] / max(raw_fwd, 1e-12)
    cost.bwd_scale = bwd_times[len(bwd_times) // 2] / max(raw_bwd, 1e-12)
    cost.name = f"measured on {device} at {cube}³ batch {batch}"
    if device.type == "cuda":
        cost.h2d_bytes_per_s, cost.d2h_bytes_per_s = measure_bandwidth(device)
    return cost


def resolve_cost_model(model: nn.Module, memory_cfg: MemoryConfig, device: torch.device | str,
                       dtype: torch.dtype, *, profile: dict | None = None, measure: bool | None = None,
                       bandwidth_gbs: float | None = None) -> OpCostModel:
    """Saved profile > measurement (default on CUDA) > constants. The link rate: the argument, then
    `memory.bandwidth_gbs`, then the measured or saved rate, then 25 GB/s (PCIe 4) for a GPU."""
    device = torch.device(device)
    measure = device.type == "cuda" if measure is None else measure
    if profile is not None:
        cost = OpCostModel.from_dict(profile)
    elif measure:
        cost = profile_device(model, device, dtype=dtype)
    else:
        cost = default_cost_model(device, dtype)
    rate = bandwidth_gbs if bandwidth_gbs is not None else memory_cfg.bandwidth_gbs
    if rate is None and profile is None and not measure and device.type != "cpu":
        rate = DEFAULT_BANDWIDTH_GBS
    if rate is not None:
        if rate <= 0:
            raise ConfigError(f"memory.bandwidth_gbs: must be positive, got {rate}")
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = float(rate) * 1e9
    return cost


# --------------------------------------------------------------------------------------------------------
# Public entries
# --------------------------------------------------------------------------------------------------------


def plan_report(model: nn.Module, memory_cfg: MemoryConfig, input_shape: Sequence[int], *,
                dtype: torch.dtype | str = torch.float32, cost: OpCostModel | None = None,
                budget_gib: float | None = None, loss_fn: Callable | None = None) -> tuple[PlanReport, Planner]:
    """Price every named policy and, with a budget, auto-tune; never raises when nothing fits."""
    started = time.perf_counter()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    planner = Planner(model, input_shape, dtype=dtype, cost=cost, loss_fn=loss_fn)
    budget_gib = budget_gib if budget_gib is not None else memory_cfg.budget_gib
    planner.budget_gib = budget_gib
    budget_bytes = budget_gib * GIB if budget_gib is not None else None
    report = PlanReport(
        input_shape=planner.input_shape, dtype=str(dtype).split(".")[-1], budget_gib=budget_gib,
        floor_gib=planner.floor_bytes() / GIB, bandwidth_gbs=planner.cost.h2d_bytes_per_s / 1e9,
        cost_model=planner.cost.as_dict(),
    )
    for name, cfg in named_policies(memory_cfg).items():
        report.policies.append(planner.predict(name, cfg, budget_bytes))
    if budget_bytes is not None:
        best, _ = planner.auto(budget_bytes, memory_cfg)
        if best is not None:
            report.policies.append(best)
            report.chosen = best
            report.reason = (f"fastest of the priced policies whose predicted peak fits "
                             f"{BUDGET_HEADROOM:.0%} of {budget_gib:g} GiB")
        else:
            report.reason = (f"no policy fits memory.budget_gib={budget_gib:g}: the floor is "
                             f"{report.floor_gib:.2f} GiB and the best plan needs "
                             f"{min(p.peak_bytes for p in report.policies) / GIB:.2f} GiB")
    else:
        report.chosen = min(report.policies, key=lambda p: p.peak_bytes)
        report.reason = "no budget given: the policy with the lowest predicted peak"
    report.plan_seconds = time.perf_counter() - started
    return report, planner


def choose_policy(model: nn.Module, memory_cfg: MemoryConfig, input_shape: Sequence[int],
                  dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                  *, loss_fn: Callable | None = None, cost: OpCostModel | None = None,
                  ) -> tuple[MemoryConfig, PlanReport]:
    """`memory.mode: auto`: the fastest concrete policy predicted to fit `memory.budget_gib`.

    Returns the MemoryConfig to hand to the engine (mode none/swap/recompute/hybrid, knobs filled, the
    budget and bandwidth carried over) and the report to save with the run. Raises ConfigError when no
    budget is set or nothing fits.
    """
    if memory_cfg.budget_gib is None:
        raise ConfigError("memory.budget_gib: memory.mode 'auto' needs a device-memory budget in GiB")
    if memory_cfg.budget_gib <= 0:
        raise ConfigError(f"memory.budget_gib: must be positive, got {memory_cfg.budget_gib}")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if cost is None:
        cost = resolve_cost_model(model, memory_cfg, device, dtype)
    report, _ = plan_report(model, memory_cfg, input_shape, dtype=dtype, cost=cost, loss_fn=loss_fn)
    if report.chosen is None:
        raise ConfigError(report.reason)
    chosen = copy.deepcopy(report.chosen.policy)
    chosen.budget_gib = memory_cfg.budget_gib
    chosen.bandwidth_gbs = memory_cfg.bandwidth_gbs
    return chosen, report


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def plan_for_config(config, *, size: int | None = None, batch: int | None = None,
                    budget_gib: float | None = None, dtype: str | None = None,
                    bandwidth_gbs: float | None = None, device: str = "auto",
                    profile: dict | None = None) -> tuple[PlanReport, Planner]:
    """`brats-swap plan`: the run's model at its cube (or `size`³) and batch, every policy priced.

    `device` picks the time model: "cuda" measures this machine's GPU (a short profile and a pinned
    copy loop), "cpu" uses CPU constants, "gpu" uses H200-class constants without measuring, and
    "auto" measures when CUDA is available and otherwise assumes an H200-class GPU.
    """
    from brats_swap.model import build_model

    cube = [size] * 3 if size is not None else list(config.data.cube)
    batch = batch if batch is not None else config.train.batch_size
    if batch < 1 or any(v < 1 for v in cube):
        raise ConfigError(f"plan: batch {batch} and size {cube} must be positive")
    dtype_name = dtype or ("bf16" if config.train.amp == "bf16" else "fp32")
    if dtype_name not in DTYPES:
        raise ConfigError(f"plan --dtype: {dtype_name!r} is not one of fp32, bf16")
    torch_dtype = DTYPES[dtype_name]
    model = build_model(config.model)
    input_shape = (batch, config.model.in_channels, *cube)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "gpu"
    if device not in ("cpu", "cuda", "gpu") and not device.startswith("cuda:"):
        raise ConfigError(f"plan --device: {device!r} is not one of auto, cpu, cuda, gpu")
    if profile is not None:
        cost = OpCostModel.from_dict(profile)
    elif device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("plan --device cuda: CUDA is not available on this machine")
        cost = profile_device(model, torch.device(device), dtype=torch_dtype)
    else:
        cost = default_cost_model(device, torch_dtype)
    rate = bandwidth_gbs if bandwidth_gbs is not None else config.memory.bandwidth_gbs
    if rate is None and not device.startswith("cuda") and profile is None:
        rate = DEFAULT_BANDWIDTH_GBS if device == "gpu" else None
    if rate is not None:
        if rate <= 0:
            raise ConfigError(f"plan --bandwidth / memory.bandwidth_gbs: must be positive, got {rate}")
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = float(rate) * 1e9
    return plan_report(model, config.memory, input_shape, dtype=torch_dtype, cost=cost, budget_gib=budget_gib)
