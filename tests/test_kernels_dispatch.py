"""Dispatch: which path runs, per-head batching and the merge with the exact part.
(Each kernel's test file checks both paths of its own entry point.)"""
import math

import jax
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.testing import INTERPRET

ON_GPU = jax.default_backend() == "gpu"


def test_kernels_setting_picks_the_path():
    Kernels = dispatch.Kernels
    assert Kernels.AUTO.uses_pallas() == ON_GPU
    assert Kernels.PALLAS.uses_pallas() and Kernels.INTERPRET.uses_pallas()
    assert not Kernels.XLA.uses_pallas() and not Kernels.NATIVE.uses_pallas()
    assert [k for k in Kernels if k.uses_native()] == [Kernels.NATIVE]
    assert Kernels.of("native") is Kernels.NATIVE and Kernels.NATIVE == "native" and repr(Kernels.XLA) == "'xla'"
    for bad in ("triton", ["xla"], None, 1):
        with pytest.raises(ValueError, match=r"cfg\.kernels must be one of \('auto', 'xla', 'pallas', 'interpret', 'native'\)"):
            Kernels.of(bad, "cfg.kernels")


def test_heads_with_exact_part_is_attention_over_the_union():
    """Per KV head: exact keys [0, 20) merged with selected keys gives softmax attention over
    both sets (float64 numpy), on both paths."""
    rng = np.random.default_rng(2)
    h, g, d, n, c = 3, 2, 64, 200, 40
    q = rng.standard_normal((h, g, d)).astype(np.float32)
    k, v = (rng.standard_normal((h, n, d)).astype(np.float32) for _ in range(2))
    idx = np.stack([rng.permutation(np.arange(20, n))[:c] for _ in range(h)]).astype(np.int32)
    mask = rng.random((h, g, c)) < 0.7
    exact = jax.vmap(lambda q, k, v: dispatch.gather_attention(
        q, k, v, np.arange(20, dtype=np.int32), np.ones(20, bool), kernels="xla"))(q, k, v)
    for kw in (dict(kernels="xla"), dict(kernels="interpret" if INTERPRET else "pallas")):
        o, l, _ = dispatch.gather_attention_heads(q, k, v, idx, mask, exact=exact, **kw)
        for head in range(h):
            for row in range(g):
                keys = np.concatenate([np.arange(20), idx[head][mask[head, row]]])
                s = k[head, keys].astype(np.float64) @ q[head, row] / math.sqrt(d)
                w = np.exp(s - s.max())
                want = w @ v[head, keys] / w.sum()
                # O(1) outputs averaged over ≤ 60 keys in float32: error < 1e-5.
                np.testing.assert_allclose(o[head, row] / l[head, row], want, atol=1e-5)
