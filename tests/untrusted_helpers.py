"""Hostile files for the `test_untrusted_*` tests: self-consistent bundles (their sha256 recomputed, so only the
change under test is wrong), zip members that inflate to gigabytes from a few megabytes, and a memory limit
so that a regression which allocates what a file asks for fails the test instead of taking the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from brats_swap.ship.bundle import METADATA

GIB = 2**30
TESTS = Path(__file__).resolve().parent


def run_capped(script: str, *args: str, timeout: float = 60, cap: int = 2 * GIB,
               hang: str = "a read that blocks or never ends") -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter under RLIMIT_AS `cap` and a timeout, so that a regression fails the test
    instead of hanging or taking the machine; the package and these helpers are importable (`memory_limit`
    narrows the cap from inside the script)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=limit, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s: {hang}")


def read_volumes_capped(folder: Path, case_id: str, names: Sequence[str], headroom_bytes: int) -> list[str]:
    """`read_volume` on each `<name>.nii.gz` of `folder` in a fresh interpreter whose address space is
    `headroom_bytes` above its own (`run_capped`, `memory_limit`): the DataError lines it printed, in order."""
    result = run_capped(f"""
        import sys
        from pathlib import Path
        from brats_swap.data.nifti import read_volume
        from brats_swap.errors import DataError
        from untrusted_helpers import memory_limit
        memory_limit({int(headroom_bytes)}).__enter__()
        for name in {list(names)!r}:
            try:
                read_volume({case_id!r}, Path(sys.argv[1]) / f"{{name}}.nii.gz")
            except DataError as exc:
                print(exc)
        """, str(folder))
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


@contextmanager
def memory_limit(headroom_bytes: int = GIB):
    """RLIMIT_AS at this process's current address space plus `headroom_bytes`, restored on exit: an allocation
    past it raises MemoryError here rather than growing until the kernel kills something."""
    status = Path("/proc/self/status").read_text()
    in_use = int(re.search(r"^VmSize:\s+(\d+) kB", status, re.MULTILINE)[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = in_use + headroom_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def members_of(bundle: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(bundle) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def rewrite_bundle(bundle: Path, target: Path, change: Callable[[dict, dict[str, bytes]], None] | None = None) -> Path:
    """A copy of `bundle` after `change(metadata, members)` edited them in place, with metadata's sha256 of
    every member recomputed: a bundle that is consistent, and wrong only where the test made it so."""
    members = members_of(bundle)
    metadata = json.loads(members.pop(METADATA))
    if change is not None:
        change(metadata, members)
    metadata["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(members.items())}
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(METADATA, json.dumps(metadata))
        for name, data in members.items():
            archive.writestr(name, data)
    return target


def _deflated_spaces(size: int) -> bytes:
    """A raw deflate stream that inflates to `size` spaces, made in milliseconds: one compressed MiB, fully
    flushed (so it stands alone), repeated, then an empty final block."""
    chunk = 2**20
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(b" " * chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    return block * (size // chunk) + b"\x03\x00"


def zip_with_inflating_member(target: Path, members: dict[str, bytes], big: str, inflated: int,
                              declared: int | None = None) -> Path:
    """A zip of `members` (deflated as zipfile does) plus member `big`: a few MB that inflate to `inflated`
    bytes, declared in the zip as `declared` (default: the truth). Its CRC is not the data's (computing it
    would cost seconds): a reader must refuse it by size before it gets that far."""
    entries, body = [], bytearray()
    for name, data in [*members.items(), (big, None)]:
        if data is None:
            payload, size, crc = _deflated_spaces(inflated), inflated if declared is None else declared, 0
        else:
            compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
            payload, size, crc = compressor.compress(data) + compressor.flush(), len(data), zlib.crc32(data)
        encoded = name.encode()
        entries.append((encoded, len(body), len(payload), size, crc))
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(payload), size, len(encoded), 0)
        body += encoded + payload
    directory = bytearray()
    for encoded, offset, compressed, size, crc in entries:
        directory += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, crc, compressed, size,
                                 len(encoded), 0, 0, 0, 0, 0o100644 << 16, offset) + encoded
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(directory), len(body), 0)
    target.write_bytes(bytes(body + directory + end))
    return target
