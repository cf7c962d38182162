"""One host buffer for every storage a step swaps out, sized from the plan, reused every step.

Why our own arena instead of `torch.empty(..., pin_memory=True)` per tensor (or per slab): PyTorch's
caching host allocator rounds every pinned request up to a power of two and caches what is freed, so a
swap-all step at 192³ batch 2 (24.4 GiB swapped) ends up holding about 73 GiB pinned; each new
`cudaHostAlloc` also costs milliseconds under a global driver lock, and freeing pinned memory
synchronizes the device. Here one slab of exactly the step's swapped bytes (every slice rounded up to
512 bytes, for DMA and for any dtype view) is allocated as ordinary host memory and page-locked with
`cudaHostRegister`, which pins exactly the pages asked for. A bump allocator hands out slices.

Sizing:
- from the plan: `HostArena(capacity_bytes=arena_bytes(...))` with the swapped storages' sizes the
  planner predicts (they equal what the engine swaps, byte for byte): one slab, allocated before
  training starts, never grown;
- without a plan: the first step places each swapped storage in a chunk of its own (exact size), and the
  next `reset` replaces the chunks by one slab of the largest step seen (freeing the chunks first, so
  host memory never holds both). A later step that swaps more grows the slab once more the same way.
Either way the pinned bytes stay within 1.2x of a step's swapped bytes (the slice rounding only).

Host memory is checked before each slab or chunk is allocated (`check_host_memory`): an arena larger
than the host's available memory is a one-line `ConfigError` instead of a swapping, then killed, host.
Several processes on one host (DDP ranks) each hold an arena: whoever sizes them checks the host for
all of them at once, before any allocates (`check_host_memory(..., ranks=N)`).
`close()` unregisters and frees everything (after the link's copies have finished); an arena dropped
without `close()` unregisters its slabs when they are collected (a finalizer per slab).

Page-locking goes through a `Registrar` (`CudaRegistrar` by default; tests inject their own). It
registers with `cudaHostRegisterPortable`, as torch's own pinning does, so the pages count as pinned for
every CUDA context; a failed registration clears CUDA's per-thread last error before raising, or an
unrelated kernel launch later would report it.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch

from brats_swap.config import ConfigError
from brats_swap.config.host import available_host_bytes
from brats_swap.memory.budget import GIB

ALIGN = 512  # bytes; keeps every slice aligned for fast DMA and for any dtype view
PAGE = 4096  # page-locking works on whole pages; a pinned slab owns every page it touches
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context (torch pins this way)


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def arena_bytes(storage_bytes: Iterable[int]) -> int:
    """Capacity that holds the swapped storages of one step exactly (each slice aligned as `alloc` does)."""
    return sum(_align(max(int(n), 1)) for n in storage_bytes)


def check_host_memory(nbytes: int, available: int | None = None, ranks: int = 1) -> None:
    """Raise a one-line `ConfigError` when the host cannot hold `nbytes` more of swapped activations for
    each of `ranks` processes (DDP ranks on this host, each with an arena of `nbytes`)."""
    available = available_host_bytes() if available is None else available
    needed = nbytes * max(int(ranks), 1)
    if available is not None and needed > available:
        each = f" ({ranks} ranks on this host, {nbytes / GIB:.2f} GiB each)" if ranks > 1 else ""
        raise ConfigError(
            f"memory.swap: the host arena needs {needed / GIB:.2f} GiB for one step's swapped activations{each} "
            f"but the host has {available / GIB:.2f} GiB available; swap less (memory.swap.tensors, "
            "memory.swap.exclude), recompute instead (memory.mode=recompute), or free host memory")



def empty_unfilled(*size, **kwargs) -> torch.Tensor:
    """`torch.empty` as it is without deterministic algorithms: never filled. Under
    `torch.use_deterministic_algorithms(True)` torch fills every new tensor (NaN for floats,
    `torch.utils.deterministic.fill_uninitialized_memory`), a full write of each of the engine's buffers (the
    arena, reload and staging buffers) that the copy into it then overwrites whole: bandwidth on the step's
    path, and for the pinned arena a pass over tens of GiB. The flag is global, so it is lifted for the one
    call only."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        return torch.empty(*size, **kwargs)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        return torch.empty(*size, **kwargs)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True

class Registrar(Protocol):
    """Page-locks host memory for the device (module docstring)."""

    def register(self, address: int, nbytes: int) -> int:
        """Page-lock `nbytes` at `address`; 0 on success, else the CUDA error code."""

    def unregister(self, address: int) -> None:
        """Undo `register`."""

    def clear_error(self) -> None:
        """Reset CUDA's last error after a failed call."""


def _cudart_library():
    """The CUDA runtime this process loaded (torch loads it), for the one call torch does not expose."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "libcudart.so" in os.path.basename(path):
                return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


class CudaRegistrar:
    """`cudaHostRegister` through torch's CUDA runtime bindings."""

    def register(self, address: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    def clear_error(self) -> None:
        cudart = torch.cuda.cudart()
        get_last_error = getattr(cudart, "cudaGetLastError", None) or _cudart_library().cudaGetLastError
        get_last_error()


def _unregister(registrar: Registrar, address: int, block: torch.Tensor) -> None:
    """A slab's finalizer: unpin before the block (held here until then) returns to the host allocator."""
    registrar.unregister(address)
    del block


class _Slab:
    """`nbytes` of host memory, page-locked by `registrar` when given (module docstring)."""

    def __init__(self, nbytes: int, registrar: Registrar | None):
        self.nbytes = nbytes
        # Pinned: register whole pages that belong to this block alone (a page shared with a neighbouring
        # allocation could be registered twice, which CUDA refuses). Otherwise slices need ALIGN only.
        boundary = PAGE if registrar is not None else ALIGN
        self._block = empty_unfilled(nbytes + 2 * boundary, dtype=torch.uint8)
        start = _align(self._block.data_ptr(), boundary) - self._block.data_ptr()
        self.data = self._block[start:start + nbytes]
        self._unpin = None
        if registrar is None:
            return
        address = self.data.data_ptr()
        error = registrar.register(address, _align(nbytes, PAGE))
        if error != 0:
            registrar.clear_error()
            raise RuntimeError(f"host arena: cudaHostRegister of {nbytes} bytes failed with CUDA error {error}")
        self._unpin = weakref.finalize(self, _unregister, registrar, address, self._block)

    @property
    def pinned(self) -> bool:
        return self._unpin is not None and self._unpin.alive

    def free(self) -> None:
        if self._unpin is not None:
            self._unpin()
        self.data = self._block = None


class HostArena:
    """Bump allocator of uint8 slices over host memory (page-locked when `pin` is true: CUDA training)."""

    def __init__(self, capacity_bytes: int = 0, pin: bool = False, registrar: Registrar | None = None):
        self.pin = pin
        self.registrar = (registrar or CudaRegistrar()) if pin else None
        self._slabs: list[_Slab] = []
        self._slab_index = 0
        self._offset = 0
        self._step_bytes = 0
        self._largest_step = 0
        self.peak_capacity = 0  # most host bytes this arena ever held at once
        if capacity_bytes > 0:
            self._add_slab(_align(capacity_bytes))

    @property
    def capacity(self) -> int:
        """Host bytes held now."""
        return sum(slab.nbytes for slab in self._slabs)

    @property
    def pinned_bytes(self) -> int:
        return sum(slab.nbytes for slab in self._slabs if slab.pinned)

    @property
    def used(self) -> int:
        """Bytes handed out since the last `reset` (slices rounded to `ALIGN`)."""
        return self._step_bytes

    def _add_slab(self, nbytes: int) -> _Slab:
        check_host_memory(nbytes)
        slab = _Slab(nbytes, self.registrar)
        self._slabs.append(slab)
        self.peak_capacity = max(self.peak_capacity, self.capacity)
        return slab

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 slice of `nbytes`, valid until the next `reset`."""
        size = _align(max(nbytes, 1))
        while self._slab_index < len(self._slabs):
            slab = self._slabs[self._slab_index]
            if self._offset + size <= slab.nbytes:
                out = slab.data[self._offset:self._offset + nbytes]
                self._offset += size
                self._step_bytes += size
                return out
            self._slab_index += 1
            self._offset = 0
        # Past the capacity (no plan, or a step that swaps more than planned): a chunk of exactly this
        # size, merged with the rest into one slab at the next `reset`.
        slab = self._add_slab(size)
        self._slab_index = len(self._slabs) - 1
        self._offset = size
        self._step_bytes += size
        return slab.data[:nbytes]

    @property
    def spilled(self) -> bool:
        """The last step spilled past the capacity: the next `reset` frees slabs (copies must be done)."""
        return len(self._slabs) > 1

    def reset(self) -> None:
        """Forget every slice; the caller guarantees no copy still reads or writes them."""
        self._largest_step = max(self._largest_step, self._step_bytes)
        if len(self._slabs) > 1:
            # The step spilled past the capacity: one slab of the largest step replaces the chunks,
            # freed first so that host memory never holds both.
            self._free_all()
            self._add_slab(self._largest_step)
        self._slab_index = 0
        self._offset = 0
        self._step_bytes = 0

    def _free_all(self) -> None:
        for slab in self._slabs:
            slab.free()
        self._slabs = []

    def close(self) -> None:
        """Return every byte to the host (the caller guarantees no copy is still in flight)."""
        self._free_all()
        self._slab_index = self._offset = self._step_bytes = 0
