"""The training data pipeline: cube symmetries, patches, and a sample stream independent of workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train_helpers import prepared_dataset

from brats_swap.augment.cube import CUBE_SYMMETRIES, CubeSymmetry, allowed_symmetries, apply_symmetry
from brats_swap.data.cache import list_prepared, load_prepared
from brats_swap.data.class_locations import default_regions, sample_locations, sample_region_locations
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
    sampled_regions,
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


# --------------------------------------------------------------------------------------------------
# Region models: nnU-Net samples and draws per region (`label_manager.foreground_regions`).

def test_the_default_regions_are_in_nnunets_order_for_a_brats_dataset():
    """nnU-Net's regions are the dataset.json labels in their order, background left out (`regions_class_order`
    only names the label each head paints); a BraTS dataset.json lists them largest first, as the tables do."""
    label_handling = pytest.importorskip("nnunetv2.utilities.label_handling.label_handling")
    for edition in ("2021", "gli", "ped"):
        regions = default_regions(edition)
        dataset_labels = {"background": 0, **{name: list(values) for name, values in regions.items()}}
        manager = label_handling.LabelManager(dataset_labels, regions_class_order=list(range(1, len(regions) + 1)))
        assert manager.has_regions and manager.foreground_regions == list(regions.values()), edition
    assert default_regions("2021") == {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}
    from brats_swap.data.challenges import get_challenge
    from brats_swap.model.targets import region_tree

    for edition in ("2021", "gli", "met", "ped"):  # the regions a region model trains, by default
        tree = region_tree(get_challenge(edition))
        assert default_regions(edition) == {name: region.values for name, region in tree.items()}


def test_the_stored_region_locations_are_nnunets_sample(data):
    """Per region, the rows nnU-Net v2's preprocessing samples for a region dataset (`_sample_foreground_locations`
    with the regions, seed 1234), row for row: a region over 10000 voxels (the union of its labels, label after
    label), one kept whole, one the case lacks (skipped without a draw); PED's four regions; and in the cache."""
    preprocessing = pytest.importorskip("nnunetv2.preprocessing.preprocessors.default_preprocessor")
    theirs = preprocessing.DefaultPreprocessor._sample_foreground_locations
    rng = np.random.default_rng(5)
    for edition, values in (("2021", (1, 2, 4)), ("ped", (1, 2, 3, 4))):
        regions = default_regions(edition)
        for lacking in (None, values[-1]):
            label = rng.choice(np.array((0, *values), np.uint8), size=(40, 40, 36), p=[0.5, *[0.5 / len(values)] * len(values)])
            label[label == lacking] = 0
            record, ours = sample_region_locations(label, regions)
            reference = theirs(label[None], list(regions.values()))
            for position, (name, values_of) in enumerate(regions.items()):
                voxels = int(np.isin(label, values_of).sum())
                assert record[position] == [name, voxels, min(voxels, 10000)]
                if voxels:
                    assert np.array_equal(ours.rows[position], reference[values_of][:, 1:]), (edition, name)
                else:
                    assert position not in ours.rows and len(reference[values_of]) == 0
            assert any(n > 10000 for _, n, _ in record) and any(0 < n < 10000 for _, n, _ in record)
    _, cache = data
    for case_id in list_prepared(cache):
        prepared = load_prepared(cache, case_id)
        regions = default_regions(prepared.meta["edition"])
        stored, cube = prepared.region_locations(regions), np.asarray(prepared.label)
        reference = theirs(cube[None], list(regions.values()))
        assert stored.classes and all(np.array_equal(stored.rows[position], reference[values][:, 1:])
                                      for position, values in enumerate(regions.values()) if position in stored.rows)
        assert [position in stored.rows for position in range(len(regions))] == [
            len(reference[values]) > 0 for values in regions.values()]


def _patch_holds(label, starts, value, size=4):
    return np.mean([value in label[tuple(slice(s, s + size) for s in start)] for start in starts])


def test_nnunet_patches_of_a_region_model_draw_a_present_region_uniformly():
    """nnU-Net's get_bbox for a region dataset: a region present drawn uniformly, then one of its rows. A large
    edema (2), a small necrosis (1) and a small enhancing tumour (4) far apart: WT's rows are nearly all edema,
    TC's half necrosis, ET's all enhancing, so a 4³ patch holds enhancing tumour 1/3 * 1/2 + 1/3 = 1/2 of the
    time and necrosis 1/6 (per label: 1/3 each). Without enhancing tumour: WT and TC, 1/2 each."""
    regions = default_regions("2021")
    label = np.zeros((32, 32, 32), np.uint8)
    label[16:32, 16:32, 16:32] = 2  # 4096 voxels
    label[2:4, 2:4, 2:4], label[2:4, 2:4, 26:28] = 1, 4  # 8 voxels each
    _, locations = sample_region_locations(label, regions)
    rng = np.random.default_rng(0)
    starts = [class_patch_start(label.shape, (4, 4, 4), locations, rng) for _ in range(900)]
    assert 0.44 < _patch_holds(label, starts, 4) < 0.56 and 0.12 < _patch_holds(label, starts, 1) < 0.22
    per_label = [class_patch_start(label.shape, (4, 4, 4), sample_locations(label), rng) for _ in range(900)]
    assert 0.27 < _patch_holds(label, per_label, 4) < 0.39  # what a region model must not do
    label[label == 4] = 0
    _, locations = sample_region_locations(label, regions)
    assert locations.classes == [0, 1]
    starts = [class_patch_start(label.shape, (4, 4, 4), locations, rng) for _ in range(900)]
    assert 0.44 < _patch_holds(label, starts, 1) < 0.56  # TC (all necrosis) is drawn half the time
    empty = np.zeros((16, 16, 16), np.uint8)
    _, nothing = sample_region_locations(empty, regions)
    assert all(0 <= s <= 8 for s in class_patch_start(empty.shape, (8, 8, 8), nothing, rng))


def test_only_a_region_model_draws_per_region():
    """Label and softmax models keep the per-label draw (their `CubeDataset` is built as before); a region
    model's regions are its channels', in order."""
    from brats_swap.config import Config

    for outputs in ("labels", "softmax"):
        config = Config()
        config.model.outputs = outputs
        assert sampled_regions(config, "2021") is None
    config = Config()
    config.model.outputs = "regions"
    assert sampled_regions(config, "2021") == default_regions("2021")
    config.model.regions = ["ET", "TC", "WT"]  # another channel order: another nnU-Net dataset
    assert list(sampled_regions(config, "2021").items()) == [("ET", (4,)), ("TC", (1, 4)), ("WT", (1, 2, 4))]


def test_a_region_run_builds_a_per_region_loader(data):
    """`build_train_data` (what train, cv and compare call) hands a region model's regions to the dataset."""
    from train_helpers import tiny_config

    from brats_swap.train.data import build_train_data

    root, cache = data
    ids = list_prepared(cache)
    for outputs, expected in (("regions", default_regions("2021")), ("labels", None)):
        config = tiny_config(root, cache, f"model.outputs={outputs}", "train.mode=patch", "train.patch=[16,16,16]",
                             "train.patch_foreground=nnunet", "train.batch_size=2")
        built = build_train_data(config, ids[:2], ids[2:], edition="2021", fold=0, device=torch.device("cpu"))
        try:
            assert built.train_dataset.regions == expected and built.train_dataset.foreground == "nnunet"
        finally:
            built.close()


def test_a_region_dataset_centres_its_forced_patches_on_region_rows(data, monkeypatch):
    from brats_swap.data import cache as cache_module

    _, cache = data
    ids = list_prepared(cache)
    regions = default_regions(load_prepared(cache, ids[0]).meta["edition"])
    read = []
    real = cache_module.PreparedCase.region_locations
    monkeypatch.setattr(cache_module.PreparedCase, "region_locations",
                        lambda case, names: read.append(case.case_id) or real(case, names))
    dataset = CubeDataset(cache, ids, crop=(16, 16, 16), seed=3, foreground="nnunet", batch_size=2, regions=regions)
    for position in range(8):
        sample = collate_samples([dataset[SampleKey(0, position, position % len(ids))]])
        if position % 2:  # the forced sample of each batch of 2: centred on a region's row
            assert sample.label[0].any() and read[-1] == sample.case_id[0]
    assert len(read) == 4
    numeric = CubeDataset(cache, ids, crop=(16, 16, 16), seed=3, foreground=1.0, regions=regions)
    assert numeric.regions is None  # a numeric patch_foreground keeps `tumour_patch_start` per label


def test_a_region_run_whose_regions_the_cache_lacks_is_refused_before_it_starts(data, tmp_path):
    """Other regions than the table's defaults (stored at prepare), or entries written before region locations
    were stored: one line at start, never a silent per-label draw."""
    import json
    import shutil

    _, prepared = data
    cache = tmp_path / "cache"
    shutil.copytree(prepared, cache)
    ids = list_prepared(cache)
    with pytest.raises(DataError, match=r"stores region locations for WT, TC, ET .*not for this run's regions ET, "
                                        r"TC, WT \(model.regions\)") as error:
        CubeDataset(cache, ids, crop=(16, 16, 16), foreground="nnunet", batch_size=2,
                    regions={"ET": (4,), "TC": (1, 4), "WT": (1, 2, 4)})
    assert "\n" not in str(error.value)
    meta = json.loads((cache / ids[1] / "meta.json").read_text())
    del meta["region_locations"]
    (cache / ids[1] / "meta.json").write_text(json.dumps(meta))
    (cache / ids[1] / "region_locations.npy").unlink()
    with pytest.raises(DataError, match=rf"cache {cache}: 1 of 4 case\(s\) \(e.g. {ids[1]}\) have no tumour-class or "
                                        r"region locations .*run `brats-swap data prepare`"):
        CubeDataset(cache, ids, crop=(16, 16, 16), foreground="nnunet", batch_size=2, regions=default_regions("2021"))
    # a label model does not read them
    assert CubeDataset(cache, ids, crop=(16, 16, 16), foreground="nnunet", batch_size=2).regions is None
