"""`python signal_hook.py ARGS` = `python -m brats_swap ARGS`, sending itself a real signal at a chosen moment.

BRATS_SIGNAL_AT="SIGNAL:WHERE", SIGNAL a signal's name (SIGTERM, SIGINT, SIGUSR1, SIGKILL...), and WHERE one of:
- `step:N`: during the N-th training step (counted over the process), in its loss: the step then runs to its end;
- `call:MODULE.FUNCTION`: as the first call of that module-level function starts (the module's attribute is
  replaced before brats_swap runs, so every `from MODULE import FUNCTION` made afterwards gets the hook);
- `replace:NAME[:N[:before|after]]`: just before (or just after) the N-th (default first) `os.replace` onto a
  file called NAME. Every atomic write and the checkpoint rotation end in one, so this reaches the worst
  moments: a temporary file complete and not yet renamed, or checkpoint_latest.pt already rotated to
  checkpoint_prev.pt and the new one not yet in place.
The signal goes through the kernel (os.kill of this process), so whatever handler is installed then decides,
as with a signal from outside, but at a moment a test can name (tests/test_trainable_stop.py). `install(spec)`
sets the same hook in a process forked from the test process (tests/forked_cli.py: SIGKILL at a replace, whose
handler no process can choose).
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import sys


def install(spec: str) -> None:
    """Send this process the signal of `spec` ("SIGNAL:WHERE", the module docstring) at that moment."""
    signal_name, where, what = spec.split(":", 2)
    signum = signal.Signals[signal_name]
    sent = []

    def send() -> None:
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signum)

    if where == "step":
        import torch

        from brats_swap.train import loop

        real_loss, steps = loop.weighted_dice_loss, []

        def loss_with_signal(probs, target):
            loss = real_loss(probs, target)
            if torch.is_grad_enabled():  # training steps only (validation runs under no_grad)
                steps.append(1)
                if len(steps) == int(what):
                    send()
            return loss

        loop.weighted_dice_loss = loss_with_signal
    elif where == "call":
        module_name, function_name = what.rsplit(".", 1)
        module = importlib.import_module(module_name)
        real_function = getattr(module, function_name)

        @functools.wraps(real_function)
        def function_with_signal(*args, **kwargs):
            send()
            return real_function(*args, **kwargs)

        setattr(module, function_name, function_with_signal)
    elif where == "replace":
        name, occurrence, when = (what.split(":") + ["1", "before"])[:3]
        if when not in ("before", "after"):
            raise SystemExit(f"BRATS_SIGNAL_AT: {when!r} is neither before nor after")
        real_replace, replaces = os.replace, []

        def replace_with_signal(src, dst, *args, **kwargs):
            ours = os.path.basename(os.fspath(dst)) == name
            if ours:
                replaces.append(1)
            at_it = ours and len(replaces) == int(occurrence)
            if at_it and when == "before":
                send()
            result = real_replace(src, dst, *args, **kwargs)
            if at_it and when == "after":
                send()
            return result

        os.replace = replace_with_signal
    else:
        raise SystemExit(f"BRATS_SIGNAL_AT: unknown moment {where!r}")


if __name__ == "__main__":
    install(os.environ["BRATS_SIGNAL_AT"])
    sys.argv = ["brats-swap", *sys.argv[1:]]
    runpy.run_module("brats_swap", run_name="__main__", alter_sys=True)
