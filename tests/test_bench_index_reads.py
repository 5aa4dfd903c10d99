"""benchmarks/bench_index_reads.py: the cache lines it counts, and a small run end to end (its
C++ program and jaxkv's ParisKV kernels) whose rows, bytes and lines follow from the index."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxkv import native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_index_reads  # noqa: E402


def brute_force_lines(rows, stride, nbytes):
    return sum(len({byte // 64 for r in head for byte in range(r * stride, r * stride + nbytes)}) for head in rows)


@pytest.mark.parametrize("stride,nbytes", [(8, 8), (16, 16), (30, 30), (58, 58), (32, 30), (64, 58)])
def test_lines_touched_counts_each_line_once(stride, nbytes):
    rng = np.random.default_rng(stride)
    rows = np.sort(rng.choice(4096, (2, 300), replace=True), axis=-1)  # repeats and neighbours share lines
    assert bench_index_reads.lines_touched(rows, stride, nbytes) == brute_force_lines(rows, stride, nbytes)


@pytest.mark.skipif(not native.available(*native.AVX2_TARGETS),
                    reason=str(native.unavailable_reason(*native.AVX2_TARGETS)))
def test_a_small_run_reports_what_the_index_holds(tmp_path, monkeypatch):
    n, heads = 4096, 2
    monkeypatch.setattr(sys, "argv", ["bench_index_reads.py", "--sizes", str(n), "--heads", str(heads),
                                      "--cached-rows", "512", "--repeats", "1", "--evict-mb", "1",
                                      "--out", str(tmp_path)])
    bench_index_reads.main()
    result = json.loads((tmp_path / "bench_index_reads.json").read_text())["results"][0]
    table = (tmp_path / "bench_index_reads.md").read_text().splitlines()
    assert sum(line.startswith(f"| {n:,} |") for line in table) == 6
    modes = result["modes"]
    b, record = result["sign_bytes"], result["record_bytes"]
    assert (b, record, result["padded_record_bytes"]) == (8, 30, 32)  # d = 64: 24 B planes, 4 B weights, 2 B scale
    c = result["candidates_per_head"]
    assert c == math.ceil(0.5 * n)  # the official candidate ratio below 5k keys
    assert modes["signs"]["rows"] == modes["coarse kernel"]["rows"] == heads * n
    assert modes["signs"]["line_bytes"] == modes["coarse kernel"]["line_bytes"] == heads * n * b
    assert modes["rerank kernel"]["rows"] == heads * c
    assert modes["rerank kernel"]["bytes"] == heads * c * (b + record)
    for mode in ("candidates", "padded", "rerank kernel"):
        # A candidate's bytes lie in at least as many bytes of lines, and in at most a sign line
        # and two record lines.
        assert modes[mode]["bytes"] <= modes[mode]["line_bytes"] <= modes[mode]["rows"] * 3 * 64
    assert all(m["median_s"] > 0 for m in modes.values())
