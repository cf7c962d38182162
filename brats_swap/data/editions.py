"""The 2017–2021 editions and the 2023 table under their historical names.

The one table of label conventions is `brats_swap.data.challenges.CHALLENGES` (editions and challenges
alike); this module keeps the names the rest of the project has always imported: `get_edition` accepts any
key of that table ("2021", "2023", "ped", ...), `EditionSpec` is its entry type and `EDITIONS` lists the
keys `data.edition` may force (the legacy years and "2023").
"""

from __future__ import annotations

from brats_swap.data.challenges import (
    ALIASES,
    CANONICAL_MODALITIES,
    CHALLENGES,
    LEGACY_EDITIONS,
    REGIONS,
    ChallengeSpec,
    get_challenge,
    region_masks,
)

EditionSpec = ChallengeSpec
EDITIONS: dict[str, ChallengeSpec] = {
    **{year: CHALLENGES[year] for year in LEGACY_EDITIONS},
    **{alias: CHALLENGES[key] for alias, key in ALIASES.items()},
}


def get_edition(name: str | ChallengeSpec) -> ChallengeSpec:
    """The table entry of an edition or challenge key (see `brats_swap.data.challenges.get_challenge`)."""
    return get_challenge(name)


__all__ = ["CANONICAL_MODALITIES", "EDITIONS", "REGIONS", "EditionSpec", "get_edition", "region_masks"]
