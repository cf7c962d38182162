"""The checkpoint file format (brats_swap/run/checkpoint.py): the payload travels as a uint8 tensor (its raw
bytes), a file of format 1 (payload as `bytes`) still loads, and a record of neither shape is refused in one
line."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from brats_swap.errors import CheckpointError
from brats_swap.run.checkpoint import load_checkpoint, save_checkpoint


def _state() -> dict:
    return {"model": {"weight": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))}, "epoch": 3}


def test_a_checkpoint_is_about_its_payloads_size_and_loads_back(tmp_path):
    state, path = _state(), tmp_path / "checkpoint_latest.pt"
    save_checkpoint(state, path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    # Format 1 stored the payload as a latin-1 string: 1.5 times a payload of random bytes.
    assert path.stat().st_size < 1.05 * len(buffer.getvalue())
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["weight"], state["model"]["weight"])


def test_a_format_1_checkpoint_still_loads(tmp_path):
    state, path = _state(), tmp_path / "checkpoint_latest.pt"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    torch.save({"format": 1, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}, path)
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    bad = tmp_path / "bad.pt"
    torch.save({"format": 1, "sha256": hashlib.sha256(payload[:-1]).hexdigest(), "payload": payload[:-1]}, bad)
    with pytest.raises(CheckpointError, match=r"bad\.pt: checksum mismatch|bad\.pt: unreadable"):
        load_checkpoint(bad)


@pytest.mark.parametrize("record", [
    {"format": 2, "sha256": "", "payload": torch.zeros(4, dtype=torch.float32)},  # not bytes
    {"format": 2, "sha256": "", "payload": torch.zeros(2, 2, dtype=torch.uint8)},  # not flat
    {"format": 2, "sha256": "", "payload": b"\x00"},  # format 1's payload under format 2
    {"format": 1, "sha256": "", "payload": torch.zeros(4, dtype=torch.uint8)},  # format 2's under format 1
    {"format": 3, "sha256": "", "payload": torch.zeros(4, dtype=torch.uint8)},
], ids=["float payload", "2-d payload", "bytes as format 2", "tensor as format 1", "format 3"])
def test_a_record_of_another_shape_is_not_a_checkpoint(tmp_path, record):
    path = tmp_path / "other.pt"
    torch.save(record, path)
    with pytest.raises(CheckpointError, match=r"^.*other\.pt: not a brats-swap checkpoint \(format 1 or 2\)$"):
        load_checkpoint(path)
