"""A recorded training step (`Trace`): what is saved for backward, when, and what each operator costs.

The planner needs, for a model at the real size (192³, batch 2), the full life of every tensor in one
forward + backward: when its storage is allocated, when it would die if autograd did not hold it, which
storages autograd saves (grouped into records exactly as the engine groups them), every event the
memory engine reacts to, and the FLOPs and bytes of every operator. `recorder.trace_step` records it on
the `meta` device in seconds and without memory; `simulate.replay` replays its events through a
rulebook under any policy: the engine's decisions and release/reload points, event for event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brats_swap.config import RecomputeConfig
from brats_swap.memory.events import Event, EventKind
from brats_swap.memory.records import SavedRecord


@dataclass
class Storage:
    """One physical storage seen during the step (an activation, a gradient, a temporary)."""

    sid: int
    nbytes: int
    alloc_op: int
    free_op: int = -1  # first op index at which the storage was seen dead; -1 = alive at the end
    artifact_of: int = -1  # >= 0: a tensor the trace's unpack hook made for record `artifact_of`


@dataclass
class TracedRecord:
    """A `SavedRecord` plus where it lives in the trace."""

    record: SavedRecord
    sid: int  # physical storage (-1 for parameters and buffers, which live outside the step)
    deps: list[int] = field(default_factory=list)  # recomputed: the stored records its recipe reads
    # One storage per unpack, in unpack order; an unpack while an earlier one's storage is alive shares it.
    artifact_sids: list[int] = field(default_factory=list)


@dataclass
class OpInfo:
    name: str
    phase: int  # events.FORWARD or events.BACKWARD
    flops: float
    bytes_accessed: int  # bytes of the views read and written, per distinct storage at most its size
    kernel: bool  # False for view-like ops that launch nothing
    module: str = ""  # innermost running module ("" in backward outside recomputation)
    recompute: bool = False  # part of a recomputation in backward (checkpoint or norm_act recipe)
    grouped: bool = False  # a grouped (e.g. depthwise) convolution or its backward: no tensor-core rate
    fused: bool = False  # computed inside its consumer's compiled kernel: no launch of its own


@dataclass
class Trace:
    """Everything the memory and time simulations need, for one (model, input shape, dtype, variant)."""

    input_shape: tuple[int, ...]
    dtype: str
    variant: str
    ops: list[OpInfo]
    storages: list[Storage]
    records: list[TracedRecord]
    events: list[Event]
    module_names: list[str]
    regions: list[list[int]]
    fwd_end: int  # op index where backward starts
    param_bytes: int
    buffer_bytes: int
    input_bytes: int  # the batch and its target (also storages of the trace, alive for the whole step)
    seconds: float = 0.0
    compiled: bool = False  # traced with the blocks compiled (`recorder.trace_step(compiled=True)`)
    cache: dict = field(default_factory=dict, repr=False)  # derived arrays, filled by the simulator

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def saved_bytes(self) -> int:
        """Bytes of distinct non-parameter storages saved for backward (the engine's `saved_bytes`)."""
        return sum(r.record.nbytes for r in self.records if not r.record.is_param)

    def saved_records(self) -> list[SavedRecord]:
        return [r.record for r in self.records]

    def unpack_order(self) -> list[int]:
        """Record indices in first-unpack order: what the engine learns in one step for lookahead 0."""
        seen: dict[int, None] = {}
        for event in self.events:
            if event.kind is EventKind.UNPACK_BEGIN and event.arg not in seen:
                seen[event.arg] = None
        return list(seen)


def variant_name(recompute: RecomputeConfig | None) -> str:
    if recompute is None:
        return "plain"
    parts = []
    if recompute.modules:
        parts.append("checkpoint[" + ",".join(recompute.modules) + "]")
    if recompute.norm_act:
        parts.append("norm_act")
        if recompute.norm_act_exclude:
            parts.append("stored[" + ",".join(recompute.norm_act_exclude) + "]")
    return "+".join(parts) or "plain"
