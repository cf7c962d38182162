"""Tiny models and phantom challenge inputs for the shipping tests (bundle, challenge entrypoint, checks).

`task_run` writes a run folder for one 2023+ task the way training leaves it (config.yaml, a checksummed
`checkpoint_best.pt` per fold with the weights, config and label table), from an untrained 3-level U-Net
with 2 base filters on a 16³ cube: what the shipping code reads is the same, at no training cost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import brats_swap
from brats_swap.config import load_config
from brats_swap.config.loader import config_to_dict, config_to_yaml
from brats_swap.data.discovery import challenge_images, discover_cases
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.model import build_model
from brats_swap.model.targets import run_output_count
from brats_swap.run.checkpoint import save_checkpoint
from brats_swap.run.folder import RunFolder

PHANTOM_SHAPE = (24, 24, 20)
# The uid the container-contract tests run brats-swap as (no user of that uid exists).
NON_ROOT = 4242


def task_run(base: Path, task: str, folds: int = 1) -> Path:
    """A run folder with `folds` folds of an untrained tiny model for `task`'s label table."""
    modalities = challenge_images(base, task)  # None for a 2017-2021 table (an edition): the default four
    table = [f"data.challenge={task}", f"data.modalities=[{','.join(modalities)}]"] if modalities else [f"data.edition={task}"]
    config = load_config(None, [f"name=tiny-{task}", *table,
                                "data.cube=[16,16,16]", "model.base_filters=2", "model.depth=3",
                                "model.segmentation_levels=2", "train.device=cpu", "evaluate.threshold=0.45"])
    run = RunFolder(base / f"run-{task}")
    run.root.mkdir(parents=True)
    run.config.write_text(config_to_yaml(config), encoding="utf-8")
    for k in range(folds):
        torch.manual_seed(k)
        model = build_model(config.model, out_channels=run_output_count(task, config.model))
        save_checkpoint({"model": model.state_dict(), "config": config_to_dict(config), "edition": task, "epoch": 1,
                         "optimizer": {"state": {}, "param_groups": []}}, run.fold(k).best)
    return run.root


def challenge_input(folder: Path, task: str, cases: int, seed: int = 0) -> list[str]:
    """`folder/<case id>/<case id><sep><modality>.nii.gz` as the organisers mount /input (no segmentation)."""
    ids = synthesize_dataset(folder, cases, seed=seed, edition=task, shape=PHANTOM_SHAPE)
    for case in discover_cases(folder):
        case.seg.unlink()
    return ids


# ---- another uid in its own mount and network namespaces ------------------------------------------------------

def namespaces_permitted() -> bool:
    """Root with `unshare -m -n` and `setpriv`, and a root that can be remounted read-only in the namespace."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "-n", "--", "sh", "-c", "mount --make-rprivate / && "
                            "mount -o remount,bind,ro / && true"], capture_output=True)
    return probe.returncode == 0


def reachable_paths(paths: list[Path | str], stage: Path) -> list[str]:
    """Mount commands (for a private mount namespace) that let any uid reach each of `paths`: every folder on
    the way that others cannot enter (a 0700 /root holding pyenv, or the venv and the checkout) is shadowed
    by a read-only tmpfs holding only the ways down, each the real folder bound back in (staged in `stage`,
    outside them). Outside the namespace nothing changes."""
    reals = sorted({Path(os.path.realpath(path)) for path in paths})
    blocked: dict[Path, set[str]] = {}
    for real in reals:
        for folder in [*reversed(real.parents), real][:-1]:  # the path itself: its own mode is kept
            if not folder.stat().st_mode & 0o001:
                blocked.setdefault(folder, set()).add(real.relative_to(folder).parts[0])
    commands: list[str] = []
    for number, folder in enumerate(sorted(blocked, key=lambda f: len(f.parts))):  # outermost first
        staged = []
        for name in sorted(blocked[folder]):
            staged.append((folder / name, stage / f"{number}-{name}"))
            staged[-1][1].mkdir(parents=True)
        commands += [f"mount --bind {child} {copy}" for child, copy in staged]
        commands.append(f"mount -t tmpfs -o mode=755 tmpfs {folder}")
        commands += [f"mkdir {child} && mount --bind {copy} {child}" for child, copy in staged]
        commands.append(f"mount -o remount,ro {folder}")
    return commands


def reachable_interpreter(stage: Path) -> list[str]:
    """`reachable_paths` for what running brats-swap reads: the base interpreter, the virtual environment and
    the brats_swap package (an editable install: the checkout)."""
    return reachable_paths([sys.base_prefix, sys.prefix, Path(brats_swap.__file__).parent], stage)
