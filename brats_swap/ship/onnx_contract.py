"""What a bundle's ONNX network returns, one rule for the exporter (`ship/onnx_export.py`, which imports torch)
and the runtime (`ship/onnx_runtime.py`, which must not): the logits for a model under nnU-Net's rules, which
sum logits over tiles and mirrors, else the probabilities."""

from __future__ import annotations

from brats_swap.config import Config

PROBABILITIES, LOGITS = "probabilities", "logits"


def network_output(config: Config) -> str:
    """What the exported network of a fold predicting with `config` returns (module docstring)."""
    from brats_swap.evaluate.nnunet_inference import NNUNET

    return LOGITS if config.evaluate.inference == NNUNET else PROBABILITIES
