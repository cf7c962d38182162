"""What the host offers new allocations, read by the checks that refuse a setting before it is allocated (the
memory arena, the pricing of a case before prediction, nnU-Net's resampling). Here, beside the config, because
every layer may read it: the memory package and the torch-free predictor (`predict --runtime onnxruntime`) alike."""

from __future__ import annotations

import os


def available_host_bytes() -> int | None:
    """Host memory available to new allocations without swapping: Linux's MemAvailable, else the free
    physical pages (`os.sysconf`); None when neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
