"""generate()'s decode loop compiled for an H100 on this CPU machine (JAX deviceless AOT).

Every method × offload on/off, at Llama-3.1-8B's per-layer shapes (hidden 4096,
32 query heads, 8 KV heads, head dim 128, intermediate 14,336, vocabulary
128,256) and its full 128k context, in bfloat16, with the layer count reduced so
that the suite stays short: one layer (every layer of these methods is the same
program), two for MagicPIG (its layer 0 stays dense: both kinds of layer compile). XLA's GPU compiler runs for real: the host offloader,
memory-space assignment and the Triton compilation of the Pallas kernels. Each
case runs ``scripts/deviceless_compile.py`` in a process of its own, because the
JAX CUDA plugin lives outside the test environment (``make cuda-plugin``): loaded
into it, the plugin would look for a GPU in every JAX process.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jaxlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from decode_variants import METHODS  # noqa: E402

PLUGIN_DIR = pathlib.Path(os.environ.get("JAXKV_CUDA_PLUGIN_DIR", pathlib.Path(sys.prefix) / "cuda-plugin"))
COMPILE_TIMEOUT_S = 600
LAYERS = {"magicpig": 2}  # default 1
# The Pallas kernels each method's selection runs in on a GPU, whatever the placement.
SELECTION_KERNELS = {"pariskv": {"vote_totals", "rsq_rerank"}, "magicpig": {"simhash"}}


def _plugin_or_skip() -> None:
    """Skip without the plugin, except in CI, where `make test` installs it and its absence fails."""
    if (PLUGIN_DIR / "jax_plugins" / "xla_cuda12").is_dir():
        return
    message = f"the JAX CUDA plugin is not installed in {PLUGIN_DIR} (run `make cuda-plugin`)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def deviceless_compile(tmp_path: pathlib.Path, *args: str) -> dict:
    """Run scripts/deviceless_compile.py with ``args``; its JSON report."""
    _plugin_or_skip()
    out = tmp_path / "report.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(PLUGIN_DIR), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "deviceless_compile.py"), *args, "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if not out.exists():
        pytest.fail(f"deviceless_compile.py wrote no report (exit {run.returncode}):\n{run.stderr[-4000:]}")
    report = json.loads(out.read_text())
    print(run.stdout)
    return report


@pytest.mark.parametrize("offload", [False, True], ids=["device-kv", "host-kv"])
@pytest.mark.parametrize("method", METHODS)
def test_decode_loop_compiles_for_h100(tmp_path, method, offload):
    report = deviceless_compile(tmp_path, "--method", method, "--offload" if offload else "--no-offload",
                                "--layers", str(LAYERS.get(method, 1)))
    assert report["ok"], f"{report.get('stage')}: {report.get('error')}\n{report.get('traceback')}"
    assert report["plugin"] == report["jaxlib"] == jaxlib.__version__
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3"
    memory, states = report["memory"], report["state_bytes"]
    # The memory kinds reach the compiled program: its pinned-host arguments are
    # exactly the states placed there (retrieval K/V and the index's bulk)...
    assert memory["host_argument_bytes"] == states["pinned_host"]
    assert (states["pinned_host"] > 0) == offload
    # ...and the donated states are updated in place, host and device alike: the
    # outputs alias them instead of being second copies.
    assert memory["host_alias_bytes"] == memory["host_argument_bytes"]
    assert memory["device_alias_bytes"] >= states["device"]
    # The selection runs in Pallas kernels that XLA compiled for sm_90, and with the
    # retrieval region on the device, so does the attention over the rows it selects.
    kernels = set(report["triton_kernels"])
    if method in SELECTION_KERNELS:
        assert SELECTION_KERNELS[method] <= kernels
        assert offload or "gather_attention" in kernels
    else:
        assert not kernels


def test_magicpig_with_its_index_on_the_host_is_refused_by_xla(tmp_path):
    """MagicPIG's paper placement (``CacheConfig(host_index=True)``: sampling and attention in
    host computations) does not compile for a GPU with this jaxlib, which is why it is not the
    default (docs/architecture.md, "Data movement"). A jaxlib that compiles it fails this test:
    then the default can move to the placement that moves fewer bytes."""
    report = deviceless_compile(tmp_path, "--method", "magicpig", "--offload", "--host-index", "--layers", "2")
    assert not report["ok"] and report["stage"] == "compile", report
    assert "to be called only by one caller and that caller to be a While" in report["error"], report["error"]
