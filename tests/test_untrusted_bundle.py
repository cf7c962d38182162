"""Issue 31, bundles: a bundle made or changed by someone else is opened without trusting anything in it.

Each hostile bundle below is self-consistent (metadata.json's sha256 recomputed), so the refusal comes from the
check under test, in one line naming the bundle; the allocation tests run under a memory limit.
"""

from __future__ import annotations

import io
import pathlib
import stat
import zipfile

import pytest
import torch
import yaml
from ship_helpers import task_run
from typer.testing import CliRunner
from untrusted_helpers import GIB, members_of, memory_limit, rewrite_bundle, zip_with_inflating_member

from brats_swap.cli.main import app
from brats_swap.errors import BratsSwapError, CheckpointError
from brats_swap.model.pricing import MAX_NETWORK_PARAMETERS
from brats_swap.ship.bundle import (
    CONFIG,
    METADATA,
    bundle_predictor,
    export_bundle,
    fold_config,
    fold_weights,
    open_bundle,
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    base = tmp_path_factory.mktemp("untrusted-bundle")
    return export_bundle(task_run(base, "met", 1), base / "met.zip").path


def _one_line_refusal(call, *words: str) -> str:
    with pytest.raises(BratsSwapError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message
    return message


def _container(bundle_path, out):
    return CliRunner().invoke(app, ["container", "--model", str(bundle_path), "--out", str(out)])


def test_a_newline_in_the_bundle_name_is_refused_before_anything_is_written(bundle, tmp_path):
    hostile = rewrite_bundle(bundle, tmp_path / "b.zip", lambda meta, _: meta.update(name="x\nRUN touch /PWNED"))
    result = _container(hostile, tmp_path / "image")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert "bundle name" in errors[0] and "control character" in errors[0] and str(hostile) in errors[0]
    assert not (tmp_path / "image" / "Dockerfile").exists()


@pytest.mark.parametrize(("change", "words"), [
    (lambda meta, _: meta.update(folds=[]), ("'folds' is empty",)),
    (lambda meta, _: meta.pop("challenge"), ("no 'challenge' entry",)),
    (lambda meta, _: meta.update(challenge="../../gli"), ("challenge", "separator")),
    (lambda meta, _: meta.update(folds=[{"fold": 0, "checkpoint": "best"}] * 2), ("each fold once",)),
])
def test_malformed_metadata_is_one_line(bundle, tmp_path, change, words):
    hostile = rewrite_bundle(bundle, tmp_path / "b.zip", change)
    _one_line_refusal(lambda: open_bundle(hostile), str(hostile), METADATA, *words)


def test_a_fold_config_that_is_not_a_mapping_is_one_line(bundle, tmp_path):
    hostile = rewrite_bundle(bundle, tmp_path / "b.zip",
                             lambda _, members: members.update({fold_config(0): b"- a list\n- not a config\n"}))
    _one_line_refusal(lambda: bundle_predictor(open_bundle(hostile)), fold_config(0), "expected a mapping")


class _Payload:
    """What a hostile pickle would run on load: touch a file."""

    marker: pathlib.Path

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_pickle_payload_in_the_weights_is_refused_in_one_line_and_never_runs(bundle, tmp_path):
    payload = _Payload()
    payload.marker = tmp_path / "PWNED"
    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(1), "payload": payload}, buffer)
    hostile = rewrite_bundle(bundle, tmp_path / "b.zip",
                             lambda _, members: members.update({fold_weights(0): buffer.getvalue()}))
    _one_line_refusal(lambda: bundle_predictor(open_bundle(hostile)), fold_weights(0), "weights_only")
    assert not payload.marker.exists()


def test_duplicate_and_symlink_members_are_refused(bundle, tmp_path):
    duplicate = rewrite_bundle(bundle, tmp_path / "dup.zip")
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(duplicate, "a") as archive:
        archive.writestr(CONFIG, b"name: the-other-one\n")
    _one_line_refusal(lambda: open_bundle(duplicate), CONFIG, "appears twice")

    link = rewrite_bundle(bundle, tmp_path / "link.zip")
    with zipfile.ZipFile(link, "a") as archive:
        info = zipfile.ZipInfo("configs/link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(info, "/etc/passwd")
    _one_line_refusal(lambda: open_bundle(link), "configs/link", "symlink")


@pytest.mark.parametrize("member", [METADATA, CONFIG])
def test_a_member_inflating_to_2_gib_is_refused_by_its_size_under_a_memory_limit(bundle, tmp_path, member):
    members = members_of(bundle)
    big = members.pop(member)
    assert len(big) < 2**20
    hostile = zip_with_inflating_member(tmp_path / "bomb.zip", members, member, 2 * GIB)
    assert hostile.stat().st_size < 8 * 2**20
    with memory_limit(GIB):
        _one_line_refusal(lambda: open_bundle(hostile), member, "declares 2,147,483,648 bytes")
    # The same stream declared as 1 KiB: the reader stops at the declared size (and the CRC then fails), it never
    # inflates the rest.
    lying = zip_with_inflating_member(tmp_path / "lying.zip", members, member, 2 * GIB, declared=1024)
    with memory_limit(GIB):
        _one_line_refusal(lambda: open_bundle(lying), member)


def _base_filters(count: int):
    """A `rewrite_bundle` change: fold 0's config asks for `count` base filters (its weights stay)."""
    def change(_, members):
        raw = yaml.safe_load(members[fold_config(0)])
        raw["model"]["base_filters"] = count
        members[fold_config(0)] = yaml.safe_dump(raw).encode()

    return change


def test_a_fold_config_asking_for_a_huge_network_is_priced_and_refused_before_it_is_built(bundle, tmp_path):
    hostile = rewrite_bundle(bundle, tmp_path / "huge.zip", _base_filters(4096))
    with memory_limit(GIB):  # the network asked for is over a terabyte of weights
        message = _one_line_refusal(lambda: bundle_predictor(open_bundle(hostile)), str(hostile), fold_config(0),
                                    f"{MAX_NETWORK_PARAMETERS:,}")
    assert "parameters" in message and "not built" in message


def test_weights_that_do_not_fit_the_fold_config_are_refused_before_the_build(bundle, tmp_path):
    hostile = rewrite_bundle(bundle, tmp_path / "wider.zip", _base_filters(3))
    with pytest.raises(CheckpointError, match=r"has shape \[.*\], the network's is"):
        bundle_predictor(open_bundle(hostile))


def test_an_untouched_bundle_still_opens_and_loads(bundle):
    predictor = bundle_predictor(open_bundle(bundle))
    assert len(predictor.members) == 1


def test_folds_predicting_different_outputs_are_refused_as_a_run_folder_refuses_them(tmp_path):
    """A bundle is loaded by the same loader as a run folder: folds whose outputs differ (regions vs labels:
    three channels each for MET, so the weights still fit) cannot be averaged and are refused in one line."""
    two = export_bundle(task_run(tmp_path, "met", 2), tmp_path / "two.zip").path

    def regions_in_fold_1(_, members):
        raw = yaml.safe_load(members[fold_config(1)])
        raw["model"]["outputs"] = "regions"
        members[fold_config(1)] = yaml.safe_dump(raw).encode()

    mixed = rewrite_bundle(two, tmp_path / "mixed.zip", regions_in_fold_1)
    _one_line_refusal(lambda: bundle_predictor(open_bundle(mixed)), str(mixed), "model.outputs", "--folds K")
    assert len(bundle_predictor(open_bundle(mixed), 1).members) == 1  # one of them alone still predicts
