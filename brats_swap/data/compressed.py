"""The cache's arrays on disk: the part of a prepared cube that holds data, compressed with blosc2, read back
padded to the cube.

nnU-Net v2 stores its preprocessed cases the same way (blosc2 `.b2nd` files with chunk and block shapes sized
to its patch), so a patch read decompresses only the chunks it touches. Here:

- What is stored is the cube's *content box*: the smallest box holding every non-zero voxel of any channel
  and of the label (`content_box`). With `data.fit=pad_crop` that is the brain's box inside the zero-padded
  cube; with `resample` the brain box already fills the cube, so the box is (almost) the whole cube and the
  saving comes from compression. Outside the box the cube is zero, which is what a read puts there.
- Codec ZSTD level 3 with byte shuffle (nnU-Net v2 uses ZSTD too; level 3 compresses the float16 images as
  well as level 8 within 1% and writes several times faster, scripts/bench_scale.py).
- Chunks: the channel axis 1 (a sample reads every channel, but a channel per chunk keeps chunks small);
  each spatial axis cut into equal parts of at most `CHUNK_EDGE` voxels, so a 128³ patch touches at most 3
  chunks per axis and a whole cube reads each chunk once, with no chunk padded beyond the array.
  Blocks (blosc2's unit of decompression inside a chunk): the chunk halved along its longest axes until
  a block is at most `BLOCK_BYTES`, as nnU-Net caps its blocks.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

CHUNK_EDGE = 64
BLOCK_BYTES = 64 * 1024
CLEVEL = 3


def content_box(image: np.ndarray, label: np.ndarray | None) -> list[list[int]]:
    """[[start, stop]] per spatial axis of the voxels non-zero in any channel of `image` (C, D, H, W) or in
    `label`; an all-zero case keeps a 1-voxel box so every stored array has a shape."""
    mask = np.any(image != 0, axis=0)
    if label is not None:
        mask |= label != 0
    box = []
    for axis in range(3):
        hits = np.flatnonzero(mask.any(axis=tuple(a for a in range(3) if a != axis)))
        box.append([int(hits[0]), int(hits[-1]) + 1] if hits.size else [0, 1])
    return box


def chunk_and_block_shapes(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunk and block shapes (see the module docstring) for an array whose last three axes are spatial."""
    lead = (1,) * (len(shape) - 3)
    chunk = [math.ceil(size / math.ceil(size / CHUNK_EDGE)) for size in shape[-3:]]
    block = list(chunk)
    while math.prod(block) * itemsize > BLOCK_BYTES and max(block) > 1:
        axis = block.index(max(block))
        block[axis] = math.ceil(block[axis] / 2)
    return (*lead, *chunk), (*lead, *block)


def write_volume(path: Path, array: np.ndarray) -> None:
    """Compress `array` into the blosc2 file `path` (written whole; the caller's temp folder makes it atomic)."""
    import blosc2  # here, not at module level: `data check` and the CLI's start never load it

    array = np.ascontiguousarray(array)
    chunks, blocks = chunk_and_block_shapes(array.shape, array.itemsize)
    cparams = blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=CLEVEL, filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    blosc2.asarray(array, urlpath=os.fspath(path), mode="w", chunks=chunks, blocks=blocks, cparams=cparams)


class CachedVolume:
    """A stored content box seen as the whole cube: `shape` and `dtype` of the cube, basic slicing (`[...]` with
    slices of step 1) decompresses only the chunks the slice touches and returns a numpy array with zeros
    outside the box; `np.asarray(volume)` gives the whole cube. Read-only; opened lazily, so it pickles as paths.
    """

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype, box: list[list[int]]) -> None:
        self.path, self.shape, self.dtype = Path(path), tuple(int(s) for s in shape), np.dtype(dtype)
        self.box = [(int(a), int(b)) for a, b in box]
        self._array = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _stored(self):
        if self._array is None:
            import blosc2

            blosc2.set_nthreads(1)  # a loader worker is one core; blosc2's own threads would oversubscribe
            self._array = blosc2.open(os.fspath(self.path), mode="r")
        return self._array

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": None}

    def __getitem__(self, key) -> np.ndarray:
        slices = _basic_slices(key, self.shape)
        out = np.empty(tuple(s.stop - s.start for s in slices), dtype=self.dtype)
        self.read_into(out, slices)
        return out

    def read_into(self, out: np.ndarray, slices: tuple[slice, ...] | None = None) -> None:
        """Write the cube's `slices` (default: all of it) into `out` (of their shape): zeros outside the box."""
        slices = slices if slices is not None else tuple(slice(0, s) for s in self.shape)
        lead = len(self.shape) - 3
        src, dst = [], []
        for axis, s in enumerate(slices):
            low, high = (0, self.shape[axis]) if axis < lead else self.box[axis - lead]
            start, stop = max(s.start, low), min(s.stop, high)
            if stop <= start:
                out[...] = 0
                return
            src.append(slice(start - low, stop - low))
            dst.append(slice(start - s.start, stop - s.start))
        if not _covers(dst, out.shape):
            out[...] = 0
        out[tuple(dst)] = self._stored()[tuple(src)]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"CachedVolume({self.path}, shape={self.shape}, dtype={self.dtype}, box={self.box})"


def _covers(dst: list[slice], shape: tuple[int, ...]) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(dst, shape, strict=True))


def _basic_slices(key, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`key` ((...), slices of step 1, or fewer than ndim of them) as one in-bounds slice per axis."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = (*key[:at], *(slice(None),) * (len(shape) - len(key) + 1), *key[at + 1:])
    key = (*key, *(slice(None),) * (len(shape) - len(key)))
    slices = []
    for k, size in zip(key, shape, strict=True):
        if not isinstance(k, slice):
            raise TypeError(f"a cached volume reads slices only, got {k!r}")
        start, stop, step = k.indices(size)
        if step != 1:
            raise TypeError(f"a cached volume reads slices of step 1 only, got {k!r}")
        slices.append(slice(start, max(start, stop)))
    return tuple(slices)
