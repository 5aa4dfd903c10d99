"""RSQ-IP rerank kernel vs its plain-jnp reference, the code layout, and CUDA lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import dispatch
from pallas_kernels.rsq_rerank import rsq_rerank, rsq_rerank_reference
from pallas_kernels.testing import INTERPRET, lower_for_cuda, triton_kernels

M = 8  # coordinates per subspace
# ParisKV's official Lloyd–Max centres for m = 8 (DESIGN.md).
CENTRES = np.array([0.0420, 0.1266, 0.2130, 0.3025, 0.3973, 0.5001, 0.6169, 0.7633], np.float32)
EPS32 = np.finfo(np.float32).eps
# The XLA path and the kernel path of the public entry point.
BOTH_PATHS = (dict(kernels="xla"), dict(kernels="interpret" if INTERPRET else "pallas"))


def _problem(seed, n, dp, c):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, dp // 2)).astype(np.uint8)
    weight = rng.uniform(0.5, 3.0, (n, dp // M)).astype(np.float32)
    q = rng.standard_normal(dp).astype(np.float32)
    idx = rng.integers(0, n, (c,)).astype(np.int32)
    return q / np.linalg.norm(q), np.float32(rng.uniform(0.5, 20)), codes, weight, idx


def _numpy_scores(q_rot, q_norm, codes, weight, idx):
    """score[c] = ‖q‖ Σ_b w[n,b] ⟨v_{n,b}, q̃_b⟩, decoding nibbles one coordinate at a time (float64)."""
    n_sub = weight.shape[1]
    out = np.zeros(len(idx))
    for c, n in enumerate(idx):
        v = np.zeros(len(q_rot))
        for j in range(len(q_rot)):
            nibble = (int(codes[n, j // 2]) >> (4 * (j % 2))) & 0xF
            v[j] = (-1 if nibble >> 3 else 1) * CENTRES[nibble & 7]
        per_sub = (v * q_rot).reshape(n_sub, -1).sum(1)
        out[c] = q_norm * np.sum(weight[n] * per_sub)
    return out


def _tolerance(q_rot, q_norm, weight, idx):
    """Rounding bound of a float32 sum of Dp products (|v_j| ≤ 0.77): Dp·eps·Σ|terms|, doubled
    because kernel and reference each round."""
    bound = q_norm * (weight[idx] * np.abs(q_rot).reshape(len(weight[0]), -1).sum(1)).sum(1) * CENTRES[-1]
    return 2 * len(q_rot) * EPS32 * bound


# A quarter of the profile's examples (5 by default): interpret mode is slow.
@settings(max_examples=settings.default.max_examples // 4)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 600), dp=st.sampled_from([64, 128]),
       c=st.integers(0, 300))
def test_kernel_matches_reference(seed, n, dp, c):
    q, q_norm, codes, weight, idx = _problem(seed, n, dp, c)
    got = rsq_rerank(q, q_norm, codes, weight, CENTRES, idx, interpret=INTERPRET)
    want = rsq_rerank_reference(q, q_norm, codes, weight, CENTRES, idx)
    assert got.shape == want.shape == (c,)
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= _tolerance(q, q_norm, weight, idx))


@pytest.mark.parametrize("path", BOTH_PATHS)
def test_decodes_layout(path):
    q, q_norm, codes, weight, idx = _problem(3, 40, 64, 12)
    want = _numpy_scores(q, q_norm, codes, weight, idx)
    got = dispatch.rsq_rerank(q, q_norm, codes, weight, CENTRES, idx, **path)
    assert np.all(np.abs(np.asarray(got) - want) <= _tolerance(q, q_norm, weight, idx))


def test_bad_input_named():
    q, q_norm, codes, weight, idx = _problem(0, 10, 64, 4)
    with pytest.raises(ValueError, match="q_rot"):
        rsq_rerank(q[:32], q_norm, codes, weight, CENTRES, idx)
    with pytest.raises(ValueError, match="weight"):
        rsq_rerank_reference(q, q_norm, codes, weight[:5], CENTRES, idx)
    with pytest.raises(ValueError, match="centres"):
        rsq_rerank(q, q_norm, codes, weight, CENTRES[:4], idx)


@pytest.mark.parametrize("n, dp", [(32768, 64), (32768, 128), (524288, 128)])
def test_lowers_for_cuda(n, dp):
    c = 3277  # ParisKV keeps 10% of 32K keys as candidates
    text = lower_for_cuda(
        lambda *a: rsq_rerank(*a),
        jax.ShapeDtypeStruct((dp,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((n, dp // 2), jnp.uint8), jax.ShapeDtypeStruct((n, dp // M), jnp.float32),
        jax.ShapeDtypeStruct((M,), jnp.float32), jax.ShapeDtypeStruct((c,), jnp.int32))
    assert triton_kernels(text) == ["rsq_rerank"]
