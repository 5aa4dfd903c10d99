"""RSQ-IP: Lloyd–Max levels of the Beta prior, 4-bit codes, calibrated inner products."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import rsq

# Jitted once per (m, levels), levels as hashable tuples: op-by-op dispatch
# dominates these tests' time otherwise.
_jitted_encode = jax.jit(rsq.encode, static_argnums=(2, 3, 4))
_jitted_estimate = jax.jit(rsq.estimate, static_argnums=(3, 4))


def _encode(y, key_norm, m, thresholds, centres):
    return _jitted_encode(y, key_norm, m, tuple(thresholds), tuple(centres))


def _estimate(codes, q_rot, q_norm, m, centres):
    return _jitted_estimate(codes, q_rot, q_norm, m, tuple(centres))

# Converged Lloyd–Max levels of |u_j|, u uniform on S^7 (m = 8), to 4 decimals (the official
# table, OFFICIAL_M8_*, is Lloyd's algorithm stopped early).
CONVERGED_M8_THRESHOLDS = [0.0853, 0.1716, 0.2603, 0.3528, 0.4516, 0.5612, 0.6921]
CONVERGED_M8_CENTRES = [0.0425, 0.1280, 0.2152, 0.3053, 0.4003, 0.5030, 0.6193, 0.7648]


def test_m8_levels_match_converged_values_to_4_decimals():
    thresholds, centres = rsq.lloyd_max_levels(8)
    # "to 4 decimals": rounding the derived value gives the published one.
    np.testing.assert_array_equal(np.round(thresholds, 4), CONVERGED_M8_THRESHOLDS)
    np.testing.assert_array_equal(np.round(centres, 4), CONVERGED_M8_CENTRES)


def test_m8_levels_within_5e3_of_official_table():
    thresholds, centres = rsq.lloyd_max_levels(8)
    np.testing.assert_allclose(thresholds, rsq.OFFICIAL_M8_THRESHOLDS, atol=5e-3)
    np.testing.assert_allclose(centres, rsq.OFFICIAL_M8_CENTRES, atol=5e-3)


def test_m3_prior_is_uniform_so_levels_are_the_uniform_quantiser():
    # m = 3: |u_j| is uniform on [0, 1] (Archimedes), whose Lloyd–Max quantiser is exact.
    thresholds, centres = rsq.lloyd_max_levels(3)
    np.testing.assert_allclose(thresholds, np.arange(1, 8) / 8, atol=1e-10)
    np.testing.assert_allclose(centres, (2 * np.arange(8) + 1) / 16, atol=1e-10)


def _closed_form_centroid(lo, hi, m):
    """Conditional mean of t on [lo, hi] under f(t) ∝ (1 − t²)^((m−3)/2), m ∈ {2, 5}."""
    if m == 2:  # f ∝ 1/√(1 − t²)
        return (np.sqrt(1 - lo**2) - np.sqrt(1 - hi**2)) / (np.arcsin(hi) - np.arcsin(lo))
    assert m == 5  # f ∝ 1 − t²

    def moment(t):
        return t**2 / 2 - t**4 / 4

    def mass(t):
        return t - t**3 / 3

    return (moment(hi) - moment(lo)) / (mass(hi) - mass(lo))


@pytest.mark.parametrize("m", [2, 5])
def test_levels_satisfy_lloyd_max_conditions_in_closed_form(m):
    thresholds, centres = rsq.lloyd_max_levels(m)
    edges = np.concatenate([[0.0], thresholds, [1.0]])
    # Centres are the conditional means of their cells (closed form, no quadrature) and
    # thresholds the midpoints; 1e-10 is far above float64 quadrature error (~1e-15).
    np.testing.assert_allclose(centres, _closed_form_centroid(edges[:-1], edges[1:], m), atol=1e-10)
    np.testing.assert_allclose(thresholds, (centres[:-1] + centres[1:]) / 2, atol=1e-10)


def test_levels_need_m_at_least_2_and_official_table_needs_m8():
    with pytest.raises(ValueError, match="m"):
        rsq.lloyd_max_levels(1)
    with pytest.raises(ValueError, match="official_levels"):
        rsq.magnitude_levels(4, official=True)
    np.testing.assert_array_equal(rsq.magnitude_levels(8, True)[1], rsq.OFFICIAL_M8_CENTRES)


def test_nibble_packing_low_nibble_is_even_coordinate():
    codes = jnp.asarray([[1, 2, 15, 0, 7, 9]], jnp.uint8)
    packed = rsq.pack_nibbles(codes)
    np.testing.assert_array_equal(packed, [[1 | 2 << 4, 15, 7 | 9 << 4]])
    np.testing.assert_array_equal(rsq.unpack_nibbles(packed), codes)


def _unit_rows(key, n, p):
    y = jax.random.normal(key, (n, p))
    return y / jnp.linalg.norm(y, axis=-1, keepdims=True)


def _weights_f32(y, key_norm, m, thresholds, centres):
    """The unquantised w_b = ‖k‖·r_b/α_b, in float64 numpy from the definition."""
    blocks = np.asarray(y, np.float64).reshape(y.shape[0], -1, m)
    r = np.linalg.norm(blocks, axis=-1)
    u = blocks / np.where(r > 0, r, 1)[..., None]
    v = np.sign(np.where(u >= 0, 1, -1)) * np.asarray(centres)[np.searchsorted(thresholds, np.abs(u), side="right")]
    alpha = np.sum(v * u, axis=-1)
    return np.where(r > 0, np.asarray(key_norm)[:, None] * r / np.where(r > 0, alpha, 1), 0)


def test_codes_hold_sign_and_lloyd_max_cell_of_each_coordinate():
    m, p = 8, 64
    thresholds, centres = rsq.lloyd_max_levels(m)
    y = _unit_rows(jax.random.key(0), 50, p)
    codes = _encode(y, jnp.ones(50), m, thresholds, centres)
    blocks = np.asarray(y, np.float64).reshape(50, -1, m)
    u = (blocks / np.linalg.norm(blocks, axis=-1, keepdims=True)).reshape(50, p)
    assert codes.signs.shape == (50, p // m) and codes.magnitudes.shape == (50, 3, p // 8)
    nonnegative = (np.asarray(codes.signs)[:, :, None] >> np.arange(m)) & 1
    np.testing.assert_array_equal(nonnegative.reshape(50, p), (u >= 0).astype(np.uint8))
    np.testing.assert_array_equal(rsq.magnitude_cells(codes.magnitudes),
                                  np.searchsorted(thresholds, np.abs(u), side="right"))
    # The kernel's nibbles hold the same cell with the sign bit set for negative coordinates.
    nibbles, _ = rsq.kernel_layout(codes, m)
    unpacked = np.asarray(rsq.unpack_nibbles(nibbles))
    np.testing.assert_array_equal(unpacked >> 3, (u < 0).astype(np.uint8))
    np.testing.assert_array_equal(unpacked & 7, np.searchsorted(thresholds, np.abs(u), side="right"))


def test_magnitude_bit_planes_round_trip_every_cell():
    cells = jnp.asarray(np.random.default_rng(0).integers(0, 8, (5, 64)), jnp.uint8)
    signs = jnp.full((5, 8), 0xFF, jnp.uint8)
    planes = jnp.stack([rsq._pack_bits((cells >> i) & 1) for i in range(3)], axis=-2)
    np.testing.assert_array_equal(rsq.magnitude_cells(planes), cells)
    centres = np.arange(8) / 10
    np.testing.assert_array_equal(rsq.dequantise(signs, planes, 8, centres), centres[np.asarray(cells)].astype(np.float32))


def test_weights_are_a_bf16_scale_times_4_bit_multiples_within_half_a_step():
    m, p, n = 8, 64, 200
    thresholds, centres = rsq.lloyd_max_levels(m)
    y = _unit_rows(jax.random.key(7), n, p)
    key_norm = jnp.exp(jax.random.normal(jax.random.key(8), (n,)) * 3)  # norms over e^±9
    codes = _encode(y, key_norm, m, thresholds, centres)
    exact = _weights_f32(y, key_norm, m, thresholds, centres)
    got = np.asarray(rsq.subspace_weights(codes, p // m), np.float64)
    step = np.asarray(codes.scale, np.float64)[:, None]
    # Rounding to the nearest multiple of the (bf16-rounded) scale: half a step,
    # plus float32 rounding of the inputs (1e-5 relative).
    assert np.all(np.abs(got - exact) <= 0.5 * step + 1e-5 * exact)
    # The largest weight of every key is 15 steps, to bf16's relative precision (2^-8).
    np.testing.assert_allclose(got.max(axis=1), exact.max(axis=1), rtol=2**-8)


def test_estimate_is_exact_up_to_weight_rounding_when_query_subspaces_are_parallel_to_the_key():
    # With q_b = c_b·u_b the ratio ⟨v_b, q_b⟩/⟨v_b, u_b⟩ is c_b whatever the code v_b,
    # so the calibrated estimate carries no quantisation error but the weights' own.
    m, p, n = 8, 64, 40
    thresholds, centres = rsq.lloyd_max_levels(m)
    y = _unit_rows(jax.random.key(1), n, p)
    c = jax.random.normal(jax.random.key(2), (n, p // m, 1))
    q = (y.reshape(n, -1, m) * c).reshape(n, p)
    codes = _encode(y, 3.0 * jnp.ones(n), m, thresholds, centres)
    got = jax.vmap(lambda row, qq: _estimate(jax.tree.map(lambda x: x[None], row), qq, 2.0, m, centres)[0])(
        codes, q)
    # Exact with the stored weights: Σ_b w_b·c_b·r_b... = ‖q‖·Σ_b w_b·(r_b·c_b)/r_b·r_b.
    weights = np.asarray(rsq.subspace_weights(codes, p // m), np.float64)
    r = np.linalg.norm(np.asarray(y, np.float64).reshape(n, -1, m), axis=-1)
    alpha = 3.0 * r / _weights_f32(y, 3.0 * np.ones(n), m, thresholds, centres)
    expected = 2.0 * np.sum(weights * alpha * np.asarray(c[..., 0]) * r, axis=-1)
    # float32 sums of 64 terms of size ≤ 6: 1e-5 relative is ample.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m, p", [(8, 64), (8, 128), (2, 32), (4, 64)])
def test_estimate_is_the_float64_sum_over_the_coded_coordinates(m, p):
    # ‖q‖·Σ_p sign_p·centre[cell_p]·w_(p // m)·q_p, sign and cell taken from the key itself.
    n = 300
    thresholds, centres = rsq.lloyd_max_levels(m)
    y = _unit_rows(jax.random.key(11), n, p)
    q = _unit_rows(jax.random.key(12), 1, p)[0]
    codes = _encode(y, 1.0 + jnp.arange(n) / n, m, thresholds, centres)
    u = np.asarray(y, np.float64).reshape(n, -1, m)
    u = (u / np.linalg.norm(u, axis=-1, keepdims=True)).reshape(n, p)
    v = np.where(u >= 0, 1.0, -1.0) * np.asarray(centres, np.float64)[np.searchsorted(thresholds, np.abs(u), side="right")]
    weights = np.repeat(np.asarray(rsq.subspace_weights(codes, p // m), np.float64), m, axis=1)
    want = 1.7 * np.sum(v * weights * np.asarray(q, np.float64), axis=1)
    got = np.asarray(_estimate(codes, q, 1.7, m, centres), np.float64)
    # float32 sums of p terms, each ≤ max weight: a few ulps of the largest term.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * p * np.max(np.abs(weights)))


def test_zero_subspace_gets_zero_weight_not_nan():
    thresholds, centres = rsq.lloyd_max_levels(8)
    y = jnp.zeros((1, 16)).at[0, 3].set(1.0)  # second subspace all zero
    codes = _encode(y, jnp.ones(1), 8, thresholds, centres)
    weight = rsq.subspace_weights(codes, 2)
    assert np.isfinite(np.asarray(weight)).all() and weight[0, 1] == 0.0 and weight[0, 0] > 0


def test_bytes_per_key_is_under_15_percent_of_bf16_kv():
    # d = 64: 8 sign bytes + 24 magnitude bytes + 2 (scale) + 4 (weights) = 38 of 256.
    assert rsq.bytes_per_key(64, 8) == 38 and rsq.bytes_per_key(128, 8) == 74
    codes = rsq.empty_codes(10, 128, 8)
    assert sum(x.nbytes for x in jax.tree.leaves(codes)) == 10 * 74
    assert 74 / (2 * 2 * 128) < 0.15


@pytest.mark.parametrize("p", [16, 64, 128])
def test_record_holds_magnitudes_weights_and_scale_bytes_in_that_order(p):
    # The CPU rerank reads a record at fixed offsets: planes at 0, weight codes at 3P/8, the
    # scale's little-endian bfloat16 in the last two bytes.
    rng = np.random.default_rng(p)
    b = p // 8
    signs = rng.integers(0, 256, (7, b), np.uint8)
    magnitudes = rng.integers(0, 256, (7, 3, p // 8), np.uint8)
    weight_codes = rng.integers(0, 256, (7, -(-b // 2)), np.uint8)
    scale = np.array([0.0, 1.5, 3e-39, 6e4, 0.0371, 1e-3, 2.0 ** -130], jnp.bfloat16)  # subnormals too
    codes = rsq.pack_codes(jnp.asarray(signs), jnp.asarray(magnitudes), jnp.asarray(scale), jnp.asarray(weight_codes))
    record = np.asarray(codes.record)
    assert record.shape == (7, rsq.bytes_per_key(p, 8) - b)
    np.testing.assert_array_equal(record[:, :3 * p // 8], magnitudes.reshape(7, -1))
    np.testing.assert_array_equal(record[:, 3 * p // 8:-2], weight_codes)
    np.testing.assert_array_equal(record[:, -2:], scale.view(np.uint8).reshape(7, 2))
    # The parts read back exactly, also from gathered rows.
    rows = jnp.asarray([4, 0, 6])
    taken = jax.tree.map(lambda x: x[rows], codes)
    np.testing.assert_array_equal(taken.magnitudes, magnitudes[[4, 0, 6]])
    np.testing.assert_array_equal(taken.weight_codes, weight_codes[[4, 0, 6]])
    np.testing.assert_array_equal(np.asarray(taken.scale).view(np.uint16), scale[[4, 0, 6]].view(np.uint16))
    np.testing.assert_array_equal(taken.signs, signs[[4, 0, 6]])


@pytest.mark.parametrize("official", [False, True])
def test_estimate_is_calibrated_and_highly_correlated_at_m8(official):
    m, p, n = 8, 128, 20_000
    thresholds, centres = rsq.magnitude_levels(m, official)
    q = _unit_rows(jax.random.key(4), 1, p)[0]
    # Keys with a spread of true inner products (cosines from −0.9 to 0.9 with q).
    noise = _unit_rows(jax.random.key(5), n, p)
    noise = noise - (noise @ q)[:, None] * q
    noise = noise / jnp.linalg.norm(noise, axis=-1, keepdims=True)
    cos = jnp.linspace(-0.9, 0.9, n)
    y = cos[:, None] * q + jnp.sqrt(1 - cos**2)[:, None] * noise
    codes = _encode(y, jnp.ones(n), m, thresholds, centres)
    est = np.asarray(_estimate(codes, q, 1.0, m, centres), np.float64)
    true = np.asarray(y @ q, np.float64)
    err = est - true
    assert np.corrcoef(est, true)[0, 1] > 0.95
    # Unbiased: mean error within 4 standard errors of 0 ...
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(n)
    # ... and no shrinkage: regressing est on true gives slope 1 (4 standard errors).
    slope = np.polyfit(true, est, 1)[0]
    slope_se = err.std() / (true.std() * np.sqrt(n))
    assert abs(slope - 1) < 4 * slope_se
