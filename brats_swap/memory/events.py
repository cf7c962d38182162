"""The event vocabulary of a step, written once: what the front end reports, the recorder stores and the
simulator replays.

Every event the saved-tensor front end (`frontend.SavedTensorFrontEnd`) sees is an `Event`: a kind, the
op index at which it happened (the recorder's clock; 0 when nothing records), one integer argument and
one flag, whose meanings depend on the kind (`EventKind`). `deliver` hands an event to the rulebook:
the live engine and the replay of a recorded trace both go through it, so adding an event means adding
a kind here and its line in `deliver`, nothing else.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from brats_swap.memory.rulebook import Entry, Rulebook, SaveFacts

FORWARD, BACKWARD = 0, 1  # the phase of an operator in a trace


class EventKind(enum.IntEnum):
    """What happened; `Event.arg` and `Event.flag` as noted."""

    MODULE_START = 0  # arg: index of the module's name (`EventSource.module_name`); flag: it is a block
    MODULE_END = 1  # flag: it is a block
    SAVE = 2  # arg: record index (a storage saved for the first time in the step)
    SAVE_AGAIN = 3  # arg: record index (another view of it, or the same storage saved by a later op)
    REGION_DONE = 4  # arg: index of the region (`EventSource.region`: record indices of its saved inputs)
    FORWARD_END = 5
    MARKER = 6  # arg: block ordinal (backward reached that block)
    UNPACK_BEGIN = 7  # arg: record index
    UNPACK_END = 8  # arg: record index; flag: the first unpack of that handle
    HANDLE_DIED = 9  # arg: record index; flag: the handle had been unpacked
    BACKWARD_END = 10


class Event(NamedTuple):
    op: int  # op index at which it happened (the trace's clock)
    kind: EventKind
    arg: int = 0
    flag: bool = False


class EventSource(Protocol):
    """What `deliver` looks up for an event: the tables its integer arguments index."""

    def module_name(self, index: int) -> str:
        """The qualified name of a module (`MODULE_START`)."""

    def region(self, index: int) -> list[int]:
        """The record indices of a checkpointed region's saved inputs (`REGION_DONE`)."""

    def first_save(self, index: int) -> SaveFacts:
        """What the rulebook needs to know about record `index` at its first save (`SAVE`)."""


def deliver(rulebook: Rulebook, event: Event, source: EventSource) -> Entry | int | None:
    """Hand `event` to `rulebook`. Returns the new entry for `SAVE` and the block ordinal (or None) for
    `MODULE_END`; None otherwise."""
    kind, arg = event.kind, event.arg
    if kind is EventKind.MODULE_START:
        rulebook.module_start(source.module_name(arg), event.flag)
    elif kind is EventKind.MODULE_END:
        return rulebook.module_end(event.flag)
    elif kind is EventKind.SAVE:
        return rulebook.save(source.first_save(arg))
    elif kind is EventKind.SAVE_AGAIN:
        rulebook.save_again(rulebook.entries[arg])
    elif kind is EventKind.REGION_DONE:
        rulebook.region_done(rulebook.entries[i] for i in source.region(arg))
    elif kind is EventKind.FORWARD_END:
        rulebook.forward_end()
    elif kind is EventKind.MARKER:
        rulebook.marker(arg)
    elif kind is EventKind.UNPACK_BEGIN:
        rulebook.unpack_begin(rulebook.entries[arg])
    elif kind is EventKind.UNPACK_END:
        rulebook.unpack_end(rulebook.entries[arg], event.flag)
    elif kind is EventKind.HANDLE_DIED:
        rulebook.handle_died(rulebook.entries[arg], event.flag)
    elif kind is EventKind.BACKWARD_END:
        rulebook.backward_end()
    return None
