"""The predicted timeline of one step as a PNG: compute, device-to-host and host-to-device lanes plus
device memory over time (the layout of the IBM data-swapping paper's Figure 2)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from brats_swap.atomic import atomic_path  # noqa: E402
from brats_swap.config.schema import MemoryConfig  # noqa: E402
from brats_swap.memory.simulate import GIB  # noqa: E402

_COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "recompute": "#55A868", "stall": "#C44E52",
           "d2h": "#8172B3", "h2d": "#937860"}


def _merge(intervals: list[tuple[float, float, str]], gap: float) -> list[tuple[float, float]]:
    """Join touching intervals so a thousand small kernels draw as a few bars."""
    out: list[list[float]] = []
    for start, end, _ in sorted(intervals):
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e - s) for s, e in out]


def write_timeline_png(planner, cfg: MemoryConfig, path: str | Path, title: str = "") -> Path:
    """Simulate `cfg` with lanes kept and draw it; returns the written path (atomic write)."""
    timing = planner.time(cfg, keep_lanes=True)
    memory = planner.memory(cfg, keep_timeline=True)
    lanes = timing.lanes
    scale = 1e3  # milliseconds
    gap = timing.step_s * 1e-4

    fig, (ax_lanes, ax_mem) = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True,
                                           gridspec_kw={"height_ratios": [1.4, 1]})
    rows = [("compute", [i for i in lanes["compute"] if i[2] == "fwd"], "fwd", 3),
            ("compute", [i for i in lanes["compute"] if i[2] == "bwd"], "bwd", 3),
            ("compute", [i for i in lanes["compute"] if i[2] == "recompute"], "recompute", 3),
            ("compute", lanes["stall"], "stall", 3),
            ("D2H", lanes["d2h"], "d2h", 2), ("H2D", lanes["h2d"], "h2d", 1)]
    for _, intervals, kind, y in rows:
        bars = [(s * scale, w * scale) for s, w in _merge(intervals, gap)]
        if bars:
            ax_lanes.broken_barh(bars, (y - 0.35, 0.7), facecolors=_COLORS[kind], label=kind)
    ax_lanes.set_yticks([1, 2, 3], ["H2D", "D2H", "compute"])
    ax_lanes.legend(loc="upper right", ncol=6, fontsize=8)
    ax_lanes.set_title(title or f"predicted step: {timing.step_s * 1e3:.1f} ms, "
                                f"exposed transfer {timing.exposed_transfer_s * 1e3:.1f} ms")

    times = timing.op_start[: len(memory.timeline)] * scale
    usage = (memory.timeline + memory.persistent_bytes) / GIB
    ax_mem.plot(times, usage, color="#333333", linewidth=1, drawstyle="steps-post")
    ax_mem.axhline(memory.peak_gib, color=_COLORS["stall"], linestyle="--", linewidth=0.8,
                   label=f"peak {memory.peak_gib:.2f} GiB")
    if planner.budget_gib is not None:
        ax_mem.axhline(planner.budget_gib, color="black", linestyle=":", linewidth=0.8,
                       label=f"budget {planner.budget_gib:g} GiB")
    ax_mem.set_ylabel("device GiB")
    ax_mem.set_xlabel("time (ms)")
    ax_mem.set_ylim(bottom=0, top=max(float(np.max(usage)), planner.budget_gib or 0) * 1.1)
    ax_mem.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path
