"""scripts/gpu_check.sh and gpu_check.py, the GPU acceptance run, kept working on the CPU.

The dry run executes every section of gpu_check.py at toy sizes (SmolLM2 cut to two
layers, one layer of the Llama-3.2-1B shape with a 4,096-token vocabulary, 4k context,
kernels in interpret mode, ParisKV standing for the sparse methods): the same code the
GPU run executes, so that it cannot rot between GPU runs.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def test_dry_run_runs_every_section_and_reports_it(tmp_path):
    out_json, out_md = tmp_path / "report.json", tmp_path / "report.md"
    assert gpu_check.main(["--dry-run", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    report = json.loads(out_json.read_text())
    assert report["mode"].startswith("dry")
    tokens = report["tokens"]
    assert not tokens["skipped"] and tokens["error"] is None
    checks = [row["check"] for row in tokens["rows"]]
    assert checks == [f"{m}: offload on = off" for m in gpu_check.DRY.token_methods] + [
        f"{m}: interpret kernels = XLA" for m in gpu_check.DRY.kernel_methods]
    assert all(row["equal"] and len(row["a"]) == gpu_check.DRY.token_steps for row in tokens["rows"])
    kernels = report["kernels"]
    assert kernels["error"] is None and len(kernels["rows"]) == 5
    assert all(row["kernel_ms"] > 0 and row["xla_ms"] > 0 for row in kernels["rows"])
    speed = report["speed"]
    assert speed["error"] is None and len(speed["rows"]) == len(gpu_check.DRY.speed_variants)
    config = gpu_check.llama_config(gpu_check.DRY.shapes[0], gpu_check.DRY.layers)
    context = gpu_check.DRY.contexts[0]
    # Host KV variants hold their retrieval K/V in pinned host memory: at least the K and V
    # rows (bf16) of every prompt position past the largest sink + local window (4 + 512).
    least = 2 * (context - gpu_check.DRY.new_tokens - 516) * config.num_kv_heads * config.head_dim * 2
    for row, (method, offload) in zip(speed["rows"], gpu_check.DRY.speed_variants):
        assert row["ms_per_token"] > 0 and row["compile_seconds"] > 0
        assert row["pinned_host_bytes"] >= least * config.num_layers if offload else row["pinned_host_bytes"] == 0
    markdown = out_md.read_text()
    assert "| model | context | variant | ms/token |" in markdown and "DIFFERENT" not in markdown


def test_a_row_past_the_deadline_is_reported_not_run(tmp_path):
    out_json = tmp_path / "report.json"
    status = gpu_check.main(["--dry-run", "--sections", "speed", "--seconds", "0", "--json", str(out_json),
                             "--markdown", str(tmp_path / "report.md")])
    rows = json.loads(out_json.read_text())["speed"]["rows"]
    assert status == 1 and rows and all(row["not_run"] == "out of time" for row in rows)


def test_shell_script_refuses_a_machine_without_a_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1
    assert "gpu_check: JAX has no CUDA backend here" in run.stderr or "not gpu" in run.stderr
