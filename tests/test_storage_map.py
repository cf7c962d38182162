"""brats_swap/memory/storage_map.py: the one map from a saved storage (alive, at its version) to a value."""

from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from brats_swap.memory.frontend import StorageIndex
from brats_swap.memory.recompute import NormActRecipes
from brats_swap.memory.storage_map import StorageMap


def test_a_view_finds_its_storage_until_the_storage_changes_in_place():
    base = torch.zeros(8)
    found: StorageMap[str] = StorageMap()
    found.put(base, "entry")
    assert found.get(base[2:5]) == "entry" and found.get(base.view(2, 4)) == "entry"
    assert found.get(torch.zeros(8)) is None  # another storage
    base.add_(1)  # a new version: what was saved before is not this tensor any more
    assert found.get(base) is None
    found.put(base, "again")
    assert found.get(base) == "again" and len(found) == 1


def test_a_dead_storage_never_matches_a_new_one_at_its_address():
    found: StorageMap[int] = StorageMap()
    for attempt in range(20):  # the allocator reuses the address of a freed storage sooner or later
        t = torch.empty(1024)
        found.put(t, attempt)
        # Freed by its reference count at `del`, which the weak reference shows: no gc.collect() (20 of them
        # took 12 s in a test worker whose heap holds the modules and fixtures of the files before it).
        dead = StorageWeakRef(t.untyped_storage())
        del t
        assert dead.expired()
        fresh = torch.empty(1024)
        assert found.get(fresh) is None
    found.clear()
    assert len(found) == 0


def test_the_front_end_and_the_recipes_key_storages_the_same_way():
    assert issubclass(StorageIndex, StorageMap)
    recipes = NormActRecipes(nn.Sequential(nn.Identity()), engine=None)
    assert isinstance(recipes.registry, StorageMap)
    recipes.reset()
    assert isinstance(recipes.registry, StorageMap) and len(recipes.registry) == 0
