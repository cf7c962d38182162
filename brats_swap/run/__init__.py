"""What training and evaluation both need: the run folder, checkpoint I/O, device and AMP resolution.

This layer sits under `train/` and `evaluate/` so that neither imports the other.
"""

from brats_swap.run.folder import FoldFolder, RunFolder

__all__ = ["FoldFolder", "RunFolder"]
