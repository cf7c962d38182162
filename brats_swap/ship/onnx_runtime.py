"""Predicting with a bundle's ONNX networks (`predict --model model.zip --runtime onnxruntime`, and the same in
`serve-challenge`): the whole predict pipeline with each fold's network run by onnxruntime.

The pipeline is `evaluate/case_prediction.py`'s, the one `--runtime torch` runs (reading, cropping and
normalising, whole cube or MONAI's sliding window with the same Gaussian and step, the mirrors, the fold mean,
nnU-Net's rules for an imported nnU-Net model, postprocessing, labels written on the case's grid); only the
network call differs. Nothing on this path imports torch or MONAI (tests/test_onnx.py runs it in a process
where importing torch fails), so it runs in an environment of onnxruntime, numpy, scipy and nibabel.

Each fold's `models/fold_<k>/model.onnx` was checked against torch at export (ship/onnx_export.py) and its
sha256 against the bundle's metadata when the bundle was opened (`ship/bundle.open_bundle`), so a changed
network is refused before it is loaded.

The precision follows what `--runtime torch` runs on the same device (`runs_in_float16`): on CUDA, where torch
predicts under autocast (the fold's `train.amp`, or nnU-Net's rules, which always do), onnxruntime runs the
fold's float16 network `model.fp16.onnx`; elsewhere, and for a fold exported without one, its float32 network.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from brats_swap.config import Config
from brats_swap.config.inference import inference_config
from brats_swap.errors import CheckpointError, ConfigError
from brats_swap.evaluate.case_prediction import Predictor, check_one_output_kind
from brats_swap.evaluate.nnunet_inference import NNUNET
from brats_swap.run.console import warn
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection
from brats_swap.ship.bundle import (
    POSTPROCESSING,
    Bundle,
    bundle_config,
    choose_folds,
    fold_onnx,
    fold_onnx_half,
)
from brats_swap.ship.onnx_contract import LOGITS, network_output

RUNTIMES = ("torch", "onnxruntime")
_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
_INPUT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # export --onnx writes these two


class OnnxNetwork:
    """One fold's ONNX network as the array rules call it: a (B, C_in, ...) float32 batch to its float32 output,
    the probabilities, or the logits for a model under nnU-Net's rules (then also its `logits`)."""

    runs_on_arrays = True  # evaluate.case_prediction.array_network passes it through as it is

    def __init__(self, model_bytes: bytes, config: Config, where: str, providers: list[str]):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # The threads the project gives torch (OMP_NUM_THREADS, e.g. the tests' 1); unset: onnxruntime's default.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        options.intra_op_num_threads = int(threads) if threads.isdigit() else 0
        try:
            self.session = onnxruntime.InferenceSession(model_bytes, options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own types for a model it cannot load
            raise CheckpointError(f"{where}: onnxruntime cannot load it ({str(exc).strip().splitlines()[0][:200]})"
                                  ) from None
        # What the network takes and returns is read from the graph itself and from the fold's config, never from
        # the metadata's record (a second copy a forged bundle could contradict): one input of a fixed
        # (batch, channels, D, H, W) shape and one output, as `export --onnx` writes them.
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        shape = list(inputs[0].shape) if len(inputs) == 1 else []
        if (len(outputs) != 1 or len(shape) != 5 or not all(isinstance(s, int) and s > 0 for s in shape[1:])
                or inputs[0].type not in _INPUT_TYPES):
            raise CheckpointError(f"{where}: not a network of one (batch, channels, D, H, W) input of a fixed size and "
                                  "one output, as export --onnx writes it")
        self.where, self.returns = where, network_output(config)
        self.input_name, self.output_name = inputs[0].name, outputs[0].name
        self.input_dtype = _INPUT_TYPES[inputs[0].type]
        self.spatial = shape[2:]
        self.out_channels = outputs[0].shape[1] if len(outputs[0].shape) == 5 else None
        if not isinstance(self.out_channels, int):
            raise CheckpointError(f"{where}: its output is not (batch, channels, D, H, W) with a fixed channel count")
        self.logits = self if self.returns == LOGITS else None

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        if list(batch.shape[2:]) != self.spatial:
            raise ConfigError(f"{self.where}: the network was exported for inputs of {self.spatial}, called on "
                              f"{list(batch.shape[2:])}; export again with the settings predict uses")
        feed = {self.input_name: np.ascontiguousarray(batch, dtype=self.input_dtype)}
        return np.asarray(self.session.run([self.output_name], feed)[0], dtype=np.float32)


def providers_for(device: str | None) -> list[str]:
    """onnxruntime's execution providers for `--device`: CUDA first when asked for or (auto) when this
    onnxruntime has it, then the CPU."""
    import onnxruntime

    kind = (device or "auto").split(":")[0]
    if kind == "auto":
        kind = "cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"
    if kind not in _PROVIDERS:
        raise ConfigError(f"--device {device}: onnxruntime runs on auto, cpu or cuda")
    return _PROVIDERS[kind]


def runs_in_float16(predicts_with: Config, providers: list[str]) -> bool:
    """Whether `--runtime torch` predicts this fold under float16/bfloat16 autocast where onnxruntime will run:
    on CUDA, with the fold's `train.amp` on or under nnU-Net's rules (autocast on CUDA, as nnU-Net predicts).
    On the CPU torch predicts in float32 (or bfloat16, which has no ONNX network here): float32."""
    if providers[0] != "CUDAExecutionProvider":
        return False
    return predicts_with.evaluate.inference == NNUNET or predicts_with.train.amp != "none"


def onnx_predictor(bundle: Bundle, folds: FoldSelection = ALL_FOLDS, *, postprocess: bool = True,
                   device: str | None = None, challenge: str | None = None) -> Predictor:
    """`ship.bundle.bundle_predictor` with each fold's ONNX network in onnxruntime instead of its torch model;
    CheckpointError naming the fold when the bundle was exported without --onnx."""
    config = bundle_config(bundle, None, challenge)
    providers = providers_for(device)
    chosen, members, precisions = choose_folds(bundle, folds), [], set()
    records = {int(record["fold"]): record for record in bundle.metadata["folds"]}
    for k in chosen:
        member, record = fold_onnx(k), records[k].get("onnx")
        if member not in bundle.members or not isinstance(record, dict):
            raise CheckpointError(f"{bundle.path}: fold {k} has no {member}; export the run with --onnx, or "
                                  "predict with --runtime torch")
        predicts_with = inference_config(bundle.fold_config(k), config)
        if runs_in_float16(predicts_with, providers):
            if fold_onnx_half(k) in bundle.members:
                member = fold_onnx_half(k)
            else:
                warn(f"{bundle.path}: fold {k} has no float16 network (export could not write one); onnxruntime "
                     "runs its float32 network where torch would predict under autocast")
        network = OnnxNetwork(bundle.members[member], predicts_with, f"{bundle.path}: {member}", providers)
        precisions.add("float16" if network.input_dtype == np.float16 else "float32")
        members.append((network, predicts_with))
    check_one_output_kind(bundle.path, chosen, members)
    plan = bundle.postprocessing() if postprocess else None
    return Predictor(config, members, f"onnxruntime ({providers[0]})", plan, Path(f"{bundle.path}:{POSTPROCESSING}"),
                     f"{bundle.path.name}: fold(s) {', '.join(map(str, chosen))} ({bundle.checkpoint} checkpoint, "
                     f"ONNX in onnxruntime, {' and '.join(sorted(precisions))})")


def runtime_predictor(bundle: Bundle, runtime: str, folds: FoldSelection = ALL_FOLDS, *, postprocess: bool = True,
                      device: str | None = None, challenge: str | None = None,
                      evaluate_compile: bool | None = None) -> Predictor:
    """The bundle's predictor for `--runtime`: its torch models (`bundle_predictor`, `evaluate.compile` replaced
    by `evaluate_compile` when given) or its ONNX networks (never compiled)."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if runtime == "onnxruntime":
        return onnx_predictor(bundle, folds, postprocess=postprocess, device=device, challenge=challenge)
    from brats_swap.ship.bundle import bundle_predictor

    return bundle_predictor(bundle, folds, postprocess=postprocess, device=device, challenge=challenge,
                            evaluate_compile=evaluate_compile)
