"""SimHash kernel vs its plain-jnp reference, the bit layout, and CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import dispatch
from pallas_kernels.simhash import simhash, simhash_reference
from pallas_kernels.testing import INTERPRET, lower_for_cuda, triton_kernels

EPS32 = np.finfo(np.float32).eps
# The XLA path and the kernel path of the public entry point.
BOTH_PATHS = (dict(kernels="xla"), dict(kernels="interpret" if INTERPRET else "pallas"))


def _random(seed, n, d, n_bits, n_tables):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    proj = rng.standard_normal((d, n_bits * n_tables)).astype(np.float32)
    return x, proj


def _ambiguous_tables(x, proj, n_bits):
    """[N, L] True where some projection is so close to 0 that float32 rounding in a
    different summation order may flip its sign: |x·r| ≤ d·eps·Σ|x_i r_i| (the
    standard bound on the rounding error of a length-d dot product). The compiled
    kernel's three-pass TF32 product errs by at most ≈ 6 eps per term (the split's
    rounding and the dropped low × low products, 2^-22 each), within the bound."""
    x64, r64 = x.astype(np.float64), proj.astype(np.float64)
    bound = x.shape[1] * EPS32 * (np.abs(x64) @ np.abs(r64))
    close = np.abs(x64 @ r64) <= bound
    return close.reshape(x.shape[0], -1, n_bits).any(-1)


# A quarter of the profile's examples (5 by default): interpret mode is slow.
@settings(max_examples=settings.default.max_examples // 4)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 150), d=st.sampled_from([64, 128]),
       n_bits=st.integers(1, 16), n_tables=st.integers(1, 40))
def test_kernel_matches_reference(seed, n, d, n_bits, n_tables):
    x, proj = _random(seed, n, d, n_bits, n_tables)
    got = simhash(x, proj, n_bits=n_bits, interpret=INTERPRET)
    want = simhash_reference(x, proj, n_bits=n_bits)
    assert got.dtype == jnp.uint16 and got.shape == (n, n_tables)
    # Integer codes: exact, except tables with a projection within rounding of 0.
    ambiguous = _ambiguous_tables(x, proj, n_bits)
    # The exemption is rare (≈1e-3 of 16-bit tables at d = 128: |x·r| ~ √d against a
    # bound ~ d²·eps), so the comparison is real: at most one table or 5 % of them (the
    # long profile met 1 of 63 tables at n = 9, which a fixed 1 % would reject).
    assert ambiguous.sum() <= max(1, 0.05 * ambiguous.size)
    assert not np.any((np.asarray(got) != np.asarray(want)) & ~ambiguous)


@pytest.mark.parametrize("path", BOTH_PATHS)
def test_bit_layout(path):
    """Bit j of table l is (x·R[:, l·K + j] > 0), written out with numpy."""
    x, proj = _random(1, 5, 64, 10, 7)
    p = x.astype(np.float64) @ proj.astype(np.float64)
    want = np.zeros((5, 7), np.int64)
    for l in range(7):
        for j in range(10):
            want[:, l] |= (p[:, l * 10 + j] > 0).astype(np.int64) << j
    got = np.asarray(dispatch.simhash(x, proj, n_bits=10, **path)).astype(np.int64)
    assert not np.any((got != want) & ~_ambiguous_tables(x, proj, 10))


def test_bad_input_named():
    x, proj = _random(0, 4, 64, 10, 3)
    with pytest.raises(ValueError, match="n_bits"):
        simhash(x, proj[:, :17], n_bits=17, interpret=INTERPRET)
    with pytest.raises(ValueError, match="proj"):
        simhash(x, proj[:, :29], n_bits=10, interpret=INTERPRET)
    with pytest.raises(ValueError, match="proj"):
        simhash_reference(x, proj[:32], n_bits=10)


@pytest.mark.parametrize("n, d, dtype", [
    (32768, 64, jnp.float32),    # SmolLM2: keys of one KV head, head dim 64
    (32768, 128, jnp.bfloat16),  # Llama-8B-like: head dim 128, bf16 cache
    (4, 128, jnp.float32),       # a query group
])
def test_lowers_for_cuda(n, d, dtype):
    n_bits, n_tables = 10, 150  # MagicPIG's default K10 L150
    text = lower_for_cuda(
        lambda x, r: simhash(x, r, n_bits=n_bits),
        jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, n_bits * n_tables), jnp.float32))
    assert triton_kernels(text) == ["simhash"]
