"""Where each tumour class lies in a prepared cube: a sample of its voxels, drawn once per case at `prepare`.

A forced-foreground patch (`train.patch_foreground`) is centred on a voxel of a tumour class. Finding one
by scanning the label costs a whole 192³ label per sample (decompressed, then bincount and flatnonzero:
about 40 ms of the loader's 0.10 s budget). nnU-Net v2 samples the locations once per case in its
preprocessing (`DefaultPreprocessor._sample_foreground_locations`) and its loader draws a class, then one
of those voxels (`nnUNetDataLoader.get_bbox`). The cache does the same:

- The rule is nnU-Net's, reproduced exactly (tests/test_train_data.py compares with nnunetv2): one
  `np.random.RandomState(1234)` for the case; for every class present, in ascending label value,
  max(min(10000, n), ceil(0.01 n)) of its n voxels drawn without replacement from its voxels in C order.
  Classes are the raw non-zero label values of the case's table (nnU-Net's `foreground_labels`).
- Stored as `class_locations.npy` in the entry: uint16 (rows, 3) cube coordinates, the classes one after the
  other in ascending value, each in nnU-Net's draw order. meta.json's `class_locations` lists, per class, the
  voxels it has in the cube and the rows stored, which bounds the file before it is read (`read_locations`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brats_swap.atomic import atomic_path
from brats_swap.errors import DataError
from brats_swap.foreign_files import open_regular

LOCATIONS_FILE = "class_locations.npy"
META_KEY = "class_locations"  # meta.json: {"<label value>": [voxels in the cube, rows stored], ...}
# nnU-Net v2's constants (default_preprocessor.py, `_sample_foreground_locations`).
NNUNET_SEED = 1234
MIN_SAMPLES = 10000
MIN_COVERAGE = 0.01
LOCATION_DTYPE = np.dtype("<u2")  # a cube edge is at most 65535 voxels


def rows_for(voxels: int) -> int:
    """How many of a class's `voxels` nnU-Net keeps: max(min(10000, n), ceil(0.01 n))."""
    return max(min(MIN_SAMPLES, voxels), int(np.ceil(voxels * MIN_COVERAGE)))


@dataclass(frozen=True)
class ClassLocations:
    """Per class (raw label value): the voxels it has in the cube and the sampled ones, (rows, 3) cube
    coordinates in nnU-Net's draw order."""

    voxels: dict[int, int]
    rows: dict[int, np.ndarray]

    @property
    def classes(self) -> list[int]:
        """The classes present in the case, ascending."""
        return sorted(self.rows)

    def counts(self) -> dict[str, list[int]]:
        """What meta.json records (`META_KEY`)."""
        return {str(value): [self.voxels[value], len(self.rows[value])] for value in self.classes}


def sample_locations(label: np.ndarray, offset: tuple[int, ...] = (0, 0, 0)) -> ClassLocations:
    """nnU-Net's sample of every tumour class's voxels in `label` (see the module docstring), as coordinates
    plus `offset` (where `label` sits in the cube: the content box's corner)."""
    label = np.ascontiguousarray(label)
    counts = np.bincount(label.reshape(-1))
    rng = np.random.RandomState(NNUNET_SEED)
    voxels, rows = {}, {}
    for value in (int(v) for v in np.flatnonzero(counts) if v != 0):
        total = int(counts[value])
        picked = rng.choice(total, rows_for(total), replace=False)  # nnU-Net's call, in nnU-Net's class order
        flat = np.flatnonzero(label.reshape(-1) == value)[picked]  # C order: nnU-Net's stable sort of argwhere
        coords = np.stack(np.unravel_index(flat, label.shape), axis=1) + np.asarray(offset, dtype=np.int64)
        voxels[value], rows[value] = total, coords.astype(LOCATION_DTYPE)
    return ClassLocations(voxels, rows)


def write_locations(path: Path, locations: ClassLocations) -> None:
    """`locations` as the entry's .npy (the classes' rows one after the other), written atomically."""
    stacked = (np.concatenate([locations.rows[v] for v in locations.classes]) if locations.rows
               else np.zeros((0, 3), LOCATION_DTYPE))
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.save(handle, np.ascontiguousarray(stacked, dtype=LOCATION_DTYPE), allow_pickle=False)


def recorded_counts(meta: dict, cube: tuple[int, ...], where: str) -> dict[int, tuple[int, int]]:
    """meta.json's `class_locations` checked (a file someone else may have made): class -> (voxels, rows),
    ascending. Classes are label values 1..255, voxels fit in the cube together, rows follow nnU-Net's rule.
    DataError naming `where` otherwise."""
    recorded = meta.get(META_KEY)
    limit = math.prod(cube)
    problem = None
    if not isinstance(recorded, dict):
        problem = f"{META_KEY} is not a mapping"
    else:
        counts = {}
        for key, value in recorded.items():
            ok = (isinstance(key, str) and key.isdigit() and 1 <= int(key) <= 255 and isinstance(value, list)
                  and len(value) == 2 and all(type(v) is int for v in value) and 1 <= value[0] <= limit
                  and value[1] == rows_for(value[0]))
            if not ok:
                problem = f"{META_KEY} entry {key!r}: {value!r} is not [voxels, rows] of a label value"
                break
            counts[int(key)] = (value[0], value[1])
        if problem is None and sum(v for v, _ in counts.values()) > limit:
            problem = f"{META_KEY} counts more voxels than the cube {tuple(cube)} holds"
    if problem is not None:
        raise DataError(f"{where}: meta.json {problem}; prepare the case again (`brats-swap data prepare`)")
    return dict(sorted(counts.items()))


def read_locations(path: Path, counts: dict[int, tuple[int, int]], cube: tuple[int, ...]) -> ClassLocations:
    """The entry's .npy, checked against meta.json's `counts` (`recorded_counts`) before anything is
    allocated: its header must say exactly the rows meta.json lists, and every row must lie in the cube."""
    expected = (sum(rows for _, rows in counts.values()), 3)
    try:
        with open_regular(path, f"case {path.parent.name}: {path}") as handle:  # a FIFO would block a worker
            version = np.lib.format.read_magic(handle)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(handle)
            if shape != expected or fortran or dtype != LOCATION_DTYPE:
                raise ValueError(f"holds {shape} {dtype}, its meta.json says {expected} {LOCATION_DTYPE}")
            stacked = np.fromfile(handle, dtype=LOCATION_DTYPE, count=expected[0] * 3)
        if stacked.size != expected[0] * 3:
            raise ValueError("is shorter than its header says")
        stacked = stacked.reshape(expected)
        if expected[0] and (stacked >= np.asarray(cube, dtype=np.int64)).any():
            raise ValueError(f"holds a voxel outside the cube {tuple(cube)}")
    except (OSError, ValueError) as exc:
        raise DataError(f"case {path.parent.name}: {path} is damaged or unreadable ({exc}); prepare the case "
                        "again (`brats-swap data prepare`, or remove its folder from the cache)") from exc
    bounds = np.cumsum([0, *(rows for _, rows in counts.values())])
    return ClassLocations({v: voxels for v, (voxels, _) in counts.items()},
                          {v: stacked[a:b] for v, a, b in zip(counts, bounds[:-1], bounds[1:], strict=True)})
