"""The one table of BraTS editions: file-name suffixes per modality and the label convention.

Every label value and region definition in the project comes from here; nothing else may hard-code
"4 is enhancing tumour". Regions follow the BraTS definitions:
  WT (whole tumour)  = every tumour label
  TC (tumour core)   = WT minus edema
  ET (enhancing)     = the enhancing label
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

REGIONS: tuple[str, ...] = ("WT", "TC", "ET")

# The canonical modality names used in configs and tensors, in the default channel order.
CANONICAL_MODALITIES: tuple[str, ...] = ("t1", "t1ce", "t2", "flair")


@dataclass(frozen=True)
class EditionSpec:
    name: str
    labels: dict[int, str]  # value -> abbreviation, e.g. {1: "NCR/NET", 2: "ED", 4: "ET"}
    edema: int
    enhancing: int
    modality_suffixes: dict[str, str]  # canonical modality -> file-name suffix
    seg_suffix: str = "seg"
    alt_suffixes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # other spellings seen in releases
    seg_alt_suffixes: tuple[str, ...] = ()  # other names of the segmentation file seen in releases

    @property
    def label_values(self) -> tuple[int, ...]:
        return tuple(sorted(self.labels))

    @property
    def region_labels(self) -> dict[str, tuple[int, ...]]:
        tumour = self.label_values
        return {
            "WT": tumour,
            "TC": tuple(v for v in tumour if v != self.edema),
            "ET": (self.enhancing,),
        }


_LEGACY_LABELS = {1: "NCR/NET", 2: "ED", 4: "ET"}
_LEGACY_SUFFIXES = {"t1": "t1", "t1ce": "t1ce", "t2": "t2", "flair": "flair"}
# The TCIA 2017 release used by Ellis/IBM names the contrast-enhanced T1 "t1Gd".
_LEGACY_ALT = {"t1ce": ("t1Gd", "t1gd")}
# ... and its truth file "*_GlistrBoost_ManuallyCorrected" (fallback "*_GlistrBoost"), as Ellis's reader did.
_LEGACY_SEG_ALT = ("GlistrBoost_ManuallyCorrected", "GlistrBoost")

EDITIONS: dict[str, EditionSpec] = {
    year: EditionSpec(year, _LEGACY_LABELS, edema=2, enhancing=4, modality_suffixes=_LEGACY_SUFFIXES,
                      alt_suffixes=_LEGACY_ALT, seg_alt_suffixes=_LEGACY_SEG_ALT)
    for year in ("2017", "2018", "2019", "2020", "2021")
}
# BraTS 2023+ (BraTS-GLI and later challenges): NETC, SNFH, ET.
EDITIONS["2023"] = EditionSpec(
    "2023",
    {1: "NETC", 2: "SNFH", 3: "ET"},
    edema=2,
    enhancing=3,
    modality_suffixes={"t1": "t1n", "t1ce": "t1c", "t2": "t2w", "flair": "t2f"},
)


def get_edition(name: str) -> EditionSpec:
    try:
        return EDITIONS[str(name)]
    except KeyError:
        raise KeyError(f"unknown BraTS edition {name!r} (known: {', '.join(EDITIONS)})") from None


def region_masks(label: np.ndarray, edition: EditionSpec | str) -> dict[str, np.ndarray]:
    """Boolean WT/TC/ET masks of a label map (numpy or torch), in REGIONS order."""
    spec = get_edition(edition) if isinstance(edition, str) else edition
    return {region: _isin(label, values) for region, values in spec.region_labels.items()}


def _isin(label, values: tuple[int, ...]):
    if isinstance(label, np.ndarray):
        return np.isin(label, values)
    import torch

    return torch.isin(label, torch.tensor(values, device=label.device, dtype=label.dtype))
