#!/usr/bin/env bash
# GPU check for pallas_kernels (run on the GPU machine, from anywhere; < 5 minutes):
#   1. prints versions and devices, and stops unless JAX sees a GPU;
#   2. runs the kernel tests compiled for the GPU (no interpret mode);
#   3. times every kernel against its XLA path and dense attention at 32k/128k/512k keys.
# Exits non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/conftest.py defaults JAX_PLATFORMS to cpu; the GPU run must override it.
export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false

python - <<'PY'
import sys, platform
import jax, jaxlib
print(f"python {platform.python_version()}  jax {jax.__version__}  jaxlib {jaxlib.__version__}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not importable as a Python package (JAX's bundled Triton is used)")
try:
    print("devices:", jax.devices())
except Exception as error:  # JAX_PLATFORMS=cuda without a working CUDA backend
    sys.exit(f"gpu_check: JAX has no CUDA backend here ({type(error).__name__}: {error})")
if jax.default_backend() != "gpu":
    sys.exit(f"gpu_check: JAX backend is {jax.default_backend()!r}, not gpu")
PY

echo "== kernel tests, compiled (interpret=False) =="
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels_*.py

echo "== timings =="
timeout 180 python scripts/gpu_check.py "$@"
