"""The training data pipeline on the host: prepared cubes from the cache -> (patches) -> pinned batches.

The workers only read the cache (`load_prepared`: compressed, float16; a patch decompresses only the chunks it
touches), crop and pin; augmentation and targets are made
on the training device from the batch (`train/device_augment.py`), which keeps a GPU fed with a core or two.

Every random choice (case order, patch position, the augmentation's parameters) is drawn from a generator
seeded by `(seed, epoch, position in the epoch)`, not from a worker's global RNG state. So a sample is a pure function of where it sits in the run: the stream is identical with 0 or 4
DataLoader workers, and `--resume` in the middle of an epoch re-creates the exact batches that an
uninterrupted run would have seen, without having to snapshot worker RNG states.

The sampler hands the dataset keys `(epoch, position, index)` instead of bare indices; a plain int key
(validation) means "this case, no randomness".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from brats_swap import stop_signals
from brats_swap.augment import get_recipe
from brats_swap.config import Config, DataConfig
from brats_swap.data.cache import (
    PreparedCase,
    PrepareReport,
    load_prepared,
    prepare_missing,
    require_locations,
)
from brats_swap.data.check import preparation_warnings
from brats_swap.data.class_locations import ClassLocations
from brats_swap.data.compressed import CachedVolume, CachedWindow
from brats_swap.data.discovery import resolve_convention
from brats_swap.data.workers import available_cpus
from brats_swap.distributed import DistContext, RankShardSampler, make_sampler
from brats_swap.errors import DataError
from brats_swap.model.targets import region_tree
from brats_swap.run.console import console, warn
from brats_swap.train.device_augment import DeviceBatches, arrived_batch_bytes
from brats_swap.train.shared_batches import (
    BATCH_SLOTS,
    SHARED_MEMORY,
    BatchSlots,
    free_slot,
    shared_memory_free_bytes,
    worker_batch,
)

AUTO_LOADER_WORKERS_MAX = 12  # nnU-Net's default number of augmentation workers

# Batches each DataLoader worker loads ahead (pinned on CUDA): the host memory `plan` reports counts them.
LOADER_PREFETCH_FACTOR = 2

def random_patch_start(shape: Sequence[int], patch: Sequence[int], rng: np.random.Generator) -> tuple[int, int, int]:
    """Corner of a patch placed uniformly inside the volume."""
    return tuple(int(rng.integers(s - p + 1)) for s, p in zip(shape, patch, strict=True))  # type: ignore[return-value]


def patch_around(centre: Sequence[int], shape: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """Corner of the patch centred on `centre`, moved inside the volume."""
    return tuple(int(min(max(int(c) - p // 2, 0), s - p)) for c, p, s in zip(centre, patch, shape, strict=True))  # type: ignore[return-value]


def nnunet_forced_foreground(position_in_batch: int, batch_size: int) -> bool:
    """nnU-Net's rule (`oversample_foreground_percent` 0.33): the last `batch - round(batch * 0.67)` samples of
    every batch are forced to hold foreground (1 of 2 at batch 2, 1 of 3 at batch 3, 0 of 1 at batch 1)."""
    return position_in_batch >= round(batch_size * (1 - 0.33))


def class_patch_start(shape: Sequence[int], patch: Sequence[int], locations: ClassLocations,
                      rng: np.random.Generator) -> tuple[int, int, int]:
    """nnU-Net's forced-foreground patch (`nnUNetDataLoader.get_bbox`): a tumour class (or, for a region model,
    a region) present in the case drawn uniformly, then one of its stored voxels (`ClassLocations`, sampled at
    prepare), the patch centred on it; a case without tumour gets a uniform patch."""
    classes = locations.classes
    if not classes:
        return random_patch_start(shape, patch, rng)
    return around_stored_voxel(locations, classes[int(rng.integers(len(classes)))], shape, patch, rng)


def tumour_patch_start(shape: Sequence[int], patch: Sequence[int], locations: ClassLocations,
                       rng: np.random.Generator) -> tuple[int, int, int]:
    """A patch centred on a tumour voxel, every tumour voxel as likely (`train.patch_foreground` a number): the
    class drawn by its share of the case's tumour voxels, then one of its stored voxels, a uniform sample of
    them. A case without tumour gets a uniform patch.

    nnU-Net oversamples foreground (a third of patches) so that small tumours are seen often enough;
    uniform patches of a 192³ cube miss enhancing tumour most of the time.
    """
    classes = locations.classes
    if not classes:
        return random_patch_start(shape, patch, rng)
    shares = np.cumsum([locations.voxels[value] for value in classes])
    value = classes[int(np.searchsorted(shares, rng.integers(shares[-1]), side="right"))]
    return around_stored_voxel(locations, value, shape, patch, rng)


def around_stored_voxel(locations: ClassLocations, value: int, shape: Sequence[int], patch: Sequence[int],
                        rng: np.random.Generator) -> tuple[int, int, int]:
    """The patch centred on one of class `value`'s stored voxels, drawn uniformly (nnU-Net's `get_bbox`)."""
    rows = locations.rows[value]
    return patch_around(rows[int(rng.integers(len(rows)))], shape, patch)


def enlarged_window(start: Sequence[int], patch: Sequence[int], read: Sequence[int], shape: Sequence[int]
                    ) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """What a worker reads for the `read`-sized window centred on the patch at `start`, and how the device
    restores that window from it: the slices (a window of at most the volume per axis, moved inside it, so
    only that block is decompressed and no padding travels) and the `torch.nn.functional.pad` widths
    (last axis first; negative widths crop) that turn the read block into the centred window, zeros outside.

    nnU-Net's enlarged crop of a 160x192x160 patch is 275x289x257, larger than a 192³ cube: read whole, the
    padding would be 2.9 times the data."""
    slices, widths = [], []
    for s, p, r, dim in zip(start, patch, read, shape, strict=True):
        window = s - (r - p) // 2  # the centred window [window, window + r)
        size = min(r, dim)
        corner = min(max(window, 0), dim - size)
        slices.append(slice(corner, corner + size))
        widths.append((corner - window, window + r - corner - size))
    return tuple(slices), tuple(w for pair in reversed(widths) for w in pair)


PREPARATION_WARNINGS_SHOWN = 5  # per-case warnings a run's preparation prints before it counts the rest


def prepare_run_data(data_cfg: DataConfig, *, progress: bool = True) -> PrepareReport:
    """Bring `data.cache` up to date with `data.root` before a run reads it (`prepare_missing`: new or changed
    cases only, with a progress bar). `brats-swap train`, `cv` and `compare` call it first, once, on the main
    process, so one command goes from a download to a trained model. Skipped cases get one warning each."""
    report = prepare_missing(data_cfg, progress=progress, console=console)
    for case_id, problem in report.failed.items():
        warn(f"{data_cfg.cache}: skipped case {case_id} ({problem})")
    said = preparation_warnings(report)  # the warnings `data prepare` prints, said here too (a few, then a count)
    for line in said[:PREPARATION_WARNINGS_SHOWN]:
        warn(line)
    if len(said) > PREPARATION_WARNINGS_SHOWN:
        warn(f"{data_cfg.cache}: {len(said) - PREPARATION_WARNINGS_SHOWN} more warning(s) like these; "
             "`brats-swap data prepare` with the same config lists every one")
    if report.prepared:
        console.print(f"{data_cfg.cache}: prepared {len(report.prepared)} case(s) from {data_cfg.root}, "
                      f"{len(report.up_to_date)} already up to date")
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
    """Prepared cases (`load_prepared`) as training samples: whole cubes or random patches, read and cropped.

    Args:
        cache: prepared-cache folder.
        case_ids: the cases of this split.
        crop: patch size for patch mode, or None for the whole cube.
        patches_per_case: patches drawn per case per epoch (patch mode).
        augment: `train.augment`, the recipe whose per-sample parameters are drawn here (the augmentation
            itself runs on the device, `train/device_augment.py`); the nnU-Net recipes in patch mode read
            nnU-Net's enlarged patch around the patch.
        seed: base seed of every random choice.
        foreground: share of patches centred on a tumour voxel, or "nnunet" (nnU-Net's rule: the last third
            of every batch holds a voxel of a tumour class present in the case, or of a region with `regions`).
            Both draw the voxel from the class locations the cache stores per case
            (`PreparedCase.class_locations`, `region_locations`): DataError at once when a case lacks them
            (`require_locations`).
        regions: for a region model, its regions (name -> label values, channel order): "nnunet" then draws
            per region, as nnU-Net does for a region dataset; None (label and softmax models): per label.
        batch_size, world_size: the per-rank batch and the ranks, where a sample sits in its batch ("nnunet").
        channels: the image channels (the nnU-Net recipes draw per-channel parameters).

    Items are dicts: `image` in the cache's dtype (float16 by default; C, *crop), `label` uint8 (*crop): the
    cube's `CachedVolume`s or the patch's `CachedWindow`s, not read yet; `collate_samples`
    decompresses the cached ones straight into the batch, `augment` the sample's parameters
    (None for a plain int key), `pad` the widths that restore an enlarged crop from what was read (None: the
    arrays are the sample, `enlarged_window`), `case_id` str.
    """

    def __init__(
        self, cache: Path, case_ids: Sequence[str], *, crop: Sequence[int] | None = None, patches_per_case: int = 1,
        augment: str = "none", seed: int = 0, foreground: float | str = 0.33, batch_size: int = 1,
        world_size: int = 1, channels: int = 4, regions: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        if not case_ids:
            raise DataError(f"{cache}: no cases to load for this split")
        self.cache = Path(cache)
        self.case_ids = list(case_ids)
        self.crop = tuple(crop) if crop is not None else None
        self.patches_per_case = patches_per_case if crop is not None else 1
        self.augment = augment
        self.seed = seed
        self.foreground = foreground
        self.batch_size, self.world_size, self.channels = batch_size, world_size, channels
        self.regions = dict(regions) if regions and foreground == "nnunet" else None
        if self.crop is not None and self.draws_tumour_patches():
            require_locations(self.cache, self.case_ids, self.regions)

    def draws_tumour_patches(self) -> bool:
        """Whether some patches are centred on tumour (they read the cases' class locations)."""
        if self.foreground == "nnunet":
            return nnunet_forced_foreground(self.batch_size - 1, self.batch_size)
        return float(self.foreground) > 0

    def __len__(self) -> int:
        return len(self.case_ids) * self.patches_per_case

    def __getitem__(self, key: SampleKey | int) -> dict:
        if isinstance(key, SampleKey):
            rng: np.random.Generator | None = np.random.default_rng([self.seed, key.epoch, key.position])
            index = key.index
        else:
            rng, index = None, int(key)
        case_id = self.case_ids[index // self.patches_per_case]
        recipe = get_recipe(self.augment)  # looked up, not kept: the dataset pickles to workers as plain data
        prepared = load_prepared(self.cache, case_id, mmap=True)
        if prepared.label is None:
            raise DataError(f"{self.cache / case_id}: prepared case has no label; it cannot be used for training")
        image, label = prepared.image, prepared.label
        if self.crop is None:
            # The cached volumes themselves, in the cache's dtype: `collate_samples` decompresses them once into
            # the batch (in the worker), the device converts them.
            params = recipe.draw(rng, label.shape, self.channels) if rng is not None else None
            return {"image": image, "label": label, "augment": params, "pad": None, "case_id": case_id}
        # The corner comes from the stored class locations: the label too is read in the window only, at collate.
        start = self.patch_start(key, prepared, rng)
        read = recipe.crop_size(self.crop, patch_mode=True) if rng is not None else self.crop
        window, pad = enlarged_window(start, self.crop, read, label.shape)
        params = recipe.draw(rng, self.crop, self.channels) if rng is not None else None
        return {"image": image.window((slice(None), *window)), "label": label.window(window), "augment": params,
                "pad": pad if any(pad) else None, "case_id": case_id}

    def patch_start(self, key: SampleKey | int, case: PreparedCase, rng: np.random.Generator | None
                    ) -> tuple[int, int, int]:
        """The patch's corner: the centre patch for a plain int key (validation), else `train.patch_foreground`'s."""
        shape = case.label.shape
        if rng is None:
            return tuple((s - p) // 2 for s, p in zip(shape, self.crop, strict=True))  # type: ignore[return-value]
        if self.foreground != "nnunet":
            if rng.random() < float(self.foreground):
                return tumour_patch_start(shape, self.crop, case.class_locations(), rng)
            return random_patch_start(shape, self.crop, rng)
        global_batch = self.batch_size * self.world_size  # RankShardSampler deals positions round-robin
        assert isinstance(key, SampleKey)
        if nnunet_forced_foreground((key.position % global_batch) // self.world_size, self.batch_size):
            locations = case.region_locations(self.regions) if self.regions else case.class_locations()
            return class_patch_start(shape, self.crop, locations, rng)
        return random_patch_start(shape, self.crop, rng)


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
    stop_signals.ignore(stop_signals.STOP_SIGNALS)


def stacked(arrays: Sequence[np.ndarray | CachedVolume | CachedWindow], out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The arrays stacked into `out` (a new tensor when None). A cube or a window of one from the cache
    (`CachedVolume`, `CachedWindow`) is decompressed straight into its place; numpy stacks the rest (torch's
    CPU stack of float16 is several times slower)."""
    if out is None:
        out = torch.from_numpy(np.empty((len(arrays), *arrays[0].shape), dtype=arrays[0].dtype))
    if any(isinstance(a, CachedVolume | CachedWindow) for a in arrays):
        for array, place in zip(arrays, out.numpy(), strict=True):
            array.read_into(place) if isinstance(array, CachedVolume | CachedWindow) else np.copyto(place, array)
    else:
        np.stack(arrays, out=out.numpy())
    return out


@dataclass(frozen=True)
class LoaderBatch:
    """One batch as the loader hands it over (`collate_samples`): what `DeviceBatches.prepare` moves to the
    device and validation scores."""

    image: torch.Tensor  # (B, C, *crop) in the cache's dtype (float16 by default)
    label: torch.Tensor  # (B, *crop) uint8
    augment: list  # each sample's drawn augmentation parameters (None where nothing is drawn: validation)
    pad: list[tuple[int, ...] | None]  # the widths that restore each enlarged crop (`enlarged_window`); None: none
    case_id: list[str]
    in_slot: bool = False  # image and label are in a worker's reusable buffer, freed by `copied` (shared_batches)

    def pin_memory(self) -> LoaderBatch:
        """What DataLoader(pin_memory=True) calls, in its pin thread: the tensors copied into pinned memory."""
        return self.copied(torch.Tensor.pin_memory)

    def copied(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> LoaderBatch:
        """The batch with its tensors copied by `copy`, the per-sample lists as they are. A worker's slot
        holding them is free for its next batch once both copies have returned (shared_batches rule 1)."""
        moved = dataclasses.replace(self, image=copy(self.image), label=copy(self.label), in_slot=False)
        if self.in_slot:
            free_slot(self.image)
        return moved


def collate_samples(samples: list[dict], slots: BatchSlots | None = None) -> LoaderBatch:
    """One batch of `CubeDataset` items (`stacked`), with the per-sample draws and pads as lists. In a loader
    worker the batch is in shared memory, as torch's own collate makes it, so it reaches the main process
    without another copy: in one of the worker's `slots` when one is free (for a loader that copies each
    batch as it arrives, `loader_collate`), else in fresh shared memory."""
    images, labels = [s["image"] for s in samples], [s["label"] for s in samples]
    outs, in_slot = [None, None], False
    if get_worker_info() is not None:
        outs, in_slot = worker_batch([((len(arrays), *arrays[0].shape), torch_dtype(arrays[0].dtype))
                                      for arrays in (images, labels)], slots)
    return LoaderBatch(
        image=stacked(images, outs[0]),
        label=stacked(labels, outs[1]),
        augment=[s["augment"] for s in samples],
        pad=[s["pad"] for s in samples],
        case_id=[s["case_id"] for s in samples],
        in_slot=in_slot,
    )


def loader_collate(reuse_slots: bool) -> Callable[[list[dict]], LoaderBatch]:
    """The loaders' collate function. `reuse_slots` where every batch is copied as it arrives (pinned on
    CUDA, copied out by `WorkerLoader` otherwise: shared_batches rule 4): the workers then reuse their
    shared-memory buffers, each worker filling its own copy of the empty slots (rule 3)."""
    return functools.partial(collate_samples, slots=BatchSlots()) if reuse_slots else collate_samples


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (torch's own table is private)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class WorkerLoader(DataLoader):
    """A DataLoader that can end the workers of every pass it started (`close`), and that copies each batch
    out of its worker's shared-memory slot as it arrives when nothing pins it (`copy_out`).

    On the way out of an error the pass's iterator outlives the loop that used it: the traceback holds the
    frame that holds it, so torch never shuts its workers down, and at exit multiprocessing's handler
    terminates them with SIGTERM, which `seed_worker` makes them ignore, then waits for them forever. The
    training recipe closes its loaders when a fold ends, however it ends.
    """

    def __init__(self, *args, copy_out: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.copy_out = copy_out
        self._passes: weakref.WeakSet = weakref.WeakSet()

    def __iter__(self):
        iterator = super().__iter__()
        self._passes.add(iterator)
        if not self.copy_out:
            return iterator
        # On the CPU the step would read the worker's buffer itself: copied here, as the pin thread copies on
        # CUDA, the worker may write its next batch into it (shared_batches rule 4).
        return (batch.copied(torch.Tensor.clone) if batch.in_slot else batch for batch in iterator)

    def close(self) -> None:
        """End the workers of every pass still alive (a finished pass has ended its own)."""
        for iterator in list(self._passes):
            end_workers(iterator)


def end_workers(iterator: object) -> None:
    """Shut the loader workers of one pass down and wait for them: torch's own shutdown (what its iterator does
    when it is exhausted or collected), then SIGKILL for a worker that did not leave (it ignores SIGTERM)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)  # absent with num_workers=0: nothing to end
    if shutdown is None:
        return
    shutdown()
    for worker in getattr(iterator, "_workers", ()):
        if worker.is_alive():
            worker.kill()
            worker.join()


def loader_worker_count(data_cfg: DataConfig) -> int:
    """`data.loader_workers`, with auto resolved as nnU-Net sizes its augmentation workers from the machine:
    the CPUs this process may run on (its affinity: a SLURM allocation or `taskset` narrows it) shared by the
    ranks (GPUs) on this host, one of them left to the main process that drives the device, at most 12
    (nnU-Net's default); at least 1."""
    if data_cfg.loader_workers != "auto":
        return int(data_cfg.loader_workers)
    cpus = available_cpus()
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(AUTO_LOADER_WORKERS_MAX, cpus // ranks - 1))


def fit_loader_to_shared_memory(workers: int, batch_bytes: int, *, auto: bool, free: int | None = None) -> int:
    """The loader workers this host's shared memory has room for (`free`: measured when None). A worker that
    runs out of it dies of a bus error in the middle of an epoch, and a container's default is 64 MB, less
    than one 192³ batch. Each worker holds its two slots (shared_batches); every rank on the host has its
    own workers.

    Where they do not fit, one line says so. `auto` (`data.loader_workers: auto`): as many as fit, down to
    none (the training process then loads its own batches). A number the user set is kept."""
    per_worker = BATCH_SLOTS
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    free = shared_memory_free_bytes() if free is None else free
    need = ranks * workers * per_worker * batch_bytes
    if not workers or free is None or need <= free:
        return workers
    fitting = min(workers, free // (ranks * per_worker * batch_bytes))
    ranks_text = f" on each of {ranks} ranks" if ranks > 1 else ""
    where = (f"{SHARED_MEMORY} has {free / 2**30:.2f} GiB free, and {workers} loader workers{ranks_text} hold up "
             f"to {need / 2**30:.2f} GiB of batches there ({per_worker} of {batch_bytes / 2**30:.2f} GiB each)")
    if auto:
        use = f"{fitting} workers" if fitting else "no workers (the training process loads its batches)"
        warn(f"{where}: data.loader_workers auto uses {use}; give it more shared memory (docker run --shm-size) "
             f"for all {workers}")
        return fitting
    warn(f"{where}: a worker that runs out dies of a bus error; give it more (docker run --shm-size) or lower "
         "data.loader_workers or train.batch_size")
    return workers


@dataclass
class TrainData:
    """The loaders of one fold and the objects `train_fold` steers (sampler epoch, generator state)."""

    train_dataset: CubeDataset
    val_dataset: CubeDataset
    sampler: EpochSampler | RankShardSampler
    train_loader: WorkerLoader
    val_loader: WorkerLoader
    generator: torch.Generator
    steps_per_epoch: int
    device_batches: DeviceBatches  # a loader batch -> the step's augmented images and targets on the device
    loader_workers: int  # `data.loader_workers` resolved

    def close(self) -> None:
        """End the loaders' workers, also those of a pass an error left unfinished (`WorkerLoader`)."""
        self.train_loader.close()
        self.val_loader.close()


def sampled_regions(config: Config, edition: str) -> dict[str, tuple[int, ...]] | None:
    """What `train.patch_foreground: nnunet` draws per, nnU-Net's way: a region model's regions (name -> label
    values, channel order, which is nnU-Net's `foreground_regions` order), None (per label) otherwise."""
    if config.model.outputs != "regions":
        return None
    return {name: region.values for name, region in region_tree(edition, config.model.regions).items()}


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
    seed = config.seed * 1000 + fold % 1000  # folds draw different streams from one config seed (fold_all: 999)
    world_size = ctx.world_size if ctx is not None else 1
    train_dataset = CubeDataset(
        cache, train_ids, crop=crop, patches_per_case=train_cfg.patches_per_case, augment=train_cfg.augment,
        seed=seed, foreground=train_cfg.patch_foreground, batch_size=train_cfg.batch_size, world_size=world_size,
        channels=config.model.in_channels, regions=sampled_regions(config, edition),
    )
    # Validation sees whole cubes, not augmented: the cube Dice is the model selection signal in both modes.
    val_dataset = CubeDataset(cache, val_ids, seed=seed)
    global_batch = train_cfg.batch_size * world_size
    batches = train_cfg.steps_per_epoch or max(1, len(train_dataset) // global_batch)
    sampler = EpochSampler(len(train_dataset), batches * global_batch, seed)
    if ctx is not None and ctx.is_distributed:
        sampler = RankShardSampler(sampler, ctx)
    generator = torch.Generator().manual_seed(seed)
    pin = device.type == "cuda"
    batch_bytes = arrived_batch_bytes(train_cfg.augment, train_cfg.batch_size, config.model.in_channels,
                                      crop or config.data.cube, train_cfg.mode == "patch")
    workers = fit_loader_to_shared_memory(loader_worker_count(config.data), batch_bytes,
                                          auto=config.data.loader_workers == "auto")
    collate = loader_collate(reuse_slots=True)  # every batch is copied as it arrives: pinned, or copied out
    train_loader = WorkerLoader(
        train_dataset, batch_size=train_cfg.batch_size, sampler=sampler, num_workers=workers,
        collate_fn=collate, pin_memory=pin, drop_last=True, worker_init_fn=seed_worker, generator=generator,
        persistent_workers=False, prefetch_factor=LOADER_PREFETCH_FACTOR if workers else None, copy_out=not pin,
    )
    val_loader = WorkerLoader(
        val_dataset, batch_size=train_cfg.val_batch_size, shuffle=False, num_workers=min(workers, 1),
        sampler=make_sampler(val_dataset, ctx, shuffle=False) if ctx is not None else None,
        collate_fn=collate, pin_memory=pin, worker_init_fn=seed_worker, copy_out=not pin,
    )
    device_batches = DeviceBatches(train_cfg.augment, device, edition=edition, outputs=config.model.outputs,
                                   regions=config.model.regions, label_order=config.model.label_order,
                                   sample_size=crop or config.data.cube)
    return TrainData(train_dataset, val_dataset, sampler, train_loader, val_loader, generator, batches,
                     device_batches, workers)
