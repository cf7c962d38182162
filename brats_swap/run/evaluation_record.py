"""Which training state a fold's evaluation saw: `fold_<k>/evaluated_checkpoint.json`.

A fold's metrics.csv describes the model it was written from. A fold trained further afterwards (`train --fold
K --set train.max_epochs=<more>` continues a finished fold) keeps that metrics.csv, so "metrics.csv exists" said
"evaluated" of a model nobody had scored, and a cross-validation run read `complete: true`. The evaluation
therefore records the fold's newest training state as it found it (checkpoint_latest.pt, else
checkpoint_prev.pt: the file every further training replaces), and the fold counts as evaluated only while that
file is still the one recorded.

The record is compared by size and modification time first (free), then by the file's sha256, so a run copied
elsewhere (new times, same bytes) is still evaluated. The record is a file of the run folder, so it is read as
untrusted: the only names it may give are those two checkpoint names; anything else counts as "not this file".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from brats_swap.atomic import atomic_write_json
from brats_swap.run.folder import LATEST, PREVIOUS, FoldFolder

_NAMES = (LATEST, PREVIOUS)  # the newest training state, in load_latest's order of preference
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 10  # ours are about 200 bytes; a larger file is not ours and is not read


def _newest_training_state(folder: FoldFolder) -> Path | None:
    return next((folder.root / name for name in _NAMES if (folder.root / name).is_file()), None)


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _identity(path: Path, *, with_digest: bool) -> dict:
    stat = path.stat()
    identity = {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if with_digest:
        identity["sha256"] = _sha256(path)
    return identity


def record_evaluated_state(folder: FoldFolder) -> None:
    """Called when an evaluation has written the fold's metrics: note the training state it evaluated (none, for
    an imported nnU-Net fold never fine-tuned)."""
    state = _newest_training_state(folder)
    record = {"version": RECORD_VERSION, "training_state": None if state is None else _identity(state, with_digest=True)}
    atomic_write_json(folder.evaluated_checkpoint, record)


def trained_since_evaluation(folder: FoldFolder) -> bool:
    """True when the fold's newest training state is not the one its last evaluation recorded: it trained
    further (or its checkpoints were replaced) after its metrics were written. A fold evaluated before these
    records existed has none and keeps the old rule (evaluated)."""
    path = folder.evaluated_checkpoint
    if not path.is_file():  # also a FIFO or a device under that name: no record, the old rule
        return False
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return True  # not a record this package wrote: re-evaluating is the safe answer
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True  # written atomically: unreadable means edited; re-evaluating is the safe answer
    recorded = record.get("training_state") if isinstance(record, dict) else "unreadable"
    state = _newest_training_state(folder)
    if recorded is None or state is None:
        return recorded is not None or state is not None
    if not isinstance(recorded, dict) or recorded.get("name") not in _NAMES or recorded.get("name") != state.name:
        return True
    now = _identity(state, with_digest=False)
    if all(recorded.get(key) == now[key] for key in ("size", "mtime_ns")):
        return False
    if recorded.get("size") != now["size"]:
        return True
    if recorded.get("sha256") != _sha256(state):  # same size, new time: new bytes, or a copy of the run
        return True
    try:  # a copy: remember its times, so that the next question costs a stat again, not a digest
        atomic_write_json(path, {**record, "training_state": {**recorded, **now}})
    except OSError:
        pass  # a read-only run folder answers the same, only slower
    return False
