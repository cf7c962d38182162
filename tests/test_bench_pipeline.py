"""scripts/bench_pipeline.py's reference: nnU-Net's training transforms built from batchgeneratorsv2 run on a
BraTS-shaped sample and give what nnU-Net's trainer feeds its network (the patch, regions, deep supervision)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_pipeline.py"


def test_the_reference_pipeline_is_nnunets_get_training_transforms():
    spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    transforms = module.nnunet_transforms((16, 16, 16))
    names = [type(getattr(t, "transform", t)).__name__ for t in transforms.transforms]
    assert names == ["SpatialTransform", "GaussianNoiseTransform", "GaussianBlurTransform",
                     "MultiplicativeBrightnessTransform", "ContrastTransform", "SimulateLowResolutionTransform",
                     "GammaTransform", "GammaTransform", "MirrorTransform", "MaskImageTransform", "RemoveLabelTransform",
                     "ConvertSegmentationToRegionsTransform", "DownsampleSegForDSTransform"]
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(4, 24, 24, 24, generator=generator)
    label = torch.randint(-1, 4, (1, 24, 24, 24), generator=generator).to(torch.int16)
    out = transforms(image=image, segmentation=label)
    assert out["image"].shape == (4, 16, 16, 16)
    assert [tuple(seg.shape) for seg in out["segmentation"]] == [(3, 16, 16, 16), (3, 8, 8, 8), (3, 4, 4, 4),
                                                               (3, 2, 2, 2), (3, 1, 1, 1)]
