"""Postprocessing of predicted label maps, tuned on the out-of-fold predictions of cross-validation.

Two rules, each off at 0, applied by `apply`:

- **minimum component size per evaluation group**: the 26-connected components of a group's mask (the
  union of its labels, the connectivity the official evaluation uses for lesions) smaller than the
  group's minimum number of voxels are set to background (0);
- **small enhancing tumour -> necrosis** (nnU-Net's BraTS rule): when a case's whole enhancing-tumour
  volume is below a threshold, its enhancing voxels are relabelled as the necrosis / non-enhancing core
  label, because a few enhancing voxels are more often a false positive than a real enhancing tumour.
  The two labels come from the challenge table (`relabel_labels`): GLI/MET/MEN 3 -> 1, PED 1 -> 2, the
  2017-2021 editions 4 -> 1.

`apply` runs the component removals in group order, then the relabelling, and repeats until nothing
changes (removing one group's voxels can split another group's component), so applying a plan twice
gives the same labels as applying it once.

`tune_postprocessing` chooses the values on the grid `MIN_SIZE_GRID` (0 to 1000 voxels) one rule at a
time (the relabelling first, then each group's minimum size in group order). A rule must earn its place,
as nnU-Net keeps a postprocessing step only when it helps; the keep rule (`KeepRule`, defaults in
`KEEP_RULE`) is:

- with fewer than 10 (prediction, reference) cases nothing is tuned: the plan is the identity and its
  `not_tuned` says why (a threshold grid fitted to a handful of cases fits their noise);
- a rule's value is kept only if, on the cases, it raises the objective by at least 1% of the objective
  before it (relative gain), improves more than half of the cases it changes (a case improves when its
  mean over the groups rises), and improves at least 3 cases;
- among the values that pass, those within 1% (of the objective before) of the best are ties and the
  smallest of them wins, so a hair's change in the scores does not move the value from 30 to 1000 voxels;
  when no value passes (ties and near-ties with no postprocessing included) the rule stays off.

Every rule's outcome is recorded (`RuleRecord` in the plan's `rules`): the best value, the cases it
changes, how many it improves and worsens, the objective before and with it, kept or why not.

The objective is the official lesion-wise Dice (`lesionwise_dsc_mean`, the mean Dice over matched
lesions, see `brats_swap.evaluate.official`) averaged over the cases and then over the groups. The
official report leaves a case with no lesion of a group on either side out of that group's mean (NaN);
the tuner counts such a case as 1 instead (a correct empty prediction), so every case counts, the score
exists even for a group no case has, and deleting a false-positive lesion from a lesion-free case is
rewarded as it should be. With some lesions but no matched pair a case scores 0.

To stay fast on a full cross-validation, the search applies each candidate to the labels the values
chosen so far produce, skips the cases it cannot change (no component, or enhancing volume, below the
threshold), scores only the bounding box of each case's foreground and re-evaluates only groups whose
mask changed; the reported scores after postprocessing apply the final plan to the raw predictions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy import ndimage

from brats_swap.atomic import atomic_write_json
from brats_swap.errors import DataError
from brats_swap.evaluate.official import Groups, check_labels, evaluate_groups

# Candidate thresholds in voxels (minimum component size, and small-enhancing volume); 0 is "off".
MIN_SIZE_GRID: tuple[int, ...] = (0, 10, 20, 30, 50, 75, 100, 150, 200, 300, 400, 500, 750, 1000)


# ---- the rules --------------------------------------------------------------------------------------------


def _components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    # Full connectivity (26 neighbours in 3D): a component is what the official evaluation calls a lesion.
    return ndimage.label(mask, structure=ndimage.generate_binary_structure(mask.ndim, mask.ndim))


def remove_small_components(labels: np.ndarray, group_labels: Sequence[int], min_voxels: int) -> np.ndarray:
    """A copy of `labels` where the 26-connected components of the mask `isin(labels, group_labels)` with
    fewer than `min_voxels` voxels are background (0). `min_voxels` 0 returns an unchanged copy."""
    result = np.array(labels, copy=True)
    if min_voxels <= 0:
        return result
    components, count = _components(np.isin(result, group_labels))
    if count == 0:
        return result
    sizes = np.bincount(components.ravel())
    small = sizes < min_voxels
    small[0] = False  # background, not a component
    result[small[components]] = 0
    return result


def relabel_small_enhancing(labels: np.ndarray, enhancing_label: int, necrosis_label: int,
                            max_voxels: int) -> np.ndarray:
    """A copy of `labels` where, if the case has fewer than `max_voxels` (and more than 0) voxels of
    `enhancing_label`, all of them become `necrosis_label`. `max_voxels` 0 returns an unchanged copy."""
    result = np.array(labels, copy=True)
    enhancing = result == enhancing_label
    if 0 < np.count_nonzero(enhancing) < max_voxels:
        result[enhancing] = necrosis_label
    return result


def relabel_labels(challenge) -> tuple[int, int] | None:
    """(enhancing, necrosis) label values of a challenge-table entry or key for the small-enhancing rule,
    or None where the table has no distinct pair (MEN-RT's single GTV label)."""
    from brats_swap.data.challenges import get_challenge

    spec = get_challenge(challenge)
    enhancing, necrosis = spec.tissues.get("enhancing"), spec.tissues.get("necrosis")
    if enhancing is None or necrosis is None or enhancing == necrosis:
        return None
    return int(enhancing), int(necrosis)


# ---- the plan ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PostprocessingPlan:
    """What `apply` does to a predicted label map, and the cross-validation scores that chose it.

    `groups`: name -> label values (the challenge's evaluation groups, in order). `min_component_voxels`:
    group name -> minimum component size (0 keeps every component). `enhancing_label`/`necrosis_label`
    and `small_enhancing_voxels` (0 = off) describe the relabelling. `lesionwise_dice_before/after`: the
    tuner's per-group objective (see the module docstring) without and with the plan, over `n_cases`.
    `tuned_on`: a digest of the label maps it was tuned on (cross-validation re-tunes only when they
    change; "" when unknown).
    """

    groups: dict[str, tuple[int, ...]]
    min_component_voxels: dict[str, int]
    enhancing_label: int | None = None
    necrosis_label: int | None = None
    small_enhancing_voxels: int = 0
    lesionwise_dice_before: dict[str, float] = field(default_factory=dict)
    lesionwise_dice_after: dict[str, float] = field(default_factory=dict)
    n_cases: int = 0
    tuned_on: str = ""
    # One record per rule the tuner weighed (`RuleRecord.to_dict()`), and why nothing was tuned ("" if tuned).
    rules: tuple[dict, ...] = ()
    not_tuned: str = ""

    @classmethod
    def identity(cls, groups: Groups, relabel: tuple[int, int] | None = None) -> PostprocessingPlan:
        """The plan that changes nothing (every threshold 0)."""
        enhancing, necrosis = relabel if relabel is not None else (None, None)
        return cls(groups={name: tuple(int(v) for v in labels) for name, labels in groups.items()},
                   min_component_voxels={name: 0 for name in groups}, enhancing_label=enhancing,
                   necrosis_label=necrosis)

    @property
    def active(self) -> bool:
        """Whether any rule is on (a tuning that kept none leaves every label map as it is: `apply` is the
        identity then, and there is nothing to say per case)."""
        return self.small_enhancing_voxels > 0 or any(size > 0 for size in self.min_component_voxels.values())

    def describe(self) -> str:
        """One line for people: the active rules, or "no postprocessing"."""
        parts = [f"{name} components < {size} voxels removed"
                 for name, size in self.min_component_voxels.items() if size > 0]  # empty: not `active`
        if self.small_enhancing_voxels > 0:
            parts.append(f"enhancing label {self.enhancing_label} -> {self.necrosis_label} when below "
                         f"{self.small_enhancing_voxels} voxels")
        return "; ".join(parts) if parts else "no postprocessing"

    def to_dict(self) -> dict:
        return {
            "groups": {name: list(labels) for name, labels in self.groups.items()},
            "min_component_voxels": dict(self.min_component_voxels),
            "enhancing_label": self.enhancing_label,
            "necrosis_label": self.necrosis_label,
            "small_enhancing_voxels": self.small_enhancing_voxels,
            "lesionwise_dice_before": dict(self.lesionwise_dice_before),
            "lesionwise_dice_after": dict(self.lesionwise_dice_after),
            "n_cases": self.n_cases,
            "tuned_on": self.tuned_on,
            "rules": [dict(record) for record in self.rules],
            "not_tuned": self.not_tuned,
        }

    @classmethod
    def from_dict(cls, data: Mapping, where: str = "postprocessing plan") -> PostprocessingPlan:
        """The plan of `to_dict`'s output; DataError (one line naming `where` and the key) if malformed."""
        known = set(cls.identity({}).to_dict())
        # Plans written before the tuner recorded its rules lack the two optional keys: still valid plans.
        required = known - set(_OPTIONAL_KEYS)
        if not isinstance(data, Mapping) or not required <= set(data) <= known:
            keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise DataError(f"{where}: expected the keys {sorted(known)}, got {keys}")
        try:
            groups = {str(name): tuple(_count(v) for v in labels) for name, labels in data["groups"].items()}
            sizes = {str(name): _count(size) for name, size in data["min_component_voxels"].items()}
            plan = cls(groups=groups, min_component_voxels=sizes,
                       enhancing_label=_optional_count(data["enhancing_label"]),
                       necrosis_label=_optional_count(data["necrosis_label"]),
                       small_enhancing_voxels=_count(data["small_enhancing_voxels"]),
                       lesionwise_dice_before={str(k): float(v) for k, v in data["lesionwise_dice_before"].items()},
                       lesionwise_dice_after={str(k): float(v) for k, v in data["lesionwise_dice_after"].items()},
                       n_cases=_count(data["n_cases"]), tuned_on=_text(data["tuned_on"]),
                       rules=tuple(dict(record) for record in data.get("rules", [])),
                       not_tuned=_text(data.get("not_tuned", "")))
        except (AttributeError, TypeError, ValueError) as exc:
            raise DataError(f"{where}: malformed value ({exc})") from None
        if set(sizes) != set(groups):
            raise DataError(f"{where}: min_component_voxels names {sorted(sizes)}, groups are {sorted(groups)}")
        if plan.small_enhancing_voxels and (plan.enhancing_label is None or plan.necrosis_label is None):
            raise DataError(f"{where}: small_enhancing_voxels is set but enhancing_label/necrosis_label are not")
        return plan


_OPTIONAL_KEYS = ("rules", "not_tuned")


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count (an integer >= 0)")
    return value


def _optional_count(value) -> int | None:
    return None if value is None else _count(value)


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def save_plan(plan: PostprocessingPlan, path: str | os.PathLike) -> None:
    """Write the plan as JSON (atomically), e.g. to the run folder's postprocessing.json."""
    atomic_write_json(path, plan.to_dict())


def load_plan(path: str | os.PathLike) -> PostprocessingPlan:
    """Read a plan written by `save_plan`; DataError naming the file if it is unreadable or malformed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: unreadable postprocessing plan ({exc})") from None
    return PostprocessingPlan.from_dict(data, where=str(path))


def _one_pass(plan: PostprocessingPlan, labels: np.ndarray) -> np.ndarray:
    result = labels
    for name, min_voxels in plan.min_component_voxels.items():
        if min_voxels > 0:
            result = remove_small_components(result, plan.groups[name], min_voxels)
    if plan.small_enhancing_voxels > 0:
        result = relabel_small_enhancing(result, plan.enhancing_label, plan.necrosis_label,
                                         plan.small_enhancing_voxels)
    return result


def apply(plan: PostprocessingPlan, labels: np.ndarray) -> np.ndarray:
    """The postprocessed copy of a predicted label map (same shape and dtype); idempotent.

    Passes repeat until one changes nothing. That ends: every changing pass lowers the number of
    foreground voxels (a removal) or, leaving it equal, the number of enhancing voxels (a relabelling).
    """
    current = np.array(labels, copy=True)
    while True:
        updated = _one_pass(plan, current)
        if np.array_equal(updated, current):
            return updated
        current = updated


# ---- the tuner --------------------------------------------------------------------------------------------

LabelSource = np.ndarray | str | os.PathLike


@dataclass
class _TuningCase:
    name: str
    prediction: np.ndarray  # as predicted, cropped to the foreground of prediction and reference
    reference: np.ndarray  # the same crop of the reference
    current: np.ndarray  # the prediction under the plan chosen so far
    dice: dict[str, float]  # group -> official lesion-wise Dice of `current` (NaN: no lesion on either side)
    # label map digest -> its lesion-wise Dice: many thresholds produce the same map
    seen: dict[bytes, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Rule:
    title: str
    group: str | None  # the evaluation group of a component-size rule; None for the relabelling
    with_value: Callable[[PostprocessingPlan, int], PostprocessingPlan]
    # The rule at value v changes a label map only if v > reach(map): the smallest component of its group,
    # or the enhancing volume (inf when there is nothing the rule could touch).
    reach: Callable[[np.ndarray], float]


def _read_labels(source: LabelSource, what: str) -> np.ndarray:
    if isinstance(source, (str, os.PathLike)):
        from brats_swap.data.nifti import read_volume

        path = Path(source)
        data, _, _ = read_volume(path.name.split(".nii")[0], path, as_float=False)
    else:
        data = np.asarray(source)
    if not np.issubdtype(data.dtype, np.integer):
        rounded = np.rint(data)
        if not np.array_equal(rounded, data):
            raise DataError(f"{what}: label map has non-integer values")
        data = rounded.astype(np.int64)
    return data


def _foreground_box(*arrays: np.ndarray) -> tuple[slice, ...]:
    # Lesion-wise Dice and connected components only see foreground voxels, so scoring the bounding box of
    # both maps' foreground gives the same numbers as the whole grid, many times faster.
    occupied = np.logical_or.reduce([array != 0 for array in arrays])
    if not occupied.any():
        return tuple(slice(0, 1) for _ in range(occupied.ndim))
    box = []
    for axis in range(occupied.ndim):
        hits = np.flatnonzero(occupied.any(axis=tuple(a for a in range(occupied.ndim) if a != axis)))
        box.append(slice(int(hits[0]), int(hits[-1]) + 1))
    return tuple(box)


def _lesionwise_dice(pred: np.ndarray, ref: np.ndarray, groups: Groups, only: Sequence[str], what: str) -> dict[str, float]:
    # Dice alone gives the official lesion-wise Dice (matching is by Dice) without the surface distances.
    results = evaluate_groups(pred, ref, groups, metrics=("DSC",), only=only, what=what)
    return {name: float("nan") if results[name].get("sq_dsc") is None else float(results[name]["sq_dsc"])
            for name in only}


def _load_tuning_case(index: int, pair: tuple[LabelSource, LabelSource], groups: Groups) -> _TuningCase:
    prediction_source, reference_source = pair
    name = (Path(reference_source).name.split(".nii")[0] if isinstance(reference_source, (str, os.PathLike))
            else f"#{index}")
    prediction = _read_labels(prediction_source, f"case {name}: prediction")
    reference = _read_labels(reference_source, f"case {name}: reference")
    if prediction.shape != reference.shape:
        raise DataError(f"case {name}: prediction {prediction.shape} and reference {reference.shape} differ in shape")
    check_labels(prediction, groups, f"case {name}: prediction")
    check_labels(reference, groups, f"case {name}: reference")
    box = _foreground_box(prediction, reference)
    prediction, reference = prediction[box].copy(), reference[box].copy()
    dice = _lesionwise_dice(prediction, reference, groups, list(groups), f"case {name}")
    return _TuningCase(name, prediction, reference, prediction, dice)


def _group_means(dice_rows: Sequence[Mapping[str, float]], groups: Groups) -> dict[str, float]:
    """Per group: mean lesion-wise Dice over the cases, a case without lesions on either side counting 1."""
    return {name: float(np.mean([1.0 if np.isnan(row[name]) else row[name] for row in dice_rows])) for name in groups}


def _objective(dice_rows: Sequence[Mapping[str, float]], groups: Groups) -> float:
    return float(np.mean(list(_group_means(dice_rows, groups).values())))


def _score(case: _TuningCase, labels: np.ndarray, groups: Groups) -> dict[str, float]:
    """The lesion-wise Dice of `labels` for this case; only groups whose mask differs from `current` are
    evaluated, and a map seen before is not evaluated again."""
    key = hashlib.blake2b(np.ascontiguousarray(labels).tobytes(), digest_size=16).digest()
    if key not in case.seen:
        changed = [name for name, values in groups.items()
                   if not np.array_equal(np.isin(labels, values), np.isin(case.current, values))]
        fresh = _lesionwise_dice(labels, case.reference, groups, changed, f"case {case.name}") if changed else {}
        case.seen[key] = {**case.dice, **fresh}
    return case.seen[key]


def _smallest_component(labels: np.ndarray, group_labels: Sequence[int]) -> float:
    components, count = _components(np.isin(labels, group_labels))
    return float(np.bincount(components.ravel())[1:].min()) if count else math.inf


def _rules(plan: PostprocessingPlan) -> list[_Rule]:
    """The rules in tuning order: the relabelling (if the plan has its labels), then each group's size."""
    rules = []
    if plan.enhancing_label is not None and plan.necrosis_label is not None:
        enhancing = plan.enhancing_label
        rules.append(_Rule(
            f"label {enhancing} -> {plan.necrosis_label} below", None,
            lambda current, value: replace(current, small_enhancing_voxels=value),
            lambda labels: float(np.count_nonzero(labels == enhancing)) or math.inf))
    for name, values in plan.groups.items():
        rules.append(_Rule(
            f"{name} components below", name,
            lambda current, value, name=name: replace(
                current, min_component_voxels={**current.min_component_voxels, name: value}),
            lambda labels, values=values: _smallest_component(labels, values)))
    return rules


def _case_score(dice: Mapping[str, float], groups: Groups) -> float:
    """One case's share of the objective: its lesion-wise Dice averaged over the groups (no lesion on either
    side counts 1). The objective is the mean of these over the cases."""
    return float(np.mean([1.0 if np.isnan(dice[name]) else dice[name] for name in groups]))


@dataclass(frozen=True)
class RuleRecord:
    """What the tuner found for one rule: the best grid value (`candidate`, 0 if no value changes anything),
    the cases it changes and how many of them it improves or worsens, the objective before and with it,
    whether it is `kept` (then `value` == `candidate`), and `why` in words."""

    rule: str
    group: str | None  # the evaluation group of a component-size rule; None for the relabelling
    value: int
    candidate: int
    changed_cases: tuple[str, ...]
    improved: int
    worsened: int
    before: float
    after: float
    kept: bool
    why: str

    def to_dict(self) -> dict:
        return {"rule": self.rule, "group": self.group, "value": self.value, "candidate": self.candidate,
                "changed_cases": list(self.changed_cases), "improved": self.improved, "worsened": self.worsened,
                "before": self.before, "after": self.after, "kept": self.kept, "why": self.why}


@dataclass(frozen=True)
class KeepRule:
    """When a rule earns its place (see the module docstring): at least `min_cases` cases to tune on at all;
    a rule's value is kept only if it raises the objective by at least `min_relative_gain` of its value
    before, improves more than half of the cases it changes, and at least `min_improved_cases` of them."""

    min_cases: int = 10
    min_relative_gain: float = 0.01
    min_improved_cases: int = 3

    def rejects(self, before: float, after: float, improved: int, changed: int) -> str:
        """Why a candidate is not kept ("" if it is)."""
        gain = after - before
        if gain <= self.min_relative_gain * max(before, 1e-12):
            return f"gain {gain:+.4f} is below {self.min_relative_gain:.0%} of {before:.4f}"
        if improved * 2 <= changed:
            return f"improves {improved} of the {changed} cases it changes, not a majority"
        if improved < self.min_improved_cases:
            return f"improves {improved} case(s), fewer than {self.min_improved_cases}"
        return ""

    def describe(self) -> str:
        return (f"at least {self.min_cases} out-of-fold cases; a rule is kept when it raises the mean lesion-wise "
                f"Dice by at least {self.min_relative_gain:.0%} (relative), improves a majority of the cases it "
                f"changes and at least {self.min_improved_cases} of them")


KEEP_RULE = KeepRule()


@dataclass
class _Candidate:
    value: int
    plan: PostprocessingPlan
    states: list  # per case: (labels, dice)
    score: float
    changed: list[int]  # indexes of the cases whose labels it changes
    improved: int
    worsened: int


def _try_value(plan: PostprocessingPlan, rule: _Rule, value: int, cases: list[_TuningCase], reaches: list[float],
               groups: Groups) -> _Candidate:
    candidate = rule.with_value(plan, value)
    states, changed, improved, worsened = [], [], 0, 0
    for index, (case, reach) in enumerate(zip(cases, reaches, strict=True)):
        # A value above the rule's reach removes (or relabels) at least one component: the case changes.
        labels = apply(candidate, case.current) if value > reach else case.current
        dice = _score(case, labels, groups) if value > reach else case.dice
        states.append((labels, dice))
        if value > reach:
            changed.append(index)
            delta = _case_score(dice, groups) - _case_score(case.dice, groups)
            improved, worsened = improved + (delta > 1e-12), worsened + (delta < -1e-12)
    score = _objective([dice for _, dice in states], groups)
    return _Candidate(value, candidate, states, score, changed, improved, worsened)


def _tune_rule(plan: PostprocessingPlan, rule: _Rule, cases: list[_TuningCase], groups: Groups,
               grid: Sequence[int], keep: KeepRule) -> tuple[PostprocessingPlan, RuleRecord]:
    """The plan with one rule's grid value when a value earns its place (`keep`), else unchanged, and the
    record of the value shown (the kept one, or else the best). Candidates are applied to the labels the
    rules kept so far produce; a case the candidate cannot change keeps its labels and scores.

    Among the values `keep` accepts, those within the noise margin (`keep.min_relative_gain` of the
    objective before) of the best are ties, and the smallest of them wins: the smaller intervention, and a
    choice that does not jump from 30 to 1000 voxels when a re-evaluation moves the scores by a hair."""
    reaches = [rule.reach(case.current) for case in cases]
    start = _objective([case.dice for case in cases], groups)
    tried = []  # per value changing some case: the candidate without its label maps (memory: one at a time)
    for value in sorted(v for v in grid if v > 0):
        if any(value > reach for reach in reaches):  # else it changes nothing: the score of a smaller value
            tried.append(replace(_try_value(plan, rule, value, cases, reaches, groups), states=[]))
    if not tried:
        return plan, RuleRecord(rule.title, rule.group, 0, 0, (), 0, 0, start, start, False, "changes no case")
    accepted = [c for c in tried if not keep.rejects(start, c.score, c.improved, len(c.changed))]
    if accepted:
        margin = keep.min_relative_gain * max(start, 1e-12)
        top = max(c.score for c in accepted)
        shown = min((c for c in accepted if c.score >= top - margin), key=lambda c: c.value)
    else:
        shown = max(tried, key=lambda c: c.score)  # the first maximum: a tie shows the smaller value
    why = "kept" if accepted else keep.rejects(start, shown.score, shown.improved, len(shown.changed))
    record = RuleRecord(rule.title, rule.group, shown.value if accepted else 0, shown.value,
                        tuple(cases[i].name for i in shown.changed), shown.improved, shown.worsened, start,
                        shown.score, bool(accepted), why)
    if not accepted:
        return plan, record
    kept = _try_value(plan, rule, shown.value, cases, reaches, groups)  # its label maps again (scores cached)
    for case, (labels, dice) in zip(cases, kept.states, strict=True):
        case.current, case.dice = labels, dice
    return kept.plan, record


def tune_postprocessing(cases: Sequence[tuple[LabelSource, LabelSource]], groups: Groups,
                        relabel: tuple[int, int] | None = None, grid: Sequence[int] = MIN_SIZE_GRID,
                        report: Callable[[str], None] | None = None, keep: KeepRule = KEEP_RULE) -> PostprocessingPlan:
    """Choose the postprocessing that clearly raises the mean official lesion-wise Dice on these cases.

    `cases`: (prediction, reference) pairs, each a label array or a NIfTI path, in the challenge's labels
    (typically the out-of-fold predictions of every cv fold). `groups`: the challenge's evaluation groups.
    `relabel`: (enhancing, necrosis) labels for the small-enhancing rule (`relabel_labels(challenge)`),
    None to leave that rule off. `grid`: candidate thresholds in voxels. `keep`: when a rule earns its
    place (`KeepRule`; below `keep.min_cases` cases nothing is tuned and `not_tuned` says why). `report`
    gets one line per rule. The returned plan holds the kept thresholds, a `RuleRecord` per rule and the
    per-group objective without and with the plan (the final plan applied to the raw predictions).
    """
    loaded = [_load_tuning_case(index, pair, groups) for index, pair in enumerate(cases)]
    if not loaded:
        raise DataError("postprocessing: no (prediction, reference) pairs to tune on")
    plan = PostprocessingPlan.identity(groups, relabel)
    before = _group_means([case.dice for case in loaded], groups)
    if len(loaded) < keep.min_cases:
        why = (f"{len(loaded)} out-of-fold cases are fewer than the {keep.min_cases} needed to tell a rule's gain "
               "from noise")
        if report is not None:
            report(f"not tuned: {why}")
        return replace(plan, lesionwise_dice_before=before, lesionwise_dice_after=before, n_cases=len(loaded),
                       not_tuned=why)
    records = []
    for rule in _rules(plan):
        plan, record = _tune_rule(plan, rule, loaded, groups, grid, keep)
        records.append(record.to_dict())
        if report is not None:
            report(f"{rule.title}: {record.value} voxels ({record.why}; best value {record.candidate} changes "
                   f"{len(record.changed_cases)} case(s), mean lesion-wise Dice {record.before:.4f} -> {record.after:.4f})")
    for case in loaded:
        final = apply(plan, case.prediction)
        case.dice, case.current = _score(case, final, groups), final
    after = _group_means([case.dice for case in loaded], groups)
    return replace(plan, lesionwise_dice_before=before, lesionwise_dice_after=after, n_cases=len(loaded),
                   rules=tuple(records))


def describe_label_changes(before: np.ndarray, after: np.ndarray) -> str:
    """What postprocessing did to one label map, for people: "label 2: 493 -> 0 voxels; ..." per label
    whose voxel count changed, or "changed nothing"."""
    values = sorted((set(np.unique(before).tolist()) | set(np.unique(after).tolist())) - {0})
    parts = [f"label {value}: {np.count_nonzero(before == value)} -> {np.count_nonzero(after == value)} voxels"
             for value in values if np.count_nonzero(before == value) != np.count_nonzero(after == value)]
    return "; ".join(parts) if parts else "changed nothing"
