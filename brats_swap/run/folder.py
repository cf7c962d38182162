"""The run folder: every path of a run comes from here, and nothing else spells those names.

Like nnU-Net's output folder, the layout is a contract users script against:

```
<run>/config.yaml  env.json  splits.json  .lock  cv.log  cv_summary.json  cv_summary.md
      postprocessing.json  compare.json  compare.md  figures/*.png
      training_plan.json                 (train-challenge: the card, the plan and the schedule it chose)
      fold_<k>/checkpoint_latest.pt  checkpoint_prev.pt  checkpoint_best.pt  checkpoint_nnunet.pt
               train.log  env.json  tb/  state.json  memory_plan.json  cv_worker.log
               metrics.csv  summary.json  summary.md  dice_boxplot.png  predictions/<case>.nii.gz
               official.csv  official_summary.json      (the official BraTS lesion-wise metrics)
      full/  patch/                      (compare --patch: each arm is a run folder of its own)
      fold_all/                          (the all-cases model: nnU-Net's fold `all`, trained on every case)
```

The all-cases model is `ALL_CASES_FOLD` wherever a fold number is passed around and `fold_all/` on disk;
`existing_folds` lists the numbered folds only, so "every fold" (`--folds all`) never takes it in.

`RunFolder` and `FoldFolder` are plain path arithmetic: building one touches no file, so they are
cheap to create anywhere (CLI, training, evaluation, cv) and safe to pass between processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# File names, in one place. Modules import the folder objects, not these constants, wherever they
# have a run or fold at hand; the constants exist for messages and documentation.
CONFIG_FILE = "config.yaml"
ENV_FILE = "env.json"
SPLITS_FILE = "splits.json"
LOCK_FILE = ".lock"
CV_LOG = "cv.log"
CV_SUMMARY_JSON = "cv_summary.json"
CV_SUMMARY_MD = "cv_summary.md"
POSTPROCESSING_FILE = "postprocessing.json"
COMPARE_JSON = "compare.json"
COMPARE_MD = "compare.md"
FIGURES_DIR = "figures"
COMPARE_ARMS = ("full", "patch")
# Figures of a run (in figures/); DICE_BOXPLOT below is also the cv summary's figure name.
COMPARE_BOXPLOT = "compare_dice_boxplot.png"
COMPARE_OVERLAYS = "compare_overlays.png"
TRAINING_CURVES = "training_curves.png"

LATEST = "checkpoint_latest.pt"
PREVIOUS = "checkpoint_prev.pt"
BEST = "checkpoint_best.pt"
IMPORTED = "checkpoint_nnunet.pt"  # weights of an imported nnU-Net fold (`import-nnunet`), where fine-tuning starts
FAILURE = "failed.txt"
TRAIN_LOG = "train.log"
TENSORBOARD_DIR = "tb"
STATE_FILE = "state.json"
MEMORY_PLAN = "memory_plan.json"
CV_WORKER_LOG = "cv_worker.log"
METRICS_CSV = "metrics.csv"
EVALUATED_CHECKPOINT = "evaluated_checkpoint.json"  # the training state the metrics were written from
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
DICE_BOXPLOT = "dice_boxplot.png"
OFFICIAL_CSV = "official.csv"
OFFICIAL_SUMMARY_JSON = "official_summary.json"
PREDICTIONS_DIR = "predictions"
TRAINING_PLAN = "training_plan.json"
FOLD_PREFIX = "fold_"
# nnU-Net's fold `all`: one model trained on every case, none held out. A negative number, so that it is
# never one of splits.json's folds; its folder is `fold_all`.
ALL_CASES_FOLD = -1
ALL_CASES_NAME = "all"


def fold_name(fold: int) -> str:
    """`<k>` for a numbered fold, `all` for the all-cases model (`fold_<name>`: its folder and bundle member)."""
    return ALL_CASES_NAME if int(fold) == ALL_CASES_FOLD else str(int(fold))


def _fold_index(name: str) -> int | None:
    """k for a folder named `fold_<k>`, else None."""
    suffix = name[len(FOLD_PREFIX):] if name.startswith(FOLD_PREFIX) else ""
    if suffix == ALL_CASES_NAME:
        return ALL_CASES_FOLD
    return int(suffix) if suffix.isdigit() else None


@dataclass(frozen=True)
class FoldFolder:
    """`<run>/fold_<k>/`: one fold's checkpoints, logs, state and evaluation."""

    root: Path
    fold: int

    @classmethod
    def at(cls, root: Path | str) -> FoldFolder:
        """The fold folder at path `root`, which must be named `fold_<k>`."""
        root = Path(root)
        index = _fold_index(root.name)
        if index is None:
            raise ValueError(f"{root}: not a fold folder (expected a name like fold_0)")
        return cls(root, index)

    @property
    def latest(self) -> Path:
        return self.root / LATEST

    @property
    def previous(self) -> Path:
        return self.root / PREVIOUS

    @property
    def best(self) -> Path:
        return self.root / BEST

    @property
    def imported(self) -> Path:
        return self.root / IMPORTED

    @property
    def train_log(self) -> Path:
        return self.root / TRAIN_LOG

    @property
    def env(self) -> Path:
        """What produced this fold (host, device, versions, whether its steps ran compiled): the run's
        `env.json` is rewritten by every process that trains a fold, and folds on a cluster run on other nodes."""
        return self.root / ENV_FILE

    @property
    def failure(self) -> Path:
        """The error line that ended the fold's last training call (absent once a call starts again)."""
        return self.root / FAILURE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def state(self) -> Path:
        return self.root / STATE_FILE

    @property
    def memory_plan(self) -> Path:
        return self.root / MEMORY_PLAN

    @property
    def cv_worker_log(self) -> Path:
        return self.root / CV_WORKER_LOG

    @property
    def metrics_csv(self) -> Path:
        return self.root / METRICS_CSV

    @property
    def evaluated_checkpoint(self) -> Path:
        """Which training state the metrics describe (`run/evaluation_record.py`)."""
        return self.root / EVALUATED_CHECKPOINT

    @property
    def summary_json(self) -> Path:
        return self.root / SUMMARY_JSON

    @property
    def summary_md(self) -> Path:
        return self.root / SUMMARY_MD

    @property
    def dice_boxplot(self) -> Path:
        return self.root / DICE_BOXPLOT

    @property
    def official_csv(self) -> Path:
        return self.root / OFFICIAL_CSV

    @property
    def official_summary_json(self) -> Path:
        return self.root / OFFICIAL_SUMMARY_JSON

    @property
    def predictions(self) -> Path:
        return self.root / PREDICTIONS_DIR

    def prediction(self, case_id: str, suffix: str = ".nii.gz") -> Path:
        """`predictions/<case><suffix>` (labels as `.nii.gz`; probabilities as `.npz`)."""
        return self.predictions / f"{case_id}{suffix}"


@dataclass(frozen=True)
class RunFolder:
    """`runs/<name>/`: a run of one config (one training, a cross-validation, or a compare arm)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def of(cls, run: RunFolder | Path | str) -> RunFolder:
        """`run` as a RunFolder: functions that take a run accept the folder object or its path."""
        return run if isinstance(run, RunFolder) else cls(Path(run))

    @classmethod
    def default_for(cls, config_name: str, runs_root: Path | str = "runs") -> RunFolder:
        """`runs/<config name>`, the folder a command uses when no `--run` is given."""
        return cls(Path(runs_root) / config_name)

    def fold(self, k: int) -> FoldFolder:
        return FoldFolder(self.root / f"{FOLD_PREFIX}{fold_name(k)}", int(k))

    @contextlib.contextmanager
    def removed_if_start_fails(self) -> Iterator[None]:
        """For a call that may create this run folder: when the block fails and the folder it created holds
        nothing but lock files (`.lock`, `.fold_<k>.lock`: the start failed before any work), remove them and
        it, so a mistyped start leaves no folder behind. Only what this call created goes."""
        existed = self.root.exists()
        try:
            yield
        except BaseException:
            if not existed and self.root.is_dir():
                entries = list(self.root.iterdir())
                if all(e.is_file() and e.name.startswith(".") and e.name.endswith(".lock") for e in entries):
                    for entry in entries:
                        entry.unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        self.root.rmdir()
            raise

    def existing_folds(self) -> list[int]:
        """Numbered fold indices that have a `fold_<k>/` folder, sorted (`fold_all/` is not one of them)."""
        indices = (_fold_index(path.name) for path in self.root.glob(f"{FOLD_PREFIX}*") if path.is_dir())
        return sorted(index for index in indices if index is not None and index >= 0)

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def env(self) -> Path:
        return self.root / ENV_FILE

    @property
    def splits(self) -> Path:
        return self.root / SPLITS_FILE

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def cv_log(self) -> Path:
        return self.root / CV_LOG

    @property
    def cv_summary_json(self) -> Path:
        return self.root / CV_SUMMARY_JSON

    @property
    def cv_summary_md(self) -> Path:
        return self.root / CV_SUMMARY_MD

    @property
    def postprocessing(self) -> Path:
        return self.root / POSTPROCESSING_FILE

    @property
    def training_plan(self) -> Path:
        return self.root / TRAINING_PLAN

    @property
    def compare_json(self) -> Path:
        return self.root / COMPARE_JSON

    @property
    def compare_md(self) -> Path:
        return self.root / COMPARE_MD

    @property
    def figures(self) -> Path:
        return self.root / FIGURES_DIR

    def figure(self, name: str) -> Path:
        """`figures/<name>` (e.g. `dice_boxplot.png`)."""
        return self.figures / name

    @property
    def cv_boxplot(self) -> Path:
        """`figures/dice_boxplot.png`: per-case Dice of every evaluated fold (the cv summary's figure)."""
        return self.figure(DICE_BOXPLOT)

    @property
    def compare_boxplot(self) -> Path:
        return self.figure(COMPARE_BOXPLOT)

    @property
    def compare_overlays(self) -> Path:
        return self.figure(COMPARE_OVERLAYS)

    @property
    def training_curves(self) -> Path:
        return self.figure(TRAINING_CURVES)

    def relative(self, path: Path) -> str:
        """`path` as the run's reports link it (`figures/x.png`): relative to the run, forward slashes."""
        return Path(path).relative_to(self.root).as_posix()

    def arm(self, name: str) -> RunFolder:
        """A compare arm (`full` or `patch`): a run folder of its own inside this one."""
        if name not in COMPARE_ARMS:
            raise ValueError(f"unknown compare arm {name!r}; expected one of {COMPARE_ARMS}")
        return RunFolder(self.root / name)
