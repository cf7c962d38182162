"""Helpers shared by the failure tests: the CLI runner, the "one clean line" check, tiny settings."""

from __future__ import annotations

import contextlib
import gzip
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from forked_cli import run_forked
from typer.testing import CliRunner

from brats_swap.cli.main import app

PHANTOM_SHAPE = (48, 48, 40)
PHANTOM_CASES = 4
# Overrides that make any command tiny: 16³ cube (the crash, resume and bad-data rules hold at any size; a step
# costs a quarter of one at 32³), 4 base filters, 3 levels, no worker processes.
TINY = [
    "data.cube=[16,16,16]",
    "model.base_filters=4",
    "model.depth=3",
    "model.segmentation_levels=2",
    "model.dropout=0.0",
    "data.loader_workers=0",
    "data.prepare_workers=1",
    "cv.folds=2",
    "train.max_epochs=2",
    "train.device=cpu",
    "train.threads=1",
    "train.deterministic=false",  # use_deterministic_algorithms imports torch._inductor: 5 s per process
    "train.augment=none",
    "evaluate.hd95=false",
    "data.cache_only=true",  # the fixtures' caches are the data (data.root stays the default, never prepared)
]


def invoke(*args: str):
    """Run `brats-swap ARGS` in-process (stdout and stderr together in `.output`)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def error_line(result, exit_code: int, *fragments: str) -> str:
    """Assert the command failed with `exit_code`, printed exactly one `error:` line holding every
    fragment, and no traceback; return that line."""
    output = result.output
    assert result.exit_code == exit_code, f"exit {result.exit_code}, expected {exit_code}:\n{output}"
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, f"expected one error line:\n{output}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@contextlib.contextmanager
def file_size_limit(max_bytes: int) -> Iterator[None]:
    """A real kernel-side write failure without a tiny file system: RLIMIT_FSIZE makes any write past
    `max_bytes` fail with EFBIG (SIGXFSZ ignored), exactly where a full disk would fail with ENOSPC."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


def leftovers(folder) -> list[str]:
    """Temporary files an atomic write might have left behind in `folder` (recursively)."""
    return sorted(p.name for p in Path(folder).rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".tmp-"))


# --------------------------------------------------------------------------------------------------
# Damaging one phantom case in place. Each returns the file name the error must name.


def case_file(case_dir: Path, role: str) -> Path:
    """`role` is a 2021 suffix: t1, t1ce, t2, flair or seg."""
    return case_dir / f"{case_dir.name}_{role}.nii.gz"


def rewrite_nifti(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> None:
    img = nib.load(path)
    nib.save(nib.Nifti1Image(data, img.affine if affine is None else affine), path)


def _voxels(path: Path) -> np.ndarray:
    return np.asarray(nib.load(path).dataobj)


def _with_one_voxel(path: Path, value, dtype) -> np.ndarray:
    data = _voxels(path).astype(dtype)
    data.flat[data.size // 2] = value
    return data


def damage_missing_modality(case_dir: Path) -> str:
    case_file(case_dir, "t1ce").unlink()
    return f"{case_dir.name}_t1ce.nii.gz"


def damage_truncated_gz(case_dir: Path) -> str:
    path = case_file(case_dir, "flair")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.name


def damage_truncated_nii(case_dir: Path) -> str:
    gz = case_file(case_dir, "flair")
    path = gz.with_name(gz.name.removesuffix(".gz"))
    path.write_bytes(gzip.decompress(gz.read_bytes())[:5000])
    gz.unlink()
    return path.name


def damage_not_nifti(case_dir: Path) -> str:
    path = case_file(case_dir, "t2")
    path.write_bytes(b"this is a text file, not an image\n" * 20)
    return path.name


def damage_gzip_of_text(case_dir: Path) -> str:
    path = case_file(case_dir, "t2")
    path.write_bytes(gzip.compress(b"this is a text file, not an image\n" * 20))
    return path.name


def damage_empty_file(case_dir: Path) -> str:
    path = case_file(case_dir, "t1")
    path.write_bytes(b"")
    return path.name


def damage_4d(case_dir: Path) -> str:
    path = case_file(case_dir, "t1")
    volume = _voxels(path)
    rewrite_nifti(path, np.stack([volume, volume], axis=-1))
    return path.name


def damage_other_shape(case_dir: Path) -> str:
    path = case_file(case_dir, "t2")
    rewrite_nifti(path, _voxels(path)[:-8])
    return path.name


def damage_other_affine(case_dir: Path) -> str:
    path = case_file(case_dir, "t2")
    rewrite_nifti(path, _voxels(path), affine=np.diag([2.0, 2.0, 2.0, 1.0]))
    return path.name


def damage_nan(case_dir: Path) -> str:
    path = case_file(case_dir, "flair")
    rewrite_nifti(path, _with_one_voxel(path, np.nan, np.float32))
    return path.name


def damage_inf(case_dir: Path) -> str:
    path = case_file(case_dir, "t1ce")
    rewrite_nifti(path, _with_one_voxel(path, -np.inf, np.float32))
    return path.name


def damage_all_zero(case_dir: Path) -> str:
    path = case_file(case_dir, "t1")
    rewrite_nifti(path, np.zeros_like(_voxels(path)))
    return path.name


def damage_labels(case_dir: Path) -> str:
    path = case_file(case_dir, "seg")
    rewrite_nifti(path, _with_one_voxel(path, 3, np.uint8))  # 3 is not a 2017-2021 label
    return path.name


def damage_seg_shape(case_dir: Path) -> str:
    path = case_file(case_dir, "seg")
    rewrite_nifti(path, _voxels(path)[:, :, :-8])
    return path.name


# name -> (damage, words the error line must hold besides the case id and file name)
DAMAGES = {
    "missing-modality": (damage_missing_modality, ["missing modality t1ce"]),
    "truncated-gz": (damage_truncated_gz, ["truncated"]),
    "truncated-nii": (damage_truncated_nii, ["truncated"]),
    "not-nifti": (damage_not_nifti, ["not a NIfTI file"]),
    "gzip-of-text": (damage_gzip_of_text, ["not a NIfTI file"]),
    "empty-file": (damage_empty_file, ["not a NIfTI file"]),
    "4d": (damage_4d, ["4D image", "expected one 3D volume"]),
    "other-shape": (damage_other_shape, ["shape 40x48x40 differs"]),
    "other-affine": (damage_other_affine, ["affine differs"]),
    "nan": (damage_nan, ["1 non-finite voxels"]),
    "inf": (damage_inf, ["1 non-finite voxels"]),
    "all-zero": (damage_all_zero, ["every voxel is zero"]),
    "labels": (damage_labels, ["labels {3} not in the 2021 edition's table"]),
    "seg-shape": (damage_seg_shape, ["segmentation shape", "differs"]),
}


# --------------------------------------------------------------------------------------------------
# Training runs: in-process, or in a subprocess that can be killed.

REPO = Path(__file__).resolve().parents[2]


def tiny_config(cache: Path, *extra: str):
    from brats_swap.config import load_config

    return load_config(None, [*TINY, f"data.cache={cache}", *extra])


def set_args(cache: Path, *extra: str) -> list[str]:
    """`--set` options for a tiny run on `cache`."""
    return [a for item in [*TINY, f"data.cache={cache}", *extra] for a in ("--set", item)]


def run_killed_at(args: list, kill_at: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`brats-swap ARGS` in a process forked from this one (tests/forked_cli.py) that SIGKILLs itself at an
    os.replace: `kill_at` "file:occurrence:before|after" (tests/signal_hook.py's `replace` moment)."""
    return run_forked(args, signal_at=f"SIGKILL:replace:{kill_at}", cwd=REPO, timeout=timeout)


def assert_no_half_written_files(folder: Path) -> None:
    """Every visible result file under `folder` is complete: checkpoints pass their checksum, JSON/YAML
    parse, arrays load. (Hidden `.name.tmp` files are what an atomic write leaves when killed.)"""
    import json

    import yaml

    from brats_swap.run.checkpoint import load_checkpoint

    for path in sorted(Path(folder).rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue
        if path.suffix == ".pt":
            load_checkpoint(path)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".yaml":
            yaml.safe_load(path.read_text())
        elif path.suffix == ".npy":
            np.load(path)
        elif path.suffix == ".png":
            data = path.read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[-12:-4] == b"\x00\x00\x00\x00IEND", path
        elif path.name.endswith(".nii.gz"):
            nib.load(path).get_fdata()


def squash(text: str) -> str:
    """`text` without any whitespace: rich wraps long warnings anywhere, even inside a file name."""
    return "".join(text.split())


def says(output: str, *fragments: str) -> bool:
    """Whether every fragment appears in `output`, ignoring line wrapping and spacing."""
    flat = squash(output)
    return all(squash(fragment) in flat for fragment in fragments)


def loss_with_fault(fault, at_step: int):
    """The training loss, with `fault(loss, probs)` applied at the `at_step`-th training step (1-based,
    counted over the whole run; validation calls run without grad and are not counted)."""
    from brats_swap.train.losses import weighted_dice_loss

    calls = {"train": 0}

    def loss_fn(probs, target, *args, **kwargs):
        loss = weighted_dice_loss(probs, target, *args, **kwargs)
        if not torch.is_grad_enabled():
            return loss
        calls["train"] += 1
        return fault(loss, probs) if calls["train"] == at_step else loss

    return loss_fn
