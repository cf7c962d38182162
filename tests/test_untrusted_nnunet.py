"""Issue 31, nnU-Net results folders: every problem of a plans file, a dataset.json or a checkpoint that
`import-nnunet` reads is one line naming the file, before anything is written; the plans' network is priced
before it could be built (under a memory limit) and must take every fold's weights.

Each case edits a copy of nnU-Net's own results folder (tests/fixtures/nnunet_results, see test_nnunet_import).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner
from untrusted_helpers import GIB, memory_limit

from brats_swap.cli.main import app
from brats_swap.errors import BratsSwapError
from brats_swap.model.pricing import MAX_NETWORK_PARAMETERS
from brats_swap.ship.nnunet_import import import_nnunet

pytest.importorskip("dynamic_network_architectures")
RESULTS = (Path(__file__).parent / "fixtures" / "nnunet_results" / "Dataset991_BraTSPhantoms"
           / "nnUNetTrainerTiny__nnUNetPlans__3d_fullres")
CHECKPOINT = "checkpoint_final.pth"


def _results(tmp_path: Path, edit_plans=None, edit_dataset=None, checkpoint: bytes | None = None) -> Path:
    """A copy of the fixture's results folder with plans.json, dataset.json or the checkpoint changed."""
    results = tmp_path / RESULTS.name
    (results / "fold_0").mkdir(parents=True)
    for name, edit in (("plans.json", edit_plans), ("dataset.json", edit_dataset)):
        record = json.loads((RESULTS / name).read_text())
        if edit is not None:
            edit(record)
        (results / name).write_text(json.dumps(record))
    if checkpoint is None:
        (results / "fold_0" / CHECKPOINT).symlink_to(RESULTS / "fold_0" / CHECKPOINT)
    else:
        (results / "fold_0" / CHECKPOINT).write_bytes(checkpoint)
    return results


def _refused(results: Path, tmp_path: Path, *words: str) -> str:
    with pytest.raises(BratsSwapError) as caught:
        import_nnunet(results, tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message
    assert not (tmp_path / "run").exists()
    return message


def _full(plans: dict) -> dict:
    return plans["configurations"]["3d_fullres"]


def _kwargs(plans: dict) -> dict:
    return _full(plans)["architecture"]["arch_kwargs"]


PLANS_PROBLEMS = {
    "configurations a list": (lambda p: p.update(configurations=list(p["configurations"].values())),
                              "configurations is"),
    "no kernel_sizes": (lambda p: _kwargs(p).pop("kernel_sizes"), "arch_kwargs.kernel_sizes is None"),
    "strides an int": (lambda p: _kwargs(p).update(strides=2), "arch_kwargs.strides is 2"),
    "a stride an int": (lambda p: _kwargs(p)["strides"].__setitem__(1, 2), "arch_kwargs.strides[1] is 2"),
    "features a string": (lambda p: _kwargs(p).update(features_per_stage="4,8,16"), "features_per_stage is"),
    "patch_size missing": (lambda p: _full(p).pop("patch_size"), "patch_size is None"),
    "patch_size a string": (lambda p: _full(p).update(patch_size="20x28x24"), "patch_size is '20x28x24'"),
    "unknown inherits_from": (lambda p: _full(p).update(inherits_from="3d_nowhere"), "'3d_nowhere', which is not"),
    "transpose_forward wrong": (lambda p: p.update(transpose_forward=[0, 1, 1]), "transpose_forward is [0, 1, 1]"),
    "transpose_forward a string": (lambda p: p.update(transpose_forward="012"), "transpose_forward is '012'"),
    "spacing a string": (lambda p: _full(p).update(spacing="1,1,1"), "spacing is '1,1,1'"),
    "a configuration not a mapping": (lambda p: p["configurations"].update({"3d_fullres": "big"}), "expected a mapping"),
}


@pytest.mark.parametrize("problem", PLANS_PROBLEMS)
def test_each_plans_problem_is_one_line_naming_the_key(tmp_path, problem):
    edit, words = PLANS_PROBLEMS[problem]
    _refused(_results(tmp_path, edit_plans=edit), tmp_path, "plans.json", words)


@pytest.mark.timeout(60)  # the loop this guards against never ends
def test_an_inherits_from_cycle_is_one_line(tmp_path):
    def cycle(plans):
        plans["configurations"]["3d_lowres"] = {"inherits_from": "3d_fullres"}
        _full(plans)["inherits_from"] = "3d_lowres"

    _refused(_results(tmp_path, edit_plans=cycle), tmp_path, "inherits_from loops: 3d_fullres -> 3d_lowres -> 3d_fullres")


def test_a_parent_configuration_is_merged_in(tmp_path):
    def split(plans):
        full = _full(plans)
        plans["configurations"]["base"] = {"architecture": full.pop("architecture")}
        full["inherits_from"] = "base"

    assert import_nnunet(_results(tmp_path, edit_plans=split), tmp_path / "run").folds == [0]


def _saved(record) -> bytes:
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(("checkpoint", "words"), [
    (b"", "unreadable nnU-Net checkpoint"),
    (_saved({"network_weights": {"encoder.stages.0.0.convs.0.conv.weight": [1.0, 2.0]}}), "is a list, not a tensor"),
])
def test_an_empty_or_foreign_checkpoint_is_one_line(tmp_path, checkpoint, words):
    _refused(_results(tmp_path, checkpoint=checkpoint), tmp_path, CHECKPOINT, words)


def test_declared_channels_that_the_weights_contradict_are_refused_at_import(tmp_path):
    three = _results(tmp_path, edit_dataset=lambda d: d["channel_names"].pop("3"))
    _refused(three, tmp_path, CHECKPOINT, "3 channel(s)", "[4, 4, 3, 3, 3]")


def test_a_plan_asking_for_a_huge_network_is_priced_before_it_is_built(tmp_path):
    def huge(plans):
        _kwargs(plans)["features_per_stage"] = [4096, 8192, 16384]

    with memory_limit(GIB):
        _refused(_results(tmp_path, edit_plans=huge), tmp_path, "plans.json", f"{MAX_NETWORK_PARAMETERS:,}",
                 "parameters")


def test_the_cli_prints_the_one_line(tmp_path):
    results = _results(tmp_path, edit_plans=lambda p: _full(p).update(patch_size="big"))
    result = CliRunner().invoke(app, ["import-nnunet", str(results), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and result.output.startswith("error: ") and "patch_size" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
