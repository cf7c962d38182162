"""The one table of BraTS label conventions: the 2017–2021 editions and every 2023+ challenge.

Every label value, label name, evaluation group, default training region, file-name suffix and case-id
pattern in the project comes from `CHALLENGES`; nothing else may hard-code "3 is enhancing tumour".

| key | what | labels | evaluation groups (official BraTS evaluation, in report order) |
|---|---|---|---|
| 2017 ... 2021 | BraTS 2017–2021 glioma | 1 NCR/NET, 2 ED, 4 ET | WT [1,2,4], TC [1,4], ET [4] |
| gli | GLI pre-operative glioma (2023) | 1 NETC, 2 SNFH, 3 ET | ET [3], NETC [1], SNFH [2], TC [1,3], WT [1,2,3] |
| gli-post | GLI post-treatment glioma (2024+) | + 4 RC | ET, NETC, SNFH, RC [4], TC, WT |
| met | brain metastases | 1 NETC, 2 SNFH, 3 ET, 4 RC | ET [3], RC [4], TC [1,3], WT [1,2,3] |
| men | pre-operative meningioma | 1 NETC, 2 SNFH, 3 ET | ET [3], TC [1,3], WT [1,2,3] |
| men-rt | meningioma radiotherapy (t1c only) | 1 GTV | GTV [1] |
| ped | pediatric tumours (2024+) | 1 ET, 2 NETC, 3 CC, 4 ED | ET [1], NETC [2], CC [3], ED [4], TC [1,2,3], WT [1,2,3,4] |
| ssa | sub-Saharan Africa glioma | as gli | ET [3], TC [1,3], WT [1,2,3] |
| goat | generalizability across tumours | as gli | ET [3], TC [1,3], WT [1,2,3] |

The GLI pre-operative table has no label 4, so its groups are the GLI groups without RC. "2023" is an
alias of "gli" (the 2023 release used that table for GLI, MEN, MET, PED and SSA alike; forcing
`data.edition=2023` reads every case with it).

Default training regions (`regions`, overlapping masks, largest first) are groups of the table chosen so
that labels are recoverable: the regions form a laminar family (any two are nested or disjoint) and each
region owns exactly one label (the one not covered by a smaller region inside it); see
`brats_swap.model.targets`. WT/TC/ET everywhere, plus RC where the challenge has a resection cavity, plus
CC for PED (TC holds NETC and CC, which WT/TC/ET alone cannot tell apart), and GTV for MEN-RT.

One word: a *challenge* is an entry of this table and its key (the legacy years included: "the BraTS 2021
challenge"). The config keeps its two historical keys, `data.edition` (a legacy year or "2023") and
`data.challenge` (a 2023+ key); both force a challenge of this table. The files written keep their
spelling too: checkpoints and the prepared cache's metadata store the key under "edition".

Case ids (matched case-insensitively, whole id): `Brats17_*`, `BraTS18_*` ... `BraTS2021_*`,
`BraTS-GLI-<subject>-<timepoint>` (a timepoint of 100 or more, as the 2024+ post-treatment release numbers
its scans, means gli-post; otherwise gli), `BraTS-MET-*`, `BraTS-MEN-*`, `BraTS-MEN-RT-*`, `BraTS-PED-*`,
`BraTS-SSA-*`, `BraTS-GoAT-*`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from brats_swap.errors import DataError

# The canonical modality names used in configs and tensors, in the default channel order.
CANONICAL_MODALITIES: tuple[str, ...] = ("t1", "t1ce", "t2", "flair")
# The regions of the 2017–2021 (CaPTk) metrics, kept for the legacy reports.
REGIONS: tuple[str, ...] = ("WT", "TC", "ET")
# Tissues the phantoms draw; a challenge maps the ones it labels to its values (others are background).
TISSUES: tuple[str, ...] = ("edema", "necrosis", "enhancing", "cavity", "cyst")


@dataclass(frozen=True)
class ChallengeSpec:
    """One label convention: file names, labels, official evaluation groups and default regions."""

    key: str  # table key: "2017" ... "2021", "gli", "gli-post", "met", "men", "men-rt", "ped", "ssa", "goat"
    title: str
    labels: dict[int, str]  # value -> abbreviation, e.g. {1: "ET", 2: "NETC", 3: "CC", 4: "ED"}
    groups: dict[str, tuple[int, ...]]  # official evaluation groups in report order, e.g. {"ET": (3,), ...}
    regions: tuple[str, ...]  # default region targets (group names), largest first
    tissues: dict[str, int]  # phantom tissue (see TISSUES) -> label value
    modality_suffixes: dict[str, str]  # canonical modality -> file-name suffix; absent: not shipped
    id_pattern: str  # regular expression a case id of this convention matches (whole id, any case)
    id_format: str  # a case id of this convention from {index} (0-based) and {number} (1-based): phantoms
    separator: str = "-"  # between the case id and the suffix in the file names it ships
    seg_suffix: str = "seg"
    alt_suffixes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # other spellings seen in releases
    seg_alt_suffixes: tuple[str, ...] = ()  # other names of the segmentation file seen in releases

    @property
    def name(self) -> str:
        return self.key

    @property
    def legacy(self) -> bool:
        """True for the 2017–2021 editions (named by year, scored with WT/TC/ET)."""
        return self.key.isdigit()

    @property
    def label_values(self) -> tuple[int, ...]:
        return tuple(sorted(self.labels))

    @property
    def region_labels(self) -> dict[str, tuple[int, ...]]:
        """The regions of the legacy WT/TC/ET metrics that this table has (MEN-RT: its only group, GTV)."""
        legacy = {name: self.groups[name] for name in REGIONS if name in self.groups}
        return legacy or dict(self.groups)

    @property
    def edema(self) -> int | None:
        return self.tissues.get("edema")

    @property
    def enhancing(self) -> int | None:
        return self.tissues.get("enhancing")

    def describe_labels(self) -> str:
        """`1 ET, 2 NETC, 3 CC, 4 ED`: the label table for people."""
        return ", ".join(f"{value} {name}" for value, name in sorted(self.labels.items()))

    def describe_groups(self) -> str:
        """`ET [1], NETC [2], ...`: the evaluation groups for people."""
        return ", ".join(f"{name} [{','.join(map(str, values))}]" for name, values in self.groups.items())

    def example_id(self, index: int = 0) -> str:
        """The id of case `index` in this convention's naming, e.g. `BraTS-PED-00000-000`."""
        return self.id_format.format(index=index, number=index + 1)

    def matches(self, case_id: str) -> bool:
        return re.fullmatch(self.id_pattern, case_id, flags=re.IGNORECASE) is not None


# ---- the label tables -------------------------------------------------------------------------------------

_LEGACY_LABELS = {1: "NCR/NET", 2: "ED", 4: "ET"}
_LEGACY_GROUPS = {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}
_LEGACY_TISSUES = {"edema": 2, "necrosis": 1, "enhancing": 4}
_LEGACY_SUFFIXES = {"t1": "t1", "t1ce": "t1ce", "t2": "t2", "flair": "flair"}
# The TCIA 2017 release used by Ellis/IBM names the contrast-enhanced T1 "t1Gd" and its truth file
# "*_GlistrBoost_ManuallyCorrected" (fallback "*_GlistrBoost"), as Ellis's reader did.
_LEGACY_ALT = {"t1ce": ("t1Gd", "t1gd")}
_LEGACY_SEG_ALT = ("GlistrBoost_ManuallyCorrected", "GlistrBoost")

_LEGACY_IDS = {"2017": "Brats17_SYN_{number:03d}_1", "2018": "BraTS18_Training_{number:03d}",
               "2019": "BraTS19_Training_{number:03d}", "2020": "BraTS20_Training_{number:03d}",
               "2021": "BraTS2021_{index:05d}"}
_MODERN_SUFFIXES = {"t1": "t1n", "t1ce": "t1c", "t2": "t2w", "flair": "t2f"}
_ADULT_LABELS = {1: "NETC", 2: "SNFH", 3: "ET"}
_ADULT_TISSUES = {"edema": 2, "necrosis": 1, "enhancing": 3}
_CORE_GROUPS = {"ET": (3,), "TC": (1, 3), "WT": (1, 2, 3)}
# A GLI scan id ends in its timepoint; the 2024+ post-treatment release numbers them from 100.
_POST_TIMEPOINT = r"-[1-9]\d{2,}"


def _legacy(year: str) -> ChallengeSpec:
    return ChallengeSpec(
        key=year, title=f"BraTS {year} glioma", labels=_LEGACY_LABELS, groups=_LEGACY_GROUPS, regions=REGIONS,
        tissues=_LEGACY_TISSUES, modality_suffixes=_LEGACY_SUFFIXES,
        id_pattern=rf"brats(20)?{year[2:]}_.+", id_format=_LEGACY_IDS[year], separator="_", alt_suffixes=_LEGACY_ALT,
        seg_alt_suffixes=_LEGACY_SEG_ALT)


def _modern(key: str, title: str, id_pattern: str, id_format: str, labels=_ADULT_LABELS, groups=_CORE_GROUPS,
            regions=REGIONS, tissues=_ADULT_TISSUES) -> ChallengeSpec:
    return ChallengeSpec(key=key, title=title, labels=labels, groups=groups, regions=regions, tissues=tissues,
                         modality_suffixes=_MODERN_SUFFIXES, id_pattern=id_pattern, id_format=id_format)


CHALLENGES: dict[str, ChallengeSpec] = {year: _legacy(year) for year in ("2017", "2018", "2019", "2020", "2021")}
CHALLENGES.update({
    "gli": _modern(
        "gli", "GLI pre-operative glioma (2023)", rf"brats-gli-(?!.*{_POST_TIMEPOINT}$).+", "BraTS-GLI-{index:05d}-000",
        groups={"ET": (3,), "NETC": (1,), "SNFH": (2,), "TC": (1, 3), "WT": (1, 2, 3)}),
    "gli-post": _modern(
        "gli-post", "GLI post-treatment glioma (2024+)", rf"brats-gli-.*{_POST_TIMEPOINT}", "BraTS-GLI-{index:05d}-100",
        labels={**_ADULT_LABELS, 4: "RC"},
        groups={"ET": (3,), "NETC": (1,), "SNFH": (2,), "RC": (4,), "TC": (1, 3), "WT": (1, 2, 3)},
        regions=(*REGIONS, "RC"), tissues={**_ADULT_TISSUES, "cavity": 4}),
    "met": _modern(
        "met", "MET brain metastases", r"brats-met-.+", "BraTS-MET-{index:05d}-000", labels={**_ADULT_LABELS, 4: "RC"},
        groups={"ET": (3,), "RC": (4,), "TC": (1, 3), "WT": (1, 2, 3)},
        regions=(*REGIONS, "RC"), tissues={**_ADULT_TISSUES, "cavity": 4}),
    "men": _modern("men", "MEN pre-operative meningioma", r"brats-men-(?!rt-).+", "BraTS-MEN-{index:05d}-000"),
    "men-rt": ChallengeSpec(
        key="men-rt", title="MEN-RT meningioma radiotherapy (t1c only)", labels={1: "GTV"},
        groups={"GTV": (1,)}, regions=("GTV",), tissues={"necrosis": 1, "enhancing": 1},
        modality_suffixes={"t1ce": "t1c"}, id_pattern=r"brats-men-rt-.+", id_format="BraTS-MEN-RT-{number:04d}-1", separator="_", seg_suffix="gtv"),
    "ped": _modern(
        "ped", "PED pediatric tumours (2024+)", r"brats-ped-.+", "BraTS-PED-{index:05d}-000", labels={1: "ET", 2: "NETC", 3: "CC", 4: "ED"},
        groups={"ET": (1,), "NETC": (2,), "CC": (3,), "ED": (4,), "TC": (1, 2, 3), "WT": (1, 2, 3, 4)},
        regions=(*REGIONS, "CC"), tissues={"edema": 4, "necrosis": 2, "enhancing": 1, "cyst": 3}),
    "ssa": _modern("ssa", "SSA glioma, sub-Saharan Africa", r"brats-ssa-.+", "BraTS-SSA-{index:05d}-000"),
    "goat": _modern("goat", "GoAT generalizability across tumours", r"brats-goat-.+", "BraTS-GoAT-{index:05d}"),
})

# Other names accepted wherever a key is (the 2023 release's one table is GLI pre-op's).
ALIASES: dict[str, str] = {"2023": "gli"}
LEGACY_CHALLENGES: tuple[str, ...] = tuple(key for key, spec in CHALLENGES.items() if spec.legacy)
MODERN_CHALLENGES: tuple[str, ...] = tuple(key for key, spec in CHALLENGES.items() if not spec.legacy)
# The keys the config's `data.edition` may force (its schema's `Edition`): the legacy years and the aliases.
FORCED_EDITIONS: tuple[str, ...] = (*LEGACY_CHALLENGES, *ALIASES)


def get_challenge(key: str | ChallengeSpec) -> ChallengeSpec:
    """The table entry of a key ("2021", "ped", ...; "2023" = "gli"); a spec is returned as it is."""
    if isinstance(key, ChallengeSpec):
        return key
    name = ALIASES.get(str(key), str(key))
    try:
        return CHALLENGES[name]
    except KeyError:
        known = ", ".join([*CHALLENGES, *ALIASES])
        raise KeyError(f"unknown BraTS edition or challenge {key!r} (known: {known})") from None


def evaluation_groups(key: str | ChallengeSpec) -> dict[str, tuple[int, ...]]:
    """The official evaluation groups of a challenge, in report order: {"ET": (3,), "NETC": (1,), ...}."""
    return dict(get_challenge(key).groups)


def challenge_of_case_id(case_id: str) -> str | None:
    """The key whose id pattern the case id matches, or None (the patterns are mutually exclusive)."""
    for key, spec in CHALLENGES.items():
        if spec.matches(case_id):
            return key
    return None


# ---- what a label's name means (dataset.json files of nnU-Net and the Decathlon) ----------------------------

# Names datasets give the tissues of `TISSUES`, after `normalize_label_name` (nnU-Net's BraTS conversions,
# the Decathlon's Task01, the challenges' own abbreviations and their long forms).
TISSUE_NAMES: dict[str, tuple[str, ...]] = {
    "edema": ("edema", "peritumoral edema", "ed", "snfh", "surrounding non enhancing flair hyperintensity",
              "edema/invaded tissue", "invaded tissue"),
    "necrosis": ("necrosis", "necrotic", "ncr", "net", "ncr/net", "ncr net", "necrotic tumor core",
                 "necrotic and non enhancing tumor core", "non enhancing tumor", "non enhancing tumor core",
                 "netc", "necrotic core"),
    "enhancing": ("enhancing tumor", "enhancing", "et", "enhancing tumor core"),
    "cavity": ("resection cavity", "cavity", "rc"),
    "cyst": ("cyst", "cystic component", "cc"),
}
# Long names of the evaluation groups (nnU-Net's BraTS conversions declare its regions by them).
GROUP_NAMES: dict[str, str] = {"whole tumor": "WT", "tumor core": "TC", "enhancing tumor": "ET"}
BACKGROUND_NAMES: tuple[str, ...] = ("background", "bg", "healthy", "healthy tissue")


def normalize_label_name(name: str) -> str:
    """`Non-Enhancing_Tumour` -> `non enhancing tumor`: how label names are compared."""
    text = str(name).strip().lower().replace("tumour", "tumor").replace("oedema", "edema")
    return " ".join(text.replace("-", " ").replace("_", " ").split())


def label_name_meaning(spec: ChallengeSpec, name: str) -> tuple[int, ...] | None:
    """The table values a dataset's label (or region) name stands for in `spec`: a group of the table
    (`WT`, `tumor core`, ...), one of its label abbreviations (`SNFH`, `NCR/NET`), or a tissue name
    (`edema`, `non-enhancing tumor`); () when the name is a tissue this table does not label (a cavity in
    2021); None when the name means nothing known."""
    key = normalize_label_name(name)
    groups = {group.lower(): values for group, values in spec.groups.items()}
    group = GROUP_NAMES.get(key, key).lower()
    if group in groups:
        return tuple(groups[group])
    abbreviations = {abbreviation.lower(): value for value, abbreviation in spec.labels.items()}
    if key in abbreviations:
        return (abbreviations[key],)
    for tissue, names in TISSUE_NAMES.items():
        if key in names:
            return (spec.tissues[tissue],) if tissue in spec.tissues else ()
    return None


def label_map_from_names(spec: ChallengeSpec, declared: dict[str, tuple[int, ...]], where: str) -> dict[int, int | None]:
    """File value -> table value of `spec`, from a dataset's declared labels {name: file values} (a label is
    one value; a region such as nnU-Net's `"whole tumor": [1, 2, 3]` several). A file value maps to the one
    table value that is inside exactly the same declared names; a value that only names tissues this table
    lacks maps to None (refused if it occurs). DataError naming `where` when a name means nothing known or
    the names do not tell a value's class."""
    meanings: list[tuple[str, frozenset[int], tuple[int, ...]]] = []
    for name, values in declared.items():
        if normalize_label_name(name) in BACKGROUND_NAMES:
            continue
        meaning = label_name_meaning(spec, name)
        if meaning is None:
            raise DataError(f"{where}: label {name!r} names no tumour class of the {spec.key} table "
                            f"({spec.describe_labels()}); name it in the labels as one of "
                            f"{', '.join(sorted({*GROUP_NAMES, *spec.groups, *TISSUE_NAMES}))}")
        meanings.append((name, frozenset(int(v) for v in values), meaning))
    mapping: dict[int, int | None] = {}
    for value in sorted({v for _, values, _ in meanings for v in values} - {0}):
        if all(not meaning for _, values, meaning in meanings if value in values):
            mapping[value] = None
            continue
        fits = [u for u in spec.label_values
                if all((value in values) == (u in meaning) for _, values, meaning in meanings if meaning)]
        if len(fits) != 1:
            names = ", ".join(name for name, values, _ in meanings if value in values)
            options = " or ".join(spec.labels[u] for u in (fits or spec.label_values))
            raise DataError(f"{where}: the labels do not tell which class of the {spec.key} table value {value} "
                            f"is (declared in: {names}; it could be {options}); name each value in the labels")
        mapping[value] = fits[0]
    return mapping


def region_masks(label, challenge: str | ChallengeSpec) -> dict[str, np.ndarray]:
    """Boolean masks of the legacy metric regions (`ChallengeSpec.region_labels`) of a label map, numpy or
    torch: WT, TC, ET in that order where the table has them."""
    spec = get_challenge(challenge)
    return {region: isin(label, values) for region, values in spec.region_labels.items()}


def isin(label, values: tuple[int, ...]):
    """`label` in `values` as a boolean mask, for numpy arrays and torch tensors alike."""
    if isinstance(label, np.ndarray):
        return np.isin(label, values)
    import torch

    return torch.isin(label, torch.tensor(values, device=label.device, dtype=label.dtype))
