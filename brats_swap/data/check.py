"""`brats-swap data check`: load and validate every case of a dataset folder, without writing anything."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from rich.progress import Progress

from brats_swap.data.challenges import CANONICAL_MODALITIES, get_challenge
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.errors import DataError


@dataclass
class CaseCheck:
    case_id: str
    edition: str  # the key of the table the case was checked against ("2021", "gli", "ped", ...)
    shape: tuple[int, ...] | None = None
    spacing: tuple[float, ...] | None = None
    label_counts: dict[str, int] | None = None  # label abbreviation -> voxels; None without a segmentation
    problem: str | None = None  # the one-line DataError that makes the case unusable
    notes: list[str] = field(default_factory=list)  # non-fatal: ignored files, seg affine differences

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_dataset(root: str | os.PathLike, edition: str = "auto",
                  modalities: tuple[str, ...] | list[str] = CANONICAL_MODALITIES,
                  progress: bool = True, challenge: str = "auto") -> list[CaseCheck]:
    """One CaseCheck per discovered case. Folder-level problems (missing, empty, duplicates) raise."""
    cases = discover_cases(root, edition, tuple(modalities), challenge)
    results = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("check", total=len(cases))
        for case in cases:
            result = CaseCheck(case.case_id, case.edition)
            result.notes.extend(f"ignored {p.name}" for p in case.ignored)
            try:
                loaded = load_case(case, tuple(modalities))
            except DataError as exc:
                result.problem = str(exc)
            else:
                result.shape = loaded.shape
                result.spacing = loaded.spacing
                result.notes.extend(loaded.warnings)
                if loaded.seg is not None:
                    spec = get_challenge(case.edition)
                    counts = np.bincount(loaded.seg.ravel(), minlength=max(spec.label_values) + 1)
                    result.label_counts = {spec.labels[v]: int(counts[v]) for v in spec.label_values}
            results.append(result)
            bar.advance(task)
    return results
