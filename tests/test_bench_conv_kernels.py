"""scripts/bench_conv_kernels.py runs on the CPU and writes its rows (the timings themselves are the benchmark's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_conv_kernels.py"


def test_bench_conv_kernels_names_torchs_kernel_and_times_both(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_conv_kernels", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "conv.json"
    assert script.main(["--networks", "nnunet", "--cubes", "16", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # nnU-Net's U-Net at 16³ with 4/8/16 features: every convolution, each distinct one once.
    assert len(rows) == len({(tuple(r["input"]), tuple(r["weight"]), r["stride"]) for r in rows}) >= 5
    assert {r["torch_kernel"] for r in rows} == {"slow_conv3d_forward"}  # torch's size rule at batch 1
    runs = {(r["weight"][2], r["input"][2]): r["compiled_runs"] for r in rows if r["stride"] == 1}
    assert runs[(3, 16)] == "forward and backward" and runs[(3, 4)] == "torch"  # under 8³ voxels: torch's
    assert runs[(1, 16)] == "torch"  # the 1x1x1 head
    assert all(r["onednn_forward_ms"] > 0 and r["torch_backward_ms"] > 0 for r in rows)
    assert "torch picks" in capsys.readouterr().out
