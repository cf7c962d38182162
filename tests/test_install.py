"""The install keeps the torch it found: dynamic-network-architectures goes in without its dependencies
(its metadata pulls timm -> torchvision -> another torch build), and nnU-Net's networks need none of them;
batchgeneratorsv2, the tests' augmentation reference, goes in without its dependencies too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from brats_swap.config import load_config
from brats_swap.model import build_model


def test_the_torch_recorded_before_installing_the_network_library_is_the_one_installed():
    recorded = Path(sys.prefix) / "torch-version.txt"
    if not recorded.is_file():
        pytest.skip(f"{recorded}: not written; this environment was not made by `make install`")
    assert torch.__version__ == recorded.read_text(encoding="utf-8").strip()


def test_building_nnunet_networks_imports_neither_timm_nor_torchvision():
    for name in ("nnunet", "resenc_l"):
        build_model(load_config(None, [f"model.name={name}", "data.cube=[16,16,16]", "model.features=[2,4,8]"]).model)
    assert not {"timm", "torchvision"} & set(sys.modules)


def test_batchgeneratorsv2_imports_its_transforms_with_the_installed_torch():
    from importlib.metadata import version

    from batchgeneratorsv2.transforms.intensity.gamma import GammaTransform  # noqa: F401
    from batchgeneratorsv2.transforms.noise.gaussian_blur import GaussianBlurTransform  # noqa: F401
    from batchgeneratorsv2.transforms.spatial.spatial import SpatialTransform  # noqa: F401

    assert version("batchgeneratorsv2") == "0.3.6"
    recorded = Path(sys.prefix) / "torch-version.txt"
    if recorded.is_file():
        assert torch.__version__ == recorded.read_text(encoding="utf-8").strip()


def test_nnunets_predictor_imports_with_the_installed_torch_and_no_torchvision():
    """nnunetv2 (the oracle of tests/test_nnunet_predict.py) goes in with --no-deps (Makefile)."""
    pytest.importorskip("nnunetv2")
    from importlib.metadata import version

    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor  # noqa: F401

    assert version("nnunetv2") == "2.8.1"
    assert not {"timm", "torchvision"} & set(sys.modules)
    recorded = Path(sys.prefix) / "torch-version.txt"
    if recorded.is_file():
        assert torch.__version__ == recorded.read_text(encoding="utf-8").strip()
