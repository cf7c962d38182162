"""The garbage collector kept off the heap a test module starts with.

A test process's heap holds torch, every imported module and what the files run before left: hundreds of
thousands of objects, which every full collection walks (0.2 s and more each). The engine runs, traces and
measuring scripts of the memory tests allocate enough to set off dozens of full collections per file, and the
scripts (scripts/validate_plan.py, bench_memory.py, gpu_check.py) collect after every policy they run:
test_planner.py spent 7 s of its 65 s of CPU in the collector. Frozen (`gc.freeze`), those objects are left
out of every collection; what the module allocates is collected as before, and the frozen objects are
handed back to the collector when the module ends.

Used as `from heap_fixtures import frozen_heap  # noqa: F401` (an autouse fixture: importing it is using it).
"""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def frozen_heap():
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
