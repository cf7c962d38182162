"""Files that someone else made, opened and parsed with limits a hostile file cannot get past.

`open_regular` is the one way such a file is opened (NIfTI images, configs, `dataset.json`): only a regular
file, after following links. A FIFO would block the reader forever, a device such as /dev/zero never ends, and
both report a size of 0, so a size cap alone would not stop them. The file is opened without blocking and its
kind checked on the open descriptor, so what is read is what was checked.

JSON and YAML (a config, a `dataset.json`, nnU-Net's `plans.json`, a bundle's metadata and configs):

- no more than `limit` bytes of the file are read;
- the text must be UTF-8 (a leading byte-order mark is allowed);
- nesting deeper than MAX_NESTING lists or mappings is refused before anything is built (the parsers recurse
  once per level: 100,000 `[` would end in a RecursionError, not a message);
- a key given twice in one mapping is refused (JSON and PyYAML keep the last silently, other readers the first);
- JSON numbers must be finite (`NaN`, `Infinity` and `1e999999`, which Python reads as infinity, are refused).

Every refusal is one line, naming the file (or what the text is) and the problem, raised as the caller's error
type (DataError for data, ConfigError for configs). YAML is read with `yaml.SafeLoader` only: nothing in a
file runs as code.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from brats_swap.errors import BratsSwapError, DataError

# Lists and mappings inside each other: a config has 4 levels, nnU-Net's plans.json about 8.
MAX_NESTING = 64
# A config, dataset.json or plans.json is kilobytes; a dataset.json listing every case of a large dataset a
# few megabytes.
MAX_TEXT_BYTES = 16 * 2**20

_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class _Refused(ValueError):
    """A structural refusal inside a parser hook, turned into the caller's one-line error."""


def read_text(path: str | os.PathLike, error: type[BratsSwapError] = DataError, limit: int = MAX_TEXT_BYTES,
              what: str = "file") -> str:
    """The UTF-8 text of the regular file `path` (at most `limit` bytes); `error` naming it otherwise."""
    path = Path(path)
    try:
        with open_regular(path, str(path), error, what) as file:
            data = file.read(limit + 1)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as exc:
        raise error(f"{path}: unreadable ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{path}: more than {limit // 2**20} MiB, far larger than any {what} of this kind; it is not read")
    return decode_utf8(data, str(path), error)


def open_regular(path: str | os.PathLike, where: str, error: type[BratsSwapError] = DataError, what: str = "file"):
    """`path` opened for binary reading; `error` ("<where>: a FIFO (named pipe), not a regular <what>; it is not
    read") unless it is a regular file, links followed. OSError as `open` raises it (not found, denied)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise error(f"{where}: {file_kind(mode)}, not a regular {what}; it is not read")
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):  # the name was swapped for something else after the first look
        os.close(descriptor)
        raise error(f"{where}: {file_kind(mode)}, not a regular {what}; it is not read")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def decode_utf8(data: bytes, where: str, error: type[BratsSwapError] = DataError) -> str:
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def parse_json(text: str, where: str, error: type[BratsSwapError] = DataError) -> Any:
    """JSON with the limits of the module docstring; `error` naming `where` for any problem."""
    depth = 0
    for token in _JSON_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise error(f"{where}: nested more than {MAX_NESTING} levels deep; it is not read")
        elif bracket in "]}":
            depth -= 1
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                          parse_float=_finite_float)
    except _Refused as exc:
        raise error(f"{where}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{where}: not valid JSON ({' '.join(str(exc).split())[:160]})") from None


def parse_yaml(text: str, where: str, error: type[BratsSwapError] = DataError) -> Any:
    """YAML (`yaml.SafeLoader`) with the limits of the module docstring; `error` naming `where`."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # the event parser keeps a stack, not recursion
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_NESTING:
                    raise error(f"{where}: nested more than {MAX_NESTING} levels deep; it is not read")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML{yaml_problem(exc)}") from None
    except RecursionError:  # aliases nested past Python's stack within MAX_NESTING levels of text
        raise error(f"{where}: nested too deeply; it is not read") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's reason and position: " at line L, column C: <problem> (while <context> that starts at line
    L, column C)"; PyYAML counts lines and columns from 0."""
    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    text = f" at {at(mark)}" if mark is not None else ""
    text += f": {' '.join(str(problem).split())}" if problem else ""
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({' '.join(str(context).split())} that starts at {at(context_mark)})"
    return text


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader refusing a key given twice in one mapping (merge keys `<<` keep their meaning)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    twice = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeConstructor names it below
                    continue
                if twice:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice in one mapping",
                                                            key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for key, value in pairs:
        if key in record:
            raise _Refused(f"key {key!r} given twice in one object")
        record[key] = value
    return record


def _no_constant(name: str) -> float:
    raise _Refused(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} is beyond the range of a float")
    return value


__all__ = ["MAX_NESTING", "MAX_TEXT_BYTES", "decode_utf8", "file_kind", "open_regular", "parse_json", "parse_yaml",
           "read_text", "yaml_problem"]
