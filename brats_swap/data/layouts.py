"""Dataset folders described by a `dataset.json`: nnU-Net's raw layout and the Decathlon's Task01.

- nnU-Net v2 (and v1) raw: `Dataset<NNN>_<Name>/{imagesTr,labelsTr,imagesTs}/`, one file per channel
  `<case>_<NNNN><file_ending>` (channel NNNN of `channel_names`, v1: `modality`), the labels as
  `labelsTr/<case><file_ending>`. `labels` maps names to values, or to several values for a region
  (nnU-Net's BraTS 2021 conversion declares only regions: `"whole tumor": [1, 2, 3]`, `"tumor core": [2, 3]`,
  `"enhancing tumor": [3]`, i.e. 1 edema, 2 necrosis, 3 enhancing). A `dataset` entry listing each case's
  files is honoured too.
- Medical Segmentation Decathlon (MONAI's tutorials download Task01_BrainTumour): `imagesTr/<case>.nii.gz`
  holds all channels as one 4D image (`modality`: FLAIR, T1w, T1gd, T2w), `labels` maps values to names
  (1 edema, 2 non-enhancing tumour, 3 enhancing tumour), `training` / `test` list the files.

The channels are matched to the canonical modalities by their names (`CHANNEL_NAMES`), the label values to
a label table by the meaning of their names (`challenges.label_map_from_names`), never by which values a
file happens to hold. `brats_swap.data.discovery` turns what this module reads into cases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.data.challenges import ChallengeSpec, label_map_from_names
from brats_swap.errors import BratsSwapError, DataError
from brats_swap.foreign_files import parse_json, read_text
from brats_swap.names import checked_name, relative_path_inside

DATASET_JSON = "dataset.json"
# The largest label value a dataset.json may declare: any integer type a segmentation is stored in holds it;
# beyond it a value is a damaged or hostile file, not a label.
MAX_LABEL_VALUE = 2**31 - 1
LAYOUT_FOLDERS = ("imagesTr", "labelsTr", "imagesTs")
# Channel names datasets use (compared lower case, without spaces, "-" or "_"), per canonical modality.
CHANNEL_NAMES: dict[str, tuple[str, ...]] = {
    "t1": ("t1", "t1w", "t1n", "t1native", "nativet1"),
    "t1ce": ("t1ce", "t1c", "t1gd", "t1wgd", "t1gad", "t1contrast", "t1post", "t1wce", "t1wc"),
    "t2": ("t2", "t2w"),
    "flair": ("flair", "t2f", "t2flair", "t2wflair"),
}
MODERN_CHANNELS = ("t1n", "t1c", "t2f")  # spellings only the 2023+ releases use (the Decathlon says T2w too)


@dataclass
class LayoutCase:
    """One case of a layout: its channel files (or one 4D file) and its label file."""

    case_id: str
    images: dict[str, Path]  # canonical modality -> file (an MSD case: the same 4D file for every modality)
    seg: Path | None
    channels: dict[str, int] = field(default_factory=dict)  # modality -> index in the 4D file (MSD only)


@dataclass
class Layout:
    """What a folder's dataset.json says: its kind, channels, declared labels and cases."""

    kind: str  # "nnunet" or "msd"
    description: Path  # the dataset.json
    modalities: dict[int, str]  # channel index -> canonical modality
    labels: dict[str, tuple[int, ...]]  # declared name -> file values (a region: several)
    file_ending: str
    modern_names: bool  # channels named as the 2023+ releases name them (t1n, t1c, t2w, t2f)
    cases: list[LayoutCase]

    def label_map(self, spec: ChallengeSpec) -> dict[int, int | None]:
        """File value -> value of `spec`'s table, by the declared meaning of each value."""
        return label_map_from_names(spec, self.labels, f"{self.description}: labels")


def find_layout(folder: Path) -> Layout | None:
    """The layout of `folder` when it holds a dataset.json next to imagesTr/ or imagesTs/; None for a
    BraTS-named folder. DataError when imagesTr/ or labelsTr/ is there without a dataset.json (channel order
    and label meaning unknown), or the dataset.json cannot be read."""
    if folder.name in LAYOUT_FOLDERS and (folder.parent / DATASET_JSON).is_file():
        raise DataError(f"{folder}: part of the dataset {folder.parent}; give that folder (the one with "
                        f"{DATASET_JSON}), so the channels and labels are read by its meaning")
    has_folders = [name for name in LAYOUT_FOLDERS if (folder / name).is_dir()]
    description = folder / DATASET_JSON
    if not has_folders:
        return None
    if not description.is_file():
        raise DataError(f"{folder}: {has_folders[0]}/ without a {DATASET_JSON}: the channel order and the meaning "
                        f"of the label values cannot be known; put the dataset's {DATASET_JSON} in {folder}")
    meta = read_json_object(description)
    names = meta.get("channel_names", meta.get("modality"))
    if not isinstance(names, dict) or not names:
        raise DataError(f"{description}: no channel_names (nnU-Net v2) or modality (Decathlon) entry")
    modalities = channel_modalities(description, names)
    labels = declared_labels(description, meta.get("labels"))
    file_ending = str(meta.get("file_ending", ".nii.gz"))
    modern = modern_channel_names(names)
    cases = _cases(folder, description, meta, modalities, file_ending)
    kind = "msd" if any(case.channels for case in cases) else "nnunet"
    return Layout(kind, description, modalities, labels, file_ending, modern, cases)


def modern_channel_names(names: dict) -> bool:
    """Whether channel names are spelled as only the 2023+ releases spell them (t1n, t1c, t2f)."""
    return any(_squash(name) in MODERN_CHANNELS for name in names.values())


def _squash(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", str(name).lower())


def channel_modalities(description: Path, names: dict) -> dict[int, str]:
    known = {spelling: modality for modality, spellings in CHANNEL_NAMES.items() for spelling in spellings}
    modalities: dict[int, str] = {}
    for index, name in sorted(_numbered_channels(description, names).items()):
        modality = known.get(_squash(name))
        if modality is None:
            raise DataError(f"{description}: channel {index} {name!r} is none of T1, T1ce/T1Gd, T2, FLAIR (or "
                            f"t1n, t1c, t2w, t2f); rename it in the channel names")
        if modality in modalities.values():
            raise DataError(f"{description}: two channels are {modality} ({name!r} and another)")
        modalities[index] = modality
    return modalities


def _numbered_channels(description: Path, names: dict) -> dict[int, object]:
    """Channel index -> name; DataError naming the key when a key is not a channel number ("0", "1", ...)."""
    numbered = {}
    for key, name in names.items():
        if not str(key).strip().isdecimal():
            raise DataError(f"{description}: channel key {key!r} is not a channel number (expected \"0\", \"1\", ...)")
        numbered[int(key)] = name
    return numbered


def declared_labels(description: Path, labels) -> dict[str, tuple[int, ...]]:
    """{name: values} from nnU-Net v2's {name: value | [values]} or the Decathlon's {"value": name}."""
    if not isinstance(labels, dict) or not labels:
        raise DataError(f"{description}: no labels entry, so the meaning of the label values cannot be known")
    declared: dict[str, tuple[int, ...]] = {}
    try:
        if all(str(key).strip().isdigit() for key in labels):  # Decathlon / nnU-Net v1: value -> name
            for value, name in labels.items():
                declared.setdefault(str(name), ())
                declared[str(name)] += (int(value),)
        else:
            for name, values in labels.items():
                declared[str(name)] = tuple(int(v) for v in (values if isinstance(values, list | tuple) else [values]))
    except (TypeError, ValueError, OverflowError) as exc:
        raise DataError(f"{description}: labels: expected integer values ({exc})") from exc
    beyond = [v for values in declared.values() for v in values if not 0 <= v <= MAX_LABEL_VALUE]
    if beyond:
        raise DataError(f"{description}: labels: value {beyond[0]} outside 0..{MAX_LABEL_VALUE}, the values a "
                        "segmentation file can hold as labels")
    return declared


def _cases(folder: Path, description: Path, meta: dict, modalities: dict[int, str],
           file_ending: str) -> list[LayoutCase]:
    if isinstance(meta.get("dataset"), dict):  # nnU-Net v2: each case's files listed
        return [_listed_case(folder, description, checked_name(case_id, "dataset entry", description), entry,
                             modalities) for case_id, entry in sorted(meta["dataset"].items())]
    cases: dict[str, LayoutCase] = {}
    for images, labels in (("imagesTr", "labelsTr"), ("imagesTs", None)):
        for case in _folder_cases(folder, images, labels, modalities, file_ending):
            if case.case_id in cases:
                raise DataError(f"case {case.case_id}: in both imagesTr/ and imagesTs/ of {folder}")
            cases[case.case_id] = case
    if not cases:
        raise DataError(f"{folder}: no {file_ending} images in imagesTr/ or imagesTs/")
    return [cases[case_id] for case_id in sorted(cases)]


def _folder_cases(folder: Path, images: str, labels: str | None, modalities: dict[int, str],
                  file_ending: str) -> list[LayoutCase]:
    """The cases of one images folder: `<case>_<NNNN>` channel files, or one 4D `<case>` file each."""
    image_dir = folder / images
    if not image_dir.is_dir():
        return []
    files = sorted(p for p in image_dir.iterdir() if p.name.endswith(file_ending) and not p.name.startswith("."))
    split: dict[str, dict[str, Path]] = {}
    whole: dict[str, Path] = {}
    for path in files:
        stem = path.name[: -len(file_ending)]
        match = re.fullmatch(r"(.+)_(\d{4})", stem)
        if match and int(match.group(2)) in modalities:
            split.setdefault(match.group(1), {})[modalities[int(match.group(2))]] = path
        else:
            whole[stem] = path
    cases = []
    for case_id in sorted({*split, *whole}):
        checked_name(case_id, "case id (from its file names)", image_dir)
        seg = folder / labels / f"{case_id}{file_ending}" if labels else None
        seg = seg if seg is not None and seg.is_file() else None
        if case_id in split:
            cases.append(LayoutCase(case_id, split[case_id], seg))
        else:  # the Decathlon: one 4D image holding every channel
            path = whole[case_id]
            cases.append(LayoutCase(case_id, {m: path for m in modalities.values()}, seg,
                                    channels={m: i for i, m in modalities.items()}))
    return cases


def _listed_case(folder: Path, description: Path, case_id: str, entry, modalities: dict[int, str]) -> LayoutCase:
    """A case of nnU-Net v2's `dataset` entry: {"images": [one path per channel], "label": path}."""
    if not isinstance(entry, dict) or not isinstance(entry.get("images"), list):
        raise DataError(f"{description}: dataset entry {case_id!r}: expected images (a list) and a label")
    if len(entry["images"]) != len(modalities):
        raise DataError(f"{description}: dataset entry {case_id!r}: {len(entry['images'])} images for "
                        f"{len(modalities)} channels")
    where = f"dataset entry {case_id!r}"
    images = {modalities[index]: relative_path_inside(folder, path, f"{where}: image", description)
              for index, path in zip(sorted(modalities), entry["images"], strict=True)}  # in channel order
    seg = entry.get("label")
    return LayoutCase(case_id, images, relative_path_inside(folder, seg, f"{where}: label", description) if seg else None)


def read_json_object(path: Path, error: type[BratsSwapError] = DataError) -> dict:
    """A JSON file that must hold an object (`dataset.json`, nnU-Net's `plans.json`); `error` (one line naming
    the file) when it cannot be read, is not JSON or holds something else."""
    record = parse_json(read_text(path, error, what="JSON file"), str(path), error)
    if not isinstance(record, dict):
        raise error(f"{path}: expected a JSON object, got {type(record).__name__}")
    return record
