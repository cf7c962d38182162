"""Figures as PNG files: matplotlib on the Agg backend (no display), written atomically and reproducibly,
and the per-case Dice box plot that a fold's evaluation and a cross-validation summary both draw."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from brats_swap.atomic import atomic_path
from brats_swap.run.dice import dice_column, regions_of_columns


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def savefig_deterministic(figure, path: Path, dpi: int = 110) -> None:
    """PNG without a software/date stamp, so an unchanged plot gives an unchanged file."""
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=dpi, metadata={"Software": None})


def dice_boxplot(case_rows: Sequence[dict], path: Path, title: str = "") -> None:
    """Per-case Dice per region (the rows' `dice_<region>` columns): one box per region, every case drawn
    as a dot. `title` defaults to the number of cases."""
    plt = pyplot()
    regions = regions_of_columns(key for row in case_rows for key in row)
    data = [[float(r[dice_column(region)]) for r in case_rows if dice_column(region) in r] for region in regions]
    figure, axis = plt.subplots(figsize=(5, 4))
    axis.boxplot(data, showfliers=False)
    axis.set_xticks(range(1, len(regions) + 1), regions)
    for i, values in enumerate(data, start=1):
        # A deterministic spread of the dots (no random jitter: the PNG must be reproducible).
        offsets = [(-0.12 + 0.24 * j / max(len(values) - 1, 1)) for j in range(len(values))]
        axis.scatter([i + o for o in offsets], values, s=10, alpha=0.6, color="tab:blue", zorder=3)
    axis.set_ylim(-0.02, 1.02)
    axis.set_ylabel("Dice per case")
    axis.set_title(title or f"Dice per region ({len(case_rows)} cases)")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    savefig_deterministic(figure, path)
    plt.close(figure)
