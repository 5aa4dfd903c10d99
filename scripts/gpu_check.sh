#!/usr/bin/env bash
# GPU check for pallas_kernels (run on the GPU machine, from anywhere; at most 11 minutes):
#   1. prints versions and devices, and stops unless JAX sees a GPU;
#   2. runs the kernel tests compiled for the GPU (no interpret mode), the slow
#      end-to-end ones (generate() with the kernels equals the XLA path) included;
#   3. times every kernel against its XLA path and dense attention at 32k/128k/512k keys.
# Every step runs even when an earlier one fails; exits non-zero if any failed.
# Arguments go to gpu_check.py (e.g. --json results.json). PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# tests/conftest.py defaults JAX_PLATFORMS to cpu; the GPU run must override it.
export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# The repository's packages and tests import from its root, installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - <<'PY' || exit 1
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

failed=0
# xdist when present (compiling the kernels is CPU-bound); pytest-timeout when present,
# so that a test that hangs fails with its stack instead of the step being killed
# before pytest names anything. -v prints each test's outcome as it completes.
plugins=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8")
plugins+=" "$("$PYTHON" -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")
run_tests() {
    timeout "$1" "$PYTHON" -m pytest -v -rfE --tb=short --durations=10 -p no:cacheprovider $plugins \
        -m "$2" tests/test_kernels_*.py || failed=1
}
echo "== kernel tests, compiled (interpret=False) =="
run_tests 240 "not slow"
echo "== end-to-end: generate() with the kernels equals the XLA path (slow) =="
run_tests 200 slow

echo "== timings =="
timeout 150 "$PYTHON" scripts/gpu_check.py "$@" || failed=1
exit $failed
