"""Shared pieces of the distributed tests: start N gloo ranks on the loopback interface.

`spawn_ranks(worker, nprocs, *args)` runs `worker(ctx, *args)` in N processes forked from the test process
(torch.multiprocessing), each with torchrun's environment variables set, so the code under test goes through
the same `init_distributed` path as under `torchrun`. Workers report through files in a tmp folder; an
exception in any rank fails the test.

Forked, not spawned: a fresh interpreter spends 5-10 s per rank importing torch, MONAI and torch._dynamo (which
the first optimizer imports) before it does a second of work, while a fork starts with what the test process
has already imported. Fork is safe here: the ranks use the CPU and gloo only, the test process holds no process
group, and each rank sets its thread count before any parallel op. A launch from a fresh interpreter, as
torchrun does it, is tested end to end by tests/test_distributed_train.py (`brats-swap train --nproc 2`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from brats_swap.distributed import DistContext, cleanup, free_port, init_distributed


def _entry(rank: int, worker: Callable[..., Any], nprocs: int, port: int, args: tuple) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": "1",
    })
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    ctx = init_distributed("cpu")
    try:
        worker(ctx, *args)
    finally:
        cleanup()


def spawn_ranks(worker: Callable[..., Any], nprocs: int, *args: Any) -> None:
    mp.start_processes(_entry, args=(worker, nprocs, free_port(), args), nprocs=nprocs, join=True,
                       start_method="fork")


def torchrun_env(nprocs: int, rank: int, port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs)}


__all__ = ["DistContext", "spawn_ranks", "torchrun_env"]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), e.g. torchrun under the CLI and the ranks under torchrun."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (int(p) for p in (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found
