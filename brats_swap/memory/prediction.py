"""`PolicyPrediction`: one memory policy priced for a model, what `planner.Planner.predict` returns and the
planner's search (`swap_search`) ranks."""

from __future__ import annotations

from dataclasses import dataclass

from brats_swap.config import MemoryConfig
from brats_swap.memory.budget import GIB, inflight_window_bytes
from brats_swap.memory.records import SWAP_MODES


@dataclass
class PolicyPrediction:
    name: str
    policy: MemoryConfig
    peak_bytes: int
    saved_bytes: int
    swapped_bytes: int
    recompute_flops: float
    peak_resident_saved_bytes: int
    step_s: float
    exposed_transfer_s: float
    prefetch_misses: int
    fits: bool

    def row(self) -> dict:
        return {
            "name": self.name,
            "predicted_peak_gib": round(self.peak_bytes / GIB, 4),
            "swapped_gib": round(self.swapped_bytes / GIB, 4),
            "recompute_gflop": round(self.recompute_flops / 1e9, 3),
            "predicted_step_s": round(float(self.step_s), 5),
            "prefetch_misses": self.prefetch_misses,
            "fits": self.fits,
            "max_inflight_bytes": self.inflight_bytes,
        }

    @property
    def inflight_bytes(self) -> int | None:
        """The in-flight window this prediction assumes (rule 7); None for a policy that does not swap."""
        if self.policy.mode not in SWAP_MODES:
            return None
        return inflight_window_bytes(self.policy)
