"""A full disk (or quota, permissions, read-only file system) while writing a result: the previous file
stays intact, no temp file is left behind, and the error is one `DiskError` line naming the file (exit 1).

No tiny tmpfs here, so failures are made two ways: patching the writer to raise OSError(errno), and a
real kernel-side failure through RLIMIT_FSIZE (writes past the limit fail with EFBIG, at the same place
a full disk fails with ENOSPC).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from failure_helpers import file_size_limit, leftovers

from brats_swap import atomic
from brats_swap.errors import EXIT_BAD_INPUT, BratsSwapError, DiskError

OLD = b"previous complete version\n"


def _raise_oserror(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize(
    ("code", "phrase"),
    [
        (errno.ENOSPC, "no space left on device"),
        (errno.EDQUOT, "disk quota exceeded"),
        (errno.EACCES, "permission denied"),
        (errno.EROFS, "read-only file system"),
    ],
)
def test_write_failure_keeps_previous_file(tmp_path, monkeypatch, code, phrase):
    target = tmp_path / "fold_0" / "summary.json"
    target.parent.mkdir()
    target.write_bytes(OLD)
    monkeypatch.setattr(Path, "write_bytes", _raise_oserror(code))

    with pytest.raises(DiskError) as caught:
        atomic.atomic_write_json(target, {"dice_wt": 0.9})

    message = str(caught.value)
    assert str(target) in message and phrase in message and "previous version is unchanged" in message
    assert "\n" not in message
    assert caught.value.exit_code == EXIT_BAD_INPUT and caught.value.errno == code
    assert isinstance(caught.value, OSError)  # callers that already handle OSError keep working
    assert target.read_bytes() == OLD
    assert leftovers(tmp_path) == []


def test_failure_on_fsync_or_rename_also_keeps_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "metrics.csv"
    target.write_bytes(OLD)
    monkeypatch.setattr(atomic.os, "replace", _raise_oserror(errno.ENOSPC))
    with pytest.raises(DiskError, match="no space left on device"):
        atomic.atomic_write_text(target, "case,dice_wt\n")
    monkeypatch.undo()
    monkeypatch.setattr(atomic.os, "fsync", _raise_oserror(errno.EIO))
    with pytest.raises(DiskError, match="input/output error"):
        atomic.atomic_write_text(target, "case,dice_wt\n")
    assert target.read_bytes() == OLD
    assert leftovers(tmp_path) == []


def test_cannot_create_temp_file(tmp_path, monkeypatch):
    # A read-only folder fails already at mkstemp; a new file has no previous version to mention.
    monkeypatch.setattr(tempfile, "mkstemp", _raise_oserror(errno.EROFS))
    target = tmp_path / "report.md"
    with pytest.raises(DiskError) as caught:
        atomic.atomic_write_text(target, "# report\n")
    assert str(caught.value) == f"{target}: cannot write, read-only file system"
    assert not target.exists()


def test_unexpected_oserror_is_not_disguised(tmp_path, monkeypatch):
    # Only failures we can explain become DiskError; anything else keeps its type (and traceback).
    target = tmp_path / "x.json"
    target.write_bytes(OLD)
    monkeypatch.setattr(Path, "write_bytes", _raise_oserror(errno.EXDEV))
    with pytest.raises(OSError) as caught:
        atomic.atomic_write_json(target, {})
    assert not isinstance(caught.value, BratsSwapError) and caught.value.errno == errno.EXDEV
    assert target.read_bytes() == OLD and leftovers(tmp_path) == []


def test_keyboard_interrupt_while_writing_removes_temp(tmp_path, monkeypatch):
    target = tmp_path / "x.json"
    target.write_bytes(OLD)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write_json(target, {})
    assert target.read_bytes() == OLD and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "write",
    [
        lambda path: atomic.atomic_write_bytes(path, b"x" * 300_000),
        lambda path: atomic.atomic_torch_save({"weights": torch.zeros(100_000)}, path),
        lambda path: atomic.atomic_write_json(path, {"values": list(range(100_000))}),
    ],
    ids=["bytes", "torch", "json"],
)
def test_real_write_failure_from_the_kernel(tmp_path, write):
    target = tmp_path / "result.bin"
    target.write_bytes(OLD)
    with file_size_limit(64 * 1024), pytest.raises(DiskError) as caught:
        write(target)
    assert str(target) in str(caught.value) and "file too large" in str(caught.value)
    assert target.read_bytes() == OLD
    assert leftovers(tmp_path) == []


def test_full_disk_while_saving_a_checkpoint_keeps_the_previous_one(tmp_path):
    from brats_swap.run.checkpoint import load_checkpoint, load_latest, save_checkpoint
    from brats_swap.run.folder import LATEST, PREVIOUS

    fold_dir = tmp_path / "fold_0"
    small = {"epoch": 1, "model": {"w": torch.arange(10.0)}}
    save_checkpoint(small, fold_dir / LATEST, keep_previous=True)
    before = (fold_dir / LATEST).read_bytes()

    big = {"epoch": 2, "model": {"w": torch.zeros(200_000)}}
    with file_size_limit(256 * 1024), pytest.raises(DiskError) as caught:
        save_checkpoint(big, fold_dir / LATEST, keep_previous=True)

    assert str(fold_dir / LATEST) in str(caught.value)
    assert (fold_dir / LATEST).read_bytes() == before  # not rotated, not truncated
    assert not (fold_dir / PREVIOUS).exists()
    assert load_checkpoint(fold_dir / LATEST)["epoch"] == 1
    state, used = load_latest(fold_dir)
    assert state["epoch"] == 1 and used.name == LATEST
    assert leftovers(tmp_path) == []


def test_disk_error_is_one_line_with_exit_1_on_the_cli(tmp_path, monkeypatch):
    """Any command decorated with `handle_errors` that hits a full disk prints the DiskError line, exit 1."""
    import typer
    from failure_helpers import error_line
    from typer.testing import CliRunner

    from brats_swap.cli.common import handle_errors

    target = tmp_path / "fold_0" / "checkpoint_latest.pt"
    target.parent.mkdir()
    target.write_bytes(OLD)
    monkeypatch.setattr(Path, "write_bytes", _raise_oserror(errno.ENOSPC))
    app = typer.Typer()

    @app.command()
    @handle_errors
    def write() -> None:
        atomic.atomic_write_bytes(target, b"new")

    @app.command()
    def other() -> None:  # a second command, so Typer keeps the command name
        pass

    line = error_line(CliRunner().invoke(app, ["write"]), 1, str(target), "no space left on device")
    assert line.startswith("error: ")
    assert target.read_bytes() == OLD


def test_json_written_atomically_is_complete_or_absent(tmp_path, monkeypatch):
    # A failure half-way through serialising (a value json cannot encode) leaves nothing behind.
    target = tmp_path / "summary.json"
    target.write_text(json.dumps({"ok": 1}))
    with pytest.raises(TypeError):
        atomic.atomic_write_json(target, {"bad": object()})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert leftovers(tmp_path) == []


def test_stale_temp_files_of_killed_writers_are_removed(tmp_path):
    import subprocess

    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, alive = finished.pid, os.getpid()
    stale = tmp_path / f".checkpoint_latest.pt.{dead}.k2j4h1xz.tmp"
    in_progress = tmp_path / f".checkpoint_latest.pt.{alive}.a8d7f6g5.tmp"
    unrelated = [tmp_path / "notes.tmp", tmp_path / ".hidden", tmp_path / "checkpoint_latest.pt"]
    for path in [stale, in_progress, *unrelated]:
        path.write_bytes(b"x")
    assert atomic.remove_stale_temp_files(tmp_path) == 1
    assert not stale.exists() and in_progress.exists() and all(p.exists() for p in unrelated)
    assert atomic.remove_stale_temp_files(tmp_path / "missing") == 0


def test_temp_file_names_carry_the_writer_pid(tmp_path):
    with atomic.atomic_path(tmp_path / "summary.json") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".summary.json.{os.getpid()}.")
        assert atomic.remove_stale_temp_files(tmp_path) == 0  # our own write in progress is kept


def test_prepare_on_a_full_disk(phantom_root, tmp_path, monkeypatch):
    from failure_helpers import error_line, invoke

    real_write_bytes = Path.write_bytes

    def full(self, data):  # the disk fills up while the first case's volumes are written (its temp folder)
        if self.parent.name.startswith(".tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    cache = tmp_path / "cache"
    result = invoke("data", "prepare", phantom_root, "--out", cache, "--workers", "1", "--set", "data.cube=[32,32,32]")
    error_line(result, EXIT_BAD_INPUT, str(cache), "case BraTS2021_00000", "no space left on device")
    assert leftovers(cache) == [] and not (cache / "BraTS2021_00000").exists()


def test_training_on_a_full_disk_keeps_the_previous_checkpoint(prepared_cache, tmp_path, monkeypatch):
    """The second checkpoint_latest.pt write hits a full disk: exit 1 naming the file, epoch 1's checkpoint
    intact and resumable."""
    from failure_helpers import error_line, invoke, set_args

    from brats_swap.run.checkpoint import load_checkpoint
    from brats_swap.run.folder import LATEST

    real_write_bytes = Path.write_bytes
    calls = {"latest": 0}

    def write_bytes(self, data):
        if self.name.startswith(f".{LATEST}."):
            calls["latest"] += 1
            if calls["latest"] >= 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    run = tmp_path / "run"
    result = invoke("train", "--run", run, *set_args(prepared_cache, "train.max_epochs=3"))
    latest = run / "fold_0" / LATEST
    error_line(result, EXIT_BAD_INPUT, str(latest), "no space left on device", "previous version is unchanged")
    assert load_checkpoint(latest)["epoch"] == 1
    assert leftovers(run) == []
    monkeypatch.undo()
    resumed = invoke("train", "--run", run, "--resume", *set_args(prepared_cache, "train.max_epochs=3"))
    assert resumed.exit_code == 0, resumed.output


def test_unexplained_write_failures_outside_atomic_writes_are_one_line(tmp_path):
    """Logs and TensorBoard events are appended, not written atomically: a full disk there is still one line
    naming the file (the CLI's safety net), exit 1."""
    import typer
    from failure_helpers import error_line
    from typer.testing import CliRunner

    from brats_swap.cli.common import handle_errors

    log = tmp_path / "train.log"
    app = typer.Typer()

    @app.command()
    @handle_errors
    def write() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(log))

    @app.command()
    @handle_errors
    def other() -> None:
        raise OSError(errno.ECONNRESET, "unexpected")

    error_line(CliRunner().invoke(app, ["write"]), EXIT_BAD_INPUT, str(log), "no space left on device")
    unexpected = CliRunner().invoke(app, ["other"])
    assert unexpected.exit_code != 0 and isinstance(unexpected.exception, OSError)  # a bug keeps its traceback
