"""The one spelling of fold selection on the command line: `--folds all|K|K,K`.

`all` is every fold; `K` one fold number; `K,K` several (order and repeats do not matter). Every command
that picks folds (cv, evaluate, predict, compare) parses it here, so the same text means the same folds.
`all-cases` is the one model trained on every case (nnU-Net's fold `all`, folder `fold_all/`): spelled
apart from `all`, so that "every fold" and "the model of every case" cannot be mistaken for each other.

The one exception left is `compare --folds K`, which for one release still means the first K folds (with
a notice): see `compare_fold_selection`.
"""

from __future__ import annotations

from collections.abc import Sequence

from brats_swap.errors import ConfigError
from brats_swap.run.folder import ALL_CASES_FOLD

ALL_FOLDS = "all"
ALL_CASES = "all-cases"
FoldSelection = str | int | Sequence[int]


def parse_fold_selection(selection: FoldSelection, option: str = "--folds") -> str | list[int]:
    """`ALL_FOLDS`, or the sorted distinct fold numbers of "K" / "K,K" / an int / a sequence of ints;
    ConfigError naming `option` for anything else (a negative number, a word, an empty list)."""
    if isinstance(selection, str) and selection.strip().lower() == ALL_FOLDS:
        return ALL_FOLDS
    if isinstance(selection, str) and selection.strip().lower() == ALL_CASES:
        return [ALL_CASES_FOLD]
    if isinstance(selection, int) and selection == ALL_CASES_FOLD:
        return [ALL_CASES_FOLD]
    try:
        if isinstance(selection, str):
            # Empty items are skipped, so "3," is fold 3 (how `compare` names a single fold, see its help).
            chosen = [int(item) for item in selection.split(",") if item.strip()]
        elif isinstance(selection, int):
            chosen = [int(selection)]
        else:
            chosen = [int(k) for k in selection]
    except (TypeError, ValueError):
        chosen = []
    if not chosen or min(chosen) < 0:
        raise ConfigError(f"{option} {selection!r}: expected 'all', 'all-cases', a fold number or "
                          "numbers like 0,2")
    return sorted(set(chosen))


def resolve_folds(selection: FoldSelection, n_folds: int, option: str = "--fold") -> list[int]:
    """The folds of a run with `n_folds` folds that `selection` names (`parse_fold_selection`; "all" is every
    fold); ConfigError naming `option` for a fold the run does not have."""
    chosen = parse_fold_selection(selection, option)
    if chosen == ALL_FOLDS:
        return list(range(n_folds))
    for k in chosen:
        if k != ALL_CASES_FOLD and k >= n_folds:
            raise ConfigError(f"{option} {k}: the run has folds 0..{n_folds - 1} (see splits.json)")
    return chosen


def compare_fold_selection(selection: str) -> tuple[str | list[int], str | None]:
    """`compare --folds`: the folds `parse_fold_selection` reads, and a notice (else None).

    A bare number K is the one spelling whose meaning differed: in `compare` it meant "the first K folds",
    everywhere else fold K. For one more release it keeps its `compare` meaning, with a one-line notice
    naming the spelling that says it in the one meaning (`0,...,K-1`); "K," (one fold) and lists already
    mean what they mean everywhere.
    """
    text = selection.strip()
    if not text.isdigit():
        return parse_fold_selection(selection), None
    count = int(text)
    if count < 1:  # "the first 0 folds": the user meant fold 0, which compare spells "0," for this release
        raise ConfigError(f"--folds {selection!r}: in compare a bare number K still means the first K folds; for "
                          "fold 0 write --folds 0, (or --folds 1)")
    first = list(range(count))
    spelled = ",".join(map(str, first)) + ("," if count == 1 else "")
    return first, (f"compare --folds {count}: read as the first {count} fold(s), as a bare number meant in compare "
                   f"before; write --folds {spelled} (from the next release --folds {count} is fold {count}, "
                   "as in cv)")


__all__ = ["ALL_CASES", "ALL_FOLDS", "FoldSelection", "compare_fold_selection", "parse_fold_selection", "resolve_folds"]
