"""jaxkv.native on a CPU that lacks an instruction set the kernels need: the reason names it,
and a kernel call refuses with it rather than failing to compile or crashing."""
import jax.numpy as jnp
import pytest

from jaxkv import native


@pytest.fixture
def cpu_without(monkeypatch):
    """Pretends /proc/cpuinfo lacks one required flag; the real answer comes back after."""
    def lacking(flag: str) -> None:
        others = " ".join(f for f in native.REQUIRED_CPU_FLAGS if f != flag)
        monkeypatch.setattr(native, "_cpu_flags", lambda: f"flags\t\t: fpu sse2 avx2 {others}")
        native.unavailable_reason.cache_clear()
    yield lacking
    monkeypatch.undo()
    native.unavailable_reason.cache_clear()  # decided again for this CPU (the kernels re-registered)


@pytest.mark.parametrize("flag", native.REQUIRED_CPU_FLAGS)
def test_a_missing_flag_is_the_reason(cpu_without, flag):
    cpu_without(flag)
    assert not native.available()
    assert native.unavailable_reason().endswith(f"without {flag}")
    with pytest.raises(native.NativeUnavailable, match=f"without {flag}$"):
        native.top_k(jnp.arange(4.0), 1)
