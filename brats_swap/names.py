"""What a name read from someone else's file may be, and the only way such a name becomes a path.

Datasets (`dataset.json`), bundles, nnU-Net results folders, the challenge's `/input` and shared configs are
made by someone else: a case id, dataset key, bundle, config or task name taken from them is untrusted. This
module is the one place that decides (rule numbers are cited where the rules are used):

1. A name is 1-200 characters from ``A-Z a-z 0-9 . _ -``, starts with a letter or digit, and holds no
   ``..``: no separator, no control character, no way up (`checked_name`).
2. A path built from a name or from a relative path read from a file is resolved (symlinks followed) and
   must stay inside the folder it was built in (`path_inside`, `relative_path_inside`).
3. Text written into a generated script, Dockerfile or README holds no control character (newline
   included); shell words go through `shlex.quote` (`script_text`, `shell_word`).
4. A name printed on the terminal or in a log is shown as itself when it follows rule 1, else as its `repr`
   (`shown`), and a line that quotes a file's text has its control characters escaped (`printable`): a
   folder named "x\nerror: all done" cannot start a line of its own, nor a terminal escape rewrite one.

Every refusal is one `DataError` line naming the file the value came from and the problem (exit 1).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from brats_swap.errors import DataError

# Rule 1. BraTS (BraTS-GLI-00000-000, BraTS2021_00000, Brats17_CBICA_AAB_1, BraTS-MEN-RT-0000-1) and
# nnU-Net (glioma_007, BRATS_001) ids all fit; so do run, bundle and task names.
NAME_CHARACTERS = "A-Z a-z 0-9 . _ -"
MAX_NAME_LENGTH = 200
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UntrustedNameError(DataError):
    """A name or path from a file that breaks one of this module's rules (exit 1)."""


def name_problem(value: object) -> str | None:
    """Why `value` is not a valid name (rule 1), or None when it is."""
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    if not value:
        return "is empty"
    if len(value) > MAX_NAME_LENGTH:
        return f"is {len(value)} characters long (at most {MAX_NAME_LENGTH})"
    if _CONTROL.search(value):
        return "holds a control character"
    if "/" in value or "\\" in value:
        return "holds a path separator"
    if ".." in value:
        return "holds '..'"
    if not _NAME.fullmatch(value):
        return f"may only use {NAME_CHARACTERS} and must start with a letter or digit"
    return None


def shown(name: object) -> str:
    """`name` as it may be printed (rule 4): itself when it is a valid name, else its `repr`."""
    return name if isinstance(name, str) and name_problem(name) is None else repr(name)


def printable(line: str) -> str:
    """`line` with each control character (newline, carriage return, escape, ...) written as its escape (rule 4)."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], line)


def checked_name(value: object, what: str, source: str | Path) -> str:
    """`value` when it is a valid name (rule 1); else one line naming `source`, `what` and the problem."""
    problem = name_problem(value)
    if problem is not None:
        raise UntrustedNameError(f"{source}: {what} {value!r} {problem}")
    return value  # type: ignore[return-value]


def _inside(folder: Path, candidate: Path, what: str, shown: str, source: str | Path) -> Path:
    root = folder.resolve()
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise UntrustedNameError(f"{source}: {what} {shown!r} leads outside {folder} (to {resolved})")
    return resolved


def path_inside(folder: str | Path, name: object, what: str, source: str | Path, suffix: str = "") -> Path:
    """`folder / (name + suffix)` for a checked name (rule 1), resolved and kept inside `folder` (rule 2)."""
    checked = checked_name(name, what, source)
    folder = Path(folder)
    return _inside(folder, folder / f"{checked}{suffix}", what, checked, source)


def relative_path_inside(folder: str | Path, relative: object, what: str, source: str | Path) -> Path:
    """A relative path read from a file (e.g. `./imagesTr/x.nii.gz`), resolved and kept inside `folder`.

    Rule 2: absolute paths, control characters and anything that resolves outside `folder` (through `..` or
    a symlink) are refused.
    """
    if not isinstance(relative, str) or not relative:
        raise UntrustedNameError(f"{source}: {what} {relative!r} is not a relative path")
    if _CONTROL.search(relative):
        raise UntrustedNameError(f"{source}: {what} {relative!r} holds a control character")
    if Path(relative).is_absolute() or relative.startswith("\\"):
        raise UntrustedNameError(f"{source}: {what} {relative!r} is absolute; expected a path inside {folder}")
    folder = Path(folder)
    return _inside(folder, folder / relative, what, relative, source)


def script_text(value: object, what: str, source: str | Path) -> str:
    """`value` as text safe to put on one line of a generated file (rule 3): no control character."""
    text = str(value)
    if _CONTROL.search(text):
        raise UntrustedNameError(f"{source}: {what} {text!r} holds a newline or control character")
    return text


def shell_word(value: object, what: str, source: str | Path) -> str:
    """`value` checked by rule 3 and quoted as one shell word (`shlex.quote`)."""
    return shlex.quote(script_text(value, what, source))
