"""What a brats-swap process sets for itself before torch is imported: the CLI's first step (`cli.main.main`),
inherited by everything it starts (data-loader workers, `cv` fold processes, torchrun ranks).

Transparent huge pages for torch's CPU buffers (`THP_MEM_ALLOC_ENABLE`, torch's own switch, read once at its
first CPU allocation): buffers of 2 MiB and more are aligned to 2 MiB and advised as huge pages. A 3D U-Net
allocates and frees activations of tens to hundreds of MB in every layer, and glibc serves each from fresh
pages, so with 4 KiB pages each costs a page fault per 4 KiB. Four forward passes of a 128³ tile through an
nnU-Net PlainConvUNet on 2 threads took 1.4 million page faults and 12.6 s of CPU; with huge pages 54 thousand
and 8.4 s, the same outputs (the alignment changes where buffers live, not what is computed). The kernel has the
last word: with `/sys/kernel/mm/transparent_hugepage/enabled` at `never` nothing changes. A value the user
set is kept (`THP_MEM_ALLOC_ENABLE=0` turns it off).
"""

from __future__ import annotations

import os

TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def configure_process() -> None:
    """Set this process's environment for torch (the module docstring); call before torch is imported."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")
