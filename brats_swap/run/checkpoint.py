"""Checkpoints: full training state, checksummed, written atomically, with a fallback to the previous file.

File format: a `torch.save`d dict `{"format": 2, "sha256": <hex>, "payload": <uint8 tensor>}` where
`payload` holds the bytes of the `torch.save` of the state dict. The checksum is verified on load, so a torn
or bit-rotted file is detected instead of silently resuming from garbage. Both levels load with
`weights_only=True`: the state holds only tensors, numbers, strings, lists and dicts (RNG states are
converted to plain lists), so a checkpoint is never arbitrary pickle. Format 1 (still read) held the payload
as `bytes`, which torch's pickle protocol 2 stores as a latin-1 string: 1.5 times the payload on disk, and
about 0.7 s of CPU to write and 0.5 s to read per 60 MB (torch 2.13); a tensor is stored as its raw bytes.

Per fold folder: `checkpoint_latest.pt` (every epoch, and on interruption), `checkpoint_prev.pt` (the
latest before it, kept as the fallback) and `checkpoint_best.pt` (best mean validation Dice).
"""

from __future__ import annotations

import hashlib
import io
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from brats_swap.atomic import atomic_path
from brats_swap.errors import CheckpointError
from brats_swap.run.folder import PREVIOUS, FoldFolder

CHECKPOINT_FORMAT = 2
READABLE_FORMATS = (1, CHECKPOINT_FORMAT)


def save_checkpoint(state: dict[str, Any], path: Path, *, keep_previous: bool = False) -> None:
    """Write `state` atomically; with `keep_previous`, the file it replaces becomes `checkpoint_prev.pt`."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()  # writable: torch.frombuffer shares it without a copy or a warning
    record = {"format": CHECKPOINT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(),
              "payload": torch.frombuffer(payload, dtype=torch.uint8)}
    buffer = io.BytesIO()
    torch.save(record, buffer)
    with atomic_path(path) as tmp:
        # Bytes written by Python, not torch.save(record, tmp): torch's zip writer turns a full disk into
        # "RuntimeError: [enforce fail at inline_container.cc]"; a plain write keeps errno ENOSPC, which
        # atomic_path reports as a DiskError naming the file (the previous checkpoint is untouched).
        tmp.write_bytes(buffer.getvalue())
        # Rotate only once the new file is complete on disk: at any instant either latest or prev is good.
        if keep_previous and path.exists():
            os.replace(path, path.with_name(PREVIOUS))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint file; raises CheckpointError naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated/garbled files
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc.__class__.__name__})") from exc
    payload = _payload_bytes(record)
    if payload is None:
        raise CheckpointError(f"{path}: not a brats-swap checkpoint (format {' or '.join(map(str, READABLE_FORMATS))})")
    if hashlib.sha256(payload).hexdigest() != record.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch, the file is corrupted")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint payload ({exc.__class__.__name__})") from exc


def _payload_bytes(record: Any) -> bytes | None:
    """The state's bytes in a checkpoint record of a readable format (2: a flat uint8 tensor, 1: bytes);
    None for anything else."""
    if not isinstance(record, dict) or record.get("format") not in READABLE_FORMATS:
        return None
    payload = record.get("payload")
    if record["format"] == 1:
        return payload if isinstance(payload, bytes) else None
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        return None
    return payload.numpy().tobytes()


def load_latest(fold: FoldFolder | Path, warn: Callable[[str], None] | None = None,
                ) -> tuple[dict[str, Any], Path] | None:
    """The newest good training state of a fold: latest, else prev (with a warning); None if neither exists.

    `fold` is the fold's folder (or its `fold_<k>` path). Raises CheckpointError when files exist but
    none is usable.
    """
    folder = fold if isinstance(fold, FoldFolder) else FoldFolder.at(fold)
    latest, previous = folder.latest, folder.previous
    if not latest.exists() and not previous.exists():
        return None
    problem = f"{latest}: checkpoint not found"
    if latest.exists():
        try:
            return load_checkpoint(latest), latest
        except CheckpointError as exc:
            problem = str(exc)
    if previous.exists():
        state = load_checkpoint(previous)
        if warn is not None:
            warn(f"{problem}; falling back to {previous.name} (epoch {state.get('epoch', '?')})")
        return state, previous
    raise CheckpointError(f"{problem}, and there is no {PREVIOUS} to fall back to")


def capture_rng_states(loader_generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG the training step can touch, in weights_only-safe types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # is_initialized, not is_available: a CPU run on a GPU host must not create a CUDA context just to save RNGs.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss_next],
        "loader": loader_generator.get_state() if loader_generator is not None else None,
    }


def restore_rng_states(states: dict[str, Any], loader_generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(states["torch"])
    if states.get("cuda") and torch.cuda.is_available():
        # Per device, not set_rng_state_all: a checkpoint from a node with more GPUs would index past device_count().
        for index, cuda_state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if loader_generator is not None and states.get("loader") is not None:
        loader_generator.set_state(states["loader"])
