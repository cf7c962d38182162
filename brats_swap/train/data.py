"""The training data pipeline: prepared cubes from the cache -> (patches) -> augmentation -> targets.

Every random choice (case order, patch position, which of the 48 cube symmetries, MONAI augmentations) is
drawn from a generator seeded by `(seed, epoch, position in the epoch)`, not from a worker's global RNG
state. So a sample is a pure function of where it sits in the run: the stream is identical with 0 or 4
DataLoader workers, and `--resume` in the middle of an epoch re-creates the exact batches that an
uninterrupted run would have seen, without having to snapshot worker RNG states.

The sampler hands the dataset keys `(epoch, position, index)` instead of bare indices; a plain int key
(validation) means "this case, no randomness".
"""

from __future__ import annotations

import itertools
import random
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from brats_swap.config import Config, DataConfig
from brats_swap.data.cache import PrepareReport, load_prepared, prepare_missing
from brats_swap.data.discovery import resolve_convention
from brats_swap.distributed import DistContext, RankShardSampler, make_sampler
from brats_swap.errors import DataError
from brats_swap.model.targets import targets_from_labels
from brats_swap.run.console import console, warn

# The 48 symmetries of a cube (the full octahedral group with reflections): 6 axis permutations x 8 flips.
# Ellis's `generate_permutation_keys` enumerates the same group as rotate/transpose/flip combinations.
CUBE_SYMMETRIES: tuple[tuple[tuple[int, int, int], tuple[bool, bool, bool]], ...] = tuple(
    (perm, flips)  # type: ignore[misc]
    for perm in itertools.permutations(range(3))
    for flips in itertools.product((False, True), repeat=3)
)


def allowed_symmetries(shape: Sequence[int]) -> list[tuple[tuple[int, int, int], tuple[bool, bool, bool]]]:
    """Symmetries that keep the array shape: an axis permutation may only swap axes of equal size."""
    return [(perm, flips) for perm, flips in CUBE_SYMMETRIES if all(shape[p] == shape[i] for i, p in enumerate(perm))]


def apply_symmetry(array: np.ndarray, perm: Sequence[int], flips: Sequence[bool]) -> np.ndarray:
    """Permute then flip the last three (spatial) axes of `array`; leading axes (channels) are kept."""
    lead = array.ndim - 3
    moved = np.transpose(array, tuple(range(lead)) + tuple(lead + p for p in perm))
    flip_axes = tuple(lead + i for i, f in enumerate(flips) if f)
    if flip_axes:
        moved = np.flip(moved, axis=flip_axes)
    return np.ascontiguousarray(moved)


def random_patch_start(
    shape: Sequence[int], patch: Sequence[int], label: np.ndarray | None, rng: np.random.Generator,
    foreground_fraction: float,
) -> tuple[int, int, int]:
    """Corner of a random patch; with probability `foreground_fraction` centred on a tumour voxel.

    nnU-Net oversamples foreground (a third of patches) so that small tumours are seen often enough;
    uniform patches of a 192³ cube miss enhancing tumour most of the time.
    """
    limits = [s - p for s, p in zip(shape, patch, strict=True)]
    if label is not None and rng.random() < foreground_fraction:
        tumour = np.flatnonzero(np.asarray(label).reshape(-1))
        if tumour.size:
            centre = np.unravel_index(int(tumour[rng.integers(tumour.size)]), tuple(shape))
            return tuple(int(min(max(c - p // 2, 0), lim)) for c, p, lim in zip(centre, patch, limits, strict=True))  # type: ignore[return-value]
    return tuple(int(rng.integers(lim + 1)) for lim in limits)  # type: ignore[return-value]


def build_monai_augment():
    """Mild intensity and spatial augmentations (MONAI dictionary transforms), applied jointly to image+label."""
    from monai.transforms import (
        Compose,
        RandAffined,
        RandGaussianNoised,
        RandScaleIntensityd,
        RandShiftIntensityd,
    )

    return Compose([
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.26, 0.26, 0.26), scale_range=(0.1, 0.1, 0.1),
                    mode=("bilinear", "nearest"), padding_mode="zeros"),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
        RandGaussianNoised(keys="image", prob=0.15, std=0.1),
    ])


def prepare_run_data(data_cfg: DataConfig, *, progress: bool = True) -> PrepareReport:
    """Bring `data.cache` up to date with `data.root` before a run reads it (`prepare_missing`: new or changed
    cases only, with a progress bar). `brats-swap train`, `cv` and `compare` call it first, once, on the main
    process, so one command goes from a download to a trained model. Skipped cases get one warning each."""
    report = prepare_missing(data_cfg, progress=progress)
    for case_id, problem in report.failed.items():
        warn(f"{data_cfg.cache}: skipped case {case_id} ({problem})")
    if report.prepared:
        console.print(f"{data_cfg.cache}: prepared {len(report.prepared)} case(s) from {data_cfg.root}, "
                      f"{len(report.up_to_date)} already up to date", markup=False, highlight=False)
    return report


def run_table(cache: Path, case_ids: Sequence[str], data_cfg: DataConfig) -> str:
    """The label table ("2021", "gli-post", "ped", ...) that every one of `case_ids` was prepared with.

    A run trains one set of outputs, so DataError when the cases hold several tables (e.g. GLI pre-operative
    and post-treatment scans in one folder: `data.challenge` reads them all with one), or when
    `data.challenge` / `data.edition` force another table than the cache was prepared with.
    """
    first_case: dict[str, str] = {}
    for case_id in case_ids:
        first_case.setdefault(load_prepared(cache, case_id).meta["edition"], case_id)
    if len(first_case) > 1:
        found = ", ".join(f"{table} (e.g. {case})" for table, case in first_case.items())
        raise DataError(f"{cache}: the prepared cases hold several label tables: {found}; a run trains on one, "
                        "set data.challenge to read every case with it")
    (table, case_id), = first_case.items()
    if data_cfg.challenge != "auto" or data_cfg.edition != "auto":
        forced = resolve_convention(case_id, None, data_cfg.edition, data_cfg.challenge)
        if forced != table:
            raise DataError(f"{cache}: cases were prepared with the {table} table but the config forces {forced} "
                            "(data.challenge / data.edition); prepare them again from data.root")
    return table


@dataclass(frozen=True)
class SampleKey:
    """Where a sample sits in the run; the dataset derives all of its randomness from this."""

    epoch: int
    position: int  # position within the epoch (0 .. samples per epoch - 1)
    index: int  # dataset index: case index * patches_per_case + patch number


class CubeDataset(Dataset):
    """Prepared cases (memory-mapped) as training samples: whole cubes or random patches.

    Args:
        cache: prepared-cache folder.
        case_ids: the cases of this split.
        edition: label table of the cases ("2021", "gli-post", "ped", ...; targets and regions follow it).
        outputs: `model.outputs` ("labels" or "regions"): which sigmoid channels the targets have.
        regions: `model.regions` (the region targets with outputs "regions"; empty: the table's defaults).
        crop: patch size for patch mode, or None for the whole cube.
        patches_per_case: patches drawn per case per epoch (patch mode).
        augment: "cube48" for the 48 cube symmetries, "none" for no symmetry augmentation.
        monai_augment: add MONAI intensity/spatial augmentations.
        seed: base seed of every random choice.
        foreground_fraction: share of patches centred on a tumour voxel (patch mode).

    Items are dicts: `image` float32 (C, D, H, W), `target` float32 (outputs, D, H, W), `label` uint8 (D, H, W),
    `case_id` str.
    """

    def __init__(
        self, cache: Path, case_ids: Sequence[str], *, edition: str, outputs: str, regions: Sequence[str] = (),
        crop: Sequence[int] | None = None, patches_per_case: int = 1, augment: str = "none",
        monai_augment: bool = False, seed: int = 0, foreground_fraction: float = 0.33,
    ) -> None:
        if not case_ids:
            raise DataError(f"{cache}: no cases to load for this split")
        self.cache = Path(cache)
        self.case_ids = list(case_ids)
        self.edition = edition
        self.outputs = outputs
        self.regions = tuple(regions)
        self.crop = tuple(crop) if crop is not None else None
        self.patches_per_case = patches_per_case if crop is not None else 1
        self.augment = augment
        self.seed = seed
        self.foreground_fraction = foreground_fraction
        self.monai = build_monai_augment() if monai_augment else None

    def __len__(self) -> int:
        return len(self.case_ids) * self.patches_per_case

    def __getitem__(self, key: SampleKey | int) -> dict:
        if isinstance(key, SampleKey):
            rng: np.random.Generator | None = np.random.default_rng([self.seed, key.epoch, key.position])
            index = key.index
        else:
            rng, index = None, int(key)
        case_id = self.case_ids[index // self.patches_per_case]
        prepared = load_prepared(self.cache, case_id, mmap=True)
        if prepared.label is None:
            raise DataError(f"{self.cache / case_id}: prepared case has no label; it cannot be used for training")
        image, label = prepared.image, prepared.label

        if self.crop is not None:
            if rng is None:  # deterministic access (validation): the centre patch
                start = tuple((s - p) // 2 for s, p in zip(label.shape, self.crop, strict=True))
            else:
                start = random_patch_start(label.shape, self.crop, label, rng, self.foreground_fraction)
            window = tuple(slice(s, s + p) for s, p in zip(start, self.crop, strict=True))
            image, label = image[(slice(None), *window)], label[window]

        # Copy out of the memory map into float32 (the cache stores float16).
        image = np.asarray(image, dtype=np.float32)
        label = np.array(label, dtype=np.uint8)  # a copy: the memory map is read-only

        if rng is not None and self.augment == "cube48":
            options = allowed_symmetries(label.shape)
            perm, flips = options[int(rng.integers(len(options)))]
            image, label = apply_symmetry(image, perm, flips), apply_symmetry(label, perm, flips)

        if rng is not None and self.monai is not None:
            self.monai.set_random_state(seed=int(rng.integers(2**31 - 1)))
            out = self.monai({"image": torch.from_numpy(image), "label": torch.from_numpy(label[None].astype(np.float32))})
            image = np.asarray(torch.as_tensor(out["image"]).float().numpy(), dtype=np.float32)
            label = np.rint(torch.as_tensor(out["label"]).numpy()[0]).astype(np.uint8)

        label_tensor = torch.from_numpy(np.ascontiguousarray(label))
        target = targets_from_labels(label_tensor[None].long(), self.edition, self.outputs, self.regions)[0].float()
        return {"image": torch.from_numpy(np.ascontiguousarray(image)), "target": target, "label": label_tensor,
                "case_id": case_id}


class EpochSampler(Sampler):
    """Yields `SampleKey`s for one epoch: a seeded shuffle of the dataset, repeated to fill `num_samples`.

    `set_epoch(epoch, start)` selects the epoch and skips its first `start` samples (resume mid-epoch).
    """

    def __init__(self, dataset_length: int, num_samples: int, seed: int) -> None:
        self.dataset_length = dataset_length
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def order(self, epoch: int) -> list[int]:
        rng = np.random.default_rng([self.seed, epoch, 0x5A3D])
        passes = -(-self.num_samples // self.dataset_length)
        indices = np.concatenate([rng.permutation(self.dataset_length) for _ in range(passes)])
        return [int(i) for i in indices[: self.num_samples]]

    def __iter__(self) -> Iterator[SampleKey]:
        order = self.order(self.epoch)
        for position in range(self.start, self.num_samples):
            yield SampleKey(self.epoch, position, order[position])

    def __len__(self) -> int:
        return self.num_samples - self.start


# The stop signals a DataLoader worker leaves to the main process (see `seed_worker`).
WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy and `random` from the worker's torch seed; ignore stop signals.

    The dataset draws its own randomness from `SampleKey`s; this only keeps library code that reaches for
    global RNGs reproducible too (torch already seeds each worker from the loader's generator).
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    # Ctrl-C reaches the whole process group, and so do a scheduler's SIGTERM / SIGUSR1 (`timeout`, SLURM at
    # a time limit, scancel, preemption): the main process finishes its step and saves, so workers must not
    # die under them (a dead worker turns the clean stop into a DataLoader error). The loader ends its
    # workers through its queues, and a worker whose parent died exits by itself (torch's watchdog).
    for signum in WORKER_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def collate_samples(samples: list[dict]) -> dict:
    return {
        "image": torch.stack([s["image"] for s in samples]),
        "target": torch.stack([s["target"] for s in samples]),
        "label": torch.stack([s["label"] for s in samples]),
        "case_id": [s["case_id"] for s in samples],
    }


@dataclass
class TrainData:
    """The loaders of one fold and the objects `train_fold` steers (sampler epoch, generator state)."""

    train_dataset: CubeDataset
    val_dataset: CubeDataset
    sampler: EpochSampler | RankShardSampler
    train_loader: DataLoader
    val_loader: DataLoader
    generator: torch.Generator
    steps_per_epoch: int


def build_train_data(
    config: Config, train_ids: Sequence[str], val_ids: Sequence[str], *, edition: str, fold: int, device: torch.device,
    ctx: DistContext | None = None,
) -> TrainData:
    """Datasets, sampler and DataLoaders of one fold from the config (`data.*`, `train.*`).

    Distributed (`ctx`), `train.batch_size` is per rank: one step consumes world_size * batch_size samples
    of the global stream and each rank loads its interleaved share of them (RankShardSampler); validation
    cases are split by torch's DistributedSampler.
    """
    train_cfg = config.train
    cache = Path(config.data.cache)
    crop = train_cfg.patch if train_cfg.mode == "patch" else None
    seed = config.seed * 1000 + fold  # folds draw different streams from one config seed
    train_dataset = CubeDataset(
        cache, train_ids, edition=edition, outputs=config.model.outputs, regions=config.model.regions, crop=crop,
        patches_per_case=train_cfg.patches_per_case, augment=train_cfg.augment,
        monai_augment=train_cfg.monai_augment, seed=seed, foreground_fraction=train_cfg.patch_foreground,
    )
    # Validation sees whole cubes: the cube Dice is the model selection signal in both modes.
    val_dataset = CubeDataset(cache, val_ids, edition=edition, outputs=config.model.outputs,
                              regions=config.model.regions, seed=seed)

    world_size = ctx.world_size if ctx is not None else 1
    global_batch = train_cfg.batch_size * world_size
    batches = train_cfg.steps_per_epoch or max(1, len(train_dataset) // global_batch)
    sampler = EpochSampler(len(train_dataset), batches * global_batch, seed)
    if ctx is not None and ctx.is_distributed:
        sampler = RankShardSampler(sampler, ctx)
    generator = torch.Generator().manual_seed(seed)
    workers = config.data.loader_workers
    pin = device.type == "cuda"
    train_loader = DataLoader(
        train_dataset, batch_size=train_cfg.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=collate_samples, pin_memory=pin, drop_last=True, worker_init_fn=seed_worker, generator=generator,
        persistent_workers=False, prefetch_factor=2 if workers else None,
    )
    val_loader = DataLoader(
        val_dataset, batch_size=train_cfg.val_batch_size, shuffle=False, num_workers=min(workers, 1),
        sampler=make_sampler(val_dataset, ctx, shuffle=False) if ctx is not None else None,
        collate_fn=collate_samples, pin_memory=pin, worker_init_fn=seed_worker,
    )
    return TrainData(train_dataset, val_dataset, sampler, train_loader, val_loader, generator, batches)
