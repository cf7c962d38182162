"""The training data pipeline's cost per sample on one core, beside nnU-Net's, and the device-side augmentation
against a training step.

    .venv/bin/python scripts/bench_pipeline.py --json docs/benchmarks/pipeline.json
    .venv/bin/python scripts/bench_pipeline.py --cases 1 --repeats 2 --step-size 64 --json /tmp/pipeline.json

On `--cases` phantom cases (brats_swap.data.phantom, 240x240x155) prepared to a 192³ cube in the cache's float16,
one process, one torch thread (so seconds are per core), median over `--repeats` draws per case:

- `brats_swap loader`: what a DataLoader worker does for one sample of `train.augment: nnunet`: decompress the
  cache's chunks, crop (at 160x192x160 nnU-Net's enlarged crop around a patch with nnU-Net's foreground rule; at 192³ the
  whole cube), draw the sample's augmentation parameters, collate into ordinary memory (a worker's batch is
  shared memory: scripts/bench_scale.py times that); pinning is timed too where CUDA is present.
- `batchgeneratorsv2 nnunet`: nnU-Net v2's `get_training_transforms` (batchgeneratorsv2, nnU-Net's
  parameters, BraTS regions and deep-supervision targets) on the same cases: at 192³ the transforms on the
  whole cube, at 160x192x160 on nnU-Net's enlarged crop. Its data loader's reading is not included.
- `augment_over_step`: the nnunet recipe's `apply` ( the batch's draws forced to resample, the costly case)
  of a 2x4xS³ batch over one ResEnc L (nnU-Net's BraTS plan at S³, fp32 on CPU, fp16 autocast on CUDA)
  forward + backward of that batch, on the same device in this run. S is 192 unless `--step-size` says
  otherwise: on a CPU a 192³ ResEnc L step takes minutes, and the script says which size it measured.

Goals (issue 24): loader <= 0.10 s per sample per core at 192³; augment_over_step <= 0.05. On a shared machine
the timings are noisy: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.augment import get_recipe
from brats_swap.config import DataConfig, load_config
from brats_swap.data.cache import list_prepared, load_prepared, prepare_dataset
from brats_swap.data.phantom import synthesize_dataset
from brats_swap.model import build_model
from brats_swap.train.data import CubeDataset, SampleKey, collate_samples, enlarged_window
from brats_swap.train.losses import training_loss

CUBE = (192, 192, 192)
PATCH = (160, 192, 160)
GOALS = {"loader_seconds_per_sample_per_core_at_192": 0.10, "augment_over_step": 0.05}


def loader_seconds(cache: Path, size: tuple[int, ...], repeats: int) -> list[float]:
    """Seconds per sample of a worker's job (read, crop, draw, collate, pin on CUDA) for every case x repeat."""
    ids = list_prepared(cache)
    patch = size != CUBE
    dataset = CubeDataset(cache, ids, crop=size if patch else None, augment="nnunet", seed=0,
                          foreground="nnunet", batch_size=2, channels=4)
    times = []
    for position in range(len(ids) * repeats):
        started = time.perf_counter()
        batch = collate_samples([dataset[SampleKey(0, position, position % len(ids))]])
        if torch.cuda.is_available():
            batch.image.pin_memory(), batch.label.pin_memory()
        times.append(time.perf_counter() - started)
    return times


def nnunet_transforms(patch_size: tuple[int, ...]):
    """nnunetv2 2.8.1's `nnUNetTrainer.get_training_transforms` for BraTS (regions WT/TC/ET, mask for norm,
    mirroring of the three axes, deep supervision at ResEnc L's scales), built from batchgeneratorsv2."""
    import math

    from batchgeneratorsv2.transforms.intensity.brightness import MultiplicativeBrightnessTransform
    from batchgeneratorsv2.transforms.intensity.contrast import BGContrast, ContrastTransform
    from batchgeneratorsv2.transforms.intensity.gamma import GammaTransform
    from batchgeneratorsv2.transforms.intensity.gaussian_noise import GaussianNoiseTransform
    from batchgeneratorsv2.transforms.noise.gaussian_blur import GaussianBlurTransform
    from batchgeneratorsv2.transforms.spatial.low_resolution import SimulateLowResolutionTransform
    from batchgeneratorsv2.transforms.spatial.mirroring import MirrorTransform
    from batchgeneratorsv2.transforms.spatial.spatial import SpatialTransform
    from batchgeneratorsv2.transforms.utils.compose import ComposeTransforms
    from batchgeneratorsv2.transforms.utils.deep_supervision_downsampling import DownsampleSegForDSTransform
    from batchgeneratorsv2.transforms.utils.nnunet_masking import MaskImageTransform
    from batchgeneratorsv2.transforms.utils.random import RandomTransform
    from batchgeneratorsv2.transforms.utils.remove_label import RemoveLabelTansform
    from batchgeneratorsv2.transforms.utils.seg_to_regions import ConvertSegmentationToRegionsTransform

    rotation = (-30.0 / 360 * 2.0 * math.pi, 30.0 / 360 * 2.0 * math.pi)
    regions = [(1, 2, 3), (2, 3), (3,)]  # nnU-Net's Dataset137_BraTS21: whole tumour, tumour core, enhancing
    return ComposeTransforms([
        SpatialTransform(patch_size, patch_center_dist_from_border=0, random_crop=False, p_elastic_deform=0,
                         p_rotation=0.2, rotation=rotation, p_scaling=0.2, scaling=(0.7, 1.4),
                         p_synchronize_scaling_across_axes=1, bg_style_seg_sampling=False,
                         border_mode_seg="constant", padding_value_seg=-1),
        RandomTransform(GaussianNoiseTransform(noise_variance=(0, 0.1), p_per_channel=1, synchronize_channels=True),
                        apply_probability=0.1),
        RandomTransform(GaussianBlurTransform(blur_sigma=(0.5, 1.0), synchronize_channels=False,
                                              synchronize_axes=False, p_per_channel=0.5, benchmark=True),
                        apply_probability=0.2),
        RandomTransform(MultiplicativeBrightnessTransform(multiplier_range=BGContrast((0.75, 1.25)),
                                                          synchronize_channels=False, p_per_channel=1),
                        apply_probability=0.15),
        RandomTransform(ContrastTransform(contrast_range=BGContrast((0.75, 1.25)), preserve_range=True,
                                          synchronize_channels=False, p_per_channel=1), apply_probability=0.15),
        RandomTransform(SimulateLowResolutionTransform(scale=(0.5, 1), synchronize_channels=False,
                                                       synchronize_axes=True, ignore_axes=None,
                                                       allowed_channels=None, p_per_channel=0.5),
                        apply_probability=0.25),
        RandomTransform(GammaTransform(gamma=BGContrast((0.7, 1.5)), p_invert_image=1, synchronize_channels=False,
                                       p_per_channel=1, p_retain_stats=1), apply_probability=0.1),
        RandomTransform(GammaTransform(gamma=BGContrast((0.7, 1.5)), p_invert_image=0, synchronize_channels=False,
                                       p_per_channel=1, p_retain_stats=1), apply_probability=0.3),
        MirrorTransform(allowed_axes=(0, 1, 2)),
        MaskImageTransform(apply_to_channels=[0, 1, 2, 3], channel_idx_in_seg=0, set_outside_to=0),
        RemoveLabelTansform(-1, 0),
        ConvertSegmentationToRegionsTransform(regions=regions, channel_in_seg=0),
        DownsampleSegForDSTransform(ds_scales=[[1.0] * 3, [0.5] * 3, [0.25] * 3, [0.125] * 3, [0.0625] * 3]),
    ])


def batchgenerators_seconds(cache: Path, size: tuple[int, ...], repeats: int) -> list[float] | None:
    """Seconds per sample of nnU-Net's transforms on each case's crop (None: batchgeneratorsv2 not installed)."""
    try:
        transforms = nnunet_transforms(size)
    except ImportError:
        return None
    read = CUBE if size == CUBE else get_recipe("nnunet").crop_size(size, patch_mode=True)
    times = []
    for case_id in list_prepared(cache):
        prepared = load_prepared(cache, case_id, mmap=True)
        start = [(c - p) // 2 for c, p in zip(CUBE, size, strict=True)]  # the centre patch, its enlarged crop
        window, pad = enlarged_window(start, size, read, CUBE)
        image = F.pad(torch.from_numpy(np.array(prepared.image[(slice(None), *window)], dtype=np.float32)), pad)
        label = F.pad(torch.from_numpy(np.array(prepared.label[window], dtype=np.int16)), pad)[None]
        label[:, (image == 0).all(dim=0)] = -1  # nnU-Net's loader marks the outside of the brain
        # BraTS 2021 labels 1, 2, 4 as nnU-Net's conversion numbers them (2 edema, 1 necrosis, 3 enhancing)
        label = torch.where(label == 4, 3, torch.where(label == 1, 2, torch.where(label == 2, 1, label)))
        for repeat in range(repeats):
            torch.manual_seed(repeat)
            np.random.seed(repeat)
            started = time.perf_counter()
            transforms(image=image.clone(), segmentation=label.clone())
            times.append(time.perf_counter() - started)
    return times


def augment_over_step(size: int, draws: int) -> dict:
    """The nnunet recipe's apply to a 2x4xsize³ batch over ResEnc L's forward + backward of it, on one device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_config(None, ["model.name=resenc_l", f"data.cube=[{size},{size},{size}]", "model.outputs=regions",
                                "train.loss=dice_bce"])
    model = build_model(config.model, 3).to(device)
    loss_fn = training_loss("dice_bce", model)
    images = torch.randn(2, 4, size, size, size, device=device)
    labels = torch.randint(0, 4, (2, size, size, size), device=device)
    targets = torch.rand(2, 3, size, size, size, device=device).round()
    rng = np.random.default_rng(0)
    recipe = get_recipe("nnunet")
    params = []
    while len(params) < 2 * draws:  # the costly samples: rotation or scaling drawn (one grid_sample)
        drawn = recipe.draw(rng, (size,) * 3, 4)
        if drawn.spatial.resamples:
            params.append(drawn)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            loss = loss_fn(model(images), targets)
        loss.backward()
        model.zero_grad(set_to_none=True)

    augment_times, step_times = [], []
    step()  # warm-up: cuDNN's algorithm search, the allocator
    recipe.apply(images, labels, params[:2], (size,) * 3, (0, 1, 2, 3))
    for i in range(draws):
        sync()
        started = time.perf_counter()
        recipe.apply(images, labels, params[2 * i: 2 * i + 2], (size,) * 3, (0, 1, 2, 3))
        sync()
        augment_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        step()
        sync()
        step_times.append(time.perf_counter() - started)
    augment_s, step_s = statistics.median(augment_times), statistics.median(step_times)
    return {"device": str(device), "size": [size] * 3, "batch": [2, 4], "augment_seconds": augment_s,
            "step_seconds": step_s, "ratio": augment_s / step_s, "draws": draws}


def prepared_cases(folder: Path, cases: int) -> Path:
    root, cache = folder / "raw", folder / "cache"
    synthesize_dataset(root, cases=cases, seed=0, edition="2021", shape=(240, 240, 155))
    prepare_dataset(root, cache, DataConfig(cube=list(CUBE), cache_dtype="float16", prepare_workers=1),
                    workers=1, progress=False)
    return cache


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("docs/benchmarks/pipeline.json"))
    parser.add_argument("--cases", type=int, default=3, help="phantom cases prepared to 192³")
    parser.add_argument("--repeats", type=int, default=3, help="draws per case and pipeline")
    parser.add_argument("--step-size", type=int, default=192, help="S of augment_over_step's 2x4xS³ batch")
    parser.add_argument("--step-draws", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # seconds per core

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        cache = prepared_cases(Path(tmp), args.cases)
        for size in (CUBE, PATCH):
            ours = loader_seconds(cache, size, args.repeats)
            rows.append({"pipeline": "brats_swap loader (read, crop, draw; augmentation on the device)",
                         "size": list(size), "seconds_per_sample_per_core": statistics.median(ours),
                         "samples": len(ours)})
            theirs = batchgenerators_seconds(cache, size, args.repeats)
            rows.append({"pipeline": "batchgeneratorsv2 nnunet (get_training_transforms)", "size": list(size),
                         "seconds_per_sample_per_core": statistics.median(theirs) if theirs else None,
                         "samples": len(theirs) if theirs else 0,
                         **({} if theirs else {"note": "batchgeneratorsv2 not installed"})})
    torch.set_num_threads(os.cpu_count() or 1)
    step = augment_over_step(args.step_size, args.step_draws)
    loader_192 = rows[0]["seconds_per_sample_per_core"]
    result = {
        "rows": rows, "augment_over_step": step["ratio"], "augment_over_step_detail": step, "goals": GOALS,
        # The augment_over_step goal is for 192³ on the training GPU: a smaller size (a CPU run) is reported
        # beside it, not judged against it.
        "meets_goals": {"loader": loader_192 <= GOALS["loader_seconds_per_sample_per_core_at_192"],
                        "augment_over_step": step["ratio"] <= GOALS["augment_over_step"]
                        if args.step_size == CUBE[0] and step["device"].startswith("cuda") else None},
        "cases": args.cases, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }
    table = Table(title="training data pipeline, seconds per sample on one core (median)")
    for column in ("pipeline", "size", "s / sample / core"):
        table.add_column(column)
    for row in rows:
        value = row["seconds_per_sample_per_core"]
        table.add_row(row["pipeline"], "x".join(map(str, row["size"])), f"{value:.3f}" if value else "not measured")
    table.add_row(f"augment_over_step ({step['device']}, 2x4x{args.step_size}³: augment {step['augment_seconds']:.3f}"
                  f" s / ResEnc L step {step['step_seconds']:.3f} s)", "", f"{step['ratio']:.3f}")
    console = Console(record=True, width=120)
    console.print(table)
    atomic_write_json(args.json, result)
    atomic_write_text(args.json.with_suffix(".md"), markdown_table(result, args))
    print(f"wrote {args.json} and {args.json.with_suffix('.md')}")
    return result


def markdown_table(result: dict, args: argparse.Namespace) -> str:
    step = result["augment_over_step_detail"]
    lines = ["| pipeline | size | s / sample / core |", "|---|---|---|"]
    for row in result["rows"]:
        value = row["seconds_per_sample_per_core"]
        lines.append(f"| {row['pipeline']} | {'x'.join(map(str, row['size']))} | "
                     f"{f'{value:.3f}' if value else 'not measured'} |")
    lines.append(f"| augment_over_step: nnunet recipe apply / ResEnc L forward+backward, 2x4x{args.step_size}³ on "
                 f"{step['device']} ({step['augment_seconds']:.3f} s / {step['step_seconds']:.3f} s) | | "
                 f"{result['augment_over_step']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
