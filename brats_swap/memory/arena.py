"""One host buffer that holds every swapped storage of a step, allocated once and reused every step.

Why our own arena instead of `torch.empty(..., pin_memory=True)` per tensor: PyTorch's caching host
allocator rounds every pinned request up to a power of two (a 453 MB activation takes 512 MB), each new
`cudaHostAlloc` costs milliseconds under a global driver lock, and freeing pinned memory synchronizes the
device (reference/swap.md §6.6). A bump allocator over one slab avoids all three.

Sizing: the first step runs with whatever capacity exists and spills into extra chunks when it needs
more; the next `reset` replaces everything by one slab of the largest step seen so far (plus a margin).
After the first step the arena therefore never grows again for a fixed model and input size.
Pinned slabs come from PyTorch's caching host allocator (`pin_memory=True`), which rounds the one slab
up to a power of two; that is paid once, not per tensor.
"""

from __future__ import annotations

import torch

ALIGN = 512  # bytes; keeps every slice aligned for fast DMA and for any dtype view


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostArena:
    """Bump allocator of uint8 slices over host slabs (pinned when `pin` is true, i.e. CUDA training)."""

    def __init__(self, initial_bytes: int = 0, pin: bool = False, margin: float = 0.05):
        self.pin = pin
        self.margin = margin
        self._slabs: list[torch.Tensor] = []
        self._slab_index = 0
        self._offset = 0
        self._step_bytes = 0
        self._largest_step = 0
        if initial_bytes > 0:
            self._slabs.append(self._new_slab(_align(initial_bytes)))

    @property
    def capacity(self) -> int:
        return sum(slab.numel() for slab in self._slabs)

    @property
    def used(self) -> int:
        return self._step_bytes

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 slice of `nbytes` valid until the next `reset`."""
        size = _align(max(nbytes, 1))
        while self._slab_index < len(self._slabs):
            slab = self._slabs[self._slab_index]
            if self._offset + size <= slab.numel():
                out = slab[self._offset:self._offset + nbytes]
                self._offset += size
                self._step_bytes += size
                return out
            self._slab_index += 1
            self._offset = 0
        # Spill: a chunk for this request (and some room after it); merged into one slab at `reset`.
        slab = self._new_slab(max(size, _align(int(self._step_bytes * 0.25))))
        self._slabs.append(slab)
        self._slab_index = len(self._slabs) - 1
        self._offset = size
        self._step_bytes += size
        return slab[:nbytes]

    def reset(self) -> None:
        """Forget every slice (the caller guarantees no copy still reads or writes them)."""
        self._largest_step = max(self._largest_step, self._step_bytes)
        if len(self._slabs) > 1:
            # More than one chunk: the previous capacity was too small. Replace it by one slab, freeing
            # the old chunks first so host memory never holds both.
            self._slabs = []
            self._slabs = [self._new_slab(_align(int(self._largest_step * (1 + self.margin))))]
        self._slab_index = 0
        self._offset = 0
        self._step_bytes = 0
