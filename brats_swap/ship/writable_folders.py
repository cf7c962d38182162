"""Folders a library writes to, made writable for any uid (the challenge runs an image as any uid, with an
unwritable HOME and a read-only root file system).

HOME, torch's, matplotlib's and the XDG cache and config folders are pointed under a private folder of the
temporary folder (`$TMPDIR`, else /tmp) only when theirs (or, unset, their default under HOME) cannot be
written, before anything could use them. `serve-challenge` and the trainable image's `train` entry call
`writable_home` first.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from brats_swap.errors import DataError

# Variables naming folders that torch, matplotlib and other libraries write to, each with the folder its library
# uses when it is unset (under another of them, resolved in this order); each is pointed under the temporary
# folder only when the folder it names, or would default to, cannot be written.
CACHE_VARIABLES = {"HOME": "home", "TORCH_HOME": "torch", "MPLCONFIGDIR": "matplotlib",
                   "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config"}
_DEFAULT_FOLDERS = {"HOME": None, "XDG_CACHE_HOME": ("HOME", ".cache"), "XDG_CONFIG_HOME": ("HOME", ".config"),
                    "TORCH_HOME": ("XDG_CACHE_HOME", "torch"), "MPLCONFIGDIR": ("XDG_CONFIG_HOME", "matplotlib")}


def _writable(folder: str | None, *, creatable: bool = True) -> bool:
    """A writable folder, or (`creatable`) one its nearest existing parent, a writable folder, can hold."""
    if not folder:
        return False
    path = Path(folder)
    while creatable and not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _default_folder(variable: str, environ) -> str | None:
    """The folder the library uses when `variable` is unset: under the (already resolved) variable above it."""
    if _DEFAULT_FOLDERS[variable] is None:
        return None
    above, name = _DEFAULT_FOLDERS[variable]
    parent = environ.get(above) or _default_folder(above, environ)
    return os.path.join(parent, name) if parent else None


def writable_home(environ: dict | None = None) -> dict[str, tuple[str, str]]:
    """Point HOME and the cache folders under the temporary folder when the folder they name (or, unset, the
    one their library defaults to: ~/.cache/torch, ~/.config/matplotlib, ...) cannot be written, in `environ`
    (default os.environ); returns variable -> (the folder it set, why). Call it before importing matplotlib:
    it reads MPLCONFIGDIR once, at import."""
    environ = os.environ if environ is None else environ
    base: Path | None = None
    changed = {}
    for variable in _DEFAULT_FOLDERS:
        name = CACHE_VARIABLES[variable]
        given = environ.get(variable)
        # A missing HOME is not made (its owner would be this uid, not the user's); a cache folder is.
        if _writable(given if given is not None else _default_folder(variable, environ), creatable=variable != "HOME"):
            continue
        base = base or private_temp_folder()
        folder = base / name
        folder.mkdir(exist_ok=True, mode=0o700)
        changed[variable] = (str(folder), "unset" if given is None else "not writable")
        environ[variable] = str(folder)
    return changed


def private_temp_folder() -> Path:
    """`<temporary folder>/brats-swap-<uid>`, private to this uid: created with mode 0700, or reused only when it
    is a real folder (not a symlink) owned by this uid, then set to 0700; DataError otherwise. The
    temporary folder is shared by every user of the machine, so a folder someone else made there first is
    never used."""
    uid = os.getuid()
    base = Path(tempfile.gettempdir()) / f"brats-swap-{uid}"
    try:
        base.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise DataError(f"{base}: cannot create the private temporary folder ({exc.strerror})") from None
    info = base.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise DataError(f"{base}: not a folder but a {'symlink' if stat.S_ISLNK(info.st_mode) else 'file'}; "
                        "brats-swap uses it only as its own private folder: remove it, or set TMPDIR")
    if info.st_uid != uid:
        raise DataError(f"{base}: owned by uid {info.st_uid}, not {uid}; brats-swap uses it only as its own "
                        "private folder: remove it, or set TMPDIR")
    if stat.S_IMODE(info.st_mode) != 0o700:
        base.chmod(0o700)  # ours (an older brats-swap made it with the default mode): made private again
    return base
