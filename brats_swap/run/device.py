"""Device and mixed-precision resolution (one answer for training, evaluation and the planner), and the
process-wide torch settings a run needs: seeds, threads, determinism, peak memory.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import sys
from collections.abc import Iterator

import numpy as np
import torch

from brats_swap.config import Config
from brats_swap.errors import ConfigError

# `train.amp` -> the dtype autocast computes in; `none` trains in float32.
_AMP_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(amp: str) -> torch.dtype:
    """The dtype activations are computed (and saved for backward) in under `train.amp`.

    The planner prices saved tensors in this dtype, so it must be the one place that answers it.
    """
    try:
        return _AMP_DTYPES[amp]
    except KeyError:
        raise ConfigError(f"train.amp: {amp!r} is not one of {sorted(_AMP_DTYPES)}") from None


def amp_on_device(amp: str, device: torch.device) -> tuple[str, str | None]:
    """The `train.amp` that runs on `device`, and a one-line reason when it is not the one asked for.

    A CPU has no fast fp16 kernels: a Conv3d 32->32 step at 48³ took 19.9 s under fp16 autocast against
    0.17 s in fp32 and 0.12 s in bf16. So fp16 runs as bf16 there, which saves tensors of the same size (the
    memory plan is unchanged) and needs no loss scaling.
    """
    if amp == "fp16" and device.type == "cpu":
        return "bf16", ("train.amp: fp16 has no fast kernels on the CPU (about 100x slower than fp32); "
                        "training in bf16 instead (the run's config records bf16)")
    return amp, None


def autocast_context(device: torch.device, amp: str):
    """`torch.autocast` for `train.amp` (bf16 / fp16) as it runs on `device` (`amp_on_device`), or a no-op
    context when AMP is off."""
    amp, _ = amp_on_device(amp, device)
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype(amp))


def resolve_device(name: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU; an explicit CUDA device without CUDA is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name!r} requested but CUDA is not available")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model initialisation, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def torch_settings(config: Config, device: torch.device) -> Iterator[None]:
    """Threads and determinism for the duration of training, restored afterwards (tests share a process)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    if config.train.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the peak of allocated device memory since the last reset; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
