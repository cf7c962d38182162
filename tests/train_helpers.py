"""Shared pieces of the train/evaluate tests: a tiny prepared phantom dataset and a tiny config."""

from __future__ import annotations

import shutil
from pathlib import Path

from brats_swap.config import Config, load_config

PHANTOM_SHAPE = (40, 40, 32)
N_CASES = 4
_DATASETS: dict[str, tuple[Path, Path]] = {}


def prepared_dataset(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset root, cache) of 4 phantom cases at 40x40x32 prepared to a 32³ cube; made once per session."""
    if "tiny" not in _DATASETS:
        from brats_swap.data.cache import prepare_dataset
        from brats_swap.data.phantom import synthesize_dataset

        base = tmp_path_factory.mktemp("train-data")
        root, cache = base / "phantoms", base / "cache"
        synthesize_dataset(root, N_CASES, seed=0, shape=PHANTOM_SHAPE)
        config = tiny_config(root, cache)
        prepare_dataset(root, cache, config.data, workers=1, progress=False)
        _DATASETS["tiny"] = (root, cache)
    return _DATASETS["tiny"]


# The tests whose point holds at any size train on a 16³ cube: a step costs a quarter of one at 32³. The
# U-Net is one level shallower so that its bottleneck stays 2³ as at 32³ (an instance norm over a single voxel
# outputs its bias whatever the input).
SMALL = ("data.cube=[16,16,16]", "model.depth=4")


def small_dataset(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset root, cache): the cases of `prepared_dataset` prepared to the 16³ cube of `SMALL` (train on it
    with `tiny_config(root, cache, *SMALL)`); made once per session."""
    if "small" not in _DATASETS:
        from brats_swap.data.cache import prepare_dataset

        root, _ = prepared_dataset(tmp_path_factory)
        cache = tmp_path_factory.mktemp("train-data-small") / "cache"
        prepare_dataset(root, cache, tiny_config(root, cache, *SMALL).data, workers=1, progress=False)
        _DATASETS["small"] = (root, cache)
    return _DATASETS["small"]


def tiny_config(root: Path, cache: Path, *overrides: str) -> Config:
    """32³ cube, 4 base filters, 1 epoch of 2 steps, 2 folds (2 train / 2 val cases), no workers."""
    return load_config(None, [
        "name=tiny", f"data.root={root}", f"data.cache={cache}", "data.cube=[32,32,32]", "data.loader_workers=0",
        "model.base_filters=4", "train.max_epochs=1", "train.steps_per_epoch=2", "train.device=cpu", "cv.folds=2",
        "evaluate.hd95=false", *overrides,
    ])


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tensorboard_scalars(tb_dir: Path) -> dict[str, list[float]]:
    """tag -> values of the TensorBoard event files in `tb_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def assert_same_training_state(a: dict, b: dict) -> None:
    """Two checkpoints hold bitwise the same parameters and optimizer state, after the same steps."""
    import torch

    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key in state_a[index]:
            assert torch.equal(torch.as_tensor(state_a[index][key]), torch.as_tensor(state_b[index][key])), (index, key)
    assert a["global_step"] == b["global_step"] and a["history"][-1]["train_loss"] == b["history"][-1]["train_loss"]
