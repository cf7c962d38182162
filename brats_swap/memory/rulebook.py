"""The memory policy as one rulebook: what happens to each tensor autograd saves for backward, and when.

One front end (`frontend.SavedTensorFrontEnd`: the saved-tensor hooks, module and block markers, the
step) reports every event of a step (`events.EventKind`) to a `Rulebook`, which decides and asks its
`Executor` to act: the executor (`executor.SwapExecutor`) moves real tensors through a host<->device
link, the recorder (`recorder.TraceRecorder`) records a step on `meta` tensors, and the simulator
(`simulate.py`) replays that record on a clock. None of them decides anything on its own, so what the
simulator predicts is what the engine does, event for event.

The rules, numbered; each method below names the rules it implements.

Decision per storage (`Decider.decide`; the reason is part of the result), at its first save:

- Rule 1 (recompute): a norm_act recipe rebuilds it (`recompute.NormActRecipes`), unless its module
  matches `recompute.norm_act_exclude` (then it is stored, and rules 2-3 apply). A recomputed storage
  is never also stored or swapped.
- Rule 2 (keep): a parameter or buffer (or an autocast copy of one), an argument of the model's forward
  (the caller holds them: a copy would free nothing), any storage when the mode does not swap, a tensor
  that is not plain dense (its bytes cannot be copied and viewed again), fewer than `swap.min_bytes`,
  outside `swap.include`, inside `swap.exclude`, or past the first `swap.tensors` swapped storages.
- Rule 3 (swap): everything else. One storage is one decision: a second save of the same storage at
  the same version is the same entry (`save_again`), needed no earlier than its latest save's block.

Where a saved storage is needed (`use_marker`, the backward marker before which backward unpacks it):

- Rule 4: a save inside a block is needed from that block's backward marker on; a save between blocks
  from the next block's; a save again, a recipe's inputs and a checkpointed region's inputs (needed
  when backward reruns the region, in the last block that started) raise it, never lower it.

Swapped storages, forward (release):

- Rule 5: the copy out is issued at the save; the device storage stays referenced (`COPYING`) until
  it is released.
- Rule 6: a storage is never released because its copy happens to be found finished: release points
  depend on the saves alone (rules 7 and 8), so the device memory of a step is the same for every copy
  timing, and the planner's peak is a bound a late copy cannot break (a late copy costs a wait
  instead). Only a synchronous link, whose copy has finished when the save returns, releases at every
  module start and at the end of the forward whatever it copied (`Executor.copies_synchronously`).
- Rule 7: `swap.max_inflight_bytes` (unset: `budget.inflight_window_bytes`) bounds how long a copy may run: once that many bytes of further
  storages were saved after a swapped storage, it is released and the compute waits for that one copy.
- Rule 8: at the end of the forward (the step's peak comes as backward starts) every storage still
  copying that backward does not need within `swap.lookahead` blocks is released, waiting for its copy
  (every compressed one: rule 16).

Swapped storages, backward (reload):

- Rule 9 (`swap.lookahead = L >= 1`): when backward reaches block b, every storage on the host first
  needed in blocks >= b - L is reloaded; in the middle of backward (past its first
  `swap.mid_from_marker` markers, at blocks b >= `swap.mid_until_block`) L is `swap.mid_lookahead` when
  that is set: the reloads go further ahead where memory has room, between the peaks at the start of
  backward and at its high-resolution end; storages saved after the last block (the loss) are reloaded
  at the end of the forward; a storage still copying is read from the device.
- Rule 10 (`swap.lookahead = 0`): exactly one reload is kept ahead of backward, in the first-use order
  learned in the previous step (while the step saves as many storages; otherwise reverse forward order).
- Rule 11: a use with no reload issued reloads at once (a prefetch miss); every use waits for its reload.
- Rule 12: a reload is dropped when every view was unpacked once (autograd owns it then) or died, or at
  the end of backward.
- Rule 13 (parking): once a view of a storage saved in several blocks (a skip connection) was
  unpacked and its remaining views are needed only beyond the prefetch window, its reload is dropped
  (the host copy stays) and reloaded when backward comes within `swap.lookahead` blocks of them.

Lifetime and accounting:

- Rule 14: an entry dies with its last handle; whatever the engine still holds for it goes then.
- Rule 15: `stats.peak_resident_saved_bytes` counts the bytes of saved storages the engine holds on the
  device (kept, copying, reloaded, and the conversion buffers of bf16 copies: `Executor.staging_bytes`),
  so the engine's measurement and the simulator's prediction are the same counter.
- Rule 16 (`swap.compress: bf16`): backward reads a compressed storage from the host, never from the
  device, so its values (rounded to bf16) do not depend on when its copy finished: rule 8 releases it
  at the end of the forward, and a use that finds it still copying waits, releases and reloads it.

Each entry is in one state (`EntryState`): `ON_DEVICE` (kept or recomputed: its handles hold it),
`COPYING` (swapped, device storage referenced until released), `ON_HOST` (released, no reload held),
`RELOADED` (a reloaded device buffer is held), `PARKED` (rule 13) or `DEAD` (rule 14).

`log` (a list, optional) receives `(event, record index)` for every swap out, release, reload, reloaded
(a use waited for its reload), use and drop: the per-tensor sequence a test compares.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from brats_swap.config.schema import MemoryConfig, SwapConfig
from brats_swap.memory.budget import inflight_window_bytes
from brats_swap.memory.records import SWAP_MODES, SavedRecord, module_matches
from brats_swap.memory.stats import StepStats

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"


@dataclass(frozen=True)
class Decision:
    kind: str  # KEEP, SWAP or RECOMPUTE
    reason: str


class Decider:
    """The decision per saved storage (rules 1-3), fed in forward order: `swap.tensors` counts."""

    def __init__(self, swap_cfg: SwapConfig, swapping: bool = True):
        self.swap_cfg = swap_cfg
        self.swapping = swapping
        self.selected = 0

    def decide(self, record: SavedRecord) -> Decision:
        cfg = self.swap_cfg
        if record.recompute:
            return Decision(RECOMPUTE, "rebuilt in backward from a norm_act recipe")
        if record.is_param:
            return Decision(KEEP, "a parameter, buffer or autocast copy of one (alive anyway)")
        if record.is_input:
            return Decision(KEEP, "an input of the model's forward (the caller holds it)")
        if not self.swapping:
            return Decision(KEEP, "the memory mode does not swap")
        if not record.dense:
            return Decision(KEEP, "not a plain dense tensor (its bytes cannot be copied and viewed again)")
        if record.nbytes < cfg.min_bytes:
            return Decision(KEEP, "smaller than swap.min_bytes")
        if cfg.include and not module_matches(record.module, cfg.include):
            return Decision(KEEP, "its module is not in swap.include")
        if module_matches(record.module, cfg.exclude):
            return Decision(KEEP, "its module is in swap.exclude")
        if 0 <= cfg.tensors <= self.selected:
            return Decision(KEEP, "past the first swap.tensors swapped storages")
        self.selected += 1
        return Decision(SWAP, "swapped")


def select_swapped(records: Sequence[SavedRecord], swap_cfg: SwapConfig) -> set[int]:
    """Indices of the records the engine swaps under `swap_cfg` (records in any order; sorted by index).

    Example (a planner predicting swapped bytes from a trace):
        chosen = select_swapped(records, cfg.memory.swap)
        swapped_bytes = sum(r.nbytes for r in records if r.index in chosen)
    """
    decider = Decider(swap_cfg)
    return {r.index for r in sorted(records, key=lambda r: r.index) if decider.decide(r).kind == SWAP}


def transfer_bytes(record: SavedRecord, swap_cfg: SwapConfig) -> int:
    """Bytes a swapped storage occupies on the link and in host memory (bf16 halves an fp32 storage)."""
    if swap_cfg.compress == "bf16" and record.dtype == "float32":
        return record.nbytes // 2
    return record.nbytes


@dataclass
class SaveFacts:
    """What the rulebook is told at a storage's first save (`Rulebook.save`)."""

    nbytes: int
    dtype: str
    is_param: bool
    is_input: bool
    dense: bool
    recompute: bool  # a norm_act recipe can rebuild it
    deps: list = field(default_factory=list)  # the stored entries that recipe reads
    payload: Any = None  # the executor's own state for this storage


class EntryState(enum.Enum):
    """Where an entry's storage is (module docstring)."""

    ON_DEVICE = "on_device"
    COPYING = "copying"
    ON_HOST = "on_host"
    RELOADED = "reloaded"
    PARKED = "parked"
    DEAD = "dead"


class Entry:
    """One saved storage in one step, as the rulebook tracks it; `payload` is the executor's own state."""

    __slots__ = ("record", "decision", "reason", "transfer_bytes", "use_marker", "deps", "alive", "pending", "state",
                 "seen", "resident", "saved_mark", "payload", "handle_markers", "__weakref__")

    def __init__(self, record: SavedRecord, decision: Decision, transfer: int, use_marker: int, deps: list[Entry],
                 payload: Any):
        self.record = record
        self.decision = decision.kind
        self.reason = decision.reason
        self.transfer_bytes = transfer
        self.use_marker = use_marker  # the backward marker (block ordinal) from which it is needed
        self.deps = deps  # a recomputed storage: the stored entries its recipe reads
        self.alive = 1  # live handles (views autograd holds)
        self.pending = 1  # live handles not unpacked yet
        self.state = EntryState.ON_DEVICE
        self.seen = False  # unpacked at least once
        self.resident = 0  # device bytes of this storage the engine holds now
        self.saved_mark = 0  # bytes saved in the step up to and with this storage
        self.payload = payload
        # The use marker of each handle not unpacked yet (None: not known per handle, never parked).
        self.handle_markers: list[int] | None = [use_marker]

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def compressed(self) -> bool:
        """Swapped in bf16: the host holds a rounded copy (rule 16)."""
        return self.transfer_bytes != self.record.nbytes


class Executor(Protocol):
    """What a rulebook asks of whoever runs it (the engine: real copies; the simulator: a clock)."""

    def swap_out(self, entry: Entry) -> None:
        """Issue the copy of the entry's storage to the host."""

    def copies_synchronously(self) -> bool:
        """Every copy has finished when it is issued (the synchronous CPU link): rule 6."""

    def staging_bytes(self, entry: Entry) -> int:
        """Device bytes a copy of `entry` holds besides the storage itself (a conversion buffer for bf16
        transport on CUDA), from the copy's issue until the compute waited for it (rule 15)."""

    def release(self, entry: Entry, wait: bool) -> None:
        """Drop the device storage; with `wait`, the compute first waits for its copy out."""

    def reload(self, entry: Entry) -> None:
        """Allocate a device buffer and issue the copy back into it."""

    def await_reload(self, entry: Entry) -> None:
        """The compute waits for the reload (a use is next)."""

    def drop_reload(self, entry: Entry) -> None:
        """Forget the reloaded buffer (autograd's views keep what they still use)."""

    def died(self, entry: Entry) -> None:
        """Its last handle died: drop whatever is left (an unreleased storage once its copy out is done)."""


class Rulebook:
    """The state machine of one step (module docstring). Feed events; `stats` and `log` are the results.

    `learned` is the previous step's `(unpack_order, number of records)` for `swap.lookahead = 0`;
    `prefetch=False` issues no reload ahead of use (every use is a miss; for tests).
    """

    def __init__(self, memory_cfg: MemoryConfig, executor: Executor, *, prefetch: bool = True,
                 learned: tuple[list[int], int] | None = None, log: list | None = None):
        self.swap_cfg = memory_cfg.swap
        # Rule 7's window; unset, the budget's share (the engine and the planner fill in the card's first).
        self.inflight_window = inflight_window_bytes(memory_cfg)
        self.executor = executor
        self.prefetch = prefetch
        self.lookahead = memory_cfg.swap.lookahead
        self.base_lookahead = self.lookahead  # rule 9 outside the middle of backward
        mid = memory_cfg.swap.mid_lookahead
        self.mid_lookahead = mid if mid >= 1 and self.lookahead >= 1 else None  # rule 9 in the middle, if set
        self.markers_reached = 0
        self.decider = Decider(memory_cfg.swap, swapping=memory_cfg.mode in SWAP_MODES)
        self.norm_act_exclude = list(memory_cfg.recompute.norm_act_exclude)
        self.entries: list[Entry] = []
        self.stats = StepStats()
        self.log = log
        self.resident = 0
        self.saved_total = 0  # bytes of the storages saved so far in this step
        self.unreleased: deque[Entry] = deque()
        self.unreleased_bytes = 0
        self.released: list[Entry] = []  # released, not reloaded yet (lookahead >= 1 prunes it)
        self.held: list[Entry] = []  # entries whose reload the engine may still hold
        self.unpack_order: list[int] = []
        self.learned_order, self.learned_count = learned if learned is not None else ([], -1)
        self.learned_position = {index: position for position, index in enumerate(self.learned_order)}
        self.module_stack: list[str] = []
        self.block_stack: list[int] = []
        self.blocks_started = 0
        self.last_block = -1
        self.backward_block: int | None = None  # the last block backward reached
        self.parked: list[Entry] = []

    # ------------------------------------------------------------------ positions (forward)
    def where(self) -> tuple[str, int, int]:
        """(innermost running module, block, use marker): a save inside a block is needed before that
        block's backward marker; between blocks, before the next block's."""
        module = self.module_stack[-1] if self.module_stack else ""
        if self.block_stack:
            return module, self.block_stack[-1], self.block_stack[-1]
        return module, self.last_block, self.last_block + 1

    def module_start(self, name: str, is_block: bool) -> None:
        self.module_stack.append(name)
        self._release_copied()
        if is_block:
            ordinal = self.blocks_started
            self.blocks_started += 1
            self.block_stack.append(ordinal)
            self.last_block = ordinal

    def module_end(self, is_block: bool) -> int | None:
        """Pop the module; for a block, its ordinal (the executor marks where backward reaches it)."""
        if self.module_stack:
            self.module_stack.pop()
        if is_block and self.block_stack:
            return self.block_stack.pop()
        return None

    # ------------------------------------------------------------------ saves
    def save(self, facts: SaveFacts) -> Entry:
        """The first save of a storage: a new record, decided (rules 1-3), needed from its block (rule 4),
        and for a swap the copy out issued (rule 5)."""
        module, block, use_marker = self.where()
        nbytes, is_param = facts.nbytes, facts.is_param
        recompute = facts.recompute and not module_matches(module, self.norm_act_exclude)
        record = SavedRecord(index=len(self.entries), nbytes=nbytes, module=module, block=block, is_param=is_param,
                             recompute=recompute, dtype=facts.dtype, is_input=facts.is_input, dense=facts.dense)
        decision = self.decider.decide(record)
        entry = Entry(record, decision, transfer_bytes(record, self.swap_cfg), use_marker,
                      list(facts.deps) if recompute else [], facts.payload)
        self.entries.append(entry)
        if not is_param:
            self.saved_total += nbytes
        entry.saved_mark = self.saved_total
        stats = self.stats
        if not is_param:
            stats.saved_bytes += nbytes
            stats.saved_tensors += 1
        if entry.decision == RECOMPUTE:
            stats.recomputed_bytes += nbytes
            stats.recomputed_tensors += 1
        elif entry.decision == SWAP:
            stats.swapped_out_bytes += nbytes
            stats.swapped_tensors += 1
            self._hold(entry, nbytes + self.executor.staging_bytes(entry))
            self._note("swap_out", entry)
            self.executor.swap_out(entry)
            entry.state = EntryState.COPYING
            self.unreleased.append(entry)
            self.unreleased_bytes += nbytes
        elif not is_param:
            stats.kept_bytes += nbytes
            self._hold(entry, nbytes)
        self._enforce_inflight_budget()
        return entry

    def save_again(self, entry: Entry) -> None:
        """Another handle on an existing record (rule 3): needed no earlier than the current position's
        marker (rule 4)."""
        entry.alive += 1
        entry.pending += 1
        marker = self.where()[2]
        if entry.handle_markers is not None:
            entry.handle_markers.append(marker)
        self.raise_use_marker(entry, marker)

    def raise_use_marker(self, entry: Entry, marker: int) -> None:
        """`entry` is needed in backward no earlier than block `marker`; so are its recipe's inputs (rule 4)."""
        if marker > entry.use_marker and entry.handle_markers is not None and marker not in entry.handle_markers:
            entry.handle_markers = None  # needed earlier than any handle says (a recipe, a checkpoint): never park
        entry.use_marker = max(entry.use_marker, marker)
        for dep in entry.deps:
            self.raise_use_marker(dep, marker)

    def region_done(self, entries: Iterable[Entry | None]) -> None:
        """A checkpointed region returned: its saved inputs are first used when backward reruns it, in the
        last block that started (rule 4)."""
        for entry in entries:
            if entry is not None:
                self.raise_use_marker(entry, self.last_block)

    # ------------------------------------------------------------------ release (forward)
    def _release_copied(self) -> None:
        """Rule 6: with a synchronous link every copy has finished already; release them all."""
        if not self.executor.copies_synchronously():
            return
        while self.unreleased:
            self._release(self.unreleased.popleft(), wait=False)

    def _enforce_inflight_budget(self) -> None:
        """Release (waiting for its copy) every unreleased storage after which `swap.max_inflight_bytes`
        of further storages were saved: its copy had that much forward work to hide behind (rule 7)."""
        while self.unreleased and self.saved_total - self.unreleased[0].saved_mark >= self.inflight_window:
            self._release(self.unreleased.popleft(), wait=True)

    def _release(self, entry: Entry, wait: bool) -> None:
        if entry.state is EntryState.DEAD:
            return  # died meanwhile; its bytes left the budget then
        self.unreleased_bytes -= entry.record.nbytes
        entry.state = EntryState.ON_HOST
        self._note("release", entry)
        self.executor.release(entry, wait)
        self._unhold(entry)
        self.released.append(entry)

    def forward_end(self) -> None:
        """The peak of a step comes as backward starts: every copying storage backward does not need
        within `lookahead` blocks is released now, waiting for its copy only (rule 8). Then, with
        lookahead >= 1, storages on the host saved after the last block (a loss, say) are reloaded, since
        they are needed before any marker fires (rule 9); with lookahead 0, the first storage backward
        will need is reloaded (rule 10)."""
        self._release_outside_window()
        if not self.prefetch:
            return
        if self.lookahead != 0:
            for entry in self.released:
                if entry.use_marker > self.last_block and entry.state is EntryState.ON_HOST and entry.pending > 0:
                    self._reload(entry)
            return
        if not self.released:
            return
        if self._learned_valid() and self.learned_order:
            first = self.entries[self.learned_order[0]]
            if first.state is EntryState.ON_HOST and first.pending > 0:
                self._reload(first)
            else:
                self._prefetch_next(after=first.index)
        else:
            self._prefetch_next(after=None)

    def _release_outside_window(self) -> None:
        """At the end of the forward (rule 8): keep on the device only the copying storages the first
        markers of backward would reload (`use_marker + lookahead >= last block`; with lookahead 0, those
        saved after the last block, and none compressed: rule 16); release the others, oldest first,
        waiting for each copy (rule 6: whether a copy finished early changes nothing)."""
        self._release_copied()
        keep: deque[Entry] = deque()
        reach = self.last_block - self.lookahead if self.lookahead else self.last_block + 1
        while self.unreleased:
            entry = self.unreleased.popleft()
            if entry.state is EntryState.DEAD or (entry.use_marker >= reach and not entry.compressed):
                keep.append(entry)
            else:
                self._release(entry, wait=True)
        self.unreleased = keep

    # ------------------------------------------------------------------ reload (backward)
    def marker(self, ordinal: int) -> None:
        """Backward reached block `ordinal`: reload what is needed within `lookahead` blocks from here
        (rules 9, 10 and 13)."""
        self.backward_block = ordinal
        self.markers_reached += 1
        self.lookahead = self._lookahead_at(ordinal)
        if not self.prefetch:
            return
        self._unpark(ordinal)
        if self.lookahead == 0:
            if not self._learned_valid():
                self._prefetch_next(after=None)
            return
        remaining = []
        for entry in self.released:
            if entry.state in (EntryState.DEAD, EntryState.RELOADED):
                continue
            if entry.use_marker + self.lookahead >= ordinal and entry.pending > 0:
                self._reload(entry)
            else:
                remaining.append(entry)
        self.released = remaining

    def _lookahead_at(self, ordinal: int) -> int:
        """Rule 9's L at block `ordinal`: `swap.mid_lookahead` in the middle of backward, else `lookahead`."""
        cfg = self.swap_cfg
        if self.mid_lookahead and self.markers_reached > cfg.mid_from_marker and ordinal >= cfg.mid_until_block:
            return self.mid_lookahead
        return self.base_lookahead

    def _unpark(self, ordinal: int) -> None:
        """Reload the parked storages whose next handle is needed within the prefetch window of `ordinal`
        (rule 13)."""
        waiting = []
        for entry in self.parked:
            if entry.state is not EntryState.PARKED:
                continue  # died, or reloaded by a miss meanwhile
            if entry.pending == 0:
                entry.state = EntryState.ON_HOST
            elif entry.use_marker + self.lookahead >= ordinal:
                self._reload(entry)
            else:
                waiting.append(entry)
        self.parked = waiting

    def _park_if_needed_later(self, entry: Entry) -> None:
        """After a use of a reloaded storage: drop the reload when its remaining handles are all needed in
        blocks beyond the prefetch window; the host copy is reloaded for them later (rule 13)."""
        markers = entry.handle_markers
        if (entry.decision != SWAP or entry.state is not EntryState.RELOADED or entry.pending == 0 or not markers
                or self.backward_block is None or max(markers) + self.lookahead >= self.backward_block):
            return
        entry.use_marker = max(markers)
        self._drop_reload(entry)
        entry.state = EntryState.PARKED
        self.parked.append(entry)

    def _learned_valid(self) -> bool:
        return self.learned_count == len(self.entries)

    def _prefetch_next(self, after: int | None) -> None:
        """lookahead 0: keep exactly one swapped storage reloaded ahead of backward (rule 10).

        The order is the previous step's first-unpack order, valid while the forward saves as many
        storages. Without it, reverse forward order: first the pending storages saved just after the one
        just unpacked (one op unpacks what it saved in save order), then the ones before it, nearest
        first. At most one reload is outstanding; a wrong guess is a counted miss.
        """
        if self._learned_valid() and after is not None and after in self.learned_position:
            start = self.learned_position[after] + 1
            candidates = (self.entries[i] for i in self.learned_order[start:] if i < len(self.entries))
        elif after is None:
            candidates = reversed(self.released)
        else:
            above = sorted((e for e in self.released if after < e.index <= after + 8), key=lambda e: e.index)
            below = (e for e in reversed(self.released) if e.index < after)
            candidates = (*above, *below)
        for entry in candidates:
            if entry.state not in (EntryState.ON_HOST, EntryState.RELOADED) or entry.pending == 0:
                continue
            if entry.state is EntryState.ON_HOST:
                self._reload(entry)
            return

    def _reload(self, entry: Entry) -> None:
        self._note("reload", entry)
        self.executor.reload(entry)
        entry.state = EntryState.RELOADED
        self.held.append(entry)
        self._hold(entry, entry.record.nbytes + self.executor.staging_bytes(entry))
        self.stats.swapped_in_bytes += entry.record.nbytes

    # ------------------------------------------------------------------ unpack
    def unpack_begin(self, entry: Entry) -> None:
        """A view of `entry` is unpacked: make its storage available (reload if needed, then wait: rule 11)."""
        self._note("use", entry)
        if not entry.seen:
            entry.seen = True
            self.unpack_order.append(entry.index)
        if entry.decision != SWAP:
            return  # kept or recomputed: on the device
        if entry.state is EntryState.COPYING:
            if not entry.compressed:
                return  # never released: read on the device
            self.unreleased.remove(entry)  # rule 16: read what the host holds, whatever the timing
            self._release(entry, wait=True)
        if entry.state is not EntryState.RELOADED:
            self.stats.prefetch_misses += 1  # still correct, just synchronous
            self._reload(entry)
        self._note("reloaded", entry)
        self.executor.await_reload(entry)
        staging = self.executor.staging_bytes(entry)
        if staging and entry.resident > entry.record.nbytes:  # the reload's conversion buffer goes now
            entry.resident -= staging
            self.resident -= staging

    def unpack_end(self, entry: Entry, first_for_handle: bool) -> None:
        """After the view was built: count the handle as unpacked, drop the reload autograd now owns
        (rule 12) or park it (rule 13), and keep one reload ahead (lookahead 0, rule 10)."""
        if first_for_handle:
            entry.pending -= 1
            if entry.handle_markers:
                entry.handle_markers.remove(max(entry.handle_markers))  # backward meets the latest save first
            if entry.pending == 0 and entry.state is EntryState.RELOADED:
                self._drop_reload(entry)  # autograd's view now owns the storage
            else:
                self._park_if_needed_later(entry)
        if self.prefetch and self.lookahead == 0 and self.released:
            self._prefetch_next(after=entry.index)

    # ------------------------------------------------------------------ lifetime
    def handle_died(self, entry: Entry, unpacked: bool) -> None:
        """A handle died; the last one takes the entry with it (rules 12 and 14)."""
        entry.alive -= 1
        if not unpacked:
            entry.pending -= 1
            if entry.pending == 0 and entry.state is EntryState.RELOADED:
                self._drop_reload(entry)
        if entry.alive == 0:
            self._died(entry)

    def _died(self, entry: Entry) -> None:
        if entry.state is EntryState.RELOADED:
            self._drop_reload(entry)
        if entry.state is EntryState.COPYING:
            self.unreleased_bytes -= entry.record.nbytes
        entry.state = EntryState.DEAD
        self.executor.died(entry)
        self._unhold(entry)

    def backward_end(self) -> None:
        """End of a backward pass: drop every reload it did not consume, unused heads, branches (rule 12)."""
        for entry in self.held:
            if entry.state is EntryState.RELOADED:
                self._drop_reload(entry)
        self.held = []

    def _drop_reload(self, entry: Entry) -> None:
        entry.state = EntryState.ON_HOST
        self._note("drop", entry)
        self.executor.drop_reload(entry)
        self._unhold(entry)

    # ------------------------------------------------------------------ accounting
    def _hold(self, entry: Entry, nbytes: int) -> None:
        """Rule 15: the engine holds `nbytes` more of this entry on the device."""
        entry.resident += nbytes
        self.resident += nbytes
        if self.resident > self.stats.peak_resident_saved_bytes:
            self.stats.peak_resident_saved_bytes = self.resident

    def _unhold(self, entry: Entry) -> None:
        self.resident -= entry.resident
        entry.resident = 0

    def _note(self, event: str, entry: Entry) -> None:
        if self.log is not None:
            self.log.append((event, entry.index))

    @property
    def records(self) -> list[SavedRecord]:
        return [entry.record for entry in self.entries]
