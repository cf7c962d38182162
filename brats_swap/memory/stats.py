"""Per-step memory statistics reported by the engine (logged to TensorBoard and the progress bar)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepStats:
    """What one training step did with the tensors autograd saved for backward.

    Byte counts are per step and cover activations only (parameters and buffers are never counted).
    "Resident" means held on the compute device by the engine: kept tensors, swapped tensors not yet
    released after their copy, and reloaded tensors not yet handed to autograd.
    """

    saved_bytes: int = 0  # distinct storages saved for backward (kept + swapped + recomputed)
    saved_tensors: int = 0  # number of those storages
    kept_bytes: int = 0  # storages left on the device
    swapped_out_bytes: int = 0  # bytes copied device -> host
    swapped_in_bytes: int = 0  # bytes copied host -> device
    swapped_tensors: int = 0  # storages copied out
    recomputed_bytes: int = 0  # storages rebuilt in backward by norm_act instead of being stored
    recomputed_tensors: int = 0
    recomputed_modules: int = 0  # calls of checkpointed modules (`recompute.modules`) in this forward
    peak_resident_saved_bytes: int = 0  # maximum of the resident saved bytes over forward + backward
    prefetch_misses: int = 0  # unpacks that had to reload synchronously (no prefetch issued in time)
    late_reloads: int = 0  # (CUDA) reloads issued in time but not finished when needed
    copy_seconds: float = 0.0  # time spent in copies (CUDA: copy-stream event time; CPU: wall time)
    arena_bytes: int = 0  # size of the host arena after this step
    # module name -> why `recompute.norm_act` did not make its output recomputable (see memory/recompute.py)
    norm_act_skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self, prefix: str = "memory/") -> dict[str, float]:
        """Flat floats for loggers, e.g. {"memory/swapped_out_bytes": 1.2e9, ...}; a dict field gives its size."""
        return {f"{prefix}{key}": float(len(value) if isinstance(value, dict) else value)
                for key, value in asdict(self).items()}
