"""Other people's files, round two (issue 43): special files, memory bounded by what was read, one bad case never
stops the others, config and JSON limits, and names that cannot forge a line.

Tests that would hang or exhaust memory on a regression run in a fresh interpreter under a timeout and an
address-space rlimit (`run_capped`), or in this process under `memory_limit`.
"""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from data_helpers import write_case
from ship_helpers import task_run
from typer.testing import CliRunner
from untrusted_helpers import GIB, members_of, memory_limit, read_volumes_capped, rewrite_bundle, run_capped

from brats_swap.cli.main import app
from brats_swap.config import Config, DataConfig, load_config
from brats_swap.data import nifti
from brats_swap.data.cache import prepare_dataset
from brats_swap.data.check import check_dataset
from brats_swap.data.layouts import MAX_LABEL_VALUE, declared_labels, find_layout
from brats_swap.errors import ConfigError, DataError
from brats_swap.evaluate.predicting import Predictor
from brats_swap.foreign_files import MAX_NESTING, parse_json, parse_yaml
from brats_swap.ship.bundle import CONFIG, export_bundle, fold_config
from brats_swap.ship.inference_cost import MAX_NETWORK_CALLS_PER_CASE, windows_per_pass
from brats_swap.ship.serve import serve

TESTS = Path(__file__).resolve().parent
SHAPE = (16, 16, 16)
CASES = ("BraTS2021_00000", "BraTS2021_00001")
_CAP = 2 * GIB


def _one_line(text: str) -> str:
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text.strip()


def _error_line(result, code: int, *words: str) -> str:
    output = result.output if hasattr(result, "output") else result.stdout + result.stderr
    code_seen = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert code_seen == code, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert all(word in errors[0] for word in words), errors[0]
    return errors[0]


def _tiny_predictor() -> Predictor:
    config = Config(data=DataConfig(cube=list(SHAPE), prepare_workers=1))
    torch.manual_seed(0)
    model = torch.nn.Conv3d(4, 3, kernel_size=1)
    return Predictor(config, [(model, config)], torch.device("cpu"), None, None, "a 1x1x1 convolution")


# --- (1) special files named like images -------------------------------------------------------------------


def _special_files(folder: Path) -> dict[str, str]:
    """name -> the kind read_volume must name, one of each special file a dataset could hold."""
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "fifo.nii.gz")
    os.mkfifo(folder / "fifo.nii")
    os.symlink("/dev/zero", folder / "zero.nii.gz")
    os.symlink("/dev/zero", folder / "zero.nii")
    (folder / "folder.nii.gz").mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "socket.nii.gz"))
    server.close()
    return {"fifo.nii.gz": "a FIFO (named pipe)", "fifo.nii": "a FIFO (named pipe)",
            "zero.nii.gz": "a character device", "zero.nii": "a character device", "folder.nii.gz": "a folder",
            "socket.nii.gz": "a socket"}


def test_fifos_devices_folders_and_sockets_named_like_images_are_refused_at_once(tmp_path):
    """The issue's hang (a FIFO) and its memory exhaustion (a link to /dev/zero, whose size is 0): each refused
    in one line, in a subprocess that a blocking read would time out and an unbounded one would overrun."""
    kinds = _special_files(tmp_path)
    result = run_capped("""
        import sys
        from pathlib import Path
        from brats_swap.data.nifti import read_volume
        from brats_swap.errors import DataError
        for name in sys.argv[2:]:
            try:
                read_volume("c", Path(sys.argv[1]) / name)
            except DataError as exc:
                print(exc)
        """, str(tmp_path), *kinds, timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [f"case c: file {name}: {kind}, not a regular file; it is not read"
                                          for name, kind in kinds.items()]


def test_a_fifo_case_image_skips_its_case_in_data_check_prepare_and_serve(tmp_path):
    data = tmp_path / "data"
    for number, case_id in enumerate(CASES):
        write_case(data, case_id, "2021", shape=SHAPE, seed=number, seg=number == 0)
    fifo = data / CASES[1] / f"{CASES[1]}_t1.nii.gz"
    fifo.unlink()
    os.mkfifo(fifo)
    result = run_capped("""
        import sys
        from pathlib import Path
        from brats_swap.config import DataConfig
        from brats_swap.data.cache import prepare_dataset
        from brats_swap.data.check import check_dataset
        from test_untrusted_2 import _tiny_predictor
        from brats_swap.ship.serve import serve
        data, out = Path(sys.argv[1]), Path(sys.argv[2])
        for check in check_dataset(data, progress=False):
            print("check", check.case_id, check.problem)
        report = prepare_dataset(data, out / "cache", DataConfig(cube=[16, 16, 16], prepare_workers=1), progress=False)
        print("prepare", report.prepared, report.failed)
        report = serve(_tiny_predictor(), data, out / "serve", tta=False, say=lambda line: None)
        print("serve", [path.name for path in report.written], report.failures.describe())
        """, str(data), str(tmp_path / "out"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    refusal = f"case {CASES[1]}: file {fifo.name}: a FIFO (named pipe), not a regular file; it is not read"
    assert [line for line in result.stdout.splitlines() if line.strip()] == [
        f"check {CASES[0]} None", f"check {CASES[1]} {refusal}",
        f"prepare ['{CASES[0]}'] {{'{CASES[1]}': '{refusal}'}}",
        f"serve ['{CASES[0]}.nii.gz'] {refusal}"]


# --- (2) memory bounded by what was read ------------------------------------------------------------------


def _honest_uint8(path: Path, edge: int) -> None:
    """A .nii.gz whose header declares edge^3 uint8 voxels and whose members hold all of them (zeros), in a few
    hundred KB: one 16 MiB member of zeros, repeated."""
    header = nib.Nifti1Header()
    header.set_data_shape((edge, edge, edge))
    header.set_data_dtype(np.uint8)
    header.set_data_offset(352)
    zeros = gzip.compress(bytes(16 * 2**20), mtime=0)
    path.write_bytes(gzip.compress(header.binaryblock + b"\0" * 4, mtime=0) + zeros * (edge**3 // 2**24))


def test_a_volume_is_priced_with_its_copies_and_refused_before_decoding(tmp_path):
    """512^3 and 1024^3 uint8, honest headers: 1.03 GB and 2.35+ GB on main; refused having inflated their
    header, under an address space 256 MiB above the interpreter's."""
    for edge in (512, 1024):
        _honest_uint8(tmp_path / f"cube{edge}.nii.gz", edge)
        assert (tmp_path / f"cube{edge}.nii.gz").stat().st_size < 2**20
    result = run_capped("""
        import sys
        from pathlib import Path
        from brats_swap.data.nifti import read_volume
        from brats_swap.errors import DataError
        from untrusted_helpers import memory_limit
        memory_limit(256 * 2**20).__enter__()  # the rest of the script: 256 MiB above the interpreter's
        for edge in (512, 1024):
            try:
                read_volume("big", Path(sys.argv[1]) / f"cube{edge}.nii.gz")
            except DataError as exc:
                print(exc)
        """, str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("to decode (the copies and the float32 array), more than the 2 GiB allowed" in line
                                   for line in lines), lines
    assert lines[0].startswith("case big: file cube512.nii.gz: header declares a 512x512x512 image of uint8, 2.2")


def test_a_brats_volume_is_far_under_the_decoding_cap():
    voxels = 240 * 240 * 155
    assert nifti.decoded_bytes(352 + 4 * voxels, voxels, stored=4 * voxels) < nifti.MAX_DECODED_BYTES / 8


def test_label_values_are_bounded_and_the_lookup_is_sized_by_the_declared_values(tmp_path):
    """A dataset.json declaring 2^40 made a 1 TiB lookup table; now the value is refused in one line, and the
    largest value allowed renumbers a segmentation without a table as long as the value (2 GiB on main)."""
    with pytest.raises(DataError, match=r"labels: value 1099511627776 outside 0\.\.2147483647"):
        declared_labels(tmp_path / "dataset.json", {"background": 0, "tumour": 2**40})
    raw = np.zeros((8, 8, 8), dtype=np.int64)
    raw[2:4, 2:4, 2:4] = MAX_LABEL_VALUE
    from brats_swap.data.challenges import get_challenge

    with memory_limit(512 * 2**20):
        renumbered = nifti.to_table_values("w", raw, {MAX_LABEL_VALUE: 2}, get_challenge("2021"), None)
    assert renumbered.dtype == np.uint8 and int(renumbered.sum()) == 2 * 8


def _bundle_with(bundle: Path, target: Path, change) -> Path:
    def edit(metadata, members):
        for name in [CONFIG, *[m for m in members if m.endswith("/config.yaml")]]:
            raw = yaml.safe_load(members[name])
            change(raw)
            members[name] = yaml.safe_dump(raw).encode()
    return rewrite_bundle(bundle, target, edit)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    base = tmp_path_factory.mktemp("untrusted-2-bundle")
    return export_bundle(task_run(base, "met", 1), base / "met.zip").path


def _serve(bundle_path: Path, input_dir: Path, output_dir: Path, *args: str):
    return CliRunner().invoke(app, ["serve-challenge", "--model", str(bundle_path), "--input", str(input_dir),
                                    "--output", str(output_dir), "--device", "cpu", *args])


def test_a_bundle_cube_of_1024_cubed_is_priced_and_refused_before_any_case(bundle, tmp_path):
    from ship_helpers import challenge_input

    challenge_input(tmp_path / "in", "met", 1)
    huge = _bundle_with(bundle, tmp_path / "huge.zip", lambda raw: raw["data"].update(cube=[1024, 1024, 1024]))
    with memory_limit(2 * GIB):
        result = _serve(huge, tmp_path / "in", tmp_path / "out")
    _error_line(result, 2, "huge.zip", "data.cube [1024, 1024, 1024]", "GiB of host memory per case",
                "refused before any case is read")
    assert not (tmp_path / "out").exists()


def test_predict_prices_a_bundle_before_any_case_as_serve_challenge_does(bundle, tmp_path):
    from ship_helpers import challenge_input

    challenge_input(tmp_path / "in", "met", 1)
    huge = _bundle_with(bundle, tmp_path / "huge.zip", lambda raw: raw["data"].update(cube=[1024, 1024, 1024]))
    with memory_limit(2 * GIB):
        result = CliRunner().invoke(app, ["predict", "--model", str(huge), "--input", str(tmp_path / "in"),
                                          "--out", str(tmp_path / "out"), "--device", "cpu"])
    _error_line(result, 2, "huge.zip", "data.cube [1024, 1024, 1024]", "GiB of host memory per case",
                "refused before any case is read")
    assert not (tmp_path / "out").exists()


def test_windows_that_could_not_finish_a_case_are_refused_before_any_case(bundle, tmp_path):
    """Patch 8^3 at overlap 0.999 on a 64^3 cube: 57^3 = 185,193 windows per pass (x 8 mirrors)."""
    from ship_helpers import challenge_input

    challenge_input(tmp_path / "in", "met", 1)

    def slow(raw):
        raw["data"]["cube"] = [64, 64, 64]
        raw["train"].update(mode="patch", patch=[8, 8, 8])
        raw["evaluate"]["sw_overlap"] = 0.999
    result = _serve(_bundle_with(bundle, tmp_path / "slow.zip", slow), tmp_path / "in", tmp_path / "out")
    line = _error_line(result, 2, "slow.zip", "train.patch [8, 8, 8], evaluate.sw_overlap 0.999",
                       f"more than the {MAX_NETWORK_CALLS_PER_CASE:,} one case may take")
    assert f"{185_193 * 8:,} network calls per case" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("size", "patch", "overlap"), [((64, 64, 64), (8, 8, 8), 0.999), ((192, 160, 150),
                         (128, 128, 128), 0.5), ((16, 16, 16), (32, 32, 32), 0.5), ((100, 90, 80), (40, 30, 20), 0.25)])
def test_the_window_count_is_monais(size, patch, overlap):
    from monai.data.utils import dense_patch_slices
    from monai.inferers.utils import _get_scan_interval

    padded = tuple(max(s, p) for s, p in zip(size, patch, strict=True))
    interval = _get_scan_interval(padded, patch, 3, (overlap,) * 3)
    assert windows_per_pass(size, patch, overlap) == len(dense_patch_slices(padded, patch, interval))


# --- (3) one bad case never stops the others ----------------------------------------------------------------


def test_a_dataset_json_of_100000_brackets_in_a_case_folder_skips_that_case(tmp_path):
    input_dir = tmp_path / "input"
    write_case(input_dir, CASES[0], "2021", shape=SHAPE, seg=False)
    hostile = input_dir / CASES[1]
    (hostile / "imagesTr").mkdir(parents=True)
    (hostile / "dataset.json").write_text("[" * 100_000)
    lines: list[str] = []
    report = serve(_tiny_predictor(), input_dir, tmp_path / "out", tta=False, say=lines.append)
    assert [p.name for p in report.written] == [f"{CASES[0]}.nii.gz"]
    assert report.failures.describe() == (f"{hostile / 'dataset.json'}: nested more than {MAX_NESTING} levels deep; "
                                          "it is not read")


@pytest.mark.parametrize("error", [RecursionError("maximum recursion depth exceeded"), IndexError(),
                                   ValueError("nibabel says no")])
def test_any_exception_of_one_case_skips_it_in_serve_check_and_prepare(tmp_path, monkeypatch, error):
    data = tmp_path / "data"
    for number, case_id in enumerate(CASES):
        write_case(data, case_id, "2021", shape=SHAPE, seed=number)
    real = nifti.load_case

    def load_case(case, *args, **kwargs):
        if case.case_id == CASES[1]:
            raise error
        return real(case, *args, **kwargs)
    for module in ("brats_swap.data.nifti", "brats_swap.data.check", "brats_swap.data.cache",
                   "brats_swap.evaluate.predicting"):
        if hasattr(sys.modules[module], "load_case"):
            monkeypatch.setattr(sys.modules[module], "load_case", load_case)
    expected = f"case {CASES[1]}: {type(error).__name__}: {str(error) or 'no message'}"
    assert [c.problem for c in check_dataset(data, progress=False)] == [None, expected]
    report = prepare_dataset(data, tmp_path / "cache", DataConfig(cube=list(SHAPE), prepare_workers=1), progress=False)
    assert report.prepared == [CASES[0]] and report.failed == {CASES[1]: expected}
    lines: list[str] = []
    served = serve(_tiny_predictor(), data, tmp_path / "out", tta=False, say=lines.append)
    assert [p.name for p in served.written] == [f"{CASES[0]}.nii.gz"] and f"skipped {expected}" in lines


# --- (4) configs, JSON and NIfTI headers ----------------------------------------------------------------------


def _config_show(path: Path, *overrides: str):
    args = ["config", "show", "--config", str(path)]
    for item in overrides:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


@pytest.mark.parametrize(("content", "words"), [
    (b"train: " + b"[" * 100_000, ("nested more than 64 levels deep",)),
    (b"train:\n  lr: 0.1\n  max_epochs: 3\n  lr: 0.2\n", ("not valid YAML at line 4, column 3",
                                                                   "key 'lr' given twice in one mapping")),
    ("name: caf\xe9\n".encode("latin-1"), ("not UTF-8 text (byte 0xe9 at offset 9)",)),
    (b"train:\n  batch_size: 1000000000000000000000000000000\n", ("train.batch_size: a 31-digit integer is beyond",)),
    (b"train:\n  max_epochs: 10000000000000000000000000\n", ("train.max_epochs: a 26-digit integer",)),
    (b"train:\n  max_epochs: 1000000\n", ("train.max_epochs: 1000000 is more than 100,000",)),
    (b"data:\n  prepare_workers: 100000\n", ("data.prepare_workers: 100000 is more than 256",)),
    (b"cv:\n  folds: 1000\n", ("cv.folds: 1000 is more than 100",)),
    (b"data:\n  cube: [4096, 192, 192]\n", ("data.cube: 4096 is more than 1,024",)),
])
def test_config_limits_are_one_line_each(tmp_path, content, words):
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    _error_line(_config_show(path), 2, *words)


def test_a_config_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.yaml")
    result = run_capped("""
        import sys
        from brats_swap.config import load_config
        from brats_swap.errors import ConfigError
        try:
            load_config(sys.argv[1])
        except ConfigError as exc:
            print(exc)
        """, str(tmp_path / "config.yaml"), timeout=30)
    assert result.stdout.strip() == f"{tmp_path / 'config.yaml'}: a FIFO (named pipe), not a regular config file; " \
                                    "it is not read"


def test_an_override_nested_too_deeply_is_one_line():
    with pytest.raises(ConfigError, match="override train.patch: cannot parse value"):
        load_config(None, ["train.patch=" + "[" * 100_000])


@pytest.mark.parametrize(("text", "words"), [
    ("[" * 100_000, f"nested more than {MAX_NESTING} levels deep"),
    ('{"labels": {"a": 1, "a": 2}}', "key 'a' given twice in one object"),
    ('{"labels": {"tumour": 1e999999}}', "number 1e999999 is beyond the range of a float"),
    ('{"labels": {"tumour": NaN}}', "NaN is not a number JSON allows"),
])
def test_dataset_json_limits_are_one_line_naming_the_file(tmp_path, text, words):
    (tmp_path / "imagesTr").mkdir()
    (tmp_path / "dataset.json").write_text(text)
    with pytest.raises(DataError) as caught:
        find_layout(tmp_path)
    line = _one_line(str(caught.value))
    assert line.startswith(f"{tmp_path / 'dataset.json'}: ") and words in line, line


def test_json_and_yaml_parsers_accept_what_they_should():
    assert parse_json('{"a": [1, 2.5, {"b": "[[[["}]}', "x") == {"a": [1, 2.5, {"b": "[[[["}]}
    assert parse_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n", "x") == {"a": {"b": 1}, "c": {"b": 1, "d": 2}}
    assert parse_json("[" * MAX_NESTING + "]" * MAX_NESTING, "x") is not None


def _case_with_header(folder: Path, change) -> Path:
    """A 4^3 volume whose header bytes `change` edited after nibabel wrote them (it would fix them on writing)."""
    payload = nib.Nifti1Image(np.ones((4, 4, 4), dtype=np.float32), np.eye(4)).to_bytes()
    header = nib.Nifti1Header(payload[:348], check=False)
    change(header)
    path = folder / "vol.nii.gz"
    path.write_bytes(gzip.compress(header.binaryblock + payload[348:], mtime=0))
    return path


def test_nan_or_infinite_affines_and_spacings_are_refused(tmp_path):
    def nan_sform(header):
        affine = np.eye(4)
        affine[0, 3] = np.nan
        header.set_sform(affine, code=1)

    def nan_pixdim(header):
        header["pixdim"][1] = np.nan

    def inf_qoffset(header):
        header["qform_code"] = 1
        header["qoffset_x"] = np.inf
    for change, words in ((nan_sform, "non-finite values (NaN or infinity) in the affine"),
                          (nan_pixdim, "voxel spacing nanx1.0x1.0 (pixdim) is not three positive finite numbers"),
                          (inf_qoffset, "non-finite values (NaN or infinity) in the")):
        with pytest.raises(DataError, match=r"case c: file vol\.nii\.gz: ") as caught:
            nifti.read_volume("c", _case_with_header(tmp_path, change))
        assert words in _one_line(str(caught.value))


# --- (5) integrity ---------------------------------------------------------------------------------------------


def test_a_folder_name_cannot_forge_a_line(tmp_path):
    input_dir = tmp_path / "input"
    write_case(input_dir, CASES[0], "2021", shape=SHAPE, seg=False)
    forged = "x\nerror: all 2 cases done, nothing failed"
    (input_dir / forged).mkdir()
    (input_dir / "y\x1b[2K\rok").mkdir()
    lines: list[str] = []
    report = serve(_tiny_predictor(), input_dir, tmp_path / "out", tta=False, say=lines.append)
    assert len(report.failures) == 2 and len(report.written) == 1
    assert all("\n" not in line and "\r" not in line and "\x1b" not in line for line in lines), lines
    assert not any(line.startswith("error:") for line in lines)
    assert sum("x\\nerror: all 2 cases done, nothing failed" in line for line in lines) == 1, lines
    assert "\n" not in report.failures.describe() and "\x1b" not in report.failures.describe()


def test_a_case_id_held_by_two_input_folders_is_refused_for_both_and_counted(tmp_path):
    input_dir = tmp_path / "input"
    write_case(input_dir, CASES[0], "2021", shape=SHAPE, seg=False)
    for folder in ("a", "b"):
        write_case(input_dir / folder, CASES[1], "2021", shape=SHAPE, seg=False, per_case_folder=False)
    lines: list[str] = []
    report = serve(_tiny_predictor(), input_dir, tmp_path / "out", tta=False, say=lines.append)
    assert [p.name for p in report.written] == [f"{CASES[0]}.nii.gz"] and report.cases == 3
    assert sorted(report.failures.reasons) == ["a", "b"]
    assert f"case {CASES[1]}: held by 2 input folders (a, b)" in report.failures.describe()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{CASES[0]}.nii.gz"]


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_train_challenge_refuses_an_output_inside_its_data_and_data_inside_its_output(bundle, tmp_path, where):
    data = tmp_path / "data"
    write_case(data, CASES[0], "2021", shape=SHAPE)
    output = {"same": data, "inside": data / "out", "around": tmp_path}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(app, ["train-challenge", "--model", str(bundle), "--data", str(data),
                                      "--output", str(output), "--device", "cpu"])
    _error_line(result, 2, "inside")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_sigterm_while_train_challenge_prepares_the_data_stops_within_seconds(bundle, tmp_path):
    """`docker stop` sends SIGTERM to the main process; the preparation (here one that would wait for minutes)
    stops at once with exit 130 and one line, not after it."""
    data = tmp_path / "data"
    write_case(data, CASES[0], "2021", shape=SHAPE)
    script = textwrap.dedent("""
        import sys, time
        import brats_swap.train.data as train_data
        def prepare(*args, **kwargs):
            print("preparing", flush=True)
            time.sleep(300)
        train_data.prepare_missing = prepare
        from brats_swap.cli.main import app
        app(sys.argv[1:], prog_name="brats-swap")
        """)
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", script, "train-challenge", "--model", str(bundle), "--data",
                                str(data), "--output", str(tmp_path / "out"), "--device", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while process.stdout.readline().strip() != "preparing":
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert time.monotonic() - sent < 10
    assert process.returncode == 130, err[-3000:]
    # A planned stop (issue 44): one `stopped:` line, no `error:` line.
    assert not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(stops) == 1 and "Traceback" not in err, err[-3000:]
    assert "SIGTERM while the data was prepared" in stops[0] and "run the same command again" in stops[0]


def test_members_helper_reads_a_rewritten_bundle(bundle, tmp_path):
    changed = _bundle_with(bundle, tmp_path / "b.zip", lambda raw: raw["evaluate"].update(sw_overlap=0.25))
    assert yaml.safe_load(members_of(changed)[fold_config(0)])["evaluate"]["sw_overlap"] == 0.25


def test_an_nnunet_checkpoint_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "checkpoint_final.pth")
    result = run_capped("""
        import sys
        from pathlib import Path
        from brats_swap.errors import CheckpointError
        from brats_swap.ship.nnunet_import import _load_nnunet_checkpoint
        try:
            _load_nnunet_checkpoint(Path(sys.argv[1]))
        except CheckpointError as exc:
            print(exc)
        """, str(tmp_path / "checkpoint_final.pth"), timeout=60)
    assert result.stdout.strip() == (f"{tmp_path / 'checkpoint_final.pth'}: a FIFO (named pipe), not a regular file; "
                                     "it is not read"), result.stderr[-2000:]


def test_predict_skips_a_case_whatever_it_raises_and_goes_on(tmp_path, monkeypatch):
    from brats_swap.evaluate import predicting

    data = tmp_path / "data"
    for number, case_id in enumerate(CASES):
        write_case(data, case_id, "2021", shape=SHAPE, seed=number, seg=False)
    real = nifti.load_case

    def load_case(case, *args, **kwargs):
        if case.case_id == CASES[0]:
            raise RecursionError("maximum recursion depth exceeded")
        return real(case, *args, **kwargs)
    monkeypatch.setattr(nifti, "load_case", load_case)  # predicting imports it when it runs
    with pytest.raises(DataError, match=rf"1 of 2 case\(s\) failed, the others are done: case {CASES[0]}: "
                                        "RecursionError: maximum recursion depth exceeded"):
        predicting.predict_with(_tiny_predictor(), data, tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{CASES[1]}.nii.gz"]


def test_a_large_nii_gz_is_refused_from_its_first_mib_without_reading_the_rest(tmp_path):
    """512 MiB files (sparse): a small image's header followed by zeros, and no gzip header at all; each refused
    having read one MiB, under an address space 64 MiB above the interpreter's."""
    small = nib.Nifti1Image(np.ones((8, 8, 8), dtype=np.uint8), np.eye(4))
    with open(tmp_path / "padded.nii.gz", "wb") as file:
        file.write(gzip.compress(small.to_bytes(), mtime=0))
        file.truncate(512 * 2**20)
    with open(tmp_path / "garbage.nii.gz", "wb") as file:
        file.write(b"not gzip")
        file.truncate(512 * 2**20)
    # the reads: 64 MiB above the interpreter's address space
    assert read_volumes_capped(tmp_path, "c", ["padded", "garbage"], 64 * 2**20) == [
        f"case c: file padded.nii.gz: {512 * 2**20} bytes compressed for the 864 bytes its header declares; the file "
        "is damaged and is not read",
        "case c: file garbage.nii.gz: not a NIfTI file (no gzip header in a .gz file)"]


def test_sigterm_to_the_whole_group_while_workers_prepare_the_data_is_exit_130_without_a_traceback(bundle, tmp_path):
    """`docker stop` on a container whose main process leads the group, or a shell's kill of the job: the prepare
    workers die with the main process; their broken pool is the same stop (exit 130, one line), not a traceback."""
    from brats_swap.data.phantom import synthesize_dataset

    synthesize_dataset(tmp_path / "data", 6, seed=0, edition="met", shape=(64, 64, 48))
    # The real preparation, with a line when its workers start (the card line comes after it, with the plan).
    script = textwrap.dedent("""
        import sys
        import brats_swap.data.cache as cache
        run_cases = cache.run_cases
        def announced(*args, **kwargs):
            print("preparing", flush=True)
            return run_cases(*args, **kwargs)
        cache.run_cases = announced
        from brats_swap.cli.main import app
        app(sys.argv[1:], prog_name="brats-swap")
        """)
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", script, "train-challenge", "--model", str(bundle), "--data",
                                str(tmp_path / "data"), "--output", str(tmp_path / "out"), "--device", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while process.stdout.readline().strip() != "preparing":
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(1.0)  # the workers are starting (each imports torch) or preparing
        sent = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 15
    assert process.returncode == 130, err[-3000:]
    # A planned stop (issue 44): one `stopped:` line, no `error:` line.
    assert not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(stops) == 1 and "Traceback" not in err and "BrokenProcessPool" not in err, err[-3000:]
    assert "SIGTERM while the data was prepared" in stops[0] and "run the same command again" in stops[0], stops
    assert not (tmp_path / "out" / "run" / "fold_0").exists()  # stopped before training
