"""The BraTS challenge entrypoint (`brats-swap serve-challenge`): what the organisers' run of an image expects.

The contract (BraTS 2025+: a Docker image run with no network, as any uid, with a read-only root file system;
2023-2024: MLCube's `infer --data_path --output_path` task):

- `/input` is read-only, one folder per case: `/input/<case id>/<case id><sep><modality>.nii.gz`, `sep` "-"
  (or "_", as MEN-RT's cases are named). Nothing is ever written there.
- `/output` is flat: one `<case id>.nii.gz` per case, uint8 labels of the task's table, on the case's own grid
  and header (those of its first modality). Each file is written through a temporary file and a rename, so
  a case cut short leaves no half-written segmentation.
- Any uid, an unwritable HOME: home, torch, matplotlib and cache folders are set under the temporary folder
  (`$TMPDIR`, else /tmp) only when theirs (or, unset, their default under HOME) cannot be written, before
  anything could use them (`ship/writable_folders.py`).
- Case by case: a broken case (a missing or unreadable image, a folder holding no case, any exception while it
  is read or segmented) is named and skipped, the others are segmented, and the command then fails (exit 1)
  naming every failed case. Names from `/input` are printed so they cannot forge a line (`names.shown`).
- Case ids are unique: two folders holding the same case id would write one output file twice, so both are
  refused (each counted as a failed case) and neither is segmented.
- Priced before the first case (`ship/inference_cost.py`): the memory one case's input, windows and outputs
  take, against the host's available memory, and the network calls one case makes (windows x mirrors x folds)
  against MAX_NETWORK_CALLS_PER_CASE; a bundle that cannot fit or finish is refused before anything is read.
- A time budget for the whole test set (`ship/time_budget.py`): when the cases done so far project past it,
  test-time augmentation is dropped first, then folds, and each change is said.
"""


from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from brats_swap.data.discovery import discover_cases
from brats_swap.errors import ConfigError, DataError
from brats_swap.evaluate.case_prediction import predict_case
from brats_swap.evaluate.failures import CaseFailures
from brats_swap.names import shown
from brats_swap.ship.inference_cost import check_case_cost
from brats_swap.ship.time_budget import TimeBudget


def serving_compile(setting: bool | str) -> bool:
    """`evaluate.compile` as serve-challenge predicts with a bundle's setting: `auto` serves eager, an explicit
    `true` compiles (and `false` does not).

    Compiling does not pay for itself where the image runs: each start of it compiles from an empty cache (the
    root file system is read-only and the caches go under the temporary folder), and a start often serves one
    case (the BrainLesion `brats` package's `infer_single`). On the CPU the first case compiled cost more than
    eager, compiling included, and the later cases were no faster (docs/submit.md#compiling-when-serving); on a
    GPU the gain is not measured. Shipping the cache in the image would not remove the cost: dynamo traces
    every block again in each process (torch keeps no trace on disk), and inductor's kernels are built for the
    card and torch build they were compiled with, which the organisers' machine need not match."""
    return setting is True


def case_folders(input_dir: Path) -> list[Path]:
    """The case folders of the challenge's input (`<input>/<case id>/`), sorted; DataError when there are none."""
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise DataError(f"{input_dir}: input folder not found")
    # Each real folder once (a link to a case folder already listed, or back to the input, is skipped).
    here = input_dir.stat()
    seen, folders = {(here.st_dev, here.st_ino)}, []
    for path in sorted(p for p in input_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        real = path.stat()
        if (real.st_dev, real.st_ino) not in seen:
            seen.add((real.st_dev, real.st_ino))
            folders.append(path)
    if not folders:
        raise DataError(f"{input_dir}: no case folders (expected {input_dir}/<case id>/<case id>-t1c.nii.gz, ...)")
    return folders


def _check_output(input_dir: Path, output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise DataError(f"{output_dir}: the output is a file, not a folder; give a folder for <case id>.nii.gz")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"{output_dir}: cannot create the output folder ({exc.strerror})") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise DataError(f"{output_dir}: output folder is not writable by uid {os.getuid()}")
    resolved_in, resolved_out = input_dir.resolve(), output_dir.resolve()
    if resolved_out == resolved_in or resolved_in in resolved_out.parents:
        raise ConfigError(f"{output_dir}: the output folder is inside the input folder {input_dir}, which is never "
                          "written to")


@dataclass
class ServeReport:
    written: list[Path]
    failures: CaseFailures
    changes: list[str]
    cases: int


def serve(predictor, input_dir: Path, output_dir: Path, *, tta: bool = True, time_budget_s: float | None = None,
          say: Callable[[str], None] = print) -> ServeReport:
    """Segment every case folder of `input_dir` into `output_dir` (see the module docstring) with the loaded
    models of `predictor` (`evaluate.predicting.Predictor`); the caller raises on the report's failures."""
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    folders = case_folders(input_dir)
    check_case_cost(predictor, tta, predictor.description)
    _check_output(input_dir, output_dir)
    config = predictor.config
    failures = CaseFailures(say=say)
    budget = TimeBudget(time_budget_s, len(folders)) if time_budget_s is not None else None
    folds, written, changes = len(predictor.members), [], []
    say(f"serve-challenge: {len(folders)} case(s) from {input_dir} to {output_dir}; {predictor.description}"
        f"{', 8-mirror TTA' if tta else ''}; device {predictor.device}")
    for folder, case in _unique_cases(folders, config, failures):
        started = time.monotonic()
        with failures.case(folder.name):
            written.append(predict_case(case, config, predictor.members[:folds], predictor.device, output_dir,
                                        tta=tta, plan=predictor.plan, probabilities=False, say=None))
            say(f"{shown(case.case_id)}: {time.monotonic() - started:.1f} s ({folds} fold(s){', TTA' if tta else ''})")
        if budget is not None:
            tta, folds, change = budget.after_case(time.monotonic() - started, tta, folds)
            if change is not None:
                changes.append(change)
                say(change)
    return ServeReport(written, failures, changes, len(folders))


def _unique_cases(folders: list[Path], config, failures: CaseFailures) -> list[tuple[Path, object]]:
    """Each folder's one case, in order; a folder that holds none (or several) is a failure, and so is every
    folder whose case id another folder also holds (which of them would be the output file?)."""
    found: list[tuple[Path, object]] = []
    for folder in folders:
        with failures.case(folder.name):
            found.append((folder, _one_case(folder, config)))
    holders: dict[str, list[Path]] = {}
    for folder, case in found:
        holders.setdefault(case.case_id, []).append(folder)
    for case_id, where in holders.items():
        if len(where) > 1:
            names = ", ".join(shown(folder.name) for folder in where)
            for folder in where:
                failures.add(folder.name, f"case {shown(case_id)}: held by {len(where)} input folders ({names}); "
                                          "each case id must be in one folder, so none of them is segmented")
    return [(folder, case) for folder, case in found if len(holders[case.case_id]) == 1]


def _one_case(folder: Path, config):
    """The one case of a case folder, read with the bundle's modalities and label table."""
    cases = discover_cases(folder, config.data.edition, config.data.modalities, config.data.challenge)
    if len(cases) != 1:
        raise DataError(f"case {shown(folder.name)}: the folder holds {len(cases)} cases "
                        f"({', '.join(shown(c.case_id) for c in cases[:3])}); expected one")
    return cases[0]
