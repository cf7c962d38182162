"""Data-parallel training with PyTorch's own stack: torchrun starts the processes, torch.distributed
connects them, DistributedDataParallel averages the gradients.

One process per device ("rank"). Every rank runs the same command; torchrun tells each one who it is
through environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and
`init_distributed` turns them into a `DistContext`. Without those variables (a plain `brats-swap train`)
the context is a single process and nothing here creates a process group, so every helper below is a
no-op and single-process code pays nothing.

The conventions the training loop follows (see train/loop.py):

- `train.batch_size` is per rank: the global batch is `world_size * batch_size`, and one epoch is one pass
  over the training cases *in total* (each rank sees 1/world_size of them).
- Rank 0 is the only one that writes (config, env, splits, logs, TensorBoard, checkpoints, reports) or
  draws progress bars; decisions that must agree (stop now? which checkpoint to resume from? the memory
  plan) are taken on rank 0 and broadcast, so no rank can wait forever in a collective the others skipped.
- Metrics are reduced across ranks before anything is decided or logged from them.

Typical use:

    ctx = init_distributed(config.train.device)      # DistContext(rank, local_rank, world_size, device, backend)
    model = build_model(...).to(ctx.device)
    ddp_model = wrap_ddp(model, ctx)                 # the plain model when single-process
    loss_value = all_reduce_mean(float(loss), ctx)
    if ctx.is_main: save(...)
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from brats_swap import stop_signals
from brats_swap.data.workers import available_cpus
from brats_swap.errors import ConfigError
from brats_swap.memory import cuda_device
from brats_swap.run.device import resolve_device

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job. `backend` is None when no process group exists (single process)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # "nccl" | "gloo" | None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, draws progress bars and writes files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """A process group exists (even with world_size 1 under `torchrun --nproc_per_node 1`)."""
        return self.backend is not None


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _device_for(device_pref: str, local_rank: int, distributed: bool) -> torch.device:
    """The device of this rank: `auto` = CUDA if present; under torchrun each rank takes GPU LOCAL_RANK."""
    device = resolve_device(device_pref)
    if device.type != "cuda":
        return device
    if not distributed:
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    # One GPU per rank, chosen by torchrun's LOCAL_RANK; an explicit index would put every rank on the same
    # GPU, which NCCL refuses.
    if device.index is not None and device.index != local_rank:
        raise ConfigError(f"train.device: {device_pref!r} under torchrun; use 'cuda' or 'auto', each rank "
                          f"takes GPU LOCAL_RANK (this is local rank {local_rank})")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {local_rank}: only {torch.cuda.device_count()} GPU(s) on this node; "
                          "lower --nproc_per_node")
    return torch.device("cuda", local_rank)


def init_distributed(device_pref: str = "auto", *, timeout_minutes: float = 30.0) -> DistContext:
    """Join the torchrun job if there is one; otherwise describe a single process (no process group).

    Idempotent: a second call (the cv runner trains several folds in one process) returns the context of
    the existing process group. NCCL on CUDA, gloo on CPU. The group is destroyed at interpreter exit
    (or by `cleanup()`).
    """
    if dist.is_available() and dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = _device_for(device_pref, local_rank, distributed=True)
        return DistContext(dist.get_rank(), local_rank, dist.get_world_size(), device, dist.get_backend())
    if not launched_by_torchrun():
        return DistContext(device=_device_for(device_pref, 0, distributed=False))

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(f"torch.distributed: RANK is set but {', '.join(missing)} is not; start the job with torchrun")
    device = _device_for(device_pref, local_rank, distributed=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        cuda_device.use_device(device)
        kwargs["device_id"] = device  # binds the communicator to this GPU (no guessing in barrier())
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes), **kwargs)
    atexit.register(cleanup)
    return DistContext(rank, local_rank, world_size, device, backend)


def cleanup() -> None:
    """Destroy the process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0 of the current process group, or a single process (for code that holds no DistContext)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# --------------------------------------------------------------------------------------------------
# Reductions and agreement between ranks (all no-ops for a single process)


def _reduce(values: float | Sequence[float], ctx: DistContext, op) -> torch.Tensor:
    # float64 so that sums of many per-case values lose nothing; NCCL needs the tensor on the GPU.
    tensor = torch.as_tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.is_distributed:
        dist.all_reduce(tensor, op=op)
    return tensor


def all_reduce_sum(values: float | Sequence[float], ctx: DistContext) -> Any:
    """Sum over ranks of a number or a list of numbers (returned in the same shape, as Python floats)."""
    return _reduce(values, ctx, dist.ReduceOp.SUM).tolist()


def all_reduce_mean(values: float | Sequence[float], ctx: DistContext) -> Any:
    """Mean over ranks; every rank must pass the same number of values."""
    return (_reduce(values, ctx, dist.ReduceOp.SUM) / ctx.world_size).tolist()


def all_reduce_max(values: float | Sequence[float], ctx: DistContext) -> Any:
    return _reduce(values, ctx, dist.ReduceOp.MAX).tolist()


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank if it is true on any rank (e.g. Ctrl-C reached only some of them)."""
    return bool(all_reduce_max(float(flag), ctx))


def broadcast_object(obj: T | None, ctx: DistContext, src: int = 0) -> T:
    """Rank `src`'s object on every rank (pickled; fine for configs, decisions, checkpoint states)."""
    if not ctx.is_distributed:
        return obj  # type: ignore[return-value]
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=ctx.device if ctx.backend == "nccl" else None)
    return box[0]


def gather_objects(obj: T, ctx: DistContext) -> list[T]:
    """Every rank's object, in rank order, on every rank."""
    if not ctx.is_distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def run_on_main(ctx: DistContext, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `func` on rank 0 only and hand its result, or the exception it raised, to every rank.

    The way to make a decision that touches files (read the checkpoint, create splits.json): all ranks
    then act on the same answer, and an error surfaces on every rank instead of leaving the others
    waiting in the next collective.
    """
    if not ctx.is_distributed:
        return func(*args, **kwargs)
    outcome: tuple[bool, Any] | None = None
    if ctx.is_main:
        try:
            outcome = (True, func(*args, **kwargs))
        except Exception as exc:  # re-raised on every rank below
            outcome = (False, exc)
    ok, value = broadcast_object(outcome, ctx)
    if not ok:
        raise value
    return value


# --------------------------------------------------------------------------------------------------
# Data and model


def make_sampler(dataset: Dataset, ctx: DistContext, shuffle: bool, seed: int = 0) -> DistributedSampler | None:
    """torch's DistributedSampler for `dataset` when distributed, else None (the DataLoader's own order).

    Remember `sampler.set_epoch(epoch)` each epoch when shuffling. Note that DistributedSampler pads the
    dataset to a multiple of world_size by repeating items; the loop's `validation_scores` therefore
    de-duplicates per-case results by case id before averaging.
    """
    if not ctx.is_distributed:
        return None
    return DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=shuffle, seed=seed,
                              drop_last=False)


class RankShardSampler(Sampler):
    """This rank's share of another sampler's stream: items rank, rank + W, rank + 2W, ...

    The same interleaving as DistributedSampler (`indices[rank::world_size]`), applied to a sampler that
    already defines the global order, here the loop's `EpochSampler`, whose keys carry (epoch, position)
    so every sample's augmentation is a function of its global position. So the union of the ranks'
    batches of one step is exactly the batch a single process with `world_size * batch_size` would draw,
    which is what makes a DDP step equal a single-process step with the same global batch.

    `set_epoch(epoch, start)` takes `start` in this rank's samples (step_in_epoch * batch_size) and
    skips `start * world_size` samples of the global stream (resume in the middle of an epoch).
    """

    def __init__(self, sampler: Sampler, ctx: DistContext) -> None:
        self.sampler = sampler
        self.rank, self.world_size = ctx.rank, ctx.world_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch, start=start * self.world_size)

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self.sampler):
            if i % self.world_size == self.rank:
                yield item

    def __len__(self) -> int:
        total = len(self.sampler)  # type: ignore[arg-type]
        return max(0, (total - self.rank + self.world_size - 1) // self.world_size)


def wrap_ddp(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel around `model` when distributed; the model itself otherwise.

    - `device_ids=[local GPU]` on CUDA (one device per process), None on CPU/gloo.
    - `find_unused_parameters=False`: every parameter that requires a gradient, of every network with deep
      supervision on or off, takes part in every training forward (heads the loss does not use are frozen
      where they are built, model/networks.py), so the reducer need not walk the autograd graph after each
      forward to find unused ones (tests/test_distributed.py checks each network, tests/test_ddp_networks.py
      trains each on 1 and 2 gloo ranks).
    - `gradient_as_bucket_view=True`: gradients live in DDP's communication buckets, saving one copy of
      the gradients on the device.
    - Gradient all-reduce and the memory engine do not wait on each other: DDP registers hooks on the
      parameters' gradient accumulators and launches a bucket's all-reduce as soon as its gradients are
      ready (on NCCL's own stream), while the engine's saved-tensor hooks only run when backward unpacks a
      swapped activation and make the compute stream wait on that one tensor's host-to-device copy. Neither
      synchronises the device, so an all-reduce never queues behind swap traffic it does not need.
    """
    if not ctx.is_distributed:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=False,
                                               gradient_as_bucket_view=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside a DDP wrapper (state dicts are saved without the `module.` prefix)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


# --------------------------------------------------------------------------------------------------
# Launching


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now (for tests and --standalone runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N` (the workers must not relaunch themselves)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node N -m brats_swap -- ARGS` for this node.

    The `--` matters: torchrun's argument parser accepts abbreviations of its own options anywhere on the
    line, so without it our `--run DIR` is read as an ambiguous `--run-path` and torchrun exits with usage.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "brats_swap", "--", *strip_nproc(argv)]


def launch_torchrun(nproc: int, argv: Sequence[str]) -> int:
    """Re-run this command under torchrun with `nproc` processes on this node; returns torchrun's exit code.

    `argv` is the command line after the program name (sys.argv[1:]); `--nproc` is removed from it.
    torchrun reports a failed worker as exit 1 whatever that worker's own code was; the worker's one-line
    error is on stderr above torchrun's report.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: must be at least 1")
    if launched_by_torchrun():
        raise ConfigError("--nproc: already running under torchrun; drop --nproc (torchrun sets the process count)")
    # The workers inherit our environment; OMP_NUM_THREADS keeps N processes from each taking every core.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, available_cpus() // nproc)))
    # torchrun itself ignores the forwarded signals, also when they reach it directly (the job's process group
    # gets them from `timeout`, SLURM signals every process of the job): see FORWARDED_SIGNALS.
    env.update({TORCHRUN_SIGNALS_ENV: TORCHRUN_HANDLES, stop_signals.SHIELDED_ENV: "1"})
    job = subprocess.Popen(torchrun_command(nproc, argv), env=env, preexec_fn=_ignore_forwarded_signals)
    with forward_signals_to_workers(job.pid):
        return job.wait()


# torchrun does not pass SIGUSR1 on (it dies of it, leaving its workers), and on SIGTERM it kills the workers
# after a grace period and exits 1 however they ended: both go straight to the workers instead, which stop at
# the next step (train/loop.py), and torchrun ignores them, waits for the workers and reports their exit code.
FORWARDED_SIGNALS = stop_signals.SCHEDULER_SIGNALS
# The signals torchrun turns into its own shutdown (its `--signals-to-handle`, default less SIGTERM; a torchrun
# older than 2.6 has no such option and handles SIGTERM as before). The ranks undo their inherited SIG_IGN
# (stop_signals.SHIELDED_ENV, restore_after_torchrun).
TORCHRUN_SIGNALS_ENV, TORCHRUN_HANDLES = "PET_SIGNALS_TO_HANDLE", "SIGINT,SIGHUP,SIGQUIT"


def _ignore_forwarded_signals() -> None:
    """torchrun's pre-exec: SIG_IGN survives exec (a Python handler would not)."""
    stop_signals.ignore(FORWARDED_SIGNALS)


@contextlib.contextmanager
def forward_signals_to_workers(launcher_pid: int) -> Iterator[None]:
    """While in the block, SIGUSR1/SIGTERM received here are sent to every process below `launcher_pid`."""
    def forward(signum, frame):  # noqa: ARG001 - signal handler signature
        for pid in torchrun_workers(launcher_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    with stop_signals.handled(stop_signals.SCHEDULER_SIGNALS, forward):
        yield


def torchrun_workers(launcher_pid: int) -> list[int]:
    """The ranks started below `launcher_pid`: the first processes down the tree with torchrun's `LOCAL_RANK`
    in their environment (not their own children, e.g. data-loader workers, which would die of the signal).
    Linux /proc; empty elsewhere."""
    workers: list[int] = []
    frontier = _children(launcher_pid)
    while frontier:
        pid = frontier.pop(0)
        if _has_env(pid, b"LOCAL_RANK="):
            workers.append(pid)
        else:
            frontier.extend(_children(pid))
    return workers


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                children.extend(int(child) for child in handle.read().split())
    return children


def _has_env(pid: int, prefix: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return any(entry.startswith(prefix) for entry in handle.read().split(b"\0"))
    except OSError:
        return False

