"""Every network `model.name` builds trains 2 epochs on tiny phantoms under memory policies none, hybrid and
auto with bitwise-equal losses and weights, then evaluates and predicts (one with TTA); the architecture travels in
the checkpoint. Networks are narrowed (`model.features`) to keep CPU steps short; their topology is the
one nnU-Net's planner rule derives at the 16³ cube (3 stages), SwinUNETR's at 64x32x32."""

from __future__ import annotations

import json
import math

import pytest
import torch
from train_helpers import prepared_dataset, small_dataset, tiny_config

from brats_swap.config import ConfigError, load_config
from brats_swap.data.discovery import discover_cases
from brats_swap.evaluate.predicting import predict
from brats_swap.evaluate.scoring import evaluate_fold
from brats_swap.memory.planner import BUDGET_HEADROOM, Planner
from brats_swap.memory.presets import resolve_presets
from brats_swap.model import build_model
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import RunFolder
from brats_swap.train.loop import train_fold
from brats_swap.train.losses import training_loss
from brats_swap.train.planning import optimizer_state_factor

# Each network with a recipe of its own, so that every loss, both optimisers and both schedules train.
NETWORKS = {
    "nnunet": ("model.features=[4,8,16]", "model.outputs=regions", "train.loss=dice_bce", "train.optimizer=sgd",
               "train.lr=0.01", "train.weight_decay=3e-5", "train.schedule=poly", "train.grad_clip=12"),
    "resenc_l": ("model.features=[4,8,16]", "train.loss=dice_ce"),
    "segresnet": ("model.features=[4,8,16]",),
    "swinunetr": ("model.features=[12]", "model.blocks=[1,1,1,1]", "data.cube=[64,32,32]", "model.outputs=regions",
                  "train.loss=dice_bce"),
}
POLICIES = ("none", "hybrid", "auto")
# Every saved tensor of these tiny networks is large enough to swap; 2 epochs of 1 step, validated once on
# one case (4 folds of the 4 phantoms).
COMMON = ("memory.swap.min_bytes=0", "train.max_epochs=2", "train.steps_per_epoch=1", "train.val_every=2",
          "cv.folds=4")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """(root, cache) per network: the 16³ cache of `small_dataset`, and a 64x32x32 one for SwinUNETR."""
    from brats_swap.data.cache import prepare_dataset

    small = small_dataset(tmp_path_factory)
    root, _ = prepared_dataset(tmp_path_factory)
    swin_cache = tmp_path_factory.mktemp("swin-data") / "cache"
    prepare_dataset(root, swin_cache, network_config("swinunetr", (root, swin_cache)).data, workers=1,
                    progress=False)
    return {name: (root, swin_cache) if name == "swinunetr" else small for name in NETWORKS}


def network_config(name: str, data, policy: str = "none", *extra: str):
    root, cache = data
    config = tiny_config(root, cache, "data.cube=[16,16,16]", f"model.name={name}", *NETWORKS[name], *COMMON,
                         *extra)
    return tiny_config(root, cache, "data.cube=[16,16,16]", f"model.name={name}", *NETWORKS[name], *COMMON,
                       *policy_keys(config, policy), *extra)


def policy_keys(config, policy: str) -> tuple[str, ...]:
    """The `memory.*` overrides of `policy` for the network of `config`: hybrid is the named preset resolved
    from the network's own stages (norm_act everywhere, the two high-resolution encoder stages swapped); auto
    gets a budget whose tensor limit is 1% under the network's no-policy peak, so it must swap or recompute to
    fit (the weights and optimizer state of these tiny networks leave little more to gain)."""
    if policy == "none":
        return ("memory.mode=none",)
    model = build_model(config.model, 3)
    shape = (config.train.batch_size, config.model.in_channels, *config.data.cube)
    if policy == "hybrid":
        hybrid = resolve_presets(model, shape)["hybrid"]
        return ("memory.mode=hybrid", "memory.recompute.norm_act=true",
                f"memory.swap.lookahead={hybrid['swap']['lookahead']}",
                f"memory.swap.include=[{','.join(hybrid['swap']['include'])}]")
    planner = Planner(model, shape, loss_fn=training_loss(config.train.loss, model),
                      optimizer_state_factor=optimizer_state_factor(config))  # as the run's planner prices it
    limit = 0.99 * planner.memory(config.memory).peak_bytes
    return ("memory.mode=auto", f"memory.budget_gib={limit / BUDGET_HEADROOM / 2**30}")


@pytest.fixture(scope="module")
def trained(datasets, tmp_path_factory):
    """name -> {policy: (run folder, TrainResult)} of fold 0, trained once per module."""
    runs = {}
    for name, data in datasets.items():
        runs[name] = {}
        for policy in POLICIES:
            config = network_config(name, data, policy)
            run = tmp_path_factory.mktemp(f"{name}-{policy}") / "run"
            runs[name][policy] = (run, train_fold(config, run, 0, progress=False))
    return runs


@pytest.mark.parametrize("name", list(NETWORKS))
def test_every_policy_trains_the_network_to_bitwise_equal_losses_and_weights(trained, name):
    (reference_run, reference), *others = trained[name].values()
    losses = [record["train_loss"] for record in reference.history]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    weights = load_checkpoint(RunFolder.of(reference_run).fold(0).latest)["model"]
    for (run, result), policy in zip(others, POLICIES[1:], strict=True):
        assert [record["train_loss"] for record in result.history] == losses, policy
        tested = load_checkpoint(RunFolder.of(run).fold(0).latest)["model"]
        assert tested.keys() == weights.keys()
        for key, value in weights.items():
            assert torch.equal(tested[key], value), f"{name} under {policy}: {key} differs"
    plan = json.loads(RunFolder.of(others[-1][0]).fold(0).memory_plan.read_text(encoding="utf-8"))
    assert plan["memory"]["mode"] != "none"  # auto had to move or recompute something to fit its budget


@pytest.mark.parametrize("name", list(NETWORKS))
def test_the_trained_network_evaluates_and_predicts_with_tta_from_its_checkpoint(trained, datasets, name, tmp_path):
    run, _ = trained[name]["none"]
    state = load_checkpoint(RunFolder.of(run).fold(0).best)
    assert state["architecture"]["name"] == name
    assert state["architecture"]["features"] == state["config"]["model"]["features"]
    config = network_config(name, datasets[name], "none")
    scores = evaluate_fold(config, run, 0, progress=False)
    assert scores, "no case scored"
    case = discover_cases(datasets[name][0])[0]
    # Mirroring TTA is 8 forwards and does not depend on the network: one network predicts with it.
    written = predict(run, case.seg.parent, tmp_path / "out", folds="all", tta=name == "nnunet", progress=False)
    assert [path.name for path in written] == [f"{case.case_id}.nii.gz"]


@pytest.mark.parametrize("name", list(NETWORKS))
def test_the_network_trains_with_nnunets_augmentation(datasets, name, tmp_path):
    """`train.augment: nnunet` on the device before each of the network's steps: its outputs (deep supervision
    included) train on the augmented targets, and the validation that closes the run scores it. (Evaluation and
    resume do not depend on the recipe: the tests above and tests/test_stop_resume.py cover them.)"""
    config = network_config(name, datasets[name], "none", "train.augment=nnunet", "train.max_epochs=1",
                            "train.val_every=1")
    result = train_fold(config, tmp_path / "run", 0, progress=False)
    losses = [record["train_loss"] for record in result.history]
    assert result.finished and len(losses) == 1 and all(math.isfinite(loss) for loss in losses)
    assert "val_loss" in result.history[-1]


def test_resume_refuses_another_network_whose_weights_would_load(trained, datasets, tmp_path):
    import shutil

    run, _ = trained["resenc_l"]["none"]
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    # resenc_m is resenc_l's network (the presets differ in patch and batch): the weights load, the name differs.
    config = network_config("resenc_l", datasets["resenc_l"], "none", "model.name=resenc_m", "train.max_epochs=3")
    with pytest.raises(ConfigError, match=r"model\.name differs from the checkpoint's network \(resenc_l\)"):
        train_fold(config, copy, 0, resume=True, progress=False)


def test_a_key_of_another_network_is_ignored_with_one_warning_line():
    lines: list[str] = []
    config = load_config(None, ["model.name=resenc_l", "model.base_filters=8", "data.cube=[32,32,32]"],
                         warn=lines.append)
    assert lines == ["model.base_filters: not read by model.name=resenc_l; ignored"]
    assert config.model.features == [32, 64, 128, 256]  # nnU-Net's plan at 32³: 4 stages, none below 4 voxels
    assert config.model.strides == [[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]]


@pytest.mark.parametrize("config", ["default", "quickstart", "resenc_l", "resenc_l_whole"])
def test_every_shipped_config_takes_every_network_with_its_own_plan(config):
    from pathlib import Path

    from brats_swap.config.networks import NETWORK_NAMES

    path = Path(__file__).resolve().parents[1] / "configs" / f"{config}.yaml"
    for name in NETWORK_NAMES:
        if name == "swinunetr" and config == "quickstart":  # 48³: SwinUNETR's 5 halvings need edges of 32k
            with pytest.raises(ConfigError, match=r"^data\.cube: each size must be divisible by 32"):
                load_config(path, [f"model.name={name}"])
            continue
        loaded = load_config(path, [f"model.name={name}"])
        assert loaded.model.name == name
        if name in ("resenc_l", "nnunet"):
            size = loaded.train.patch if loaded.train.mode == "patch" else loaded.data.cube
            assert len(loaded.model.features) == len(loaded.model.strides) >= 2
            assert all(edge // stride >= 4 for edge, stride in zip(size, _reduction(loaded.model.strides), strict=True))


def _reduction(strides: list[list[int]]) -> list[int]:
    total = [1, 1, 1]
    for stage in strides:
        total = [t * s for t, s in zip(total, stage, strict=True)]
    return total


def test_a_patch_trained_network_takes_its_plan_from_the_patch_and_validates_by_sliding_window(tmp_path,
                                                                                               tmp_path_factory):
    root, cache = prepared_dataset(tmp_path_factory)  # the 32³ cube
    config = tiny_config(root, cache, "model.name=nnunet", "model.features=[4,8,16]", "train.mode=patch",
                         "train.patch=[16,16,16]", "train.max_epochs=1", "train.steps_per_epoch=1", "cv.folds=4")
    assert config.model.strides == [[1, 1, 1], [2, 2, 2], [2, 2, 2]]  # 16 -> 8 -> 4: three stages
    result = train_fold(config, tmp_path / "run", 0, progress=False)
    assert result.history[0]["val_dice_mean"] == result.history[0]["val_dice_mean"]  # validated (not NaN)
