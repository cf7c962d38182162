"""The package's CUDA-only calls behind one small surface: the device-index rule, `set_device`, memory caps,
card and free memory, and peak readings. Each takes a `torch.device`; a CPU device makes each a no-op (or
answers None), so callers need not branch.

The device-index rule (torch 2.13, `torch.cuda._utils._get_device_index`): some calls take an unindexed
`torch.device("cuda")` as the current device (`optional=True`: `get_device_properties`, `mem_get_info`,
`max_memory_allocated`, ...), others refuse it with "Expected a torch.device with a specified index or an
integer" (`set_per_process_memory_fraction`, `set_device`). So every call here goes through `indexed`
first, which resolves "cuda" to "cuda:<current device>" once, and none of them can meet the refusal.

`rehearsal(total_bytes)` replaces `torch.cuda` for these calls by `RehearsedCuda`, a card of that size
that keeps torch's argument rules (the strict calls run torch's own `_get_device_index`) and records every
call: a CPU-only run (scripts/gpu_check.py --dry-run, the tests) runs the same capping code a GPU run does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class RehearsedCuda:
    """The part of `torch.cuda` this module calls, for a card of `total_bytes` that holds nothing: argument
    checks as torch 2.13 makes them, every call recorded in `calls` as (function, device index, argument)."""

    def __init__(self, total_bytes: int, device_count: int = 1, capability: tuple[int, int] = (8, 6)) -> None:
        self.total_bytes = int(total_bytes)
        self.capability = capability  # (8, 6): the A10G the dry run of scripts/gpu_check.py rehearses
        self.count = device_count
        self.current = 0
        self.fractions: dict[int, float] = {}
        self.calls: list[tuple[str, int | None, Any]] = []

    def _index(self, device, optional: bool) -> int:
        """torch's rule: `optional` calls read an unindexed device (or None) as the current one, the others
        pass it to `_get_device_index`, which refuses it."""
        if optional and (device is None or (isinstance(device, torch.device | str)
                                            and torch.device(device).index is None)):
            return self.current
        index = torch.cuda._utils._get_device_index(device)
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def _record(self, name: str, device, optional: bool, argument: Any = None) -> int:
        index = self._index(device, optional)
        self.calls.append((name, index, argument))
        return index

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, device) -> None:
        self.current = self._record("set_device", device, optional=False)

    def get_device_properties(self, device=None):
        self._record("get_device_properties", device, optional=True)
        return _Properties(name="rehearsed card", total_memory=self.total_bytes)

    def get_device_capability(self, device=None) -> tuple[int, int]:
        self._record("get_device_capability", device, optional=True)
        return self.capability

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self._record("mem_get_info", device, optional=True)
        return self.total_bytes, self.total_bytes

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        # torch: None -> the current device, then `_get_device_index(device)` without `optional`.
        index = self._record("set_per_process_memory_fraction", self.current if device is None else device,
                             optional=False, argument=fraction)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fractions[index] = fraction

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None, None))

    def reset_peak_memory_stats(self, device=None) -> None:
        self._record("reset_peak_memory_stats", device, optional=True)

    def max_memory_allocated(self, device=None) -> int:
        self._record("max_memory_allocated", device, optional=True)
        return 0

    def max_memory_reserved(self, device=None) -> int:
        self._record("max_memory_reserved", device, optional=True)
        return 0

    def memory_reserved(self, device=None) -> int:
        self._record("memory_reserved", device, optional=True)
        return 0

    def memory_allocated(self, device=None) -> int:
        self._record("memory_allocated", device, optional=True)
        return 0


class _Properties:
    def __init__(self, name: str, total_memory: int) -> None:
        self.name, self.total_memory = name, total_memory


_rehearsed: RehearsedCuda | None = None


def _cuda():
    """`torch.cuda`, or the rehearsed card while `rehearsal` is active."""
    return _rehearsed if _rehearsed is not None else torch.cuda


@contextlib.contextmanager
def rehearsal(total_bytes: int, device_count: int = 1) -> Iterator[RehearsedCuda]:
    """Every call of this module goes to a `RehearsedCuda` of `total_bytes` for the block."""
    global _rehearsed
    saved, _rehearsed = _rehearsed, RehearsedCuda(total_bytes, device_count)
    try:
        yield _rehearsed
    finally:
        _rehearsed = saved


def available() -> bool:
    """A CUDA device can be used (or is rehearsed)."""
    return bool(_cuda().is_available())


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: "cuda" -> "cuda:<current device>"; any other device as it is."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", _cuda().current_device())


def use_device(device: torch.device | str) -> None:
    """Make `device` this process's current CUDA device (where "cuda" and new contexts go: the DataLoader's
    pin thread, host registrations, library handles); nothing for a CPU."""
    if is_cuda(device):
        _cuda().set_device(indexed(device))


def total_bytes(device: torch.device | str) -> int | None:
    """The card's memory; None for a CPU."""
    if not is_cuda(device):
        return None
    return int(_cuda().get_device_properties(indexed(device)).total_memory)


def capability(device: torch.device | str) -> tuple[int, int] | None:
    """The card's compute capability (major, minor), e.g. (7, 5) for a T4, (8, 0) for an A100; None for a CPU."""
    if not is_cuda(device):
        return None
    major, minor = _cuda().get_device_capability(indexed(device))
    return int(major), int(minor)


def free_bytes(device: torch.device | str) -> int | None:
    """The card's free memory now (all processes count); None for a CPU."""
    if not is_cuda(device):
        return None
    return int(_cuda().mem_get_info(indexed(device))[0])


def empty_cache(device: torch.device | str) -> None:
    if is_cuda(device):
        _cuda().empty_cache()


@contextlib.contextmanager
def memory_cap(device: torch.device | str, cap_bytes: float | None) -> Iterator[None]:
    """The block runs with this process's CUDA allocator capped at `cap_bytes` of the card
    (`set_per_process_memory_fraction`, after `empty_cache` so that the cap bounds what the block reserves),
    lifted and the cache emptied afterwards; nothing for a CPU or without a cap."""
    if not is_cuda(device) or cap_bytes is None:
        yield
        return
    device = indexed(device)
    cuda = _cuda()
    cuda.empty_cache()
    total = int(cuda.get_device_properties(device).total_memory)
    cuda.set_per_process_memory_fraction(float(min(1.0, cap_bytes / total)), device)
    try:
        yield
    finally:
        cuda.set_per_process_memory_fraction(1.0, device)
        cuda.empty_cache()


def reset_peak(device: torch.device | str) -> None:
    """Start a new peak reading; nothing for a CPU."""
    if is_cuda(device):
        _cuda().reset_peak_memory_stats(indexed(device))


def peak_allocated_bytes(device: torch.device | str) -> int | None:
    """The allocator's peak of allocated bytes since the last `reset_peak`; None for a CPU."""
    if not is_cuda(device):
        return None
    return int(_cuda().max_memory_allocated(indexed(device)))


def peak_reserved_bytes(device: torch.device | str) -> int | None:
    """The allocator's peak of reserved bytes (allocated plus its cache) since the last `reset_peak`."""
    if not is_cuda(device):
        return None
    return int(_cuda().max_memory_reserved(indexed(device)))


def reserved_bytes(device: torch.device | str) -> int | None:
    if not is_cuda(device):
        return None
    return int(_cuda().memory_reserved(indexed(device)))


def allocated_bytes(device: torch.device | str) -> int | None:
    """What tensors hold now; None for a CPU."""
    if not is_cuda(device):
        return None
    return int(_cuda().memory_allocated(indexed(device)))
