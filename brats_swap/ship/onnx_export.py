"""Each fold's network as ONNX (`brats-swap export --onnx`), checked against torch before it goes in the bundle.

What is exported is the network alone, with the output the predict pipeline reads from it: the probabilities of
the forward (sigmoid, or softmax for `model.outputs: softmax`) for brats-swap's own inference, the
full-resolution logits for a model predicting under nnU-Net's rules (`evaluate.inference: nnunet` blends
logits). The input is (B, C, X, Y, Z) float32 with the spatial size fixed to what the network is called on: the
cube (`train.mode: full`, one call per case) or the patch (`train.mode: patch`, one call per window); the batch
axis is free (`evaluate.sw_batch_size` windows per call). Opset `OPSET`.

Two of the networks' training-memory devices are swapped for their plain forms before the export (the weights
and the function are the same; only how the forward saves memory differs):
- the Isensee U-Net's instance norm is an autograd Function whose forward fills preallocated slices; the
  exporter's trace loses the input through those writes (the graph came out with no input), so it is exported
  as the same formula from plain operations, its statistics in float64: onnxruntime's float32 ReduceMean over
  a 128³ phantom case's feature maps (large constant regions) moved the output probabilities by 5.2e-3, in
  float64 by 8.2e-6 (torch's own float32 mean sums in a cascade);
- nnU-Net's LeakyReLU writes into the storage under its input (`LeakyReLUOnBase`), which the trace cannot
  follow either: it is exported as the plain `nn.LeakyReLU`.

The exporter is torch's TorchScript one (`dynamo=False`): with the two swaps above it exports every network of
`model.name` at opset 18 in about a second for a small network, and it needs no package beyond onnx. torch 2.13's
default, the dynamo exporter, needs onnxscript as well, took 20 s on the tiny Isensee U-Net and failed on
nnU-Net's networks (torch.export cannot trace the in-place activation on the norm's storage).

Checked at export, per fold: onnxruntime (CPU) against torch on a seeded random input (`RANDOM_SEED`) and on a
real case of the run (its first case under `data.root`, preprocessed as predict does); the largest |difference|
of each and the tolerance (`RTOL`, `ATOL`: |onnx - torch| <= ATOL + RTOL * |torch|) are written into the
bundle's metadata, and a fold outside it is refused. A network with an operation that has no ONNX form at the
opset is refused in one line naming the operation.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from brats_swap.config import Config
from brats_swap.errors import ConfigError
from brats_swap.model.networks import LeakyReLUOnBase
from brats_swap.model.unet import KerasInstanceNorm, keras_instance_norm_reference
from brats_swap.ship.onnx_contract import LOGITS, network_output

OPSET = 18
INPUT_NAME = "image"
OUTPUT_NAME = "output"
RANDOM_SEED = 0
# MONAI's `convert_to_onnx(verify=True)` checks with rtol 1e-4; the atol covers probabilities near 0 and the
# float32 rounding of convolutions summed in another order.
RTOL = 1e-4
ATOL = 1e-4
# The float16 network (`model.fp16.onnx`, for GPUs; written where the network exports and runs in float16) is
# checked against torch's float32 output with float16's own precision (11 significant bits).
FP16_RTOL = 1e-2
FP16_ATOL = 1e-2
_UNSUPPORTED = re.compile(r"operator '?([\w:.]+)'? to ONNX")


class _PlainKerasNorm(nn.Module):
    """KerasInstanceNorm's function, (x - mean) / (std + eps) * weight + bias, from plain operations in float64
    (the export's form; module docstring)."""

    def __init__(self, norm: KerasInstanceNorm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return keras_instance_norm_reference(x.double(), self.weight.double(), self.bias.double(),
                                             self.eps).to(x.dtype)


class _Output(nn.Module):
    """The network's output the predict pipeline reads (module docstring)."""

    def __init__(self, network: nn.Module, output: str):
        super().__init__()
        self.network, self.output = network, output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network.logits(x) if self.output == LOGITS else self.network(x)


def exportable(model: nn.Module) -> nn.Module:
    """A copy of `model` (eval mode) with the two memory devices of the module docstring in their plain forms."""
    plain = copy.deepcopy(model).eval()
    # Every path to a module: nnU-Net's blocks hold their activation twice (an attribute and a Sequential entry).
    for name, module in list(plain.named_modules(remove_duplicate=False)):
        if isinstance(module, KerasInstanceNorm):
            replacement = _PlainKerasNorm(module)
        elif isinstance(module, LeakyReLUOnBase):
            replacement = nn.LeakyReLU(module.negative_slope)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(plain.get_submodule(parent_name) if parent_name else plain, child, replacement)
    return plain


def network_input_shape(config: Config) -> list[int]:
    """(1, C, X, Y, Z): the cube for whole-volume models, the patch for sliding-window ones."""
    spatial = config.train.patch if config.train.mode == "patch" or config.evaluate.inference == "nnunet" \
        else config.data.cube
    return [1, len(config.data.modalities), *(int(s) for s in spatial)]


def onnx_bytes(model: nn.Module, output: str, shape: Sequence[int], where: str, half: bool = False) -> bytes:
    """The ONNX model (opset `OPSET`, batch axis free) of `model`'s `output` for inputs of `shape`, in float16
    with `half`; ConfigError naming the operation when one has no ONNX form."""
    module = _Output(exportable(model), output).eval()
    if half:
        module = module.half()
    buffer = io.BytesIO()
    example = torch.zeros(tuple(shape), dtype=torch.float16 if half else torch.float32)
    try:
        # The exporter logs the whole graph when it fails (the refusal below is the one line) and warns about
        # Python values in the trace (the shapes, fixed here).
        with torch.no_grad(), warnings.catch_warnings(), _exporter_log_off():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (example,), buffer, dynamo=False, opset_version=OPSET,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
    except Exception as exc:  # torch.onnx raises several types (UnsupportedOperatorError, SymbolicValueError, ...)
        text = str(exc)
        found = _UNSUPPORTED.search(text)
        what = (f"the operation {found[1]} has no ONNX form" if found
                else (text.strip().splitlines() or [type(exc).__name__])[0][:200])
        raise ConfigError(f"{where}: cannot export {type(model).__name__} to ONNX opset {OPSET}"
                          f"{' in float16' if half else ''}: {what}; predict with --runtime torch") from None
    return buffer.getvalue()


@contextlib.contextmanager
def _exporter_log_off():
    """The TorchScript exporter's C++ log silenced: it prints the whole graph when an export fails, and torch
    2.13's `setup_onnx_logging` turns it on whatever `verbose` says (it tests the getter function itself, not
    its value), so standard output and error are pointed at /dev/null for the export."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (1, 2)]
    try:
        with open(os.devnull, "w") as null:
            for fd in (1, 2):
                os.dup2(null.fileno(), fd)
        yield
    finally:
        for fd, copy_of in zip((1, 2), saved, strict=True):
            os.dup2(copy_of, fd)
            os.close(copy_of)


@dataclass
class Agreement:
    """One input's comparison of onnxruntime with torch."""

    name: str
    max_abs_diff: float
    within: bool

    def record(self) -> dict:
        return {"input": self.name, "max_abs_diff": self.max_abs_diff}


def compare(model: nn.Module, output: str, model_bytes: bytes, image: np.ndarray, name: str,
            half: bool = False) -> Agreement:
    """onnxruntime's output of `model_bytes` (a float16 network with `half`) against torch's float32 `output` of
    `model`, on one (1, C, ...) float32 input."""
    import onnxruntime

    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    ours = session.run([OUTPUT_NAME], {INPUT_NAME: image.astype(np.float16) if half else image})[0]
    with torch.no_grad():
        theirs = _Output(model, output).eval()(torch.from_numpy(image)).numpy()
    difference = np.abs(ours.astype(np.float64) - theirs)
    rtol, atol = (FP16_RTOL, FP16_ATOL) if half else (RTOL, ATOL)
    within = bool(np.all(difference <= atol + rtol * np.abs(theirs.astype(np.float64))))
    return Agreement(name, float(difference.max()), within)


def random_input(shape: Sequence[int]) -> np.ndarray:
    """The seeded standard-normal input every fold is checked on (`RANDOM_SEED`)."""
    return np.random.default_rng(RANDOM_SEED).standard_normal(tuple(shape)).astype(np.float32)


def case_input(config: Config, shape: Sequence[int]) -> tuple[str, np.ndarray] | None:
    """(case id, a (1, C, ...) network input) from the first case under the run's `data.root`, preprocessed by
    brats-swap's rules as predict feeds its own models: the cube (its centre `shape` for a patch model). A model
    under nnU-Net's rules gets the same z-scored brain, cut from the cube rather than from nnU-Net's crop. None
    when the run's data is not there."""
    from brats_swap.data.discovery import discover_cases
    from brats_swap.data.nifti import load_case
    from brats_swap.data.preprocess import preprocess_case, preprocess_settings
    from brats_swap.errors import DataError

    try:
        cases = discover_cases(config.data.root, config.data.edition, config.data.modalities, config.data.challenge)
        loaded = load_case(cases[0], config.data.modalities, label=False)
        cube, _, _ = preprocess_case(loaded, preprocess_settings(config.data))
    except (DataError, OSError, IndexError):
        return None
    image = _centre(np.asarray(cube, dtype=np.float32), shape[2:])
    return cases[0].case_id, image[None]


def _centre(image: np.ndarray, spatial: Sequence[int]) -> np.ndarray:
    """The centre `spatial` of a (C, ...) image, zero-padded where the image is smaller."""
    out = np.zeros((image.shape[0], *spatial), dtype=image.dtype)
    source, target = [], []
    for size, want in zip(image.shape[1:], spatial, strict=True):
        start = max((size - want) // 2, 0)
        offset = max((want - size) // 2, 0)
        length = min(size, want)
        source.append(slice(start, start + length))
        target.append(slice(offset, offset + length))
    out[(slice(None), *target)] = image[(slice(None), *source)]
    return out


def checked_export(model: nn.Module, config: Config, run_config: Config, where: str) -> tuple[bytes, dict]:
    """The fold's ONNX bytes and its metadata record (module docstring); ConfigError when it cannot be exported
    or onnxruntime disagrees with torch beyond the tolerance."""
    import onnx

    output, shape = network_output(config), network_input_shape(config)
    model_bytes = onnx_bytes(model, output, shape, where)
    onnx.checker.check_model(onnx.load_from_string(model_bytes))
    checks = [compare(model, output, model_bytes, random_input(shape), f"random (seed {RANDOM_SEED})")]
    real = case_input(run_config, shape)
    if real is not None:
        checks.append(compare(model, output, model_bytes, real[1], f"case {real[0]}"))
    for check in checks:
        if not check.within:
            raise ConfigError(f"{where}: onnxruntime differs from torch on the {check.name} input by up to "
                              f"{check.max_abs_diff:.3g}, beyond atol {ATOL} + rtol {RTOL}; not exported")
    return model_bytes, {"opset": OPSET, "input": INPUT_NAME, "output": OUTPUT_NAME, "returns": output,
                         "input_shape": ["batch", *shape[1:]], "dtype": "float32", "rtol": RTOL, "atol": ATOL,
                         "checks": [check.record() for check in checks],
                         "real_case": real is not None}


def half_export(model: nn.Module, config: Config, run_config: Config, where: str) -> tuple[bytes | None, dict]:
    """The fold's float16 network and its record, or (None, the reason) where the network does not allow it: an
    operation without a float16 form in torch's exporter or in onnxruntime, or an output beyond float16's
    tolerance (`FP16_RTOL`, `FP16_ATOL`) of torch's float32 output on the inputs `checked_export` uses."""
    output, shape = network_output(config), network_input_shape(config)
    try:
        model_bytes = onnx_bytes(model, output, shape, where, half=True)
        inputs = [(f"random (seed {RANDOM_SEED})", random_input(shape))]
        real = case_input(run_config, shape)
        if real is not None:
            inputs.append((f"case {real[0]}", real[1]))
        checks = [compare(model, output, model_bytes, image, name, half=True) for name, image in inputs]
    except Exception as exc:  # the exporter's and onnxruntime's errors: this network has no float16 form here
        # (e.g. torch's CPU kernels trace no float16 average pooling: nnU-Net's residual encoder)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, {"written": False, "reason": reason.removeprefix(f"{where}: ")[:300]}
    outside = [check for check in checks if not check.within]
    if outside:
        return None, {"written": False, "reason": f"differs from torch's float32 output on the {outside[0].name} "
                      f"input by up to {outside[0].max_abs_diff:.3g}, beyond atol {FP16_ATOL} + rtol {FP16_RTOL}"}
    return model_bytes, {"written": True, "dtype": "float16", "rtol": FP16_RTOL, "atol": FP16_ATOL,
                         "checks": [check.record() for check in checks]}
