"""scripts/bench_memory.py runs on CPU at a tiny size and writes its JSON and Markdown table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_memory.py"


def test_bench_memory_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_memory", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--device", "cpu", "--cubes", "8", "--depth", "3", "--base-filters", "2", "--batches", "1",
                         "--steps", "1", "--min-bytes", "0", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_memory_cpu.json").read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {row["policy"]: row for row in written["rows"]}
    assert set(rows) == set(bench.ALL_POLICIES)
    assert all(row["status"] == "ok" and row["step_s"] > 0 for row in rows.values())
    # Everything but the batch input (4 channels of 8³ fp32), which the caller holds and is never swapped.
    assert rows["swap_all"]["swapped_out_bytes"] == rows["swap_all"]["saved_bytes"] - 4 * 8**3 * 4 > 0
    assert rows["swap_all"]["peak_bytes"] < rows["none"]["peak_bytes"]
    assert rows["norm_act"]["recomputed_bytes"] > 0
    assert "| swap_all |" in (tmp_path / "bench_memory_cpu.md").read_text()
