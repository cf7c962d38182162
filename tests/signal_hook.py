"""`python signal_hook.py ARGS` = `python -m brats_swap ARGS`, sending itself a real signal at a chosen moment.

BRATS_SIGNAL_AT="SIGNAL:WHERE", SIGNAL one of SIGTERM, SIGINT, SIGUSR1, and WHERE one of:
- `step:N`: during the N-th training step (counted over the process), in its loss: the step then runs to its end;
- `call:MODULE.FUNCTION`: as the first call of that module-level function starts (the module's attribute is
  replaced before brats_swap runs, so every `from MODULE import FUNCTION` made afterwards gets the hook);
- `replace:NAME`: just before the first `os.replace` onto a file called NAME: an atomic write's temporary file
  is complete and not yet renamed.
The signal goes through the kernel (os.kill of this process), so whatever handler is installed then decides,
as with a signal from outside, but at a moment a test can name (tests/test_trainable_stop.py).
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import sys

signal_name, where, what = os.environ["BRATS_SIGNAL_AT"].split(":", 2)
signum = signal.Signals[signal_name]
sent = False


def send() -> None:
    global sent
    if not sent:
        sent = True
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
    real_replace = os.replace

    def replace_with_signal(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)) == what:
            send()
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace_with_signal
else:
    raise SystemExit(f"BRATS_SIGNAL_AT: unknown moment {where!r}")

sys.argv = ["brats-swap", *sys.argv[1:]]
runpy.run_module("brats_swap", run_name="__main__", alter_sys=True)
