"""Weight matrices kept in GGUF blocks (``models.quantized``, ``models.native.quantized_matmul``).

References: ``gguf.quants.dequantize`` (the gguf package's own dequantisation) for the
blocks' values, and the decoder on those values as float32 arrays for every product.
A product reorders float32 sums over K ≤ 128 inputs here (1,536 in SmolLM2): each side's
error is at most ~K·eps of the sum of |terms|, so the bound below is 1e-5 of Σ|w·x|.
"""
import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import models
from helpers_tiny_models import tiny_config, write_random_hf_checkpoint
from jaxkv import sharding
from models import native, quantized

FORMATS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
native_only = pytest.mark.skipif(not native.available(), reason=str(native.unavailable_reason()))


def random_blocks(rng, fmt: str, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols/32 · bytes]: random codes, scales (and Q4_1 minima) as llama.cpp writes them."""
    blocks = rng.integers(0, 256, (rows, cols // 32, quantized.BLOCK_BYTES[fmt]), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(0.002, 0.02, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    if fmt == "q4_1":
        blocks[..., 2:4] = rng.uniform(-0.15, 0.0, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def reference_matrix(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks, FORMATS[fmt]).reshape(blocks.shape[0], -1)


def assert_product_close(actual, x, w):
    """actual ≈ x · wᵀ within 1e-5 of Σ|x·w| (see the module docstring)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    np.testing.assert_array_less(np.abs(np.asarray(actual) - x @ w.T), 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_equals_the_gguf_package(fmt):
    blocks = random_blocks(np.random.default_rng(0), fmt, 24, 96)
    matrix = quantized.from_gguf_blocks(blocks, fmt, 24, 96)
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(matrix)), reference_matrix(blocks, fmt))


@native_only
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_kernel_matches_the_dequantised_product(fmt, rows):
    rng = np.random.default_rng(rows)
    blocks = random_blocks(rng, fmt, 70, 128)  # 70 outputs: three pool items, the last partial
    x = rng.standard_normal((rows, 128)).astype(np.float32)
    out = native.quantized_matmul(jnp.asarray(x), jnp.asarray(blocks), q4_1=fmt == "q4_1")
    assert out.shape == (rows, 70) and out.dtype == jnp.float32
    assert_product_close(out, x, reference_matrix(blocks, fmt))


@native_only
def test_kernel_batch_axes_pair_each_input_with_its_matrix():
    """Leading axes (a stacked layer axis, vmap's batch) pair x[i] with blocks[i]."""
    rng = np.random.default_rng(5)
    blocks = np.stack([random_blocks(rng, "q4_1", 40, 64) for _ in range(3)])
    x = rng.standard_normal((3, 2, 64)).astype(np.float32)
    out = jax.vmap(lambda xb, bb: native.quantized_matmul(xb, bb, q4_1=True))(jnp.asarray(x), jnp.asarray(blocks))
    for i in range(3):
        assert_product_close(out[i], x[i], reference_matrix(blocks[i], "q4_1"))


@native_only
def test_kernel_refuses_blocks_of_another_width():
    blocks = jnp.zeros((8, 2 * quantized.BLOCK_BYTES["q8_0"]), jnp.uint8)
    with pytest.raises(Exception, match="K/32 blocks"):
        jax.block_until_ready(native.quantized_matmul(jnp.ones((1, 64)), blocks, q4_1=True))


def _quantized_tiny_params(config, rng, fmt="q4_1"):
    """Random GGUF blocks for every weight matrix of ``config`` (norms at 1), in our layout."""
    shapes = models.param_shapes(config)

    def matrix(shape, n_in):
        rows, cols = (shape if n_in is None else (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in]))))
        m = quantized.from_gguf_blocks(random_blocks(rng, fmt, rows, cols), fmt, rows, cols)
        return quantized.in_our_layout(m, shape, n_in)

    n_in = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
    layers = {name: (quantized.stack([matrix(shape[1:], n_in[name]) for _ in range(config.num_layers)])
                     if name in n_in else jnp.ones(shape, jnp.float32)) for name, shape in shapes["layers"].items()}
    tree = {"embed": matrix(shapes["embed"], None), "final_norm": jnp.ones(shapes["final_norm"]),
            "unembed": matrix(shapes["unembed"], None), "layers": layers}
    return models.params.params_from_dict(tree)


@pytest.fixture(scope="module")
def tiny_quantized():
    config = tiny_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    params = _quantized_tiny_params(config, np.random.default_rng(0))
    return config, params, quantized.dequantize_params(params)


def test_quantized_params_pass_the_shape_check(tiny_quantized):
    config, params, dense = tiny_quantized
    models.params.check_params(config, params, jnp.float32)
    shapes = lambda p: jax.tree.map(lambda a: a.shape, models.params.params_to_dict(p),  # noqa: E731
                                    is_leaf=lambda a: isinstance(a, quantized.QuantizedMatrix))
    assert shapes(params) == shapes(dense)
    assert models.activation_dtype(params) == jnp.float32


def test_decoder_on_blocks_matches_the_dequantised_weights(tiny_quantized):
    """A prompt (XLA over the dequantised blocks) and single-token steps (the native kernel
    where available) give the logits of the same decoder on float32 weights."""
    config, params, dense = tiny_quantized
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, config.vocab_size, (2, 12)), jnp.int32)
    logits = {}
    for name, p in (("blocks", params), ("dense", dense)):
        cache = models.init_cache(config, 2, 16)
        prompt, cache = models.forward(p, config, tokens[:, :9], cache)
        steps = []
        for t in range(9, 12):
            step, cache = models.forward(p, config, tokens[:, t:t + 1], cache)
            steps.append(step)
        logits[name] = np.concatenate([prompt, *steps], axis=1)
    scale = np.abs(logits["dense"]).max()
    np.testing.assert_allclose(logits["blocks"], logits["dense"], rtol=0, atol=1e-5 * scale)


def test_split_layers_join_only_matrices_outside_blocks(tiny_quantized):
    """models.unstack_layers joins q, k and v only where none of them is in GGUF blocks: with
    k in blocks the three stay apart and compute the float32 model's logits; with none in
    blocks they are joined."""
    config, params, dense = tiny_quantized
    mixed = dataclasses.replace(dense, layers=dataclasses.replace(dense.layers, wk=params.layers.wk))
    split = models.unstack_layers(mixed, config.num_layers)
    for layer in split.layers:
        assert isinstance(layer.wk, quantized.QuantizedMatrix) and layer.wq is not None and layer.wqkv is None
    assert all(layer.wqkv is not None for layer in models.unstack_layers(dense, config.num_layers).layers)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, config.vocab_size, (2, 9)), jnp.int32)
    expected = np.asarray(models.forward(dense, config, tokens))
    logits = np.asarray(models.forward(split, config, tokens))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_generate_on_blocks_gives_the_dequantised_tokens(tiny_quantized):
    config, params, dense = tiny_quantized
    prompts = [[5, 9, 13, 17], [21, 3]]
    ours = jaxkv.generate(params, config, prompts, max_new_tokens=6, eos_ids=()).tokens
    assert ours == jaxkv.generate(dense, config, prompts, max_new_tokens=6, eos_ids=()).tokens


def test_checkpoint_of_blocks_holds_the_dequantised_weights(tiny_quantized, tmp_path):
    config, params, dense = tiny_quantized
    models.save(tmp_path / "ckpt", config, params)
    _, restored = models.restore(tmp_path / "ckpt")
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(dense)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_blocks_are_not_sharded(tiny_quantized):
    config, params, _ = tiny_quantized
    mesh = sharding.make_mesh(1, 1)
    with pytest.raises(ValueError, match="GGUF blocks"):
        sharding.shard_params(params, config, mesh)


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="only"):
        quantized.from_gguf_blocks(np.zeros((4, 20), np.uint8), "q5_k", 4, 32)
    with pytest.raises(ValueError, match="must be uint8"):
        quantized.from_gguf_blocks(np.zeros((4, 21), np.uint8), "q4_1", 4, 32)
    m = quantized.from_gguf_blocks(np.zeros((4, 20), np.uint8), "q4_1", 4, 32)
    with pytest.raises(ValueError, match="cannot stand for"):
        quantized.in_our_layout(m, (32, 2, 3), 1)
    with pytest.raises(ValueError, match="input axes"):
        quantized.contract(jnp.ones((1, 32)), quantized.in_our_layout(m, (32, 4), 1), 2, "")


def test_keep_quantized_needs_a_gguf_file(tmp_path):
    write_random_hf_checkpoint(tmp_path, tiny_config())
    with pytest.raises(models.ModelError, match="gguf files only"):
        models.load(tmp_path, keep_quantized=True)


def test_smollm2_blocks_are_its_dequantised_weights():
    """The bundled GGUF: every kept block dequantises to the float32 load's array exactly."""
    path = models.default_model_path()
    config, dense, _ = models.load(path)
    _, params, _ = models.load(path, keep_quantized=True)
    models.params.check_params(config, params, jnp.float32)
    kept = [x for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quantized.QuantizedMatrix))
            if isinstance(x, quantized.QuantizedMatrix)]
    assert {m.fmt for m in kept} == {"q4_1", "q8_0"} and len(kept) == 8  # 7 stacked fields + the embedding
    for a, b in zip(jax.tree.leaves(quantized.dequantize_params(params)), jax.tree.leaves(dense)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sum(m.nbytes for m in kept) < 0.2 * sum(x.nbytes for x in jax.tree.leaves(dense))
