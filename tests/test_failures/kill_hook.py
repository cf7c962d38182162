"""`python kill_hook.py ARGS` = `python -m brats_swap ARGS`, SIGKILLed at a chosen moment.

BRATS_KILL_AT="NAME:N:before|after": the process kills itself with SIGKILL just before (or just after)
the N-th `os.replace` whose destination file is called NAME. Every atomic write and the checkpoint
rotation end in an `os.replace`, so this reaches the worst moments: a temp file complete but not yet
renamed, or checkpoint_latest.pt already rotated to checkpoint_prev.pt and the new one not yet in place.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

name, occurrence, when = os.environ["BRATS_KILL_AT"].split(":")
occurrence = int(occurrence)
real_replace = os.replace
seen = 0


def replace(src, dst, *args, **kwargs):
    global seen
    if os.path.basename(os.fspath(dst)) != name:
        return real_replace(src, dst, *args, **kwargs)
    seen += 1
    if seen == occurrence and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = real_replace(src, dst, *args, **kwargs)
    if seen == occurrence and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return result


os.replace = replace
sys.argv = ["brats-swap", *sys.argv[1:]]
runpy.run_module("brats_swap", run_name="__main__", alter_sys=True)
