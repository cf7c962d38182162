"""Compiled steps for a run: whether they run compiled, how long compiling took, and the eager fallback.

`StepCompilation` compiles a network's regions (`memory.CompiledRegions`: each block's norm -> activation
chain, its convolution eager, which keeps the memory engine's decisions at the regions' edges;
docs/memory.md#compiled-steps) and optionally a loss, when
`train.compile` / `evaluate.compile` asks for it on the device (`memory.compile_wanted`). `run(step)`
runs one step (or a validation, a prediction) and adds what dynamo and inductor spent compiling during
it to `compile_seconds`; a step that compiled says so in one line ("compiling: 1 min 42 s").

A failed compilation never loses a run: no C compiler, an inductor error or an operation dynamo cannot
trace gives one warning line with the cause, and the step runs eager (and every later one). A region's
forward falls back by itself (`CompiledRegions`); a backward compiled lazily fails inside
`loss.backward()`, so `run` retries the whole step eager from the RNG and buffer state it started with.

The compiler's cache lives in a per-user folder (`use_compile_cache`), so a later fold, a `--resume`,
a `cv` run or `predict` loads what an earlier process compiled instead of compiling it again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch._functorch.config
from torch import nn

from brats_swap.memory import CompiledRegions, compile_wanted, compiled_regions, is_compile_failure
from brats_swap.memory.compiled import compile_cause
from brats_swap.run.console import warn

T = TypeVar("T")

# What `TORCHINDUCTOR_CACHE_DIR` defaults to under the user's cache folder (XDG_CACHE_HOME, else ~/.cache).
CACHE_SUBDIR = Path("brats-swap") / "inductor"


def compile_cache_dir() -> Path:
    """The per-user compile cache: `$TORCHINDUCTOR_CACHE_DIR` when set, else `<user cache>/brats-swap/inductor`."""
    set_by_user = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if set_by_user:
        return Path(set_by_user)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / CACHE_SUBDIR


def use_compile_cache() -> Path:
    """Point inductor's caches (FX graphs, AOTAutograd, kernels) at `compile_cache_dir()` before anything
    compiles; a `TORCHINDUCTOR_CACHE_DIR` the user set is kept. Returns the folder.

    It also lets AOTAutograd's cache keep graphs that hold a custom `autograd.Function`: by default torch
    bypasses that cache for every such graph (the switch is upstream's, off while it is tried on more models:
    pytorch PR #149751), and every block of the Isensee U-Net holds one (its instance norm and the decoder's
    prepared-input convolution, `model/unet.py`), so each later process traced and partitioned every block's
    forward and backward again. It is safe for what is compiled here: dynamo traces a Function's forward and
    backward into subgraphs of the graph the cache key is computed from, so a changed Function is another key
    (tests/test_compile_cache.py changes a backward and gets no hit), and the project's Functions read
    nothing but their inputs and `ctx`."""
    folder = compile_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    return folder


def compile_seconds_so_far() -> float:
    """Seconds this process spent compiling (dynamo's frames and AOTAutograd's lazy backwards)."""
    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))


def minutes_seconds(seconds: float) -> str:
    """"42 s", "1 min 42 s": compile times, which people compare to the second."""
    whole = round(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60:02d} s"


def _compile_loss(loss: Any, backend: str | Callable) -> Callable[[], None] | None:
    """The loss's per-output term (`single`) compiled, as nnU-Net compiles its Dice; returns what undoes it."""
    single = getattr(loss, "single", None)
    if single is None:
        return None
    loss.single = torch.compile(single, dynamic=False, backend=backend)
    return lambda: loss.__dict__.pop("single", None)


class StepCompilation:
    """The compiled state of one model (and loss) for a run; see the module docstring.

    `setting` is `train.compile` / `evaluate.compile`; `key` names it in messages; `say` prints the one-line
    warning of a fallback (e.g. `console.warn`); `log` receives the "compiling: ..." lines (train.log).
    """

    def __init__(self, model: nn.Module, setting: bool | str, device: torch.device, *, key: str = "train.compile",
                 loss: Any = None, backend: str | Callable = "inductor", say: Callable[[str], None] | None = None,
                 log: Callable[[str], None] | None = None):
        self.key, self.setting = key, setting
        self.say, self.log = say, log
        self.requested = compile_wanted(setting, device)
        self.fallback: str | None = None  # the compiler's failure, when the run went eager
        self.compile_seconds = 0.0
        self.regions: CompiledRegions | None = None
        self._undo_loss: Callable[[], None] | None = None
        if self.requested:
            use_compile_cache()
            self.regions = CompiledRegions(model, backend=backend, on_failure=self._fell_back)
            if loss is not None:
                self._undo_loss = _compile_loss(loss, backend)

    @property
    def compiled(self) -> bool:
        """Steps run compiled now (requested, and no compilation has failed)."""
        return self.regions is not None and self.fallback is None

    def describe(self) -> str:
        """For the start line: "compiled (train.compile auto)", "eager (train.compile false)"."""
        state = "compiled" if self.compiled else "eager"
        note = f"; compilation failed: {self.fallback}" if self.fallback else ""
        return f"{state} ({self.key} {str(self.setting).lower()}{note})"

    def record(self) -> dict[str, Any]:
        """For env.json: what was asked, what ran, the compile time so far, and the failure if any."""
        return {"setting": self.setting, "compiled": self.compiled, "compile_seconds": round(self.compile_seconds, 3),
                "fallback": self.fallback, "cache": str(compile_cache_dir()) if self.requested else None}

    def _fell_back(self, cause: str) -> None:
        if self.fallback is not None:
            return
        self.fallback = cause
        if self.regions is not None:
            self.regions.fail(cause)
        if self._undo_loss is not None:
            self._undo_loss()
            self._undo_loss = None
        message = f"{self.key}: compilation failed ({cause}); running eager"
        if self.say is not None:
            self.say(message)
        if self.log is not None:
            self.log(f"warning: {message}")

    def run(self, step: Callable[[], T], what: str = "step", *, module: nn.Module | None = None) -> T:
        """`step()` compiled (when it is); a compilation that fails in it reruns it eager from the RNG and
        `module`'s buffers as they were (module docstring). Logs the time it spent compiling, if any."""
        if not self.compiled:
            return step()
        before = compile_seconds_so_far()
        rng = _rng_states()
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()} if module is not None else {}
        try:
            return step()
        except Exception as exc:
            if not is_compile_failure(exc):
                raise
            self._fell_back(compile_cause(exc))
            _restore(rng, module, buffers)
            return step()
        finally:
            spent = compile_seconds_so_far() - before
            self.compile_seconds += spent
            if spent >= 0.5 and self.log is not None:
                self.log(f"compiling: {minutes_seconds(spent)} ({what})")


def compile_for_inference(model: nn.Module, setting: bool | str, device: torch.device) -> None:
    """`evaluate.compile` for a model that predicts (predict, evaluate, serve-challenge): its regions compiled
    when the setting asks for it on `device`, eager otherwise (a setting changed by `--set` after loading);
    a failed compilation says one line and predicts eager. No backward runs, so a region's own fallback
    covers every failure."""
    regions = compiled_regions(model)
    if regions is not None and not compile_wanted(setting, device):
        regions.remove()
    elif regions is None:
        StepCompilation(model, setting, device, key="evaluate.compile", say=warn)


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _restore(rng: tuple, module: nn.Module | None, buffers: dict[str, torch.Tensor]) -> None:
    cpu, cuda = rng
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if module is not None:
        with torch.no_grad(), contextlib.suppress(AttributeError):
            for name, value in module.named_buffers():
                if name in buffers:
                    value.copy_(buffers[name])
