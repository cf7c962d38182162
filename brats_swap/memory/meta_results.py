"""Meta-kernel results remembered by the layout of their inputs: the recorder's shortcut past torch's meta kernels.

A trace runs every aten operator of a step on the `meta` device, where an operator computes nothing but its
outputs' layout, and most meta kernels do that in Python (`torch._refs`, `torch._prims`): at 192³ they are
over half of a trace's time. Their result is a function of the operator, its inputs' layouts and its other
arguments, and a step repeats the same few operators (a norm's eight channel chunks, one block's ops in every
recompute variant the planner traces), so the recorder asks `MetaResults.run`, which hands back fresh
tensors of the layout remembered for the same operator and arguments (torch's `FakeTensorMode` keeps the
same kind of cache for fake tensors).

Only what a fresh output can stand for is remembered, so a remembered result is indistinguishable from a
computed one: operators whose schema aliases or writes an argument (views, in-place, `out=`), that draw
random numbers, or whose output shape depends on data are always run; an argument that is not a plain
`meta` tensor, a number, a string, a dtype/device/layout/memory format, None or a list of those (a SymInt, a
subclass) runs the operator; and a result is remembered only if its outputs are plain, strided `meta` tensors
on storages of their own, none an input's, that `torch.empty_strided` rebuilds exactly (size, stride, offset
0, dtype, storage bytes, flags), or plain numbers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import nn

from brats_swap.memory.frontend import storage_keys

# A trace of the 3D U-Net at 192³ has a few thousand distinct (operator, layouts) keys; the planner's recompute
# variants share most of them. The bound keeps a long process (cross-validation plans every fold) from growing:
# least recently used keys go first, and a key costs well under a kilobyte.
CAPACITY = 1 << 14

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
_UNCACHEABLE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape,
                     torch.Tag.data_dependent_output, torch.Tag.inplace_view)


class _Uncacheable(Exception):
    """An argument or output the cache cannot stand for: the operator runs."""


def _cacheable_operator(func: torch._ops.OpOverload) -> bool:
    """False for an operator whose outputs may alias or whose call changes an argument (any alias annotation in
    its schema), that draws random numbers or whose output shape depends on data, and for one not torch's own
    (a custom operator may do more than compute a layout)."""
    if func.namespace not in ("aten", "prims"):
        return False
    schema = func._schema
    if any(arg.alias_info is not None for arg in schema.arguments):
        return False
    if any(ret.alias_info is not None for ret in schema.returns):
        return False
    return not any(tag in func.tags for tag in _UNCACHEABLE_TAGS)


def _key_of(value):
    """A hashable stand-in of an argument: a plain meta tensor by its layout, a scalar by its type and value (1,
    1.0 and True pick different kernels and dtypes), a list by its items'."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        if value.device.type != "meta" or value.layout is not torch.strided:
            raise _Uncacheable
        # What torch's fake-tensor cache keys a tensor on (`TensorMetadata`), less what a meta tensor cannot be.
        return (value.dtype, tuple(value.shape), value.stride(), value.storage_offset(),
                value.untyped_storage().nbytes(), value.requires_grad, value.is_conj(), value.is_neg(),
                value.is_inference())
    if kind in (list, tuple):
        return (kind, tuple(_key_of(item) for item in value))
    if kind in _SCALARS:
        return (kind, value)
    raise _Uncacheable


def _layout_of(out, inputs: set[int]) -> tuple:
    """What rebuilds `out` (a tensor, a number, None, or a list/tuple of them), or `_Uncacheable`: ("tensor",
    size, stride, dtype), ("items", list or tuple, [layouts]) or ("value", the value)."""
    kind = type(out)
    if kind is torch.Tensor:
        storage = out.untyped_storage()
        if storage._cdata in inputs or out.device.type != "meta" or out.layout is not torch.strided:
            raise _Uncacheable
        inputs.add(storage._cdata)  # two outputs on one storage: the second is seen as an alias
        layout = ("tensor", tuple(out.shape), out.stride(), out.dtype)
        if not _same(_rebuild(layout), out):
            raise _Uncacheable
        return layout
    if kind in (list, tuple):
        return ("items", kind, [_layout_of(item, inputs) for item in out])
    if kind in _SCALARS:
        return ("value", out)
    raise _Uncacheable


def _rebuild(layout: tuple):
    if layout[0] == "tensor":
        _, size, stride, dtype = layout
        return torch.empty_strided(size, stride, dtype=dtype, device="meta")
    if layout[0] == "items":
        _, kind, items = layout
        return kind(_rebuild(item) for item in items)
    return layout[1]


def _same(rebuilt: torch.Tensor, out: torch.Tensor) -> bool:
    return (rebuilt.storage_offset() == out.storage_offset() == 0
            and rebuilt.untyped_storage().nbytes() == out.untyped_storage().nbytes()
            and rebuilt.requires_grad == out.requires_grad and rebuilt.is_conj() == out.is_conj()
            and rebuilt.is_neg() == out.is_neg())


def aten_tensors(value) -> list[torch.Tensor]:
    """`frontend.tensors_in` for an aten operator's arguments or results, which its schema allows to be tensors,
    scalars and lists, tuples or dicts of them only: the same tensors in the same order, without the general
    pytree walk (the recorder calls this three times per op)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in aten_tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in aten_tensors(item)]
    return []


class MetaResults:
    """A bounded, thread-safe memory of meta-kernel results (module docstring). `run(func, args, kwargs)` is
    `func(*args, **kwargs)` on meta tensors; call it where no torch dispatch mode is active (inside a mode's
    `__torch_dispatch__`), as the tensors it makes must not be seen as operators of the step."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, object] = OrderedDict()
        self._operators: dict[torch._ops.OpOverload, bool] = {}
        self._lock = threading.Lock()

    def run(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict):
        cacheable = self._operators.get(func)
        if cacheable is None:
            cacheable = self._operators[func] = _cacheable_operator(func)
        if not cacheable:
            return func(*args, **kwargs)
        try:
            # A factory called without a dtype (`aten.empty`, `aten.full`, `aten.arange`) takes the default one.
            key = (func, torch.get_default_dtype(), _key_of(args),
                   tuple((name, _key_of(value)) for name, value in kwargs.items()))
        except _Uncacheable:
            return func(*args, **kwargs)
        with self._lock:
            layout = self._entries.get(key)
            if layout is not None:
                self._entries.move_to_end(key)
        if layout is not None:
            return _rebuild(layout)
        out = func(*args, **kwargs)
        inputs = storage_keys(aten_tensors((args, kwargs)))
        try:
            layout = _layout_of(out, inputs)
        except _Uncacheable:
            return out
        with self._lock:
            self._entries[key] = layout
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._entries)


# One memory per process, shared by every trace (module docstring).
META_RESULTS = MetaResults()
