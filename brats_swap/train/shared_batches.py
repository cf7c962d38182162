"""Where a loader worker puts a batch: shared memory the main process maps, fresh or reused.

A DataLoader worker hands its batch over in shared memory (torch's own collate does the same), so the main
process receives a mapping, not a copy. Fresh shared memory is expensive to write: shared memory gets no huge
pages on common kernels, and each 4 KiB page faults in zeroed at first touch. For a 192³ whole-cube sample
that is half of the worker's CPU (scripts/bench_scale.py). When training on a GPU, the main process copies
every batch into pinned memory as it arrives (DataLoader's pin thread calls `LoaderBatch.pin_memory`); on
the CPU the loader copies it out the same way (`train.data.WorkerLoader`). After that copy the worker's
buffer is no longer read. So each worker keeps a few buffers (slots) and writes its next batch into a free
one.

The rules the slots keep (cited in the code):

1. A slot's first byte says whether it is free. The worker that owns the slot sets it busy before writing a
   batch into it. The main process frees it only after its copies of the batch have returned
   (`free_slot`, called by `LoaderBatch.copied`). The flag lives in the buffer it guards, so freeing a
   slot sends nothing between the processes.
2. With no free slot, the batch goes to fresh shared memory, as it would without slots. A worker never
   waits for the main process, so a batch that is never copied (one held by its reader, an abandoned pass)
   costs speed, never a deadlock.
3. Slots belong to the process that allocated them (`BatchSlots` starts empty in every process, forked or
   spawned), so each loader pass's workers get their own, and a late free from an earlier pass cannot
   free a buffer of a later one.
4. Slots only where every batch is copied as it arrives, by the pin thread or by the loader's own copy
   (`train.data.loader_collate`, `WorkerLoader(copy_out=True)`): a batch the step read in place would have
   nothing to free it at the right moment. A loader that hands its batches over uncopied takes no slots.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a mapping's pages in, writable, in one call

BATCH_SLOTS = 2  # per worker: one batch being written while the previous one is copied (rule 2 covers a third)
FLAG_BYTE = 0  # rule 1: the slot's state, in its own first byte
FREE, BUSY = 0, 1
ALIGN_BYTES = 64  # each tensor of a batch starts on its own cache line, after the flag
SHARED_MEMORY = Path("/dev/shm")  # where Linux keeps the shared memory torch's workers allocate (shm_open)


@functools.cache
def _madvise():
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError, TypeError):  # no C library to ask (Windows)
        return None


def populate_pages(tensor: torch.Tensor) -> None:
    """Fault in the pages of fresh shared memory in one call before it is written: touched page by page, a
    192³ whole-cube batch takes 16 thousand faults, one per 4 KiB. Populating them at once saves about
    0.01 CPU s per sample. Nothing happens where the kernel does not know the call (before Linux 5.14)."""
    madvise = _madvise()
    if madvise is None or tensor.numel() == 0:
        return
    start = tensor.data_ptr() - tensor.data_ptr() % PAGE_BYTES
    madvise(start, tensor.data_ptr() + tensor.numel() * tensor.element_size() - start, MADV_POPULATE_WRITE)


def fresh_storage(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of new shared memory, its pages faulted in."""
    storage = torch.UntypedStorage._new_shared(nbytes)
    populate_pages(torch.empty(0, dtype=torch.uint8).set_(storage))
    return storage


def layout(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of a batch's tensors in one buffer (after the flag, each on its own cache line) and the
    buffer's size."""
    offsets, end = [], ALIGN_BYTES
    for shape, dtype in specs:
        offsets.append(end)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        end += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, end


class BatchSlots:
    """A loader worker's reusable shared-memory batch buffers: `count` at most, allocated as batches need them.

    A `BatchSlots` built in the main process and handed to the workers (the collate function holds it) is
    copied into each worker empty, and fills there (rule 3)."""

    def __init__(self, count: int = BATCH_SLOTS) -> None:
        self.count = count
        self._owner = os.getpid()
        self._storages: list[torch.UntypedStorage] = []

    def __getstate__(self) -> dict:
        return {"count": self.count}  # rule 3: a spawned worker starts with no slots

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["count"])

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A free slot of at least `nbytes`, now busy; a new one while fewer than `count` exist; None when
        all are busy (rule 2)."""
        if self._owner != os.getpid():  # rule 3: copied into a forked worker, the parent's slots are not ours
            self._owner, self._storages = os.getpid(), []
        for index, storage in enumerate(self._storages):
            if storage[FLAG_BYTE] == FREE:
                if storage.nbytes() < nbytes:  # outgrown (a larger batch): replaced; the main process holds none of it
                    storage = self._storages[index] = fresh_storage(nbytes)
                storage[FLAG_BYTE] = BUSY  # rule 1
                return storage
        if len(self._storages) < self.count:
            storage = fresh_storage(nbytes)
            storage[FLAG_BYTE] = BUSY
            self._storages.append(storage)
            return storage
        return None


def worker_batch(specs: Sequence[tuple[Sequence[int], torch.dtype]], slots: BatchSlots | None
                 ) -> tuple[list[torch.Tensor], bool]:
    """Empty tensors of the given shapes and dtypes for one batch in a loader worker, in one shared-memory
    buffer: a free slot of `slots`, else fresh memory (rule 2). Also whether they occupy a slot, which the
    main process must free once it has copied them (`free_slot`)."""
    offsets, nbytes = layout(specs)
    storage = slots.take(nbytes) if slots is not None else None
    in_slot = storage is not None
    if storage is None:
        storage = fresh_storage(nbytes)
    tensors = [torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, tuple(shape))
               for (shape, dtype), offset in zip(specs, offsets, strict=True)]
    return tensors, in_slot


def free_slot(tensor: torch.Tensor) -> None:
    """Free the slot that holds `tensor` (rule 1: call it after every copy of the batch has returned)."""
    tensor.untyped_storage()[FLAG_BYTE] = FREE


def shared_memory_free_bytes(folder: Path = SHARED_MEMORY) -> int | None:
    """What `folder` (the shared-memory file system) has free; None where there is none to ask (macOS,
    Windows)."""
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize
