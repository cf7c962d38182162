"""The recorder's memory of meta-kernel results (`memory/meta_results.py`) stands for the kernels exactly."""

from __future__ import annotations

import torch

from brats_swap.config.schema import ModelConfig, RecomputeConfig
from brats_swap.memory import meta_results
from brats_swap.memory.meta_results import MetaResults
from brats_swap.memory.recorder import trace_step
from brats_swap.model import build_model
from brats_swap.train.losses import weighted_dice_loss

aten = torch.ops.aten


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes(), t.requires_grad


def test_a_remembered_result_is_a_fresh_tensor_of_the_computed_layout():
    memory = MetaResults()
    x = torch.empty(2, 3, 4, 5, device="meta").permute(0, 2, 3, 1)  # a channels-last layout: strides matter
    computed = memory.run(aten.mul.Tensor, (x, x), {})
    remembered = memory.run(aten.mul.Tensor, (x, x), {})
    assert len(memory) == 1
    assert _layout(remembered) == _layout(computed) == _layout(aten.mul.Tensor(x, x))
    storages = {t.untyped_storage()._cdata for t in (x, computed, remembered)}
    assert len(storages) == 3  # each call its own storage, as the kernel gives
    # A convolution backward's tuple with a None (no bias gradient) comes back as the kernel's.
    weight = torch.empty(8, 3, 3, 3, 3, device="meta")
    inp = torch.empty(1, 3, 6, 6, 6, device="meta")
    out = aten.convolution.default(inp, weight, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1)
    args = (out, inp, weight, None, [1] * 3, [1] * 3, [1] * 3, False, [0] * 3, 1, [True, True, False])
    first = memory.run(aten.convolution_backward.default, args, {})
    second = memory.run(aten.convolution_backward.default, args, {})
    assert second[2] is None and [_layout(t) for t in second[:2]] == [_layout(t) for t in first[:2]]


def test_what_aliases_or_writes_an_argument_always_runs():
    memory = MetaResults()
    x = torch.empty(4, 6, device="meta")
    view = memory.run(aten.view.default, (x, [6, 4]), {})
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    inplace = memory.run(aten.mul_.Tensor, (x, x), {})
    assert inplace is x
    unsafe = memory.run(aten._unsafe_view.default, (x, [24]), {})  # a view its schema does not declare
    assert unsafe.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert len(memory) == 0


def test_the_key_holds_what_the_result_depends_on():
    memory = MetaResults()
    assert memory.run(aten.arange.default, (3,), {"device": torch.device("meta")}).dtype == torch.int64
    assert memory.run(aten.arange.default, (3.0,), {"device": torch.device("meta")}).dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:  # a factory without a dtype takes the default one
        assert memory.run(aten.empty.memory_format, ([2],), {"device": torch.device("meta")}).dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert memory.run(aten.empty.memory_format, ([2],), {"device": torch.device("meta")}).dtype == previous
    x = torch.empty(2, 3, device="meta")
    assert memory.run(aten.add.Tensor, (x, x.t().contiguous().t()), {}).stride() == (3, 1)
    assert memory.run(aten.add.Tensor, (x.t(), x.t()), {}).stride() == (1, 3)


def test_the_memory_is_bounded():
    memory = MetaResults(capacity=4)
    for n in range(1, 10):
        memory.run(aten.mul.Tensor, (torch.empty(n, device="meta"), 2.0), {})
    assert len(memory) == 4


def test_a_trace_is_the_same_with_and_without_the_memory(monkeypatch):
    torch.manual_seed(0)
    model = build_model(ModelConfig(base_filters=2, depth=3, segmentation_levels=2))
    shape = (1, 4, 16, 16, 16)

    def traces():
        return [trace_step(model, shape, loss_fn=weighted_dice_loss, recompute=recompute)
                for recompute in (None, RecomputeConfig(norm_act=True, modules=["encoder.level1"]))]

    def parts(trace):
        return trace.ops, trace.storages, trace.records, trace.events, trace.module_names, trace.regions, trace.fwd_end

    remembered = traces()
    assert any(op.recompute for op in remembered[1].ops)  # checkpointing and norm_act replay ops in backward
    monkeypatch.setattr(meta_results.META_RESULTS, "run", lambda func, args, kwargs: func(*args, **kwargs))
    computed = traces()
    for with_memory, without in zip(remembered, computed, strict=True):
        assert parts(with_memory) == parts(without)
