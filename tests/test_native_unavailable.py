"""jaxkv.native where the kernels cannot be had: on a CPU that lacks an instruction set they
need the reason names it, and a kernel call refuses with it rather than failing to compile or
crashing; when the compiler fails, the reason is its errors."""
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jaxkv import native
from models.native import build


@pytest.fixture
def cpu_without(monkeypatch):
    """Pretends /proc/cpuinfo lacks one required flag; the real answer comes back after."""
    def lacking(flag: str) -> None:
        others = " ".join(f for f in native.REQUIRED_CPU_FLAGS if f != flag)
        monkeypatch.setattr(build, "cpu_flags", lambda: f"flags\t\t: fpu sse2 avx2 {others}")
        native.LIBRARY.reset()
    yield lacking
    monkeypatch.undo()
    native.LIBRARY.reset()  # decided again for this CPU (the kernels re-registered)


@pytest.mark.parametrize("flag", native.REQUIRED_CPU_FLAGS)
def test_a_missing_flag_is_the_reason(cpu_without, flag):
    cpu_without(flag)
    assert not native.available()
    assert native.unavailable_reason().endswith(f"without {flag}")
    with pytest.raises(native.NativeUnavailable, match=f"without {flag}$"):
        native.top_k(jnp.arange(4.0), 1)


def test_a_failed_build_reports_the_compiler_errors_not_its_warnings(tmp_path, monkeypatch):
    """A compiler that fails after pages of warnings (as jaxlib's FFI headers draw from g++):
    the reason keeps its error line, which a tail of its output lost."""
    compiler = tmp_path / "failing-c++"
    compiler.write_text("#!/bin/sh\n"
                        "for i in $(seq 60); do echo 'api.h:166:1: warning: control reaches end' >&2; done\n"
                        "echo \"dense_cpu.cc:129:22: error: cannot convert 'const float*'\" >&2\n"
                        "for i in $(seq 60); do echo 'api.h:179:1: warning: control reaches end' >&2; done\n"
                        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JAXKV_NATIVE_CACHE", str(tmp_path / "cache"))
    native.LIBRARY.reset()
    try:
        reason = native.unavailable_reason()
    finally:
        monkeypatch.undo()
        native.LIBRARY.reset()
    assert reason.endswith("failed:\ndense_cpu.cc:129:22: error: cannot convert 'const float*'"), reason


# Run in a process of its own: XLA refuses a second library's kernels under names this process
# has registered (on an AVX-512 CPU the reduced flags give another library).
_AVX2_ONLY = """
import jax, jax.numpy as jnp
from jaxkv import native
from jaxkv.attention import pariskv
from models.native import build
avx512_only = [f for f in native.REQUIRED_CPU_FLAGS if f not in native.AVX2_CPU_FLAGS]
line = " ".join(w for w in build.cpu_flags().split(" ") if w not in avx512_only)
build.cpu_flags = lambda: line
assert native.available(*native.AVX2_TARGETS) and not native.available()
assert native.unavailable_reason("jaxkv_attend_rows").endswith(f"without {', '.join(avx512_only)}")
values = jnp.asarray([3.0, -1.0, 3.0, 7.0, 0.5])
assert native.top_k(values, 3).tolist() == jax.lax.top_k(values, 3)[1].tolist()
try:
    native.dense_decode(jnp.zeros((1, 1, 16)), jnp.zeros((1, 16, 4)), jnp.zeros((1, 4, 16)), jnp.int32(4))
    raise AssertionError("dense_decode ran without AVX-512")
except native.NativeUnavailable as error:
    assert "without" in str(error)
assert not pariskv.METHOD.reads_rows_in_place(pariskv.ParisKVConfig(kernels="native"), jnp.zeros((4, 16)))
print("ok")
"""


def test_an_avx2_cpu_gets_pariskv_s_selection_alone():
    """This CPU's flags less every AVX-512 one and GFNI (on an AVX2 CPU, its own flags): the
    library is built for it and only ParisKV's selection registered; the other kernels refuse
    with the flags they lack, and ParisKV's native mode attends its rows in XLA."""
    flags = build.cpu_flags().split()
    if not set(native.AVX2_CPU_FLAGS) <= set(flags):
        pytest.skip(f"this CPU lacks one of {native.AVX2_CPU_FLAGS}")
    run = subprocess.run([sys.executable, "-c", _AVX2_ONLY], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_unknown_kernels_are_refused():
    with pytest.raises(ValueError, match="unknown jaxkv.native kernels"):
        native.available("jaxkv_no_such_kernel")
