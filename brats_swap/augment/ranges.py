"""The ranges a recipe draws its values from, and the draws every transform shares: one scalar from a range,
and "the transform fires with p, then on each channel with p_channel"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BGContrastRange:
    """batchgeneratorsv2's `BGContrast` draw: half the time U(low, 1), otherwise U(max(low, 1), high), so a
    factor below one is as likely as one above it however lopsided the range is."""

    low: float
    high: float


@dataclass(frozen=True)
class UniformRange:
    low: float
    high: float


def draw_scalar(rng: np.random.Generator, spec: UniformRange | BGContrastRange) -> float:
    if isinstance(spec, BGContrastRange):
        if rng.random() < 0.5 and spec.low < 1:
            return float(rng.uniform(spec.low, 1.0))
        return float(rng.uniform(max(spec.low, 1.0), spec.high))
    return float(rng.uniform(spec.low, spec.high))


def draw_per_channel(rng: np.random.Generator, p: float, p_channel: float, spec: UniformRange | BGContrastRange,
                     channels: int, neutral: float) -> tuple[float, ...]:
    """A transform that fires with p, then on each channel with p_channel, one draw per chosen channel."""
    if not rng.random() < p:
        return (neutral,) * channels
    chosen = rng.random(channels) < p_channel
    return tuple(draw_scalar(rng, spec) if use else neutral for use in chosen)
