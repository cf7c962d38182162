"""The one cost model of the memory package: how long an operator runs and how long a copy takes.

- `OpCostModel.durations`: seconds per operator of a trace (roofline: FLOPs / rate + bytes / memory
  bandwidth + launch, times a per-phase scale fitted to a measured profile);
- `OpCostModel.copy_seconds`: one storage over the host<->device link, each way at that direction's
  rate, plus the fp32<->bf16 conversion on the copy stream when it travels compressed;
- `OpCostModel.bytes_moved`: what the link moves in a given time (how much a copy queue can hide);
- `link_seconds`: bytes over a rate (also what the emulated CPU link sleeps);
- `default_cost_model`: assumed constants per device kind; a short measurement or a saved profile
  (`device_profile.resolve_cost_model`) gives measured ones.

The planner, the swap search and the simulator price everything through this module: no other module
of the package divides by (or multiplies with) a link bandwidth.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from brats_swap.memory.events import FORWARD

D2H, H2D = "d2h", "h2d"  # copy directions: device to host (swap out), host to device (reload)


def bytes_per_second(gbs: float) -> float:
    """A link rate given in GB/s (configs, command lines), in bytes per second."""
    return float(gbs) * 1e9


def link_seconds(nbytes: float, bytes_per_s: float) -> float:
    """Seconds `nbytes` take over a link of `bytes_per_s` (an infinite rate takes none)."""
    return nbytes / bytes_per_s


@dataclass
class OpCostModel:
    """Roofline-ish op duration: flops / flops_per_s + bytes / bytes_per_s + launch_s, times a per-phase
    scale fitted to a measured profile (see `profile_device`), and the link."""

    name: str = "default"
    # The device type the costs are for: the planner traces that device's autocast policy (recorder.py).
    device_type: str = "cuda"
    flops_per_s: float = 50e12
    bytes_per_s: float = 3.0e12
    launch_s: float = 5e-6
    fwd_scale: float = 1.0
    bwd_scale: float = 1.0
    h2d_bytes_per_s: float = 50e9
    d2h_bytes_per_s: float = 50e9
    # The engine's synchronous CPU link copies at once (the compute waits for the whole copy); CUDA
    # streams and the emulated link copy while the compute runs.
    sync_copies: bool = False
    # The emulated CPU link (`memory.swap.emulate_gbs`): compute seconds its copy threads take from the
    # step per byte they move (on 2 cores a copy preempts an intra-op thread); 0 for real copy engines.
    copy_interference_s_per_byte: float = 0.0
    # bf16 transport converts on the device through a staging buffer the size of the bf16 copy (CUDA);
    # the CPU links convert on the host.
    staged_conversion: bool = False
    # Grouped (depthwise) convolutions, MedNeXt's k³ layers, run on the CUDA cores at a fraction of the
    # tensor-core rate `flops_per_s` assumes; a measured profile of such a network folds the rest into its
    # scales. 0.1: cuDNN's 3D depthwise kernels reach about a tenth of dense half-precision throughput.
    grouped_efficiency: float = 1.0

    def durations(self, trace) -> list[float]:
        """Seconds of each op of `trace` (0 for ops that launch no kernel)."""
        out = [0.0] * trace.n_ops
        for i, op in enumerate(trace.ops):
            if not op.kernel:
                continue
            rate = self.flops_per_s * (self.grouped_efficiency if op.grouped else 1.0)
            raw = op.flops / rate + op.bytes_accessed / self.bytes_per_s + (0.0 if op.fused else self.launch_s)
            out[i] = raw * (self.fwd_scale if op.phase == FORWARD else self.bwd_scale)
        return out

    def phase_seconds(self, trace) -> tuple[float, float]:
        """(forward, backward) compute seconds of a trace."""
        durations = self.durations(trace)
        forward = sum(d for d, op in zip(durations, trace.ops, strict=True) if op.phase == FORWARD)
        return float(forward), float(sum(durations) - forward)

    def rate(self, direction: str) -> float:
        return self.d2h_bytes_per_s if direction == D2H else self.h2d_bytes_per_s

    def copy_seconds(self, transfer_bytes: int, nbytes: int, direction: str) -> float:
        """A copy of one storage (`nbytes` on the device, `transfer_bytes` on the link and the host) in
        `direction`: its bytes on the link, plus the fp32<->bf16 conversion on the copy stream (reads one,
        writes the other) when it travels compressed."""
        seconds = link_seconds(transfer_bytes, self.rate(direction))
        if transfer_bytes != nbytes:
            seconds += (nbytes + transfer_bytes) / self.bytes_per_s
        return seconds

    def round_trip_seconds(self, transfer_bytes: int, nbytes: int) -> float:
        """The copy out and the copy back of one storage."""
        return self.copy_seconds(transfer_bytes, nbytes, D2H) + self.copy_seconds(transfer_bytes, nbytes, H2D)

    def interference_seconds(self, transfer_bytes: int) -> float:
        """Compute time an emulated link's copy thread takes from the step while it moves these bytes."""
        return transfer_bytes * self.copy_interference_s_per_byte

    def bytes_moved(self, seconds: float, direction: str = D2H) -> float:
        """Bytes the link moves in `direction` in `seconds` (uncompressed)."""
        return self.rate(direction) * seconds

    def link_gbs(self) -> float:
        """The host-to-device rate in GB/s (reports)."""
        return self.h2d_bytes_per_s / 1e9

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> OpCostModel:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# The engine's synchronous CPU path with free copies: what the byte-exact tests replay.
INSTANT = OpCostModel(name="instant synchronous copies", device_type="cpu", h2d_bytes_per_s=float("inf"),
                      d2h_bytes_per_s=float("inf"), sync_copies=True)


# Pinned host<->device copies over PCIe 5 x16 measure about 50-55 GB/s per direction (PCIe 4 x16: about
# 22-25 GB/s); `--bandwidth` / `memory.bandwidth_gbs` set another link, a CUDA profile measures it.
DEFAULT_BANDWIDTH_GBS = 50.0
# Roofline constants when nothing was measured. CPU: this project's CI machine at 32³-48³ (about 60
# GFLOP/s per step for the U-Net). GPU: an H200-class card in fp32 (TF32 convolutions) and in half
# precision (bf16 and fp16 run on the same tensor cores at the same rate), on a PCIe 5 x16 link.
GPU_GROUPED_EFFICIENCY = 0.1  # see OpCostModel.grouped_efficiency
ASSUMED_GPU_LINK = f"PCIe 5 link {DEFAULT_BANDWIDTH_GBS:g} GB/s"
DEFAULT_COSTS = {
    "cpu": OpCostModel(name="cpu (assumed)", device_type="cpu", flops_per_s=60e9, bytes_per_s=20e9, launch_s=20e-6,
                       h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9, sync_copies=True),
    "gpu-float32": OpCostModel(name=f"H200-class GPU, fp32/TF32, {ASSUMED_GPU_LINK} (assumed)", flops_per_s=60e12,
                               bytes_per_s=3.0e12, launch_s=6e-6, h2d_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9,
                               d2h_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9, staged_conversion=True,
                            grouped_efficiency=GPU_GROUPED_EFFICIENCY),
    "gpu-half": OpCostModel(name=f"H200-class GPU, bf16/fp16, {ASSUMED_GPU_LINK} (assumed)", flops_per_s=150e12,
                            bytes_per_s=3.0e12, launch_s=6e-6, h2d_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9,
                            d2h_bytes_per_s=DEFAULT_BANDWIDTH_GBS * 1e9, staged_conversion=True,
                            grouped_efficiency=GPU_GROUPED_EFFICIENCY),
}
HALF_DTYPES = (torch.bfloat16, torch.float16)


def default_cost_model(device: str | torch.device, dtype: torch.dtype = torch.float32) -> OpCostModel:
    """Unmeasured constants: "cpu" for a CPU device, H200-class GPU constants otherwise."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    if kind == "cpu":
        return copy.deepcopy(DEFAULT_COSTS["cpu"])
    return copy.deepcopy(DEFAULT_COSTS["gpu-half" if dtype in HALF_DTYPES else "gpu-float32"])
