"""scripts/bench_scale.py runs at a tiny size and writes its JSON and Markdown table: every loader measure,
in this process and in a real DataLoader worker, with slots and without (the numbers are the benchmark's
business, docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_scale.py"


def test_bench_scale_writes_every_loader_measure(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "scale"
    bench.main(["--cases", "2", "--shape", "40", "40", "32", "--cube", "32", "32", "32", "--patch", "16", "16", "16",
                "--samples", "4", "--cold", "1", "--workers", "1", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    measures = [result["loader_cpu_seconds_per_sample"], result["loader_fresh_memory_cpu_seconds_per_sample"],
                *result["loader_worker_process_cpu_seconds_per_sample"].values(),
                result["copy_out_cpu_seconds_per_sample"]]
    for measure in measures:
        assert set(measure) == {"whole", "patch"} and all(math.isfinite(v) and v > 0 for v in measure.values())
    assert result["prepare"]["prepared"] == 2 and result["bytes_per_case"]["cache"] > 0
    table = out.with_suffix(".md").read_text()
    assert "slots reused (goal ≤ 0.10)" in table and "DataLoader worker process" in table
