"""Label maps <-> the network's output channels, for both output kinds (`model.outputs`), any challenge.

- "labels" (Ellis/IBM, the paper): one sigmoid channel per label of the case's table, in value order
  (1, 2, 4 for 2017-2021; 1, 2, 3 for GLI 2023; 1 ET, 2 NETC, 3 CC, 4 ED for PED), no background channel.
  Prediction: argmax over the channels mapped back to the label value, 0 where the largest probability is
  below the threshold.
- "softmax": nnU-Net's label-trained models (its default for a dataset without regions): a background
  channel, then one channel per label of the table, mutually exclusive (softmax over the channels in eval
  mode, trained with Dice + cross-entropy on the softmax: `train.loss: dice_ce`). The labels' channel order
  is `model.label_order` (the table's values; default value order; an imported nnU-Net model keeps its
  dataset's order, so that its weights and its argmax's tie-breaking stay nnU-Net's). Prediction: the argmax
  channel's label value, background 0, the first channel on a tie (nnU-Net's `LabelManager` for label
  models: `softmax_helper_dim0`, then `argmax(0)`; no threshold). A voxel known to be background has probability 1
  in the background channel (`background_probabilities`), as nnU-Net writes outside its crop.
- "regions": one channel per region, overlapping masks that are groups of the table (`model.regions`;
  default the challenge's `ChallengeSpec.regions`: WT, TC, ET; + RC for GLI post-treatment and MET; + CC
  for PED; GTV for MEN-RT). Prediction walks the regions from the largest down: where a region is above
  the threshold (inside its parent, and ahead of any disjoint sibling with a higher probability) its own
  label is painted, then its children are painted over it. For WT ⊃ TC ⊃ ET this is the classic nested
  rule: WT -> edema, TC inside WT -> core, ET inside TC -> enhancing.

Which region sets can be trained: the regions must form a laminar family (any two nested or disjoint), no
two may hold the same labels, each region must own exactly one label (the one left when the regions
nested inside it are taken away) and every label of the table must be in some region. Then
labels -> targets -> labels is exact, whatever the challenge; `region_tree` checks it and names
`model.regions` when it does not hold.

A run's regions and output count are said in one place, `run_regions` and `run_output_count` (the table
the run's cases were prepared with + the `model` section): training builds the network and validates with
them, trained models are loaded with them, and evaluation scores `dice_<region>` for the same regions.

Label values always come from the challenge table (`brats_swap.data.challenges`), never from literals.
Everything works on torch tensors and numpy arrays, with or without a batch dimension: a label map has
3 spatial axes (D, H, W) or (B, D, H, W); probabilities/targets have a channel axis just before them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from brats_swap.config import ModelConfig
from brats_swap.data.challenges import ChallengeSpec, get_challenge, isin
from brats_swap.errors import ConfigError

Outputs = Literal["labels", "regions", "softmax"]
OUTPUT_KINDS: tuple[str, ...] = ("labels", "regions", "softmax")
SOFTMAX = "softmax"
BACKGROUND = "background"  # the name of the softmax outputs' first channel

SPATIAL_DIMS = 3


@dataclass(frozen=True)
class Region:
    """One region target: its channel, labels, the one label it owns, and the regions nested right inside."""

    name: str
    channel: int
    values: tuple[int, ...]
    own_label: int
    children: tuple[str, ...]


def _spec(challenge: ChallengeSpec | str) -> ChallengeSpec:
    return get_challenge(challenge)


def _check_outputs(outputs: str) -> None:
    if outputs not in OUTPUT_KINDS:
        raise ValueError(f"model.outputs must be one of {', '.join(OUTPUT_KINDS)}, got {outputs!r}")


def region_names(challenge: ChallengeSpec | str, regions: Sequence[str] | None = None) -> tuple[str, ...]:
    """The region targets: `regions` (group names of the table) if given and non-empty, else the default."""
    spec = _spec(challenge)
    names = tuple(regions) if regions else spec.regions
    unknown = [name for name in names if name not in spec.groups]
    if unknown:
        raise ConfigError(f"model.regions: {unknown[0]!r} is not an evaluation group of the {spec.key} table "
                          f"(groups: {', '.join(spec.groups)})")
    return names


def region_tree(challenge: ChallengeSpec | str, regions: Sequence[str] | None = None) -> dict[str, Region]:
    """The regions by name (channel order), each with its own label and children; ConfigError naming
    `model.regions` when labels could not be recovered from them (see the module docstring)."""
    spec = _spec(challenge)
    names = region_names(spec, regions)
    sets = {name: frozenset(spec.groups[name]) for name in names}

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"model.regions: {problem} in the {spec.key} table, so its labels cannot be "
                           f"recovered from regions {', '.join(names)}")

    if len(set(names)) != len(names) or len(set(sets.values())) != len(sets):
        raise fail("two regions hold the same labels")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if sets[a] & sets[b] and not (sets[a] <= sets[b] or sets[b] <= sets[a]):
                raise fail(f"{a} and {b} overlap without one holding the other")
    parents = {name: min((other for other in names if sets[name] < sets[other]), key=lambda o: len(sets[o]),
                         default=None) for name in names}
    tree = {}
    for channel, name in enumerate(names):
        children = tuple(other for other in names if parents[other] == name)
        own = sets[name] - frozenset().union(*(sets[child] for child in children))
        if len(own) != 1:
            raise fail(f"{name} owns {len(own)} labels besides the regions inside it (needs exactly 1)")
        tree[name] = Region(name, channel, tuple(sorted(sets[name])), next(iter(own)), children)
    uncovered = set(spec.labels) - set().union(*sets.values())
    if uncovered:
        value = min(uncovered)
        raise fail(f"label {value} ({spec.labels[value]}) is in no region")
    return tree


def output_names(challenge: ChallengeSpec | str, outputs: Outputs, regions: Sequence[str] | None = None,
                 label_order: Sequence[int] | None = None) -> list[str]:
    """Channel names, e.g. ["NCR/NET", "ED", "ET"] for labels of 2021, ["background", "NCR/NET", "ED", "ET"] for
    softmax, ["WT", "TC", "ET", "CC"] for PED regions."""
    _check_outputs(outputs)
    spec = _spec(challenge)
    if outputs == "labels":
        return [spec.labels[value] for value in spec.label_values]
    if outputs == SOFTMAX:
        return [BACKGROUND, *(spec.labels[value] for value in channel_values(spec, label_order)[1:])]
    return list(region_tree(spec, regions))


def num_outputs(challenge: ChallengeSpec | str, outputs: Outputs, regions: Sequence[str] | None = None,
                label_order: Sequence[int] | None = None) -> int:
    """How many output channels the network needs for this table, output kind (and `model.regions`)."""
    return len(output_names(challenge, outputs, regions, label_order))


def run_regions(challenge: ChallengeSpec | str, model_cfg: ModelConfig) -> tuple[str, ...]:
    """The regions of a run on `challenge`: what it trains (`model.outputs: regions`, in channel order) and
    what its validation and evaluation score as `dice_<region>` (either output kind). `model.regions`, or the
    challenge's defaults: WT, TC, ET for 2017–2021 (so legacy runs keep exactly those columns), + RC for GLI
    post-treatment and MET, + CC for PED, GTV for MEN-RT."""
    return region_names(challenge, model_cfg.regions)


def run_output_count(challenge: ChallengeSpec | str, model_cfg: ModelConfig) -> int:
    """The network's output channels for a run on `challenge` (`model.outputs`, `model.regions`); ConfigError
    naming `model.regions` when labels could not be recovered from those regions."""
    return num_outputs(challenge, model_cfg.outputs, model_cfg.regions, model_cfg.label_order)


def _stack(masks: list, channel_dim: int):
    if isinstance(masks[0], np.ndarray):
        return np.stack(masks, axis=channel_dim).astype(np.float32)
    import torch  # a torch tensor's masks: torch is loaded

    return torch.stack(masks, dim=channel_dim).to(torch.float32)


def targets_from_labels(label, challenge: ChallengeSpec | str, outputs: Outputs,
                        regions: Sequence[str] | None = None, label_order: Sequence[int] | None = None):
    """Binary float32 targets from a label map: (B, D, H, W) -> (B, C, D, H, W), or (D, H, W) -> (C, D, H, W)."""
    _check_outputs(outputs)
    spec = _spec(challenge)
    if label.ndim not in (SPATIAL_DIMS, SPATIAL_DIMS + 1):
        raise ValueError(f"label map must be (D, H, W) or (B, D, H, W), got shape {tuple(label.shape)}")
    channel_dim = label.ndim - SPATIAL_DIMS
    if outputs == "labels":
        masks = [label == value for value in spec.label_values]
    elif outputs == SOFTMAX:
        masks = [label == value for value in channel_values(spec, label_order)]
    else:
        masks = [isin(label, region.values) for region in region_tree(spec, regions).values()]
    return _stack(masks, channel_dim)


def labels_from_probs(probs, challenge: ChallengeSpec | str, outputs: Outputs, threshold: float = 0.5,
                      regions: Sequence[str] | None = None, label_order: Sequence[int] | None = None):
    """A uint8 label map in the table's raw values from (B, C, D, H, W) or (C, D, H, W) probabilities.

    "labels": argmax channel -> its label value; 0 where the largest probability is < threshold (Ellis's
    `get_prediction_labels`). "softmax": argmax channel -> its value (background 0), no threshold.
    "regions": the region walk of the module docstring.
    """
    spec = _spec(challenge)
    if probs.ndim not in (SPATIAL_DIMS + 1, SPATIAL_DIMS + 2):
        raise ValueError(f"probabilities must be (C, D, H, W) or (B, C, D, H, W), got shape {tuple(probs.shape)}")
    channel_dim = probs.ndim - SPATIAL_DIMS - 1
    expected = num_outputs(spec, outputs, regions, label_order)
    if probs.shape[channel_dim] != expected:
        raise ValueError(f"probabilities have {probs.shape[channel_dim]} channels, "
                         f"{outputs} of {spec.key} need {expected}")
    if outputs in ("labels", SOFTMAX):
        # Softmax: no threshold (the background channel competes in the argmax, as nnU-Net decodes).
        values, floor = ((spec.label_values, threshold) if outputs == "labels"
                         else (channel_values(spec, label_order), None))
        if isinstance(probs, np.ndarray):
            return _argmax_labels_numpy(probs, values, floor, channel_dim)
        return _argmax_labels_torch(probs, values, floor, channel_dim)
    return _labels_from_regions(probs, region_tree(spec, regions), threshold, channel_dim)


def channel_values(challenge: ChallengeSpec | str, label_order: Sequence[int] | None = None) -> tuple[int, ...]:
    """The label value of each softmax channel: 0 (background), then the table's labels in `label_order`
    (`model.label_order`; empty: value order). ConfigError naming it when it is not an order of the table's
    labels."""
    spec = _spec(challenge)
    if not label_order:
        return (0, *spec.label_values)
    if sorted(int(v) for v in label_order) != sorted(spec.label_values):
        raise ConfigError(f"model.label_order: {list(label_order)} is not an order of the {spec.key} table's labels "
                          f"({spec.describe_labels()})")
    return (0, *(int(v) for v in label_order))


def probabilities_from_logits(logits, outputs: Outputs, channel_dim: int = 1):
    """The output kind's probabilities of logits (a torch tensor, or a float32 numpy array: the same formulas,
    torch's to float32 rounding): softmax across the channels for "softmax" (nnU-Net's `softmax_helper`), an
    elementwise sigmoid otherwise."""
    _check_outputs(outputs)
    if isinstance(logits, np.ndarray):
        if outputs != SOFTMAX:
            return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
        shifted = np.exp(logits - logits.max(axis=channel_dim, keepdims=True))
        return (shifted / shifted.sum(axis=channel_dim, keepdims=True)).astype(np.float32)
    import torch

    return torch.softmax(logits, channel_dim) if outputs == SOFTMAX else torch.sigmoid(logits)


def background_probabilities(outputs: Outputs, channels: int) -> list[float]:
    """Per channel, the probability of a voxel known to be background (outside the brain's crop): 1 in the
    background channel of "softmax" (as nnU-Net's `revert_cropping_on_probabilities`), 0 everywhere else."""
    _check_outputs(outputs)
    return [1.0 if outputs == SOFTMAX and channel == 0 else 0.0 for channel in range(channels)]


def _argmax_labels_numpy(probs: np.ndarray, values: Sequence[int], threshold: float | None,
                         channel_dim: int) -> np.ndarray:
    label = np.asarray(values, dtype=np.uint8)[np.argmax(probs, axis=channel_dim)]
    if threshold is not None:
        label[np.max(probs, axis=channel_dim) < threshold] = 0
    return label


def _argmax_labels_torch(probs, values: Sequence[int], threshold: float | None, channel_dim: int):
    import torch

    max_prob, index = probs.max(dim=channel_dim)
    label = torch.tensor(values, dtype=torch.uint8, device=probs.device)[index]
    if threshold is not None:
        label[max_prob < threshold] = 0
    return label


def _labels_from_regions(probs, tree: dict[str, Region], threshold: float, channel_dim: int):
    """Paint each region's own label where it wins, largest regions first (children over their parent)."""
    numpy = isinstance(probs, np.ndarray)

    def channel(region: Region):
        return np.take(probs, region.channel, axis=channel_dim) if numpy else probs.select(channel_dim, region.channel)

    first = channel(next(iter(tree.values())))
    if numpy:
        label = np.zeros(first.shape, dtype=np.uint8)
    else:
        import torch

        label = torch.zeros(first.shape, dtype=torch.uint8, device=probs.device)
    roots = [region for region in tree.values() if not any(region.name in r.children for r in tree.values())]
    pending = [(roots, None)]  # (siblings, mask of where their parent won; None = everywhere)
    while pending:
        siblings, allowed = pending.pop(0)
        for region, won in zip(siblings, _winners([channel(r) for r in siblings], threshold, numpy), strict=True):
            if allowed is not None:
                won = won & allowed
            label[won] = region.own_label
            if region.children:
                pending.append(([tree[name] for name in region.children], won))
    return label


def _winners(sibling_probs: list, threshold: float, numpy: bool) -> list:
    """Per sibling, where it is above the threshold and no other sibling there has a higher probability
    (ties: the first in channel order). Siblings are disjoint in the truth, so at most one may win."""
    active = [p > threshold for p in sibling_probs]
    if len(sibling_probs) == 1:
        return active
    if numpy:
        scores = np.stack([np.where(a, p, -1.0) for a, p in zip(active, sibling_probs, strict=True)])
        best = np.argmax(scores, axis=0)
    else:
        import torch

        scores = torch.stack([torch.where(a, p, torch.full_like(p, -1.0)) for a, p in
                              zip(active, sibling_probs, strict=True)])
        best = torch.argmax(scores, dim=0)
    return [a & (best == index) for index, a in enumerate(active)]
