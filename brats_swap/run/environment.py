"""`env.json`: what produced a run (versions, device, host, command, git commit)."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from brats_swap.timestamps import utc_now


def environment_record(device: torch.device) -> dict[str, Any]:
    """Versions, device and git commit, so that a result can be traced to what produced it."""
    import nibabel

    from brats_swap import __version__

    record: dict[str, Any] = {
        "brats_swap": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "monai": installed_version("monai"), "nibabel": nibabel.__version__, "numpy": np.__version__,
        "platform": platform.platform(), "hostname": platform.node(), "device": str(device),
        "cpu_threads": torch.get_num_threads(), "command": " ".join(sys.argv),
        "started_at": utc_now(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(cuda=torch.version.cuda, gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 2))
    record["git_commit"] = _git_commit()
    return record


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, read from its metadata: importing MONAI only to read its
    `__version__` cost every training process 2.5 s of CPU (it imports all its submodules), and a run whose
    network and loss are our own never imports it otherwise (nor does a bundle's export, ship/bundle.py)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The commit of the source checkout this package runs from; None outside a git checkout."""
    try:
        repo = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit or None
