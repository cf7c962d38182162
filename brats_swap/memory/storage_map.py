"""`StorageMap`: a value per saved storage, as the tensor saving it sees that storage now.

The front end (one rulebook entry per storage) and the norm_act recipes (one recipe per output) both need
"the value recorded for this tensor's storage, if it is still that storage at that version". A storage is
keyed by its impl address (`_cdata`) plus a `StorageWeakRef`, so a recycled address of a dead storage never
matches, and by the tensor's version counter, so a storage changed in place since is a new one.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

V = TypeVar("V")


class StorageMap(Generic[V]):
    def __init__(self) -> None:
        self._by_key: dict[int, tuple[StorageWeakRef, int, V]] = {}

    def get(self, t: torch.Tensor) -> V | None:
        """The value put for `t`'s storage, if that storage is alive and `t` is at the version it was put at."""
        hit = self._by_key.get(t.untyped_storage()._cdata)
        if hit is None:
            return None
        weak, version, value = hit
        if weak.expired() or version != t._version:
            return None
        return value

    def put(self, t: torch.Tensor, value: V) -> None:
        """`value` for `t`'s storage at `t`'s current version (replacing what that address held)."""
        storage = t.untyped_storage()
        self._by_key[storage._cdata] = (StorageWeakRef(storage), t._version, value)

    def clear(self) -> None:
        self._by_key.clear()

    def __len__(self) -> int:
        return len(self._by_key)


__all__ = ["StorageMap"]
