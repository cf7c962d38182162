"""The training data pipeline: cube symmetries, patches, and a sample stream independent of workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train_helpers import prepared_dataset

from brats_swap.augment.cube import CUBE_SYMMETRIES, CubeSymmetry, allowed_symmetries, apply_symmetry
from brats_swap.data.cache import list_prepared, load_prepared
from brats_swap.data.class_locations import sample_locations
from brats_swap.data.compressed import CachedVolume
from brats_swap.errors import DataError
from brats_swap.train.data import (
    CubeDataset,
    EpochSampler,
    SampleKey,
    class_patch_start,
    collate_samples,
    enlarged_window,
    loader_worker_count,
    nnunet_forced_foreground,
    tumour_patch_start,
)


def test_the_48_cube_symmetries_are_distinct_and_only_permute_equal_axes():
    volume = torch.arange(4 * 4 * 4).reshape(4, 4, 4)
    images = {apply_symmetry(volume, perm, flips).numpy().tobytes() for perm, flips in CUBE_SYMMETRIES}
    assert len(CUBE_SYMMETRIES) == 48 and len(images) == 48
    assert len(allowed_symmetries((8, 8, 8))) == 48
    assert len(allowed_symmetries((8, 8, 4))) == 16  # swap the first two axes or not, times 8 flips
    assert len(allowed_symmetries((8, 6, 4))) == 8  # flips only
    for perm, flips in allowed_symmetries((8, 8, 4)):
        assert apply_symmetry(torch.zeros((2, 8, 8, 4)), perm, flips).shape == (2, 8, 8, 4)
    # numpy's transpose + flip, the symmetry as the worker-side code applied it before it moved to the device
    array = np.arange(2 * 4 * 4 * 4).reshape(2, 4, 4, 4)
    for perm, flips in CUBE_SYMMETRIES:
        expected = np.flip(np.transpose(array, (0, *(1 + p for p in perm))), axis=tuple(1 + i for i, f in enumerate(flips) if f))
        np.testing.assert_array_equal(apply_symmetry(torch.from_numpy(array), perm, flips).numpy(), expected)


def test_a_symmetry_moves_image_channels_and_label_together():
    rng = np.random.default_rng(0)
    label = torch.from_numpy(rng.integers(0, 3, size=(6, 6, 6)).astype(np.uint8))
    image = torch.stack([(label == k).float() for k in range(3)])  # channel k marks label k
    for perm, flips in CUBE_SYMMETRIES:
        moved_image, moved_label = apply_symmetry(image, perm, flips), apply_symmetry(label, perm, flips)
        assert torch.equal(moved_image.argmax(dim=0).to(torch.uint8), moved_label)


def test_foreground_patches_contain_tumour():
    label = np.zeros((32, 32, 32), np.uint8)
    label[28:30, 2:4, 20:22] = 2
    locations = sample_locations(label)
    rng = np.random.default_rng(0)
    for _ in range(20):
        start = tumour_patch_start(label.shape, (8, 8, 8), locations, rng)
        window = tuple(slice(s, s + 8) for s in start)
        assert label[window].any() and all(0 <= s <= 24 for s in start)
    # every tumour voxel as likely: a class is drawn by its share of the tumour (1:8 here)
    label[:, :, :] = 0
    label[0:4, 0:4, 0:4], label[16:24, 16:24, 16:24] = 1, 2  # 64 and 512 voxels
    locations = sample_locations(label)
    drawn = [tumour_patch_start(label.shape, (4, 4, 4), locations, rng) for _ in range(800)]
    share = np.mean([1 in label[tuple(slice(s, s + 4) for s in start)] for start in drawn])
    assert 0.07 < share < 0.16  # class 1 is 1/9 of the tumour (±4 standard deviations of 800 draws)
    empty = np.zeros((16, 16, 16), np.uint8)
    assert all(0 <= s <= 8 for s in tumour_patch_start(empty.shape, (8, 8, 8), sample_locations(empty), rng))


def test_nnunet_forces_foreground_in_the_last_third_of_every_batch():
    forced = {batch: [nnunet_forced_foreground(i, batch) for i in range(batch)] for batch in (1, 2, 3, 4)}
    assert forced == {1: [False], 2: [False, True], 3: [False, False, True], 4: [False, False, False, True]}
    label = np.zeros((32, 32, 32), np.uint8)
    label[2:4, 2:4, 2:4] = 1  # a small class far from a large one: drawn as often (class first, then a voxel)
    label[16:32, 16:32, 16:32] = 2
    locations = sample_locations(label)
    rng = np.random.default_rng(0)
    held = []
    for _ in range(200):
        start = class_patch_start(label.shape, (8, 8, 8), locations, rng)
        window = label[tuple(slice(s, s + 8) for s in start)]
        held.append(1 in window)
        assert window.any()
    assert 0.35 < np.mean(held) < 0.65
    empty = np.zeros((16, 16, 16), np.uint8)
    assert all(0 <= s <= 8 for s in class_patch_start(empty.shape, (8, 8, 8), sample_locations(empty), rng))


def test_an_enlarged_crop_is_read_inside_the_volume_and_restored_on_the_device():
    """The worker reads at most the volume (a view of the memory map); the device pads it to the window
    centred on the patch, zeros outside the volume, as reading that window with zero padding would give."""
    from brats_swap.train.device_augment import restore_windows

    array = torch.arange(1, 1 + 2 * 12 * 10 * 8, dtype=torch.float32).reshape(2, 12, 10, 8)
    for start, patch, read in [((0, 3, 1), (4, 4, 4), (8, 14, 6)), ((8, 0, 4), (4, 6, 4), (7, 9, 9)),
                               ((2, 2, 2), (4, 4, 4), (6, 6, 6))]:
        window, pad = enlarged_window(start, patch, read, array.shape[1:])
        block = array[(slice(None), *window)]
        assert all(b <= d for b, d in zip(block.shape[1:], array.shape[1:], strict=True))
        restored, _ = restore_windows(block[None], block[0][None].long(), [pad])
        expected = torch.zeros((2, *read))
        corner = [s - (r - p) // 2 for s, r, p in zip(start, read, patch, strict=True)]
        for index in np.ndindex(*read):
            source = [c + i for c, i in zip(corner, index, strict=True)]
            if all(0 <= v < d for v, d in zip(source, array.shape[1:], strict=True)):
                expected[(slice(None), *index)] = array[(slice(None), *source)]
        assert torch.equal(restored[0], expected), (start, patch, read)


def test_auto_loader_workers_follow_the_affinity_and_the_ranks_on_the_host(monkeypatch):
    from brats_swap.config import DataConfig

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loader_worker_count(DataConfig()) == 12  # nnU-Net's default caps it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert loader_worker_count(DataConfig()) == 3  # 4 CPUs per GPU, one for the rank itself
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert loader_worker_count(DataConfig()) == 1
    assert loader_worker_count(DataConfig(loader_workers=0)) == 0


def test_sampler_is_a_seeded_shuffle_and_can_start_mid_epoch():
    sampler = EpochSampler(dataset_length=5, num_samples=7, seed=3)
    keys = list(sampler)
    assert len(keys) == 7 and sorted(k.index for k in keys[:5]) == list(range(5))
    assert keys == list(EpochSampler(5, 7, seed=3))
    sampler.set_epoch(1)
    assert [k.index for k in sampler] != [k.index for k in keys]
    sampler.set_epoch(1, start=4)
    assert [k.position for k in sampler] == [4, 5, 6]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_dataset(tmp_path_factory)


def test_samples_depend_only_on_their_key_not_on_workers(data):
    _, cache = data
    ids = list_prepared(cache)
    dataset = CubeDataset(cache, ids, crop=(16, 16, 16), patches_per_case=2, augment="cube48", seed=7)
    key = SampleKey(epoch=2, position=3, index=5)
    first, again = dataset[key], dataset[key]
    assert np.array_equal(first["image"], again["image"]) and first["augment"] == again["augment"]
    assert np.array_equal(first["label"], again["label"]) and first["case_id"] == ids[5 // 2]
    # the workers only read and crop: the cache's float16 and uint8 labels, the draw travels beside them
    assert first["image"].shape == (4, 16, 16, 16) and first["image"].dtype == np.float16
    assert first["label"].dtype == np.uint8 and isinstance(first["augment"], CubeSymmetry)
    draws = {(dataset[SampleKey(epoch, 3, 5)]["augment"], float(np.asarray(dataset[SampleKey(epoch, 3, 5)]["image"]).sum()))
             for epoch in range(8)}
    assert len(draws) > 4  # the patch and the symmetry change with the key

    sampler = EpochSampler(len(dataset), 4, seed=7)
    batches = {}
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers,
                                             collate_fn=collate_samples)
        batches[workers] = [b for b in loader]
    for a, b in zip(batches[0], batches[2], strict=True):
        assert torch.equal(a.image, b.image) and a.augment == b.augment


def test_two_ranks_never_draw_the_same_augmentation(data):
    """Each rank loads its own global positions of the epoch, and a sample's draw is a function of its position."""
    from brats_swap.distributed import DistContext, RankShardSampler

    _, cache = data
    dataset = CubeDataset(cache, list_prepared(cache), augment="nnunet", seed=7, batch_size=2, world_size=2)
    draws = {}
    for rank in (0, 1):
        ctx = DistContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        sampler = RankShardSampler(EpochSampler(len(dataset), 8, seed=7), ctx)
        draws[rank] = [dataset[key]["augment"] for key in sampler]
    assert len(draws[0]) == len(draws[1]) == 4
    assert not set(draws[0]) & set(draws[1]) and len(set(draws[0])) == 4


def test_the_stored_locations_are_nnunets_sample(data):
    """The class locations are those nnU-Net v2's preprocessing samples (`_sample_foreground_locations`, seed
    1234), row for row: on a label with a class kept at 1% (over 10000), one at 10000, one kept whole and a
    value the case does not hold; and in the cache, where they are sampled on the stored box."""
    preprocessing = pytest.importorskip("nnunetv2.preprocessing.preprocessors.default_preprocessor")
    theirs = preprocessing.DefaultPreprocessor._sample_foreground_locations
    label = np.zeros((112, 112, 112), np.uint8)
    label[:100, :100, :110] = 2  # 1,100,000 voxels: 11,000 kept
    label[100:, :50, :] = 1  # 67,200: 10,000 kept
    label[100:105, 60:70, 0:50] = 4  # 2,500: all kept, in a random order
    ours = sample_locations(label)
    reference = theirs(label[None], [1, 2, 3, 4])
    assert ours.classes == [1, 2, 4] and len(reference[3]) == 0
    assert [len(ours.rows[v]) for v in ours.classes] == [10000, 11000, 2500]
    for value in ours.classes:
        assert np.array_equal(ours.rows[value], reference[value][:, 1:]), value
    _, cache = data
    for case_id in list_prepared(cache):
        prepared = load_prepared(cache, case_id)
        stored, cube = prepared.class_locations(), np.asarray(prepared.label)
        assert prepared.meta["stored_box"] != [[0, s] for s in cube.shape]  # the box is not the cube here
        reference = theirs(cube[None], stored.classes)
        assert stored.classes and all(np.array_equal(stored.rows[v], reference[v][:, 1:]) for v in stored.classes)


@pytest.mark.parametrize("foreground", ["nnunet", 1.0])
def test_a_patch_reads_only_its_window_of_the_label(data, monkeypatch, foreground):
    """The corner comes from the stored locations: the label is read in the patch's window only (once, at
    collate), and what is read is that window of the cube; patches on tumour hold tumour."""
    _, cache = data
    ids = list_prepared(cache)
    dataset = CubeDataset(cache, ids, crop=(16, 16, 16), augment="none", seed=3, foreground=foreground, batch_size=2)
    cubes = {case_id: np.asarray(load_prepared(cache, case_id).label) for case_id in ids}
    reads, real_read = [], CachedVolume.read_into

    def recorded_read(volume, out, slices=None):
        reads.append((volume.path.name, slices))
        real_read(volume, out, slices)

    monkeypatch.setattr(CachedVolume, "read_into", recorded_read)
    for position in range(8):
        reads.clear()
        batch = collate_samples([dataset[SampleKey(0, position, position % len(ids))]])
        (label_read,) = [slices for name, slices in reads if name == "label.b2nd"]
        assert [s.stop - s.start for s in label_read] == [16, 16, 16]
        assert np.array_equal(batch.label[0].numpy(), cubes[batch.case_id[0]][label_read])
        if foreground == 1.0 or position % 2:  # nnunet at batch 2: the second sample of each batch is forced
            assert batch.label[0].any()


def test_a_patch_run_on_entries_without_class_locations_is_refused_before_it_starts(data, tmp_path):
    import json
    import shutil

    _, prepared = data
    cache = tmp_path / "cache"
    shutil.copytree(prepared, cache)
    ids = list_prepared(cache)
    meta = json.loads((cache / ids[1] / "meta.json").read_text())
    del meta["class_locations"]
    (cache / ids[1] / "meta.json").write_text(json.dumps(meta))
    (cache / ids[1] / "class_locations.npy").unlink()
    for foreground in ("nnunet", 0.33):
        with pytest.raises(DataError, match=rf"cache {cache}: 1 of 4 case\(s\) \(e.g. {ids[1]}\) have no tumour-class "
                                            r"locations .*run `brats-swap data prepare`"):
            CubeDataset(cache, ids, crop=(16, 16, 16), foreground=foreground, batch_size=2)
    # what does not centre patches on tumour does not need them: whole cubes, uniform patches, nnunet at batch 1
    for kwargs in ({}, {"crop": (16, 16, 16), "foreground": 0.0}, {"crop": (16, 16, 16), "foreground": "nnunet"}):
        sample = collate_samples([CubeDataset(cache, ids, seed=1, **kwargs)[SampleKey(0, 1, 1)]])
        assert sample.case_id == [ids[1]]
