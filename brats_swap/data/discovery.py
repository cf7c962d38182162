"""Find BraTS cases on disk, whatever the edition's or challenge's naming scheme.

A BraTS file is `<case id><sep><suffix>.nii[.gz]`: `sep` is "_" up to 2021 (and in MEN-RT's release) and
"-" from 2023 (either is accepted), and the suffix names the modality or the segmentation (`t1`, `t1ce`,
`t2`, `flair`, `seg`; 2023+: `t1n`, `t1c`, `t2w`, `t2f`, `seg`; MEN-RT: `t1c` and `gtv` only; the TCIA
2017 release: `t1Gd`, `GlistrBoost_ManuallyCorrected`). Cases may sit one
folder per case (HGG/ and LGG/ sub-folders included) or all in one flat folder; we walk the whole tree and
group files by case id, so both layouts work the same way.

Each case gets one key of the label-convention table (`brats_swap.data.challenges`), stored as
`Case.edition`: a year 2017–2021 for the legacy releases, else the 2023+ challenge. The rule:

1. `data.challenge` (`challenge=`) other than "auto" forces that challenge for every case;
2. else `data.edition` (`edition=`) other than "auto" forces that edition ("2023" = the GLI pre-op table);
3. else the case id: `Brats17_*` -> 2017, `BraTS18_/19_/20_*` -> 2018/19/20, `BraTS2021_*` -> 2021,
   `BraTS-GLI-*` -> gli, or gli-post when the id's timepoint is 100 or more (how the 2024+
   post-treatment release numbers its scans), `BraTS-MET-*` -> met, `BraTS-MEN-*` -> men,
   `BraTS-MEN-RT-*` -> men-rt, `BraTS-PED-*` -> ped, `BraTS-SSA-*` -> ssa, `BraTS-GoAT-*` -> goat;
4. else (e.g. the TCIA release's `TCGA-02-0006`) the suffix family: a `gtv` file means men-rt, 2023-style
   suffixes gli, the older ones 2017 (all of 2017-2021 share one label table).

A folder with a `dataset.json` next to `imagesTr/` (nnU-Net's raw layout, the Decathlon's Task01) is read by
`brats_swap.data.layouts` instead: rules 1-3 still choose each case's table (nnU-Net's conversions keep the
BraTS case ids), else the channel names do (2023+ spellings: gli, else 2017); the label values of its files
are read by the meaning the dataset.json gives them (`Case.label_map`), never by which values occur.

GLI pre-operative and post-treatment scans share their names; a pre-op case whose segmentation holds the
resection cavity label 4 is refused by `load_case` with a message that names `data.challenge=gli-post`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.data.challenges import (
    CANONICAL_MODALITIES,
    CHALLENGES,
    FORCED_EDITIONS,
    MODERN_CHALLENGES,
    challenge_of_case_id,
    get_challenge,
)
from brats_swap.data.layouts import Layout, LayoutCase, find_layout
from brats_swap.errors import DataError
from brats_swap.names import checked_name

NIFTI_EXTENSIONS = (".nii.gz", ".nii")
SEG = "seg"  # role name of the segmentation file


@dataclass
class Case:
    """One case: its id, label convention and the files of each canonical modality (and the segmentation)."""

    case_id: str
    edition: str  # key of the case's entry in the challenge table: "2017" ... "2021", "gli", "ped", ...
    images: dict[str, Path]  # canonical modality -> file; a missing modality is simply absent
    seg: Path | None  # None for validation/test cases that ship without labels
    ignored: list[Path] = field(default_factory=list)  # files of this case that no role claims
    # A dataset.json layout (brats_swap.data.layouts): the dataset.json, the index of each modality in a 4D
    # image (the Decathlon's), and file label value -> table value (None: a class the table lacks).
    description: Path | None = None
    channels: dict[str, int] = field(default_factory=dict)
    label_map: dict[int, int | None] | None = None

    @property
    def files(self) -> dict[str, Path]:
        """Every file of the case by role (modalities, then "seg")."""
        roles = dict(self.images)
        if self.seg is not None:
            roles[SEG] = self.seg
        return roles

    @property
    def relabelled(self) -> bool:
        """Whether its label files hold values other than the table's (a dataset.json that renumbers them):
        read them with `load_case` / `to_table_values`, never as they are."""
        return self.label_map is not None and any(v is not None and k != v for k, v in self.label_map.items())

    def expected_name(self, role: str) -> str:
        """The file name this case's convention uses for `role` (a canonical modality or "seg")."""
        if self.description is not None:
            return f"a {role} channel declared in {self.description}"
        spec = get_challenge(self.edition)
        suffix = spec.seg_suffix if role == SEG else spec.modality_suffixes.get(role, role)
        return f"{self.case_id}{spec.separator}{suffix}.nii.gz"


def discover_cases(
    root: str | os.PathLike,
    edition: str = "auto",
    modalities: tuple[str, ...] | list[str] = CANONICAL_MODALITIES,
    challenge: str = "auto",
) -> list[Case]:
    """All cases under `root`, sorted by case id; `edition` and `challenge` force a convention (see above).

    Raises DataError when the folder is missing, unreadable or holds no BraTS-named NIfTI file, and when a
    case has two files for one role (e.g. in HGG/ and LGG/, or as both .nii and .nii.gz), naming both.
    Missing modalities are not an error here: `load_case` reports them with the expected file name.
    """
    folder = Path(root)
    if not folder.exists():
        raise DataError(f"{folder}: dataset folder not found")
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    check_forced_convention(edition, challenge)
    unknown = [m for m in modalities if m not in CANONICAL_MODALITIES]
    if unknown:
        raise DataError(f"unknown modality {unknown[0]!r} (known: {', '.join(CANONICAL_MODALITIES)})")

    layout = find_layout(folder)
    if layout is not None:
        return [_layout_case(entry, layout, edition, challenge) for entry in layout.cases]
    nifti_files = _walk_nifti(folder)
    if not nifti_files:
        raise DataError(f"{folder}: empty folder (no .nii or .nii.gz files)")

    # case id -> suffix token (lower case) -> files carrying it
    grouped: dict[str, dict[str, list[Path]]] = {}
    unrecognised: list[Path] = []
    for path in nifti_files:
        parsed = parse_file_name(path.name)
        if parsed is None:
            unrecognised.append(path)
            continue
        case_id, token = parsed
        checked_name(case_id, f"file {path.name!r}: case id", path.parent)  # repr: the name may hold a newline
        grouped.setdefault(case_id, {}).setdefault(token, []).append(path)
    if not grouped:
        raise DataError(
            f"{folder}: no BraTS-named NIfTI files ({len(unrecognised)} NIfTI files with other names, "
            f"e.g. {unrecognised[0].name}; expected e.g. BraTS2021_00000_t1.nii.gz)"
        )

    cases = []
    for case_id in sorted(grouped):
        case_edition = resolve_convention(case_id, grouped[case_id], edition, challenge)
        cases.append(_assemble_case(case_id, case_edition, grouped[case_id], tuple(modalities)))
    return cases


def _layout_case(entry: LayoutCase, layout: Layout, edition: str, challenge: str) -> Case:
    """A case of a dataset.json layout: its table from the forced keys or its id (rule 1-3 above), else from
    the channel names (2023+ spellings: gli, else 2017); its label values read by dataset.json's meaning."""
    key = resolve_convention(entry.case_id, None, edition, challenge)
    if challenge == "auto" and edition == "auto" and challenge_of_case_id(entry.case_id) is None:
        key = "gli" if layout.modern_names else "2017"
    return Case(case_id=entry.case_id, edition=key, images=dict(entry.images), seg=entry.seg,
                description=layout.description, channels=dict(entry.channels),
                label_map=layout.label_map(get_challenge(key)))


def check_forced_convention(edition: str, challenge: str) -> None:
    """DataError naming the key when `data.edition` / `data.challenge` is unknown or they contradict."""
    if edition != "auto" and edition not in FORCED_EDITIONS:
        raise DataError(f"data.edition: unknown edition {edition!r} (known: auto, {', '.join(FORCED_EDITIONS)})")
    if challenge != "auto" and challenge not in MODERN_CHALLENGES:
        raise DataError(f"data.challenge: unknown challenge {challenge!r} "
                        f"(known: auto, {', '.join(MODERN_CHALLENGES)})")
    if challenge != "auto" and edition != "auto" and get_challenge(edition).legacy:
        raise DataError(f"data.challenge: the {challenge} challenge (2023+) contradicts data.edition={edition}; "
                        "set data.edition=auto")


def resolve_convention(case_id: str, tokens: dict[str, list[Path]] | None = None, edition: str = "auto",
                       challenge: str = "auto") -> str:
    """The table key of one case by the rule of the module docstring."""
    if challenge != "auto":
        return challenge
    if edition != "auto":
        return get_challenge(edition).key
    return detect_edition(case_id, tokens)


def detect_edition(case_id: str, tokens: dict[str, list[Path]] | None = None) -> str:
    """The table key of a case from its id (see the module docstring), else from its file suffixes."""
    key = challenge_of_case_id(case_id)
    if key is not None:
        return key
    found = set(tokens or ())
    if get_challenge("men-rt").seg_suffix in found:
        return "men-rt"
    modern = {s.lower() for s in get_challenge("gli").modality_suffixes.values()}
    if modern & found:
        return "gli"
    return "2017"


def parse_file_name(name: str) -> tuple[str, str] | None:
    """`Brats17_TCIA_105_1_t1ce.nii.gz` -> ("Brats17_TCIA_105_1", "t1ce"); None if not BraTS-named."""
    for extension in NIFTI_EXTENSIONS:
        if name.endswith(extension):
            stem = name[: -len(extension)]
            break
    else:
        return None
    lowered = stem.lower()
    for token in _ALL_TOKENS:  # longest first, so "t1ce" is never read as "t1" + junk
        for sep in ("_", "-"):
            if lowered.endswith(sep + token) and len(stem) > len(token) + 1:
                return stem[: -len(token) - 1], token
    return None


def _assemble_case(case_id: str, edition: str, tokens: dict[str, list[Path]], modalities: tuple[str, ...]) -> Case:
    spec = get_challenge(edition)
    images: dict[str, Path] = {}
    for modality in modalities:
        if modality not in spec.modality_suffixes:
            continue  # not shipped by this challenge (MEN-RT: t1c only); load_case says so if it is asked for
        spellings = (spec.modality_suffixes[modality], *spec.alt_suffixes.get(modality, ()))
        images_found = _pick(case_id, modality, tokens, spellings, prefer_first=False)
        if images_found is not None:
            images[modality] = images_found
    # Segmentation names are ordered by preference (ManuallyCorrected before the raw GlistrBoost output),
    # so finding several spellings is not a duplicate; the same spelling twice is.
    seg = _pick(case_id, SEG, tokens, (spec.seg_suffix, *spec.seg_alt_suffixes), prefer_first=True)
    claimed = {p for p in [*images.values(), seg] if p is not None}
    ignored = sorted(p for paths in tokens.values() for p in paths if p not in claimed)
    return Case(case_id=case_id, edition=edition, images=images, seg=seg, ignored=ignored)


def _pick(case_id: str, role: str, tokens: dict[str, list[Path]], spellings: tuple[str, ...],
          prefer_first: bool) -> Path | None:
    found: list[Path] = []
    for spelling in dict.fromkeys(s.lower() for s in spellings):
        paths = tokens.get(spelling, [])
        if len(paths) > 1:
            _duplicate(case_id, role, paths)
        found.extend(paths)
        if prefer_first and found:
            break
    if len(found) > 1:
        _duplicate(case_id, role, found)
    return found[0] if found else None


def _duplicate(case_id: str, role: str, paths: list[Path]) -> None:
    raise DataError(f"case {case_id}: duplicate {role} files {paths[0]} and {paths[1]}")


def _walk_nifti(folder: Path) -> list[Path]:
    """The NIfTI files under `folder`, symlinked folders followed (datasets are often assembled from links),
    each real folder entered once: a link back up (`up -> ..`) or to a folder already walked is skipped, so a
    loop can neither hang the walk nor list a case twice."""
    def unreadable(error: OSError) -> None:
        raise DataError(f"{error.filename}: cannot list folder ({error.strerror or error})")

    found = []
    visited: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable, followlinks=True):
        try:
            here = os.stat(dirpath)
        except OSError as exc:
            unreadable(exc)
        if (here.st_dev, here.st_ino) in visited:
            dirnames[:] = []
            continue
        visited.add((here.st_dev, here.st_ino))
        # Hidden folders hold our own temp files (and editors' / OS litter), never cases.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith(".") and name.endswith(NIFTI_EXTENSIONS):
                found.append(Path(dirpath) / name)
    return found


def _all_tokens() -> tuple[str, ...]:
    tokens = set()
    for spec in CHALLENGES.values():
        tokens.update(spec.modality_suffixes.values())
        for spellings in spec.alt_suffixes.values():
            tokens.update(spellings)
        tokens.add(spec.seg_suffix)
        tokens.update(spec.seg_alt_suffixes)
    return tuple(sorted({t.lower() for t in tokens}, key=lambda t: (-len(t), t)))


_ALL_TOKENS = _all_tokens()


def challenge_images(root: str | Path, challenge: str = "auto") -> list[str] | None:
    """The modalities a challenge ships, in the canonical channel order (MEN-RT: only t1ce): the `challenge`
    forced, else the one of the first case id under `root`. None when neither is known (a legacy edition, a
    missing or empty folder): the caller keeps its own list."""
    if challenge == "auto":
        folder = Path(root)
        parsed = (parse_file_name(path.name) for path in _walk_nifti(folder)) if folder.is_dir() else iter(())
        case_id = next((found[0] for found in parsed if found is not None), None)
        challenge = challenge_of_case_id(case_id) if case_id is not None else None
    if challenge is None or challenge not in MODERN_CHALLENGES:
        return None
    shipped = get_challenge(challenge).modality_suffixes
    return [modality for modality in CANONICAL_MODALITIES if modality in shipped]
