"""Atomic file writes: temp file in the same folder + fsync + rename.

A reader (or a re-run after SIGKILL) sees either the old file or the complete new one, never half of
either. Every checkpoint, cache entry, metrics file and report goes through here.

A full disk, a quota, missing permissions or a read-only file system while writing become one
`DiskError` naming the file and the cause (exit 1), raised after the temporary file is removed: the
previous version of the file is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from brats_swap.errors import DiskError

TEMP_SUFFIX = ".tmp"
# ".<target name>.<writer pid>.<random>.tmp", as written by atomic_path
_TEMP_NAME = re.compile(r"^\..+\.(?P<pid>\d+)\.[^.]+\.tmp$")

# errno -> what to tell the user. Other OSErrors are unexpected and keep their traceback.
DISK_PROBLEMS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (file-size limit)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "input/output error (is the disk failing?)",
}


def _fsync_dir(folder: Path) -> None:
    # The rename is only durable once the directory entry is on disk.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_umask() -> int:
    # os.umask can only be read by setting it; read it once at import, before any worker threads exist.
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_read_umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it is fsynced and renamed onto `path`.

    On any exception the temporary file is removed and `path` is left untouched.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # The writer's pid in the name lets `remove_stale_temp_files` tell a killed writer's leftover from a
        # file another process is writing right now.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=TEMP_SUFFIX,
                                        dir=target.parent)
    except OSError as exc:
        error = disk_error(target, exc)
        if error is None:
            raise
        raise error from exc
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # mkstemp creates the file 0600; give the result the permissions a plain open() would (umask),
        # so run folders, caches and predictions stay readable by the group as users expect.
        os.chmod(tmp, _FILE_MODE)
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        error = disk_error(target, exc) if isinstance(exc, OSError) else None
        if error is None:
            raise
        raise error from exc


def remove_stale_temp_files(folder: str | os.PathLike) -> int:
    """Delete the temp files that writers killed mid-write (SIGKILL, power loss) left in `folder`.

    Only files named by `atomic_path` whose writer process is gone are removed; returns how many. Call it
    when a command starts working in a folder (cache, run, fold), so crashes do not pile up checkpoint-sized
    leftovers.
    """
    removed = 0
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return 0
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or not entry.is_file() or _process_alive(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed += 1
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def disk_error(target: Path, exc: OSError) -> DiskError | None:
    """The one-line DiskError for a write failure we can explain (disk full, permissions...), else None."""
    problem = DISK_PROBLEMS.get(exc.errno)
    if problem is None or isinstance(exc, DiskError):
        return None
    kept = "; the previous version is unchanged" if target.exists() else ""
    return DiskError(f"{target}: cannot write, {problem}{kept}", errno=exc.errno, filename=str(target))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _json_default(value: Any) -> Any:
    # numpy scalars and paths show up in metrics and metadata; everything else is a bug.
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
