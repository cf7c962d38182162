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

A model trained on regions (`model.outputs: regions`) is trained by nnU-Net on a region dataset, whose
preprocessing samples per REGION instead (`label_manager.foreground_regions`): the same rule, one
`RandomState(1234)` for the case, over the regions in the dataset's order, a region present when any of its
labels is, its rows drawn from the union of its labels' voxels as nnU-Net orders it (the label blocks one after
the other in the region's label order, each block in C order). The cache stores that sample for the table's
default regions (`ChallengeSpec.regions`, largest first, as nnU-Net's BraTS dataset.json lists them; each
region's labels ascending) as `region_locations.npy`: the present regions' rows one after the other in region
order. meta.json's `region_locations` lists every region with its voxels and rows ([name, voxels, rows]; 0, 0
for a region the case lacks). Rows per region cannot be derived from the rows per label: nnU-Net draws from
the union, with its own random stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brats_swap.atomic import atomic_path
from brats_swap.data.challenges import get_challenge
from brats_swap.errors import DataError
from brats_swap.foreign_files import open_regular

LOCATIONS_FILE = "class_locations.npy"
META_KEY = "class_locations"  # meta.json: {"<label value>": [voxels in the cube, rows stored], ...}
REGIONS_FILE = "region_locations.npy"
REGIONS_KEY = "region_locations"  # meta.json: [[region name, voxels in the cube, rows stored], ...], region order
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
    """Per class (raw label value; for the rows per region, the region's position among the regions): the
    voxels it has in the cube and the sampled ones, (rows, 3) cube coordinates in nnU-Net's draw order."""

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
    values = [int(v) for v in np.flatnonzero(np.bincount(label.reshape(-1))) if v != 0]
    voxels, rows = _nnunet_sample(label, [(value,) for value in values], offset)
    return ClassLocations(dict(zip(values, voxels, strict=True)), dict(zip(values, rows, strict=True)))


def default_regions(edition: str) -> dict[str, tuple[int, ...]]:
    """The regions the cache samples per region for: the table's default regions in order (largest first,
    nnU-Net's order for BraTS), each with its label values ascending."""
    spec = get_challenge(edition)
    return {name: tuple(sorted(spec.groups[name])) for name in spec.regions}


def sample_region_locations(label: np.ndarray, regions: dict[str, tuple[int, ...]],
                            offset: tuple[int, ...] = (0, 0, 0)) -> tuple[list[list], ClassLocations]:
    """nnU-Net's sample of every region's voxels in `label` (`regions`: name -> label values, in nnU-Net's
    order; see the module docstring): what meta.json records ([name, voxels, rows] per region) and the present
    regions' locations keyed by their position in `regions` (the patch sampler draws among those)."""
    label = np.ascontiguousarray(label)
    voxels, rows = _nnunet_sample(label, list(regions.values()), offset)
    record = [[name, n, len(r)] for name, n, r in zip(regions, voxels, rows, strict=True)]
    present = [i for i, n in enumerate(voxels) if n]
    return record, ClassLocations({i: voxels[i] for i in present}, {i: rows[i] for i in present})


def _nnunet_sample(label: np.ndarray, groups: list[tuple[int, ...]], offset: tuple[int, ...]
                   ) -> tuple[list[int], list[np.ndarray]]:
    """nnU-Net's `_sample_foreground_locations` for `groups` (a label is a group of one value): one
    `RandomState(1234)`; per group in order, skipped without a draw when none of its labels is present, else
    max(min(10000, n), ceil(0.01 n)) of its n voxels drawn without replacement from its labels' voxels, label
    after label in the group's order, each label's voxels in C order (nnU-Net's stable sort of argwhere).
    Voxels per group, and the drawn rows (cube coordinates: + `offset`)."""
    flat_label = label.reshape(-1)
    counts = np.bincount(flat_label, minlength=256)
    rng = np.random.RandomState(NNUNET_SEED)
    where: dict[int, np.ndarray] = {}  # label value -> its flat indices, C order (computed once per value)
    voxels, rows = [], []
    for group in groups:
        present = [value for value in group if counts[value]]
        total = int(sum(counts[value] for value in present))
        if not total:
            voxels.append(0)
            rows.append(np.zeros((0, 3), LOCATION_DTYPE))
            continue
        picked = rng.choice(total, rows_for(total), replace=False)  # nnU-Net's call, in nnU-Net's group order
        for value in present:
            if value not in where:
                where[value] = np.flatnonzero(flat_label == value)
        union = where[present[0]] if len(present) == 1 else np.concatenate([where[v] for v in present])
        coords = np.stack(np.unravel_index(union[picked], label.shape), axis=1) + np.asarray(offset, dtype=np.int64)
        voxels.append(total)
        rows.append(coords.astype(LOCATION_DTYPE))
    return voxels, rows


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


def recorded_regions(meta: dict, regions: dict[str, tuple[int, ...]], labels: dict[int, tuple[int, int]],
                     where: str) -> dict[int, tuple[int, int]]:
    """meta.json's `region_locations` checked (a file someone else may have made) against the run's `regions`
    (name -> label values, in order) and the entry's checked per-label counts `labels` (`recorded_counts`):
    region position -> (voxels, rows) for the regions present. Every region is listed once, in order, with as
    many voxels as its labels have together and rows by nnU-Net's rule, so the file is bounded before it is
    read. DataError naming `where`: damaged (one line), or holding other regions than the run's."""
    recorded = meta.get(REGIONS_KEY)
    ok = isinstance(recorded, list) and all(
        isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
        and all(type(v) is int for v in item[1:]) for item in recorded)
    if ok and [item[0] for item in recorded] != list(regions):
        stored = ", ".join(item[0][:20] for item in recorded[:10]) or "none"
        raise DataError(f"{where}: the cache stores region locations for {stored} (the table's default regions), "
                        f"not for this run's regions {', '.join(regions)} (model.regions), which patches per region "
                        "(train.patch_foreground: nnunet) need; train the default regions, or set "
                        "train.patch_foreground to a number")
    problem = None if ok else f"{REGIONS_KEY} is not a list of [region, voxels, rows]"
    for position, (name, values) in enumerate(regions.items()):
        if problem is not None:
            break
        _, voxels, rows = recorded[position]
        if voxels != sum(labels.get(value, (0, 0))[0] for value in values) or rows != rows_for(voxels):
            problem = f"{REGIONS_KEY} entry {name!r}: {recorded[position]!r} does not match its labels' counts"
    if problem is not None:
        raise DataError(f"{where}: meta.json {problem}; prepare the case again (`brats-swap data prepare`)")
    return {position: (item[1], item[2]) for position, item in enumerate(recorded) if item[1]}


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
