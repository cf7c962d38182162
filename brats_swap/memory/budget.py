"""What of a card's memory one training step's tensors may use: the budget, less the device overhead,
less the allocator headroom.

`memory.budget_gib` is the card (`--budget 16`: a 16 GB card). Before the first tensor of a step exists,
a CUDA device already holds memory the trace never sees:

- the CUDA context with PyTorch's kernels loaded: about 0.5-1 GiB on an A100 / H100-class card (less with
  lazy module loading, the default since CUDA 11.7);
- cuDNN and cuBLAS workspaces: 3D convolutions at nnU-Net's patch sizes pick algorithms that ask for up
  to about 1 GiB of scratch;
- the caching allocator's reserve: freed blocks it keeps for reuse.

`DEFAULT_DEVICE_OVERHEAD_GIB` (2 GiB) is that sum, and it is what the published figures say too: nnU-Net
reports the GPU memory nvidia-smi shows while training its BraTS 2021 presets (default 7.7, ResEnc M 9.1,
L 22.7, XL 36.6 GB); this planner's no-policy tensor peaks at the same plans, plus 2 GiB, come 5-9% under
each, and the card use the fit rule below assumes (tensors / `BUDGET_HEADROOM` + 2 GiB: 7.6, 9.2, 23.0,
36.2) within 2% of each (`scripts/bench_networks.py` writes the planner's side to
`docs/benchmarks/networks.json`). `scripts/gpu_check.py` measures it on a real card (what the card holds
beyond the predicted tensors). A CPU device has none of it: its default is 0. `memory.device_overhead_gib`
sets another value.

On top, `BUDGET_HEADROOM` keeps a share of what is left for the allocator's block rounding and
fragmentation, which grow with the tensors (TFLMS's simulator keeps 10% for the same reason).

The in-flight window (`memory.swap.max_inflight_bytes`, rule 7 of `rulebook`) is memory too: a swapped
storage stays on the device until that many bytes were saved after it, so copies in flight hold up to the
window. Unset, it is `INFLIGHT_SHARE` of what a plan's tensors may use: of `memory.budget_gib` when given,
else of the card (an assumed H200 for the planner's "gpu" time model). A fixed size would be wrong at one
end: larger than everything a small network saves (nothing released before backward, no memory freed) or
a large share of a small card. On a CPU without a budget the link copies synchronously (the window
changes nothing) unless `swap.emulate_gbs` emulates one for tests and benchmarks, whose cubes (16-64³)
save a few MiB per tensor: `CPU_INFLIGHT_BYTES`.
"""

from __future__ import annotations

import copy

import torch

from brats_swap.config import MemoryConfig
from brats_swap.memory import cuda_device

GIB = float(1 << 30)  # bytes per GiB: the one definition (a float, so byte counts divide to GiB)
DEFAULT_DEVICE_OVERHEAD_GIB = 2.0
# Share of the budget left after the device overhead that a plan's tensors may use.
BUDGET_HEADROOM = 0.92
# The default in-flight window (module docstring): this share of a plan's tensor limit, on a CPU that much.
INFLIGHT_SHARE = 1 / 16
CPU_INFLIGHT_BYTES = 8 << 20
ASSUMED_GPU_BYTES = 141 * 10**9  # the planner's "gpu" time model is an H200-class card: 141 GB


def default_overhead_gib(device: torch.device | str) -> float:
    """The device overhead a card of kind `device` ("cpu", "cuda", "cuda:N", or "gpu": the assumed
    time model of a GPU) holds before a step: 0 on a CPU."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    return 0.0 if kind == "cpu" else DEFAULT_DEVICE_OVERHEAD_GIB


def with_overhead(cfg: MemoryConfig, device: torch.device | str) -> MemoryConfig:
    """`cfg` with `device_overhead_gib` filled (its own value, else the device's default)."""
    if cfg.device_overhead_gib is not None:
        return cfg
    out = copy.deepcopy(cfg)
    out.device_overhead_gib = default_overhead_gib(device)
    return out


def overhead_bytes(cfg: MemoryConfig) -> int:
    """The device overhead `cfg` states, in bytes (none stated: 0, the caller did not say)."""
    return int((cfg.device_overhead_gib or 0.0) * GIB)


def tensor_limit(budget_bytes: float, cfg: MemoryConfig) -> float:
    """Bytes a plan's tensors may peak at on a card of `budget_bytes` (module docstring)."""
    return (budget_bytes - overhead_bytes(cfg)) * BUDGET_HEADROOM


def device_memory_bytes(device: torch.device | str) -> int | None:
    """The memory of the card `device` names ("cuda", "cuda:N": its total; "gpu": the assumed H200), None
    for a CPU or a meta device."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    if kind == "gpu":
        return ASSUMED_GPU_BYTES
    if kind.startswith("cuda") and cuda_device.available():
        return cuda_device.total_bytes(device)
    return None


def inflight_window_bytes(cfg: MemoryConfig, device: torch.device | str | None = None) -> int:
    """`swap.max_inflight_bytes` when set, else the default of the module docstring for `device` (None:
    unknown, as a CPU)."""
    if cfg.swap.max_inflight_bytes is not None:
        return int(cfg.swap.max_inflight_bytes)
    card = float(cfg.budget_gib) * GIB if cfg.budget_gib is not None else (
        device_memory_bytes(device) if device is not None else None)
    if card is None:
        return CPU_INFLIGHT_BYTES
    filled = cfg if cfg.device_overhead_gib is not None or device is None else with_overhead(cfg, device)
    return max(CPU_INFLIGHT_BYTES, int(tensor_limit(card, filled) * INFLIGHT_SHARE))


def with_inflight_window(cfg: MemoryConfig, device: torch.device | str | None = None) -> MemoryConfig:
    """`cfg` with `swap.max_inflight_bytes` filled (its own value, else `inflight_window_bytes`)."""
    if cfg.swap.max_inflight_bytes is not None:
        return cfg
    out = copy.deepcopy(cfg)
    out.swap.max_inflight_bytes = inflight_window_bytes(cfg, device)
    return out
