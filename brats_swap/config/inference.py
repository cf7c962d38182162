"""The config a trained fold predicts with: its own architecture, mode and patch, with the settings of the
prediction at hand. Beside the config because both runtimes read it (the torch one in `run/trained.py`, the
torch-free onnxruntime one in `ship/onnx_runtime.py`)."""

from __future__ import annotations

from dataclasses import replace

from brats_swap.config.schema import Config


def inference_config(trained: Config, current: Config) -> Config:
    """Inference settings: the trained model's mode and patch, with the current evaluate.* section, device and amp."""
    return replace(trained, evaluate=current.evaluate,
                   train=replace(trained.train, device=current.train.device, amp=current.train.amp))
