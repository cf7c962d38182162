"""The compile cache keeps graphs holding a custom autograd.Function (`run.compiling.use_compile_cache`), and a
Function whose backward changed is compiled again, not taken from it.

Each compilation below starts from a reset dynamo, as a new process does, with one cache folder: what a later
fold, `--resume` or `predict` finds on disk."""

from __future__ import annotations

import torch
import torch._functorch.config
from torch._dynamo.utils import counters
from torch._inductor.cpu_vec_isa import pick_vec_isa

from brats_swap.run.compiling import compile_cache_dir, use_compile_cache


def _scale_function(backward_factor: float) -> type[torch.autograd.Function]:
    """x -> 2x, whose backward multiplies by `backward_factor`: one class name and module, two backwards (as the
    same Function edited between two runs)."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * backward_factor

    return Scale


def _compiled_gradient(function: type[torch.autograd.Function]) -> tuple[torch.Tensor, dict]:
    """The input's gradient of sin(function(x)).sum() compiled from a reset dynamo, and AOTAutograd's counters."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: function.apply(x).sin(), dynamic=False)
    x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
    compiled(x).sum().backward()
    return x.grad, dict(counters["aot_autograd"])


def test_a_custom_autograd_function_is_cached_and_a_changed_backward_is_not_taken_from_the_cache(monkeypatch,
                                                                                               tmp_path):
    # Inductor finds out which vector instructions this CPU has once per process, by building small programs
    # with the C++ compiler in its cache folder (`torch._inductor.cpu_vec_isa`: about 15 s of CPU from an empty
    # folder). Found out first in the per-user compile cache, so that the empty folder below costs only the
    # compilations under test (the graphs and their kernels, which that probe does not touch).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
    pick_vec_isa()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(torch._functorch.config, "autograd_cache_allow_custom_autograd_functions", False)
    use_compile_cache()
    assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions
    x = torch.linspace(-1.0, 1.0, 8)
    try:
        grad, first = _compiled_gradient(_scale_function(1.0))
        assert first.get("autograd_cache_saved") == 1 and "autograd_cache_bypass" not in first, first
        assert torch.allclose(grad, torch.cos(2 * x))
        grad, again = _compiled_gradient(_scale_function(1.0))
        assert again.get("autograd_cache_hit") == 1, again  # a later process loads it
        assert torch.allclose(grad, torch.cos(2 * x))
        grad, changed = _compiled_gradient(_scale_function(3.0))
        assert "autograd_cache_hit" not in changed and changed.get("autograd_cache_miss") == 1, changed
        assert torch.allclose(grad, 3 * torch.cos(2 * x))  # its own backward, not the cached one
    finally:
        torch._dynamo.reset()
