"""brats_swap.process_env: the CLI sets torch's huge-page switch before torch is imported, and keeps a user's
own value."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from brats_swap.process_env import TORCH_HUGE_PAGES, configure_process


def test_configure_process_turns_huge_pages_on_and_keeps_the_users_value(monkeypatch):
    monkeypatch.delenv(TORCH_HUGE_PAGES, raising=False)
    configure_process()
    assert os.environ[TORCH_HUGE_PAGES] == "1"
    monkeypatch.setenv(TORCH_HUGE_PAGES, "0")
    configure_process()
    assert os.environ[TORCH_HUGE_PAGES] == "0"


def test_the_cli_sets_it_before_torch_is_imported():
    """torch reads the switch once, at its first CPU allocation: it must be in the environment before torch is
    imported, which the CLI's start (no torch: tests/test_cli_startup.py) allows."""
    code = textwrap.dedent(f"""
        import os, sys
        from brats_swap.cli import main as cli
        cli.app = lambda: print(os.environ.get({TORCH_HUGE_PAGES!r}), "torch" in sys.modules)
        cli.main()
    """)
    env = {k: v for k, v in os.environ.items() if k != TORCH_HUGE_PAGES}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False"]
