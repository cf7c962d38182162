"""A loader worker's shared-memory batches (brats_swap/train/shared_batches.py): reused slots, freed only once
the main process has copied the batch, never overwritten while it is still held; the values those of the
batch made without workers."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch
from train_helpers import prepared_dataset, tiny_config

import brats_swap.train.data as train_data
import brats_swap.train.shared_batches as shared_batches
from brats_swap.data.cache import list_prepared
from brats_swap.train.data import CubeDataset, EpochSampler, SampleKey, collate_samples
from brats_swap.train.shared_batches import (
    BatchSlots,
    free_slot,
    populate_pages,
    shared_memory_free_bytes,
    worker_batch,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_dataset(tmp_path_factory)


def test_a_slot_is_reused_once_freed_and_never_while_busy():
    slots = BatchSlots(count=2)
    specs = [((2, 3, 5), torch.float16), ((2, 5), torch.uint8)]
    (first, first_label), in_slot = worker_batch(specs, slots)
    (second, _), second_in_slot = worker_batch(specs, slots)
    assert in_slot and second_in_slot and first.is_shared()
    assert first.untyped_storage().data_ptr() == first_label.untyped_storage().data_ptr()  # one buffer per batch
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    # both busy: the third batch gets fresh shared memory (rule 2), not a slot
    (third, _), third_in_slot = worker_batch(specs, slots)
    assert not third_in_slot and third.is_shared()
    assert third.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in (first, second)}
    free_slot(first)
    (again, again_label), again_in_slot = worker_batch(specs, slots)
    assert again_in_slot and again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    # the tensors of one batch do not overlap, and none covers the flag byte
    again.fill_(1.0), again_label.fill_(7)
    assert torch.all(again == 1.0) and torch.all(again_label == 7)
    assert again.untyped_storage()[shared_batches.FLAG_BYTE] == shared_batches.BUSY
    # a larger batch outgrows a free slot: it is replaced, never written past its end
    free_slot(again)
    (large, _), large_in_slot = worker_batch([((4, 3, 5, 5), torch.float32), ((4, 5, 5), torch.uint8)], slots)
    assert large_in_slot and large.untyped_storage().nbytes() >= shared_batches.layout(
        [((4, 3, 5, 5), torch.float32), ((4, 5, 5), torch.uint8)])[1]


def test_slots_belong_to_the_process_that_made_them(monkeypatch):
    slots = BatchSlots(count=1)
    parents = slots.take(64)
    # a forked worker holds a copy of the parent's object: it must not write into the parent's buffers
    monkeypatch.setattr(shared_batches.os, "getpid", lambda: -1)
    child = slots.take(64)
    assert child is not None and child.data_ptr() != parents.data_ptr()
    # a spawned worker receives the slots pickled: empty
    assert pickle.loads(pickle.dumps(slots))._storages == []


def test_populate_pages_leaves_values_and_takes_any_tensor():
    tensor = torch.arange(3 * 4096, dtype=torch.float32).share_memory_()
    before = tensor.clone()
    populate_pages(tensor)  # Linux 5.14+ faults the pages in; elsewhere nothing
    populate_pages(torch.empty(0))
    populate_pages(tensor[5:])  # a view starting inside a page
    assert torch.equal(tensor, before)


def reference_batches(dataset: CubeDataset, sampler: EpochSampler) -> list:
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=collate_samples)
    return [(b.image.clone(), b.label.clone(), b.case_id) for b in loader]


def slot_loader(dataset: CubeDataset, sampler: EpochSampler, prefetch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, prefetch_factor=prefetch,
                                       collate_fn=functools.partial(collate_samples, slots=BatchSlots()))


def test_workers_reuse_their_slots_when_each_batch_is_copied(data):
    """What the pin thread does on a GPU (`LoaderBatch.pin_memory`), with a clone for the pinned copy (this CPU
    cannot pin): each batch equals the batch made without workers, and every batch after a worker's first
    two went into a slot it had used before."""
    _, cache = data
    dataset = CubeDataset(cache, list_prepared(cache), crop=(16, 16, 16), patches_per_case=3, augment="nnunet",
                          seed=3, foreground="nnunet", batch_size=2)
    sampler = EpochSampler(len(dataset), 24, seed=3)
    expected = reference_batches(dataset, sampler)
    # one batch ahead per worker: when a worker starts a batch, at most its previous one is still unfreed
    in_slot, copies = [], []
    for batch in slot_loader(dataset, sampler, prefetch=1):
        in_slot.append(batch.in_slot)
        copies.append(batch.copied(torch.Tensor.clone))
    assert in_slot == [True] * len(expected) and len(expected) == 12  # each worker's 2 slots served 6 batches
    for (image, label, case_id), copy in zip(expected, copies, strict=True):
        assert torch.equal(copy.image, image) and torch.equal(copy.label, label) and copy.case_id == case_id
        assert not copy.in_slot and not copy.image.is_shared()


def test_a_held_batch_is_never_overwritten(data):
    """Batches never freed (held by the caller, or never pinned): the slots fill, then fresh memory (rule 2),
    and nothing held changes."""
    _, cache = data
    dataset = CubeDataset(cache, list_prepared(cache), crop=(16, 16, 16), patches_per_case=3, augment="nnunet",
                          seed=4, foreground="nnunet", batch_size=2)
    sampler = EpochSampler(len(dataset), 24, seed=4)
    expected = reference_batches(dataset, sampler)
    held = list(slot_loader(dataset, sampler, prefetch=2))
    assert sum(b.in_slot for b in held) == 2 * shared_batches.BATCH_SLOTS < len(held)
    for (image, label, _), batch in zip(expected, held, strict=True):
        assert torch.equal(batch.image, image) and torch.equal(batch.label, label)


def test_a_batch_outside_a_worker_is_plain_memory_and_never_in_a_slot(data):
    _, cache = data
    ids = list_prepared(cache)
    batch = collate_samples([CubeDataset(cache, ids, seed=1)[SampleKey(0, 0, 0)]], slots=BatchSlots())
    assert not batch.in_slot and not batch.image.is_shared()
    assert torch.equal(batch.image, torch.from_numpy(np.asarray(CubeDataset(cache, ids, seed=1)[0]["image"]))[None])


def test_train_data_copies_each_batch_out_of_its_slot_on_the_cpu(data, monkeypatch):
    """Rule 4: every loader of a fold takes slots; on CUDA the pin thread copies each batch out of its slot, on
    the CPU the loader itself (`WorkerLoader(copy_out=True)`), so the step never reads a worker's buffer."""
    root, cache = data
    freed = []
    monkeypatch.setattr(train_data, "free_slot", lambda tensor: freed.append(1) or free_slot(tensor))
    config = tiny_config(root, cache, "data.loader_workers=2", "train.batch_size=2", "train.steps_per_epoch=6")
    ids = list_prepared(cache)
    for device, pinned in (("cpu", False), ("cuda", True)):
        built = train_data.build_train_data(config, ids, ids[:2], edition="2021", fold=0, device=torch.device(device))
        built.close()
        for loader in (built.train_loader, built.val_loader):
            assert loader.pin_memory is pinned and loader.copy_out is not pinned
            assert isinstance(loader.collate_fn.keywords["slots"], BatchSlots)
    cpu = train_data.build_train_data(config, ids, ids[:2], edition="2021", fold=0, device=torch.device("cpu"))
    try:
        batches = list(cpu.train_loader)
        plain = torch.utils.data.DataLoader(cpu.train_dataset, batch_size=2, sampler=cpu.sampler,
                                            collate_fn=collate_samples)
        for batch, expected in zip(batches, plain, strict=True):
            assert not batch.in_slot
            assert torch.equal(batch.image, expected.image) and torch.equal(batch.label, expected.label)
        # every batch that came in a slot was copied out (the rest found both slots held: fresh memory, rule 2),
        # and each worker's first batch always finds a slot
        assert len(batches) == 6 and sum(not b.image.is_shared() for b in batches) == len(freed) >= 2
    finally:
        cpu.close()


def test_a_loader_that_would_outgrow_shared_memory_is_fitted_or_named_in_one_line(monkeypatch):
    lines = []
    monkeypatch.setattr(train_data, "warn", lines.append)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    fit = train_data.fit_loader_to_shared_memory
    batch = 2 * 4 * 192**3 * 2  # 2 whole-cube images in float16
    # a number the user set is kept, with a line: docker's default 64 MB holds no 192³ batch
    assert fit(12, batch, auto=False, free=64 * 2**20) == 12
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("/dev/shm has 0.06 GiB free, and 12 loader workers hold up to 2.53 GiB of batches "
                               "there (2 of 0.11 GiB each): a worker that runs out dies of a bus error")
    assert "--shm-size" in lines[0]
    # auto: as many as fit, 2 slots each
    assert fit(12, batch, auto=True, free=1 * 2**30) == 4
    assert lines[1].endswith("data.loader_workers auto uses 4 workers; give it more shared memory (docker run "
                             "--shm-size) for all 12")
    assert fit(12, batch, auto=True, free=64 * 2**20) == 0
    assert "auto uses no workers (the training process loads its batches)" in lines[2]
    # two ranks on the host share it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert fit(4, batch, auto=True, free=1 * 2**30) == 2
    assert "4 loader workers on each of 2 ranks" in lines[3]
    # what fits, no workers, or no shared-memory file system to ask: kept, nothing said
    assert fit(4, batch, auto=True, free=8 * 2**30) == 4
    assert fit(0, batch, auto=False, free=0) == 0
    monkeypatch.setattr(train_data, "shared_memory_free_bytes", lambda: None)
    assert fit(12, batch, auto=True) == 12
    assert len(lines) == 4


def test_train_data_under_a_small_shared_memory_loads_in_the_training_process(data, monkeypatch):
    root, cache = data
    lines = []
    monkeypatch.setattr(train_data, "warn", lines.append)
    monkeypatch.setattr(train_data, "shared_memory_free_bytes", lambda: 1024)
    ids = list_prepared(cache)
    for workers, used in (("auto", 0), ("2", 2)):
        config = tiny_config(root, cache, f"data.loader_workers={workers}")
        built = train_data.build_train_data(config, ids[:2], ids[2:], edition="2021", fold=0,
                                            device=torch.device("cpu"))
        built.close()
        assert built.loader_workers == built.train_loader.num_workers == used
    assert len(lines) == 2 and "auto uses no workers" in lines[0] and "bus error" in lines[1]


def test_shared_memory_free_bytes_reads_the_file_system(tmp_path):
    assert shared_memory_free_bytes(tmp_path) > 0
    assert shared_memory_free_bytes(tmp_path / "absent") is None


def test_through_dataloaders_own_pin_thread_every_batch_reuses_a_slot(data, monkeypatch):
    """DataLoader(pin_memory=True) as on a GPU: torch's own pin thread calls `LoaderBatch.pin_memory`, which
    frees the slot after its copy. This CPU has no accelerator and cannot pin, so torch is told there is one
    and a pinned copy is a clone; everything else (the workers, the pin thread, the queues) is torch's. With
    one batch ahead per worker, each batch a worker starts finds its previous one freed: all 12 in slots."""
    _, cache = data
    dataset = CubeDataset(cache, list_prepared(cache), crop=(16, 16, 16), patches_per_case=3, augment="nnunet",
                          seed=5, foreground="nnunet", batch_size=2)
    sampler = EpochSampler(len(dataset), 24, seed=5)
    expected = reference_batches(dataset, sampler)
    freed = []
    monkeypatch.setattr(train_data, "free_slot", lambda tensor: freed.append(1) or free_slot(tensor))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, *args: tensor.clone())
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, prefetch_factor=1,
                                         pin_memory=True, collate_fn=train_data.loader_collate(reuse_slots=True))
    batches = iter(loader)
    assert batches._pin_memory  # the pin thread runs
    pinned = list(batches)
    assert len(pinned) == len(expected) == len(freed) == 12
    for (image, label, case_id), batch in zip(expected, pinned, strict=True):
        assert torch.equal(batch.image, image) and torch.equal(batch.label, label) and batch.case_id == case_id
        assert not batch.in_slot and not batch.image.is_shared()
