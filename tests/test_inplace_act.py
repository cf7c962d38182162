"""nnU-Net's in-place LeakyReLU written into the instance norm's base (`model.inplace_act: base`, the default)
instead of the norm's output view (`view`, nnU-Net's own build): the same network, bitwise, with a leaner
backward that the planner sees and norm_act still rebuilds."""

from __future__ import annotations

import pytest
import torch

from brats_swap.config import MemoryConfig, load_config
from brats_swap.memory.engine import MemoryEngine
from brats_swap.memory.planner import Planner
from brats_swap.model import build_model
from brats_swap.model.networks import LeakyReLUOnBase
from brats_swap.train.losses import SegmentationLoss

CUBE = 32


def _resenc(inplace_act: str) -> torch.nn.Module:
    """ResEnc L at 32³ (4 stages) with a quarter of the features, the same weights for either build."""
    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=resenc_l", f"data.cube=[{CUBE},{CUBE},{CUBE}]", "model.features=[8,16,32,64]",
                             "model.outputs=regions", f"model.inplace_act={inplace_act}"])
    return build_model(cfg.model)


def _loss(outputs) -> torch.Tensor:
    return sum(output.float().square().mean() for output in outputs)


def _step(model: torch.nn.Module, x: torch.Tensor, engine: MemoryEngine | None = None):
    if engine is None:
        outputs = model(x)
        loss = _loss(outputs)
    else:
        with engine.step():
            outputs = model(x)
            loss = _loss(outputs)
    loss.backward()
    return [o.detach() for o in outputs], [p.grad.clone() for p in model.parameters()]


def test_both_builds_give_bitwise_the_same_outputs_and_gradients():
    torch.manual_seed(1)
    x = torch.randn(2, 4, CUBE, CUBE, CUBE)
    view_model, base_model = _resenc("view"), _resenc("base")
    assert not any(isinstance(m, LeakyReLUOnBase) for m in view_model.modules())
    assert sum(isinstance(m, LeakyReLUOnBase) for m in base_model.modules()) >= 10
    (view_out, view_grads), (base_out, base_grads) = _step(view_model, x), _step(base_model, x)
    assert all(torch.equal(a, b) for a, b in zip(view_out, base_out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(view_grads, base_grads, strict=True))


def test_the_activation_writes_into_the_norms_base_without_copyslices():
    norm, act = torch.nn.InstanceNorm3d(4, affine=True), LeakyReLUOnBase(0.01, inplace=True)
    x = torch.randn(2, 4, 6, 6, 6, requires_grad=True)
    normed = norm(x)
    assert normed._base is not None  # instance_norm returns a view of its (1, B*C, ...) batch norm
    out = act(normed)
    assert out.untyped_storage().data_ptr() == normed.untyped_storage().data_ptr()  # still in place
    assert type(out.grad_fn).__name__ == "ViewBackward0"
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "LeakyReluBackward1"  # not CopySlices
    plain = torch.nn.LeakyReLU(0.01, inplace=True)(norm(x.detach().clone().requires_grad_()))
    assert type(plain.grad_fn).__name__ == "AsStridedBackward0" or "CopySlices" in str(plain.grad_fn.next_functions)
    assert torch.equal(out, plain)
    fresh = torch.randn(2, 4, 3, 3, 3)
    assert act(fresh) is fresh  # not a view: torch's own in-place LeakyReLU


def test_the_planner_sees_the_leaner_backward():
    """Three full-size gradient buffers fewer at the peak of the no-policy step (fp32 at 32³: 8 channels
    of batch 2 are 2 MiB)."""
    peaks = {}
    for build in ("view", "base"):
        planner = Planner(_resenc(build), (2, 4, CUBE, CUBE, CUBE), loss_fn=SegmentationLoss("dice", from_logits=True))
        peaks[build] = planner.memory(MemoryConfig()).peak_bytes
    full_size = 2 * 8 * CUBE**3 * 4
    assert peaks["view"] - peaks["base"] >= 2 * full_size, peaks


@pytest.mark.parametrize("mode", ["recompute", "hybrid"])
def test_norm_act_rebuilds_the_activation_and_stays_bitwise(mode):
    torch.manual_seed(1)
    x = torch.randn(1, 4, CUBE, CUBE, CUBE)
    reference = _step(_resenc("base"), x)
    model = _resenc("base")
    cfg = MemoryConfig(mode=mode)
    cfg.recompute.norm_act = True
    cfg.swap.min_bytes = 0
    engine = MemoryEngine(model, cfg, "cpu")
    try:
        outputs, grads = _step(model, x, engine)
        stats = engine.last_stats()
    finally:
        engine.close()
    assert all(torch.equal(a, b) for a, b in zip(reference[0], outputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference[1], grads, strict=True))
    assert stats.recomputed_tensors > 0
    assert not [name for name in stats.norm_act_skipped if name.endswith("nonlin")], stats.norm_act_skipped
