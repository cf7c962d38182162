"""`brats-swap data check`: load and validate every case of a dataset folder, without writing anything."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console

from brats_swap.data.challenges import CANONICAL_MODALITIES, get_challenge
from brats_swap.data.discovery import Case, discover_cases
from brats_swap.data.nifti import is_foreign_labels, load_case
from brats_swap.data.preprocess import cropped_label_voxels, describe_cropped
from brats_swap.data.workers import resolve_workers, run_cases
from brats_swap.errors import case_problem

UNLABELLED_NOTE = "no segmentation: for prediction only"


@dataclass
class CaseCheck:
    case_id: str
    edition: str  # the key of the table the case was checked against ("2021", "gli", "ped", ...)
    shape: tuple[int, ...] | None = None
    spacing: tuple[float, ...] | None = None
    label_counts: dict[str, int] | None = None  # label abbreviation -> voxels; None without a segmentation
    problem: str | None = None  # the one-line DataError that makes the case unusable
    cropped: str | None = None  # the warning when fitting to the cube removes tumour voxels (pad_crop)
    notes: list[str] = field(default_factory=list)  # non-fatal: ignored files, seg affine differences

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def unlabelled(self) -> bool:
        """Usable without a segmentation: for prediction only (the folds leave it out)."""
        return self.ok and self.label_counts is None


def check_dataset(root: str | os.PathLike, edition: str = "auto",
                  modalities: tuple[str, ...] | list[str] = CANONICAL_MODALITIES,
                  progress: bool = True, challenge: str = "auto", fit_to: dict | None = None,
                  workers: int | str = 1, console: Console | None = None) -> list[CaseCheck]:
    """One CaseCheck per discovered case (in discovery order). Folder-level problems (missing, empty,
    duplicates) raise.

    `fit_to` ({"cube": [D, H, W], "fit": "pad_crop" | "resample"}, e.g. `preprocess_settings(cfg.data)`):
    also say, per case, which tumour voxels fitting to that cube would remove. `workers` processes check
    cases in parallel (`auto`: every CPU this process may use)."""
    cases = discover_cases(root, edition, tuple(modalities), challenge)
    results: dict[str, CaseCheck] = {}
    run_cases(check_case, [(case, tuple(modalities), fit_to) for case in cases], resolve_workers(workers),
              done=lambda result: results.__setitem__(result.case_id, result),
              failures=lambda: sum(not r.ok for r in results.values()), description="check", progress=progress,
              console=console)
    return [results[case.case_id] for case in cases]


def check_case(case: Case, modalities: tuple[str, ...], fit_to: dict | None) -> CaseCheck:
    """Read and validate one case: the one place `data check` reads a case (a DataError becomes its problem)."""
    result = CaseCheck(case.case_id, case.edition)
    result.notes.extend(f"ignored {p.name}" for p in case.ignored)
    try:
        loaded = load_case(case, modalities)
    except Exception as exc:  # one case's files never stop the check of the others (errors.case_problem)
        result.problem = case_problem(case.case_id, exc)
        if result.problem is None:
            raise
        return result
    result.shape = loaded.shape
    result.spacing = loaded.spacing
    result.notes.extend(loaded.warnings)
    if loaded.seg is not None:
        spec = get_challenge(case.edition)
        counts = np.bincount(loaded.seg.ravel(), minlength=max(spec.label_values) + 1)
        result.label_counts = {spec.labels[v]: int(counts[v]) for v in spec.label_values}
    else:
        result.notes.append(UNLABELLED_NOTE)
    cropped = cropped_label_voxels(loaded, fit_to) if fit_to is not None else {}
    if cropped:
        result.cropped = describe_cropped(case.case_id, cropped, fit_to)
    return result


def summary_line(results: list[CaseCheck]) -> str:
    """How many cases are usable, how many of them are unlabelled (for prediction only: training and the folds
    leave them out), skipped, and cropped by the cube."""
    bad = sum(not r.ok for r in results)
    unlabelled = sum(r.unlabelled for r in results)
    cropped = sum(bool(r.cropped) for r in results)
    line = f"{len(results) - bad} usable, {bad} skipped"
    if unlabelled:
        line += (f"; {unlabelled} of the usable have no segmentation: they are for prediction only (training and "
                 "the cross-validation folds leave them out)")
    return line + (f", {cropped} lose tumour voxels to the cube" if cropped else "")


def preparation_warnings(report) -> list[str]:
    """The warnings of a preparation (a `cache.PrepareReport`) besides its skipped cases: tumour voxels lost to
    the cube, label tables that cases contradict. `data prepare` prints them, and so does the preparation that
    `train`, `cv` and `compare` run first."""
    return [*report.cropped.values(), *convention_doubts(report.failed, report.editions)]


def convention_doubts(problems: dict[str, str | None], editions: dict[str, str]) -> list[str]:
    """Warnings for label tables that some cases contradict: when cases read with one table are refused for
    labels outside it, the folder's labels may follow another convention, and the cases of that table that
    were accepted (they hold none of the foreign values) may be read with the wrong meaning."""
    lines = []
    for key in sorted(set(editions.values())):
        cases = [case_id for case_id, edition in editions.items() if edition == key]
        foreign = [case_id for case_id in cases if is_foreign_labels(problems.get(case_id))]
        accepted = [case_id for case_id in cases if problems.get(case_id) is None]
        if foreign and accepted:
            lines.append(
                f"{len(foreign)} of {len(cases)} cases read with the {key} table (e.g. {foreign[0]}) hold labels "
                f"outside it: the folder's labels may follow another convention (nnU-Net's BraTS 2021 conversion "
                f"renumbers them), so the {len(accepted)} accepted (e.g. {accepted[0]}) may be mislabelled; keep "
                "the dataset.json of an nnU-Net or Decathlon folder next to imagesTr/, or set data.challenge / "
                "data.edition")
    return lines
