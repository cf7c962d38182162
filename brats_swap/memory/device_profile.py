"""Where the cost model's numbers come from: a short measurement on the device, a saved profile, or the
assumed constants of `cost.default_cost_model`.

- `measure_bandwidth`: the host<->device link's rates of pinned copies on CUDA;
- `profile_device`: forward and backward of the model timed at a small cube, the roofline's per-phase scale
  fitted so the trace of the same cube (`recorder.trace_step`) predicts the measured times;
- `resolve_cost_model`: the time model a planner uses for a device (a saved profile, a measurement on CUDA,
  constants elsewhere; a given link rate replaces the link's).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from brats_swap.memory.cost import ASSUMED_GPU_LINK, HALF_DTYPES, OpCostModel, default_cost_model
from brats_swap.memory.recorder import first_output, trace_step


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of pinned copies on CUDA.

    One unmeasured copy first (it pays for the lazy setup of the pinned path), then `repeats` copies of a
    256 MiB buffer timed with events on `device`'s stream: large enough to reach the link's sustained rate.
    """
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


def profile_device(model: nn.Module, device: torch.device, *, loss_fn: Callable, cube: int | None = None,
                   batch: int = 1, dtype: torch.dtype = torch.float32, steps: int = 3,
                   base: OpCostModel | None = None) -> OpCostModel:
    """Time forward and backward of `model` on `device` at a small cube and fit the roofline's per-phase
    scale so the trace of the same cube predicts the measured times (then scaled by FLOPs and bytes).
    `base` gives the roofline's rates (e.g. measured compute and memory rates of this CPU) instead of
    the defaults of `default_cost_model`."""
    device = torch.device(device)
    cost = copy.deepcopy(base) if base is not None else default_cost_model(device.type, dtype)
    cube = cube or (96 if device.type == "cuda" else 32)
    in_channels = next(m for m in model.modules() if isinstance(m, nn.Conv3d)).in_channels
    shape = (batch, in_channels, cube, cube, cube)
    raw_fwd, raw_bwd = cost.phase_seconds(trace_step(model, shape, dtype=dtype, loss_fn=loss_fn))

    work = copy.deepcopy(model).to(device).train()
    x = torch.randn(shape, device=device)
    fwd_times, bwd_times = [], []
    autocast = device.type == "cuda" and dtype in HALF_DTYPES
    for step in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            output = work(x)  # a tensor, or a structure of them under deep supervision
            loss = loss_fn(output, torch.rand_like(first_output(output)))
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
    cost.fwd_scale = statistics.median(fwd_times) / max(raw_fwd, 1e-12)
    cost.bwd_scale = statistics.median(bwd_times) / max(raw_bwd, 1e-12)
    cost.name = f"measured on {device} at {cube}³ batch {batch}"
    if device.type == "cuda":
        cost.h2d_bytes_per_s, cost.d2h_bytes_per_s = measure_bandwidth(device)
    return cost


def resolve_cost_model(model: nn.Module, device: torch.device | str, dtype: torch.dtype, *, loss_fn: Callable,
                       profile: dict | None = None, bandwidth_gbs: float | None = None) -> OpCostModel:
    """The time model for `device`: a saved profile, else a short measurement on a CUDA device, else
    constants ("cpu"; "gpu" or any other device: an assumed H200-class card on a 50 GB/s PCIe 5 link).
    `bandwidth_gbs`, when given, replaces the link rate (measured, saved or assumed), and the model's
    name says so."""
    kind = str(device)
    if profile is not None:
        cost = OpCostModel.from_dict(profile)
    elif kind.startswith("cuda"):
        cost = profile_device(model, torch.device(kind), loss_fn=loss_fn, dtype=dtype)
    else:
        cost = default_cost_model(kind, dtype)
    if bandwidth_gbs is not None:
        cost.h2d_bytes_per_s = cost.d2h_bytes_per_s = float(bandwidth_gbs) * 1e9
        cost.name = cost.name.replace(f", {ASSUMED_GPU_LINK} (assumed)", " (assumed)")
        cost.name += f"; link {float(bandwidth_gbs):g} GB/s (given)"
    return cost
