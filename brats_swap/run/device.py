"""Device and mixed-precision resolution (one answer for training, evaluation and the planner), and the
process-wide torch settings a run needs: seeds, threads, determinism, CPU convolution weight gradients in
fp32 under AMP, peak memory.

Determinism (`train.deterministic`, default false, nnU-Net's choice): on a CPU the run is repeatable either
way (the CPU kernels these networks run have no atomics: the same inputs give the same bits on one machine
and installation, which the bitwise tests check with the default); on CUDA the default runs cuDNN benchmark
(the fastest algorithms, some of them atomics-based) and is not repeatable. `deterministic: true` asks for
torch's deterministic algorithms (warn-only) and no benchmark: ops with no deterministic CUDA kernel still
run (trilinear upsampling's backward, for one), and the run lists them once, in its log and env.json, since
such a run is not bitwise repeatable either.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import resource
import sys
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from brats_swap.config import Config
from brats_swap.errors import ConfigError
from brats_swap.memory import cuda_device

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


# The first compute capability with bf16 tensor cores (Ampere: A100 8.0, A10G/RTX 30xx 8.6).
BF16_CAPABILITY = (8, 0)


def amp_on_device(amp: str, device: torch.device) -> tuple[str, str | None]:
    """The `train.amp` that runs on `device`, and a one-line reason when it is not the one asked for.

    A CPU has no fast fp16 kernels: a Conv3d 32->32 step at 48³ took 19.9 s under fp16 autocast against
    0.17 s in fp32 and 0.12 s in bf16. So fp16 runs as bf16 there, which saves tensors of the same size (the
    memory plan is unchanged) and needs no loss scaling.

    A CUDA card before Ampere (V100 7.0, T4 7.5) has no bf16 tensor cores: `torch.cuda.is_bf16_supported()`
    is true there only counting torch's emulation (`including_emulation=False` says false), and its fp16
    tensor cores are what it has. So bf16 runs as fp16 there, with the GradScaler that fp16 training uses;
    tensors keep their size, so the plan holds. ROCm (`torch.version.hip`, whose cards torch counts as
    bf16-capable) is left as asked.
    """
    if amp == "fp16" and device.type == "cpu":
        return "bf16", ("train.amp: fp16 has no fast kernels on the CPU (about 100x slower than fp32); "
                        "training in bf16 instead (the run's config records bf16)")
    if amp == "bf16" and device.type == "cuda" and not torch.version.hip:
        card = cuda_device.capability(device)
        if card is not None and card < BF16_CAPABILITY:
            return "fp16", (f"train.amp: bf16 needs an Ampere or newer card (compute capability 8.0), {device} is "
                            f"{card[0]}.{card[1]}; training in fp16 with loss scaling instead (the run's config "
                            "records fp16)")
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
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"train.device: {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model initialisation, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# On a CPU, torch runs bf16 convolutions on oneDNN, whose bf16 backward-weights kernel
# (`jit_bf16:avx512_core_bf16`, or the same kernel emulating bf16 on other AVX-512 CPUs; oneDNN 3.12 in
# torch 2.13) returns wrong weight gradients for small geometries, e.g. with a 3³ kernel a depth of 2 (the
# 2³ bottleneck of a 16³ cube at model.depth 4, or of 32³ at depth 5), with stride 2 an output height or
# width of 1, with 5³ a depth of 2 to 4. Part of each such gradient is read from memory the kernel never
# wrote, so it is NaN wherever the heap held NaN (freed tensors of earlier work: a long test session), and
# some of these shapes corrupt the heap ("double free or corruption"). Its backward-data kernel and the fp32
# kernels are right (relative errors 6e-3 and 6e-7 against float64 over 3,456 such shapes; the bf16 forward,
# depthwise and transposed kernels too), so under AMP on a CPU every convolution's weight and bias gradients
# are computed from fp32 copies of its input and output gradient (one rule, not a list of shapes), and its
# input gradient by the same bf16 kernel as before. At 48³ x 32 channels the fp32 weight gradient took 1.3x
# the time of the bf16 kernel.
_REDUCED_PRECISION = (torch.bfloat16, torch.float16)
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def _convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    """`aten.convolution_backward` with the weight and bias gradients of a reduced-precision CPU convolution
    computed in fp32 (and returned in the weight's dtype, as the op does); anything else exactly as asked."""
    geometry = (stride, padding, dilation, transposed, output_padding, groups)
    if (input.device.type != "cpu" or input.dtype not in _REDUCED_PRECISION
            or not (output_mask[1] or output_mask[2])):
        return _CONVOLUTION_BACKWARD(grad_output, input, weight, bias_sizes, *geometry, output_mask)
    grad_input = None
    if output_mask[0]:
        input_only = [True, False, False]
        grad_input, _, _ = _CONVOLUTION_BACKWARD(grad_output, input, weight, None, *geometry, input_only)
    _, grad_weight, grad_bias = _CONVOLUTION_BACKWARD(grad_output.float(), input.float(), weight.float(),
                                                      bias_sizes, *geometry, [False, *output_mask[1:]])
    return (grad_input, grad_weight.to(weight.dtype) if output_mask[1] else None,
            grad_bias.to(weight.dtype) if output_mask[2] else None)


class Fp32ConvolutionWeightGradients(TorchDispatchMode):
    """While active (in this thread, where a CPU backward runs), reduced-precision CPU convolutions take their
    weight and bias gradients from fp32 (see `_convolution_backward`); every other op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _CONVOLUTION_BACKWARD:
            return _convolution_backward(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def computes_in_reduced_precision_on_cpu(amp: str, device: torch.device) -> bool:
    """Training with `train.amp` on `device` runs CPU convolutions in bf16 (or fp16), so it needs
    `Fp32ConvolutionWeightGradients`."""
    return device.type == "cpu" and amp_dtype(amp_on_device(amp, device)[0]) in _REDUCED_PRECISION


# torch's warn-only message for an op without a deterministic kernel: "<op> does not have a deterministic
# implementation, but you set 'torch.use_deterministic_algorithms(True, warn_only=True)'..."
_NONDETERMINISTIC = re.compile(r"^(\S+) does not have a deterministic implementation")


class NondeterministicOps:
    """While active, the ops torch reports as having no deterministic kernel (warn-only deterministic mode):
    each is passed to `on_new` once, in order, and kept in `ops`; their repeated warnings are not shown (the
    autograd engine replays a backward's warnings in the thread that called backward, so one hook sees all).
    Every other warning goes on as before."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.on_new: Callable[[str], None] | None = None
        self._catcher: warnings.catch_warnings | None = None

    def __enter__(self) -> NondeterministicOps:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.filterwarnings("always", message=_NONDETERMINISTIC.pattern[1:])
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            match = _NONDETERMINISTIC.match(str(message))
            if match is None:
                show(message, category, filename, lineno, file, line)
            elif match.group(1) not in self.ops:
                self.ops.append(match.group(1))
                if self.on_new is not None:
                    self.on_new(match.group(1))

        warnings.showwarning = showwarning
        return self

    def __exit__(self, *exc_info) -> None:
        self._catcher.__exit__(*exc_info)


@contextlib.contextmanager
def torch_settings(config: Config, device: torch.device) -> Iterator[NondeterministicOps | None]:
    """Threads, determinism and (AMP on a CPU) fp32 convolution weight gradients for the duration of training,
    restored afterwards (tests share a process); CUDA: the run's GPU made the current device. Yields the
    collector of ops without a deterministic kernel when `train.deterministic` is asked for on CUDA (set its
    `on_new` to report them), else None."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    # The DataLoader's pin thread, the arena's host registration and library handles open their context on
    # the current device: GPU 0 unless told (someone else's card when this run is on cuda:1).
    cuda_device.use_device(device)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    collector = None
    if config.train.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        collector = NondeterministicOps() if device.type == "cuda" else None
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # nnU-Net's setting: the fastest algorithms, not repeatable
    reduced = computes_in_reduced_precision_on_cpu(config.train.amp, device)
    weight_gradients = Fp32ConvolutionWeightGradients() if reduced else contextlib.nullcontext()
    try:
        with weight_gradients, collector if collector is not None else contextlib.nullcontext():
            yield collector
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the peak of allocated device memory since the last reset; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return cuda_device.peak_allocated_bytes(device)
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
