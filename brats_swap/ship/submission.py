"""The organisers' checks of an output folder, before it is uploaded (`brats-swap check-submission`).

As the BraTS validator and the BrainLesion `brats` package read a submission: a flat folder (a subfolder
invalidates the run), one `.nii.gz` per input case whose name ends in the case's `<5-digit id>-<3-digit
timepoint>` (the validator's `(\\d{5}-\\d{3})\\.nii\\.gz$`; ids of another form, MEN-RT's `0060-1` or
GoAT's, by the id's last two parts, as `brats` collects outputs), every input case present, the grid (shape,
voxel spacing, origin, orientation: the affine) equal to the case's images, label values within the task's
table. An all-zero segmentation is allowed but warned about (`brats` warns too). One line per problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.data.challenges import get_challenge
from brats_swap.data.discovery import Case, discover_cases
from brats_swap.data.nifti import read_volume
from brats_swap.errors import DataError
from brats_swap.ship.serve import case_folders

# The organisers' validator: the key of a case in an output file name.
ORGANISERS_NAME = re.compile(r"(\d{5}-\d{3})\.nii\.gz$")
SEGMENTATION_EXTENSION = ".nii.gz"
# Affines are stored as float32 in NIfTI headers: equal grids agree to far better than this (mm).
GRID_TOLERANCE_MM = 1e-4


def submission_key(case_id: str) -> str:
    """What an output file name must end in (before `.nii.gz`) to belong to `case_id`."""
    match = ORGANISERS_NAME.search(case_id + SEGMENTATION_EXTENSION)
    return match[1] if match else "-".join(case_id.split("-")[-2:])


@dataclass
class SubmissionCheck:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cases: int = 0  # input case folders, named or not
    checked: int = 0  # segmentations whose grid and labels were read
    unnamed: list[str] = field(default_factory=list)  # input case folders whose images the task does not name


def check_submission(output_dir: Path, input_dir: Path, task: str | None = None) -> SubmissionCheck:
    """Every problem of `output_dir` as a submission for the cases of `input_dir` (see the module docstring);
    `task` forces the label table (default: each case's own, from its id)."""
    output_dir, report = Path(output_dir), SubmissionCheck()
    if not output_dir.is_dir():
        raise DataError(f"{output_dir}: output folder not found")
    cases = _input_cases(input_dir, task, report)
    report.cases = len(cases) + len(report.unnamed)
    matched: dict[str, list[Path]] = {case.case_id: [] for case in cases}
    for entry in sorted(output_dir.iterdir()):
        if entry.is_dir():
            report.problems.append(f"{entry}: a subfolder; the output must be flat (a subfolder invalidates the run)")
        elif not entry.name.endswith(SEGMENTATION_EXTENSION):
            report.problems.append(f"{entry}: not a {SEGMENTATION_EXTENSION} segmentation; the output holds only those")
        else:
            owners = [c.case_id for c in cases if entry.name.endswith(submission_key(c.case_id) + SEGMENTATION_EXTENSION)]
            if not owners:
                report.problems.append(f"{entry}: misnamed: the name ends in no input case's id (names end in "
                                       f"<5-digit id>-<3-digit timepoint>.nii.gz, e.g. {_example(cases, task)})")
            for owner in owners:
                matched[owner].append(entry)
    for case in cases:
        files = matched[case.case_id]
        if not files:
            report.problems.append(f"case {case.case_id}: no segmentation in {output_dir} (expected "
                                   f"{case.case_id}{SEGMENTATION_EXTENSION})")
        elif len(files) > 1:
            report.problems.append(f"case {case.case_id}: {len(files)} segmentations ({', '.join(f.name for f in files)}); "
                                   "one per case")
        else:
            _check_segmentation(case, files[0], report)
    return report


def _example(cases: list[Case], task: str | None) -> str:
    """An output name to show: the first input case's, else one of the task's (glioma's when none is given)."""
    case_id = cases[0].case_id if cases else get_challenge(task or "gli").example_id(1)
    return f"{case_id}{SEGMENTATION_EXTENSION}"


def _input_cases(input_dir: Path, task: str | None, report: SubmissionCheck) -> list[Case]:
    cases = []
    for folder in case_folders(input_dir):
        try:
            found = discover_cases(folder, challenge=task or "auto")
        except DataError as exc:
            report.problems.append(f"input {folder}: {exc}")
            report.unnamed.append(folder.name)
            continue
        named = [case for case in found if case.images]
        if not named:
            spec = get_challenge(task or "gli")
            example = spec.example_id(1)
            report.unnamed.append(folder.name)
            report.problems.append(f"input {folder}: no image named as a {spec.key} case (expected e.g. "
                                   f"{example}/{example}{spec.separator}t1c.nii.gz); its segmentation cannot be "
                                   "checked")
        cases.extend(named)
    return cases


def _check_segmentation(case: Case, path: Path, report: SubmissionCheck) -> None:
    reference = next(iter(case.images.values()))
    try:
        labels, affine, _ = read_volume(case.case_id, path, as_float=False)
        image = nib.load(str(reference))
    except DataError as exc:
        report.problems.append(f"{path}: {exc}")
        return
    except Exception as exc:  # nibabel raises many types for a damaged reference header
        report.problems.append(f"{reference}: unreadable image ({exc.__class__.__name__})")
        return
    report.checked += 1
    shape = tuple(image.shape[:3])
    if labels.shape != shape:
        report.problems.append(f"{path}: wrong grid: shape {labels.shape}, the case's images are {shape}")
        return
    if not np.allclose(affine, image.affine, rtol=0, atol=GRID_TOLERANCE_MM):
        report.problems.append(f"{path}: wrong grid: the affine (spacing, origin, orientation) differs from "
                               f"{reference.name}'s: {_affine_text(affine)} vs {_affine_text(image.affine)}")
        return
    spec = get_challenge(case.edition)
    values = np.unique(labels)
    foreign = [v for v in values.tolist() if v not in (0, *spec.labels)]
    if foreign:
        report.problems.append(f"{path}: label value {foreign[0]} is not in the {spec.key} table (0 background, "
                               f"{spec.describe_labels()})")
    elif values.tolist() == [0]:
        report.warnings.append(f"{path}: empty segmentation (all zero)")


def _affine_text(affine) -> str:
    return np.array2string(np.asarray(affine)[:3], precision=3, separator=",", max_line_width=10_000).replace("\n", "")
