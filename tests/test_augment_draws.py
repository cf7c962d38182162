"""The nnU-Net recipes' `draw` draws what batchgeneratorsv2 draws: over 3,000 seeded draws per recipe, each
transform fires as often (Fisher's exact test) and each parameter has the same distribution (two-sample
Kolmogorov-Smirnov), both at p > 0.001. The same checks reject recipes with one probability or range
changed (the negative controls below), so they would catch a wrong range or probability."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from augment_helpers import (
    angles_and_scales,
    bg_range,
    intensity_fields,
    intensity_transforms,
    spatial_transform,
)
from batchgeneratorsv2.helpers.scalar_type import sample_scalar
from batchgeneratorsv2.transforms.spatial.mirroring import MirrorTransform
from batchgeneratorsv2.transforms.utils.random import RandomTransform
from scipy.stats import fisher_exact, ks_2samp

from brats_swap.augment import get_recipe
from brats_swap.augment.ranges import BGContrastRange, UniformRange
from brats_swap.augment.recipes import NNUNET, Recipe

NNUNET_RECIPES = ("nnunet", "nnunet_brats2020")

DRAWS = 3000
CHANNELS = 2
PATCH = (8, 8, 8)
ALPHA = 1e-3


NEUTRAL = {"blur": ((0.0, 0.0, 0.0),) * CHANNELS, "noise": 0.0, "additive_brightness": (0.0,) * CHANNELS}


class Stats:
    """Counts (fired, out of) and pooled values, by name."""

    def __init__(self):
        self.rates = defaultdict(lambda: [0, 0])
        self.values = defaultdict(list)

    def rate(self, name, fired, out_of=1):
        self.rates[name][0] += int(fired)
        self.rates[name][1] += out_of

    def add(self, name, values):
        self.values[name].extend(float(v) for v in values)


def _spatial_stats(stats: Stats, rotation, scaling, elastic_scale, magnitude_ratios):
    rotated = any(abs(a) > 1e-9 for a in rotation)
    scaled = any(abs(s - 1) > 1e-9 for s in scaling)
    stats.rate("rotation fires", rotated)
    stats.rate("scaling fires", scaled)
    stats.rate("elastic fires", elastic_scale is not None)
    stats.rate("rotation and scaling both fire", rotated and scaled)  # drawn separately
    if rotated:
        stats.add("rotation angles", rotation)
    if scaled:
        # one value per independent draw: a factor shared by all axes counts once
        shared = max(scaling) - min(scaling) < 1e-9
        stats.add("scaling factors", scaling[:1] if shared else scaling)
        stats.rate("one scaling factor for all axes", shared)
    if elastic_scale is not None:
        stats.add("elastic deformation scale", [elastic_scale])
        stats.add("elastic magnitude / sigma", magnitude_ratios)


def _intensity_stats(stats: Stats, name: str, fields: dict | None):
    """`fields`: {step name: value} of the transform (neutral where not applied), None if it did not fire."""
    if name == "noise":
        stats.rate("noise fires", fields is not None)
        if fields is not None:
            stats.add("noise std", [fields["noise"]])
        return
    neutral_value = NEUTRAL.get(name, (1.0,) * CHANNELS)[0]
    values = fields[name] if fields is not None else (neutral_value,) * CHANNELS
    chosen = [v for v in values if v != neutral_value]
    if name in ("blur", "low_resolution"):  # a per-channel probability after the transform's
        stats.rate(f"{name} on a channel", len(chosen), CHANNELS)
    else:
        stats.rate(f"{name} fires", fields is not None)
    for v in chosen:
        if name == "blur":  # one value per independent draw: a sigma shared by all axes counts once
            stats.add("blur values", v[:1] if max(v) - min(v) < 1e-9 else v)
        else:
            stats.add(f"{name} values", [v])


def _ours(r: Recipe, seed: int) -> Stats:
    rng = np.random.default_rng(seed)
    stats = Stats()
    names = list(intensity_transforms(r))
    for _ in range(DRAWS):
        p = r.draw(rng, PATCH, CHANNELS)
        s = p.spatial
        elastic = any(m != 0 for m in s.elastic_magnitudes)
        _spatial_stats(stats, s.rotation, s.scaling, s.elastic_sigmas[0] / PATCH[0] if elastic else None,
                       [m / e for m, e in zip(s.elastic_magnitudes, s.elastic_sigmas, strict=True)] if elastic else [])
        fields = dict(p.steps)
        for name in names:
            fired = fields[name] != NEUTRAL.get(name, (1.0,) * CHANNELS)
            # blur and low resolution are counted per channel, whether the transform fired or not
            _intensity_stats(stats, name, fields if fired or name in ("blur", "low_resolution") else None)
        for axis in range(3):
            stats.rate("mirror per axis", p.value("mirror")[axis])
    return stats


def _reference(r: Recipe, seed: int) -> Stats:
    """batchgeneratorsv2's draws: each transform's own get_parameters, in nnU-Net's order."""
    np.random.seed(seed)
    torch.manual_seed(seed)
    recorded = {}

    def deformation_scale(**_):
        recorded["scale"] = sample_scalar(bg_range(r.spatial.elastic_deform_scale))
        return recorded["scale"]

    def magnitude(patch_size=None, dim=None, deformation_scale=None, **_):
        sigma = deformation_scale * patch_size[dim]
        recorded.setdefault("ratios", []).append(np.random.uniform(sigma / 8, sigma / 2) / sigma)
        return recorded["ratios"][-1] * sigma

    spatial = spatial_transform(r, PATCH, elastic_deform_scale=deformation_scale,
                                elastic_deform_magnitude=magnitude)
    randoms = {name: RandomTransform(t, p) for name, (p, t) in intensity_transforms(r).items()}
    mirror = MirrorTransform(allowed_axes=(0, 1, 2))
    image = torch.zeros((CHANNELS, *PATCH))
    stats = Stats()
    for _ in range(DRAWS):
        recorded.clear()
        params = spatial.get_parameters(image=image)
        rotation, scaling = angles_and_scales(params["affine"]) if params["affine"] is not None else ((0,) * 3,
                                                                                                   (1,) * 3)
        elastic = params["elastic_offsets"] is not None
        _spatial_stats(stats, rotation, scaling, recorded["scale"] if elastic else None, recorded.get("ratios"))
        for name, random_transform in randoms.items():
            fired = random_transform.get_parameters(image=image)["apply_transform"]
            fields = intensity_fields(name, random_transform.transform.get_parameters(image=image), CHANNELS) \
                if fired else None
            _intensity_stats(stats, name, fields)
        axes = mirror.get_parameters(image=image)["axes"]
        for axis in range(3):
            stats.rate("mirror per axis", axis in axes)
    return stats


def _mismatches(ours: Stats, reference: Stats) -> dict[str, float]:
    """name -> p-value of every statistic whose two samples differ at ALPHA."""
    bad = {}
    assert set(ours.rates) == set(reference.rates) and set(ours.values) == set(reference.values)
    for name, (k1, n1) in ours.rates.items():
        k2, n2 = reference.rates[name]
        p = fisher_exact([[k1, n1 - k1], [k2, n2 - k2]]).pvalue
        if p < ALPHA:
            bad[name] = p
    for name, values in ours.values.items():
        p = ks_2samp(values, reference.values[name]).pvalue
        if p < ALPHA:
            bad[name] = p
    return bad


_REFERENCE_CACHE: dict[str, Stats] = {}


def _reference_for(name: str) -> Stats:
    if name not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[name] = _reference(get_recipe(name).table, seed=11)
    return _REFERENCE_CACHE[name]


@pytest.mark.parametrize("name", NNUNET_RECIPES)
def test_every_probability_and_distribution_matches_batchgeneratorsv2(name):
    reference = _reference_for(name)
    ours = _ours(get_recipe(name).table, seed=7)
    assert len(ours.rates) >= 10 and len(ours.values) >= 8  # the checks below are not vacuous
    assert _mismatches(ours, reference) == {}


@pytest.mark.parametrize("change, caught", [
    ({"noise": {"p": 0.15}}, "noise fires"),
    ({"spatial": {"p_scaling": 0.3}}, "rotation and scaling both fire"),
    ({"spatial": {"p_rotation": 0.26}}, "rotation fires"),
    ({"spatial": {"rotation": UniformRange(-25 / 180 * np.pi, 25 / 180 * np.pi)}}, "rotation angles"),
    ({"spatial": {"scaling": UniformRange(0.7, 1.3)}}, "scaling factors"),
    ({"gamma": {"range": UniformRange(0.7, 1.5)}}, "gamma values"),  # BGContrast's halves dropped
    ({"low_resolution": {"p_per_channel": 0.65}}, "low_resolution on a channel"),
    ({"contrast": {"range": BGContrastRange(0.75, 1.4)}}, "contrast values"),
])
def test_the_checks_catch_a_wrong_probability_or_range(change, caught):
    wrong = NNUNET.with_changes(**change)
    assert caught in _mismatches(_ours(wrong, seed=7), _reference_for("nnunet"))


def test_the_brats2020_recipe_draws_per_axis_scaling_and_elastic_deformation():
    rng = np.random.default_rng(3)
    draws = [get_recipe("nnunet_brats2020").draw(rng, (64, 64, 64), 4) for _ in range(500)]
    elastic = [p.spatial for p in draws if any(m != 0 for m in p.spatial.elastic_magnitudes)]
    assert 100 < len(elastic) < 200  # p 0.3
    for p in elastic:
        assert len(set(p.elastic_sigmas)) == 1 and 0 <= p.elastic_sigmas[0] <= 0.25 * 64
        assert all(s / 8 <= m <= s / 2 for m, s in zip(p.elastic_magnitudes, p.elastic_sigmas, strict=True))
    scaled = [p.spatial for p in draws if any(s != 1 for s in p.spatial.scaling)]
    assert any(len(set(p.scaling)) == 3 for p in scaled) and any(len(set(p.scaling)) == 1 for p in scaled)
    assert all(0.65 <= s <= 1.6 for p in scaled for s in p.scaling)
    blurred = [sig for p in draws for sig in p.value("blur") if sig != (0.0, 0.0, 0.0)]
    assert blurred and all(len(set(sig)) == 1 for sig in blurred)  # one sigma for all axes (v1's default)
