"""The cache's arrays on disk: the part of a prepared cube that holds data, compressed with blosc2, read back
padded to the cube.

nnU-Net v2 stores its preprocessed cases the same way (blosc2 `.b2nd` files with chunk and block shapes sized
to its patch), so a patch read decompresses only the chunks it touches. Here:

- What is stored is the cube's *content box*: the smallest box holding every non-zero voxel of any channel
  and of the label (`content_box`). With `data.fit=pad_crop` that is the brain's box inside the zero-padded
  cube; with `resample` the brain box already fills the cube, so the box is (almost) the whole cube and the
  saving comes from compression. Outside the box the cube is zero, which is what a read puts there.
- Codec ZSTD level 1 with byte shuffle (nnU-Net v2 uses ZSTD too). On a 240×240×155 phantom prepared to
  192³ float16 (one case, one core), level 1 stored 22.3 MB in 0.44 s, level 3 21.8 MB in 1.27 s, level 8
  22.0 MB in 3.8 s, all decompressing at the same speed; LZ4 decompressed faster (0.03 s against 0.05 s)
  but stored 24-28 MB, too close to the 25 MB goal. `prepare` compresses every case once: level 1.
- Chunks: the channel axis 1 (a sample reads every channel, but a channel per chunk keeps chunks small);
  each spatial axis cut into equal parts of at most `CHUNK_EDGE` voxels, so a 128³ patch touches at most 3
  chunks per axis and a whole cube reads each chunk once, with no chunk padded beyond the array.
  One block per chunk (blosc2's unit of decompression; 512 KiB for a float16 64³ chunk, where nnU-Net caps
  its blocks at 128 KiB): a chunk then decompresses straight to its C-order array, so a read decompresses
  each chunk it touches once into a small buffer and copies its part into place (`_read_chunks`), which
  makes a whole cube cost the decompression plus one copy (scripts/bench_scale.py).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import numpy as np

from brats_swap.errors import DataError

CHUNK_EDGE = 64
CLEVEL = 1


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


def chunk_and_block_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunk and block shapes (see the module docstring) for an array whose last three axes are spatial:
    one channel, each spatial axis cut into equal parts of at most `CHUNK_EDGE`; one block per chunk."""
    lead = (1,) * (len(shape) - 3)
    chunk = (*lead, *(math.ceil(size / math.ceil(size / CHUNK_EDGE)) for size in shape[-3:]))
    return chunk, chunk


def write_volume(path: Path, array: np.ndarray) -> None:
    """Compress `array` into the blosc2 file `path` (written whole; the caller's temp folder makes it atomic)."""
    import blosc2  # here, not at module level: `data check` and the CLI's start never load it

    array = np.ascontiguousarray(array)
    chunks, blocks = chunk_and_block_shapes(array.shape)
    cparams = blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=CLEVEL, filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    compressed = blosc2.asarray(array, chunks=chunks, blocks=blocks, cparams=cparams)
    # Compressed in memory, written by Python: blosc2's own file writer reports a full disk as a RuntimeError
    # without errno ("Error while creating the NDArray"); Python's write keeps the OSError (ENOSPC, EFBIG), which
    # the cache reports as a full disk. The frame is the same contiguous format `blosc2.open` reads.
    Path(path).write_bytes(compressed.to_cframe())


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
            stored = blosc2.open(os.fspath(self.path), mode="r")
            lead = len(self.shape) - 3
            expected = (*self.shape[:lead], *(b - a for a, b in self.box))
            if tuple(stored.shape) != expected or np.dtype(stored.dtype) != self.dtype:
                raise ValueError(f"holds {tuple(stored.shape)} {stored.dtype}, its meta.json says {expected} "
                                 f"{self.dtype}")
            self._array = stored
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
        _zero_outside(out, dst)
        try:
            _read_chunks(self._stored(), tuple(src), out[tuple(dst)])
        except (OSError, RuntimeError, ValueError) as exc:  # blosc2 says a damaged frame with a RuntimeError
            raise DataError(f"case {self.path.parent.name}: {self.path} is damaged or unreadable "
                            f"({' '.join(str(exc).split())[:200]}); prepare the case again (`brats-swap data "
                            "prepare`, or remove its folder from the cache)") from exc

    def window(self, key) -> CachedWindow:
        """`self[key]` not read yet: what a loader worker hands to the collate, which decompresses it straight
        into the batch (`read_into`) instead of into a temporary that is then copied."""
        return CachedWindow(self, _basic_slices(key, self.shape))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"CachedVolume({self.path}, shape={self.shape}, dtype={self.dtype}, box={self.box})"


class CachedWindow:
    """A block of a `CachedVolume` (`volume.window(key)`), read when asked: `read_into(out)`, `np.asarray`."""

    def __init__(self, volume: CachedVolume, slices: tuple[slice, ...]) -> None:
        self.volume, self.slices = volume, slices
        self.shape, self.dtype = tuple(s.stop - s.start for s in slices), volume.dtype

    def read_into(self, out: np.ndarray) -> None:
        self.volume.read_into(out, self.slices)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        block = self.volume[self.slices]
        return block if dtype is None else block.astype(dtype, copy=False)


def _read_chunks(stored, src: tuple[slice, ...], out: np.ndarray) -> None:
    """`stored[src]` decompressed straight into `out`, chunk by chunk: with one block per chunk a chunk
    decompresses to its C-order array (blosc2 orders blocks inside a chunk), so each touched chunk is
    decompressed once into a small buffer and its part copied into place, with no whole-array temporary
    (slicing the NDArray would allocate one and `out` would copy it again: 1.5x the time for a cube)."""
    chunks = tuple(stored.chunks)
    if tuple(stored.blocks) != chunks:  # written otherwise: blosc2's own slicing
        out[...] = stored[src]
        return
    grid = [-(-size // edge) for size, edge in zip(stored.shape, chunks, strict=True)]
    buffer = np.empty(chunks, dtype=stored.dtype)
    ranges = [range(s.start // edge, (s.stop - 1) // edge + 1) for s, edge in zip(src, chunks, strict=True)]
    for index in itertools.product(*ranges):
        stored.schunk.decompress_chunk(int(np.ravel_multi_index(index, grid)), buffer)
        inside, place = [], []
        for i, s, edge in zip(index, src, chunks, strict=True):
            start, stop = max(s.start, i * edge), min(s.stop, (i + 1) * edge)
            inside.append(slice(start - i * edge, stop - i * edge))
            place.append(slice(start - s.start, stop - s.start))
        out[tuple(place)] = buffer[tuple(inside)]


def _zero_outside(out: np.ndarray, dst: list[slice]) -> None:
    """Zeros in `out` outside the box `dst`: the slabs before and after it along each axis (not all of `out`,
    which would touch every byte of a cube twice)."""
    for axis, s in enumerate(dst):
        before = (slice(None),) * axis
        out[(*before, slice(0, s.start))] = 0
        out[(*before, slice(s.stop, None))] = 0


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
