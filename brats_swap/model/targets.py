"""Label maps <-> the network's output channels, for both output kinds (`model.outputs`).

- "labels" (Ellis/IBM, the paper): one sigmoid channel per tumour label of the edition, in table order
  (1, 2, 4 for 2017-2021; 1, 2, 3 for 2023), no background channel. Prediction: argmax over the
  channels mapped back to the label value, 0 where the largest probability is below the threshold.
- "regions": one channel per BraTS region WT, TC, ET (nested masks). Prediction: the nested rule
  WT -> edema label, TC inside WT -> core label, ET inside TC -> enhancing label.

Label values always come from the edition table (`brats_swap.data.editions`), never from literals.
Everything works on torch tensors and numpy arrays, with or without a batch dimension: a label map has
3 spatial axes (D, H, W) or (B, D, H, W); probabilities/targets have a channel axis just before them.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from brats_swap.data.editions import REGIONS, EditionSpec, get_edition, region_masks

Outputs = Literal["labels", "regions"]

SPATIAL_DIMS = 3


def _spec(edition: EditionSpec | str) -> EditionSpec:
    return get_edition(edition) if isinstance(edition, str) else edition


def output_names(edition: EditionSpec | str, outputs: Outputs) -> list[str]:
    """Channel names, e.g. ["NCR/NET", "ED", "ET"] for labels of 2021, ["WT", "TC", "ET"] for regions."""
    spec = _spec(edition)
    if outputs == "labels":
        return [spec.labels[value] for value in spec.label_values]
    if outputs == "regions":
        return list(REGIONS)
    raise ValueError(f"model.outputs must be 'labels' or 'regions', got {outputs!r}")


def num_outputs(edition: EditionSpec | str, outputs: Outputs) -> int:
    """How many sigmoid channels the network needs for this edition and output kind."""
    return len(output_names(edition, outputs))


def core_label(edition: EditionSpec | str) -> int:
    """The tumour-core label that is neither edema nor enhancing (NCR/NET in 2017-2021, NETC in 2023)."""
    spec = _spec(edition)
    others = [v for v in spec.label_values if v not in (spec.edema, spec.enhancing)]
    if len(others) != 1:
        raise ValueError(f"edition {spec.name} has no single core label besides edema and enhancing: {others}")
    return others[0]


def _stack(masks: list, channel_dim: int):
    if isinstance(masks[0], np.ndarray):
        return np.stack(masks, axis=channel_dim).astype(np.float32)
    return torch.stack(masks, dim=channel_dim).to(torch.float32)


def targets_from_labels(label, edition: EditionSpec | str, outputs: Outputs):
    """Binary float32 targets from a label map: (B, D, H, W) -> (B, C, D, H, W), or (D, H, W) -> (C, D, H, W)."""
    spec = _spec(edition)
    if label.ndim not in (SPATIAL_DIMS, SPATIAL_DIMS + 1):
        raise ValueError(f"label map must be (D, H, W) or (B, D, H, W), got shape {tuple(label.shape)}")
    channel_dim = label.ndim - SPATIAL_DIMS
    if outputs == "labels":
        masks = [label == value for value in spec.label_values]
    elif outputs == "regions":
        regions = region_masks(label, spec)
        masks = [regions[name] for name in REGIONS]
    else:
        raise ValueError(f"model.outputs must be 'labels' or 'regions', got {outputs!r}")
    return _stack(masks, channel_dim)


def labels_from_probs(probs, edition: EditionSpec | str, outputs: Outputs, threshold: float = 0.5):
    """A uint8 label map in the edition's raw values from (B, C, D, H, W) or (C, D, H, W) probabilities.

    "labels": argmax channel -> its label value; 0 where the largest probability is < threshold (Ellis's
    `get_prediction_labels`). "regions": 0, then edema where WT > threshold, the core label where also
    TC > threshold, the enhancing label where also ET > threshold.
    """
    spec = _spec(edition)
    if probs.ndim not in (SPATIAL_DIMS + 1, SPATIAL_DIMS + 2):
        raise ValueError(f"probabilities must be (C, D, H, W) or (B, C, D, H, W), got shape {tuple(probs.shape)}")
    channel_dim = probs.ndim - SPATIAL_DIMS - 1
    expected = num_outputs(spec, outputs)
    if probs.shape[channel_dim] != expected:
        raise ValueError(f"probabilities have {probs.shape[channel_dim]} channels, "
                         f"{outputs} of edition {spec.name} need {expected}")
    if isinstance(probs, np.ndarray):
        return _labels_from_probs_numpy(probs, spec, outputs, threshold, channel_dim)
    return _labels_from_probs_torch(probs, spec, outputs, threshold, channel_dim)


def _labels_from_probs_numpy(probs: np.ndarray, spec: EditionSpec, outputs: Outputs, threshold: float,
                             channel_dim: int) -> np.ndarray:
    if outputs == "labels":
        values = np.asarray(spec.label_values, dtype=np.uint8)
        label = values[np.argmax(probs, axis=channel_dim)]
        label[np.max(probs, axis=channel_dim) < threshold] = 0
        return label
    wt, tc, et = (np.take(probs, i, axis=channel_dim) > threshold for i in range(len(REGIONS)))
    label = np.zeros(wt.shape, dtype=np.uint8)
    label[wt] = spec.edema
    label[wt & tc] = core_label(spec)
    label[wt & tc & et] = spec.enhancing
    return label


def _labels_from_probs_torch(probs: torch.Tensor, spec: EditionSpec, outputs: Outputs, threshold: float,
                             channel_dim: int) -> torch.Tensor:
    if outputs == "labels":
        values = torch.tensor(spec.label_values, dtype=torch.uint8, device=probs.device)
        max_prob, index = probs.max(dim=channel_dim)
        label = values[index]
        label[max_prob < threshold] = 0
        return label
    wt, tc, et = (probs.select(channel_dim, i) > threshold for i in range(len(REGIONS)))
    label = torch.zeros(wt.shape, dtype=torch.uint8, device=probs.device)
    label[wt] = spec.edema
    label[wt & tc] = core_label(spec)
    label[wt & tc & et] = spec.enhancing
    return label
