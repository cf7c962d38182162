"""brats-swap: whole-volume 3D U-Net training for BraTS with activation swapping and recomputation."""

__version__ = "0.1.0"
