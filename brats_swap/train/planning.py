"""Memory planning for the project's model and configs: `memory.mode: auto` for a fold, and the
out-of-memory advice. The memory package knows nothing about configs files or the U-Net; this module is
where the two meet.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from brats_swap.atomic import atomic_write_json
from brats_swap.config import Config
from brats_swap.config.loader import from_dict
from brats_swap.config.schema import MemoryConfig
from brats_swap.errors import DeviceOutOfMemoryError
from brats_swap.model import build_model

console = Console(stderr=True, highlight=False)
MEMORY_PLAN = "memory_plan.json"


def plan_memory(config: Config, model: torch.nn.Module, fold_dir: Path, input_shape: tuple[int, ...],
                device: torch.device, reuse: bool) -> MemoryConfig:
    """`memory.mode: auto` asks the planner once per fold and records the plan; resume reuses it."""
    plan_path = fold_dir / MEMORY_PLAN
    if reuse and plan_path.exists():
        saved = json.loads(plan_path.read_text(encoding="utf-8"))
        return from_dict(MemoryConfig, saved["memory"], "memory")
    from brats_swap.memory.planner import choose_policy

    dtype = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.train.amp]
    chosen, report = choose_policy(model, config.memory, input_shape, dtype, device)
    atomic_write_json(plan_path, {"memory": dataclasses.asdict(chosen), "report": _plain(report),
                                  "input_shape": list(input_shape), "device": str(device)})
    console.print(f"memory.mode=auto: planner chose mode={chosen.mode} (plan in {plan_path})", markup=False)
    return chosen


def _plain(report: Any) -> Any:
    """A planner report as JSON-ready data, whatever its type."""
    for method in ("as_dict", "to_dict"):
        if hasattr(report, method):
            return getattr(report, method)()
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return dataclasses.asdict(report)
    return report if isinstance(report, dict | list | str | int | float | type(None)) else str(report)


def out_of_memory_error(device: torch.device, config: Config, where: str,
                        memory_cfg: MemoryConfig | None = None) -> DeviceOutOfMemoryError:
    """The OOM message with the planner's advice for this model, size and device: what the running policy
    needs, and (on CUDA) the policy the planner would pick for this card."""
    memory_cfg = memory_cfg or config.memory
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    budget = f"{0.9 * total:.0f}" if total else "N"
    sample = config.train.patch if config.train.mode == "patch" else config.data.cube
    shape = (config.train.batch_size, config.model.in_channels, *sample)
    needs = pick = ""
    try:  # advice only: whatever goes wrong here must not hide the out-of-memory error itself
        from brats_swap.memory.planner import GIB, Planner

        dtype = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.train.amp]
        planner = Planner(build_model(config.model, out_channels=3), shape, dtype=dtype)
        peak = planner.memory(memory_cfg).peak_bytes
        needs = f" the planner predicts it needs about {peak / GIB:.2f} GiB for input {list(shape)}"
        needs += f" on this {total:.0f} GiB device;" if total else ";"
        if total:
            best, _ = planner.auto(0.9 * total * GIB, memory_cfg)
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
