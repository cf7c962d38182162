"""`brats-swap container` checks the torch wheel its Dockerfile installs, as far as it can without network
(ship/container.py: `check_torch_wheel`): refused when the cu128 index cannot hold it, said when unknown."""

from __future__ import annotations

import pytest

from brats_swap.errors import ConfigError
from brats_swap.ship.container import TORCH_CU128_KNOWN, TORCH_INDEX, check_torch_wheel


def test_a_known_release_passes_silently():
    assert all(check_torch_wheel(release) is None for release in TORCH_CU128_KNOWN)


@pytest.mark.parametrize("release, problem", [("2.6.0", "no wheel before 2.7.0"), ("2.13.0a0", "pre-release"),
                                              ("2.10.0.dev20260101", "pre-release")])
def test_a_release_the_index_cannot_hold_is_refused_in_one_line(release, problem):
    with pytest.raises(ConfigError, match=problem) as error:
        check_torch_wheel(release)
    assert "\n" not in str(error.value) and TORCH_INDEX in str(error.value)


def test_a_release_newer_than_the_table_is_said_to_be_unchecked():
    note = check_torch_wheel("2.13.0")
    assert note.startswith("torch 2.13.0: newer than") and "not checked (no network)" in note
