"""Decoder parity with transformers on tiny random Llama-3.1, Qwen2 and Qwen3 models.

Tolerance 1e-4 (max abs logit): both sides compute in float32 with logits of
order 1-5; the measured gap is ~4e-6 (summation order, exp/rsqrt ulps), so
1e-4 leaves a 25x margin yet catches any real mistake (a wrong norm, bias,
RoPE frequency or head mapping moves logits by >1e-2; see the sensitivity
test below).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import models
from helpers_tiny_models import TINY_HF_CONFIGS, VOCAB, reload_transformers_model, save_transformers_model
from models.rope import inverse_frequencies

TOL = 1e-4
BATCH, PROMPT = 2, 200
PREFILL = 170  # then 30 decode steps; the padded test reuses the same compiled shapes

forward = jax.jit(models.forward, static_argnums=1)


@pytest.fixture(scope="module")
def build_reference(tmp_path_factory):
    """kind -> (kind, directory, tokens [B, T], transformers float32 logits [B, T, V]), built once per kind."""
    built = {}

    def build(kind):
        if kind not in built:
            directory = save_transformers_model(kind, tmp_path_factory.mktemp(kind))
            tokens = np.random.default_rng(1).integers(0, VOCAB, (BATCH, PROMPT))
            with torch.no_grad():
                logits = reload_transformers_model(directory)(torch.tensor(tokens)).logits.numpy()
            built[kind] = kind, directory, tokens, logits
        return built[kind]

    return build


@pytest.fixture(scope="module", params=sorted(TINY_HF_CONFIGS))
def reference(request, build_reference):
    return build_reference(request.param)


@pytest.fixture(scope="module")
def loaded(reference):
    _, directory, _, _ = reference
    return models.load_hf(directory)


def test_prefill_logits_match_transformers(reference, loaded):
    _, _, tokens, expected = reference
    config, params = loaded
    logits = forward(params, config, jnp.asarray(tokens, jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == expected.shape
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=TOL)


def test_prefill_then_decode_matches_full_forward(reference, loaded):
    _, _, tokens, expected = reference
    config, params = loaded
    split = PREFILL
    cache = models.init_cache(config, BATCH, 256)
    logits, cache = forward(params, config, jnp.asarray(tokens[:, :split], jnp.int32), cache)
    steps = [logits]
    for pos in range(split, PROMPT):
        step_positions = jnp.full((BATCH, 1), pos, jnp.int32)
        logits, cache = forward(params, config, jnp.asarray(tokens[:, pos:pos + 1], jnp.int32), cache,
                                positions=step_positions)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=0, atol=TOL)


def test_right_padded_batch_matches_rows_alone(reference, loaded):
    """Rows of different lengths, right-padded with junk: each row's real logits equal its own run."""
    _, _, tokens, expected = reference
    config, params = loaded
    lengths = (PREFILL, 120)
    padded = tokens[:, :PREFILL].copy()
    padded[1, 120:] = 7  # junk after row 1's end, written to the cache but never attended by row 1
    cache = models.init_cache(config, BATCH, 256)
    logits, cache = forward(params, config, jnp.asarray(padded, jnp.int32), cache)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[row, :n]), expected[row, :n], rtol=0, atol=TOL)
    # Next token for each row at its own position overwrites the junk at index 120 of row 1.
    next_positions = jnp.asarray([[n] for n in lengths], jnp.int32)
    next_tokens = jnp.asarray([[tokens[row, n]] for row, n in enumerate(lengths)], jnp.int32)
    logits, _ = forward(params, config, next_tokens, cache, positions=next_positions)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[row, 0]), expected[row, n], rtol=0, atol=TOL)


def test_split_layers_with_joined_projections_match_transformers(reference, loaded):
    """models.unstack_layers joins each layer's q, k and v into one matrix:
    the logits stay transformers' (Llama-3.1 with 2 query heads per KV head, Qwen2 with
    biases and one KV head, Qwen3 with q/k norms), so each query head still meets its KV head."""
    _, _, tokens, expected = reference
    config, params = loaded
    split = models.unstack_layers(params, config.num_layers)
    layer = split.layers[0]
    assert layer.wq is None and layer.wk is None and layer.wv is None
    group = config.num_heads // config.num_kv_heads
    assert layer.wqkv.shape == (config.hidden_size, config.num_kv_heads, group + 2, config.head_dim)
    assert (layer.bqkv is not None) == config.attention_bias
    logits = forward(split, config, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=TOL)


def test_per_layer_callables_match_scan(build_reference):
    """forward_hidden's Python-loop path (one callable per layer) computes what the scan path does.

    On Qwen2 (biases present, o_proj bias and q/k norms absent: slicing must handle None parts).
    """
    _, directory, tokens, _ = build_reference("qwen2")
    config, params = models.load_hf(directory)
    tokens = jnp.asarray(tokens[:, :64], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), tokens.shape)
    calls = []

    def attention(q, k, v, pos, state):
        calls.append(q.shape)
        return models.dense_causal_attention(q, *_as_cache(k, v), pos, pos), state + 1

    def stacked_attention(q, k, v, pos, states, layer):
        out, _ = attention(q, k, v, pos, 0)
        return out, states.at[layer].add(1)

    run = jax.jit(models.forward_hidden, static_argnums=(1, 5))
    scanned, scan_states = run(params, config, tokens, positions, jnp.zeros(config.num_layers), stacked_attention)
    looped, loop_states = run(params, config, tokens, positions, (0,) * config.num_layers,
                              (attention,) * config.num_layers)
    np.testing.assert_allclose(np.asarray(looped), np.asarray(scanned), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(loop_states), np.ones(config.num_layers))
    np.testing.assert_array_equal(np.asarray(scan_states), np.ones(config.num_layers))
    assert calls[-1] == (BATCH, 64, config.num_heads, config.head_dim)


def test_parity_is_sensitive_to_rope_scaling(build_reference):
    """The reference really exercises Llama-3.1 scaling: plain RoPE misses it by far more than TOL."""
    _, directory, tokens, expected = build_reference("llama31")
    config, params = models.load_hf(directory)
    unscaled = dataclasses.replace(config, rope_scaling=None)
    logits = forward(params, unscaled, jnp.asarray(tokens, jnp.int32))
    assert np.abs(np.asarray(logits) - expected).max() > 100 * TOL


@pytest.mark.parametrize("kind", sorted(TINY_HF_CONFIGS))
def test_rope_frequencies_match_transformers(kind):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, kwargs = TINY_HF_CONFIGS[kind]
    hf_config = AutoConfig.for_model(model_type, **kwargs)
    config = models.ModelConfig.from_hf(hf_config.to_dict())
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        expected = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    # float32 frequencies: 1e-6 relative is a few ulps.
    np.testing.assert_allclose(inverse_frequencies(config), np.asarray(expected), rtol=1e-6, atol=0)


def test_qwen3_checkpoint_is_sharded(build_reference):
    _, directory, _, _ = build_reference("qwen3")
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("kind", sorted(TINY_HF_CONFIGS))
def test_config_round_trips_through_hf_dict(kind):
    from transformers import AutoConfig

    model_type, kwargs = TINY_HF_CONFIGS[kind]
    config = models.ModelConfig.from_hf(AutoConfig.for_model(model_type, **kwargs).to_dict())
    assert models.ModelConfig.from_hf(config.to_hf()) == config
    # transformers reads our dict back to the same model.
    assert models.ModelConfig.from_hf(AutoConfig.for_model(**config.to_hf()).to_dict()) == config
    hash(config)


def test_old_and_new_rope_keys_give_the_same_config():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    base = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                max_position_embeddings=512)
    old = models.ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": scaling})
    new = models.ModelConfig.from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    # Older configs spell rope_type as "type".
    legacy_scaling = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    legacy_type_key = models.ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": legacy_scaling})
    assert old == new == legacy_type_key
    assert old.rope_theta == 5e5 and dict(old.rope_scaling)["rope_type"] == "llama3"



def test_bfloat16_params_compute_in_bfloat16(build_reference):
    """bf16 weights: hidden states stay bf16, logits come out float32 and near the float32 reference.

    bf16 keeps 8 significant bits (0.4% relative rounding per op); over 2 layers
    with logits up to ~5 the measured error is RMS 0.022, max 0.16 (all three
    families). Bounds at ~2.5x that: a dtype bug (e.g. softmax in bf16, or
    float32 weights silently kept) shows as a failed dtype check or a larger error.
    """
    _, directory, tokens, expected = build_reference("qwen3")
    config, params = models.load_hf(directory, dtype=jnp.bfloat16)
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def self_attention(q, k, v, pos, states, layer):
        return models.dense_causal_attention(q, *_as_cache(k, v), pos, pos), states

    hidden, _ = jax.jit(models.forward_hidden, static_argnums=(1, 5))(
        params, config, tokens, positions, (), self_attention)
    assert hidden.dtype == jnp.bfloat16
    logits = models.lm_head(params, config, hidden)
    assert logits.dtype == jnp.float32
    error = np.asarray(logits) - expected
    assert np.sqrt(np.mean(error**2)) < 0.06 and np.abs(error).max() < 0.4


def _reference_attention(q, k, v, q_pos):
    """float64 numpy with explicit repeat_kv; keys at positions 0..S-1; k, v position-major [B, S, Hkv, hd]."""
    hq, hkv, hd = q.shape[2], k.shape[2], q.shape[3]
    k_rep, v_rep = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q.astype(np.float64), k_rep) / np.sqrt(hd)
    scores = np.where(np.arange(k.shape[1])[None, None, None, :] <= q_pos[:, None, :, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", weights, v_rep)


def _attention_inputs(t, s, offsets, seed=0):
    rng = np.random.default_rng(seed)
    b, hq, hkv, hd = len(offsets), 6, 2, 8
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((b, t, hq, hd), (b, s, hkv, hd), (b, s, hkv, hd)))
    q_pos = np.stack([np.arange(t) + o for o in offsets]).astype(np.int32)  # rows at different offsets
    return q, k, v, q_pos


def _as_cache(k, v):
    """Position-major keys and values [B, S, Hkv, hd] in models.KVCache's layout."""
    return models.transpose_keys(jnp.asarray(k).swapaxes(1, 2)), jnp.asarray(v).swapaxes(1, 2)


# (query_block, key_block): one block each; queries blocked; keys blocked with a
# shifted last block (45 = 5·8 + 5); key_block the cache; the default (the whole cache here).
@pytest.mark.parametrize("query_block,key_block", [(512, 1024), (8, 1024), (512, 8), (8, 8), (512, 45), (8, None)])
def test_causal_attention_matches_numpy_reference(query_block, key_block):
    """GQA head mapping (query head h -> KV head h // G), causal mask by position, query and key blocking.

    1e-5 covers float32 rounding of O(1) outputs.
    """
    q, k, v, q_pos = _attention_inputs(t=37, s=45, offsets=(3, 8))
    expected = _reference_attention(q, k, v, q_pos)
    dense = models.dense_causal_attention(jnp.asarray(q), *_as_cache(k, v), jnp.asarray(q_pos),
                                          jnp.arange(45, dtype=jnp.int32), query_block=query_block)
    prefix = models.prefix_causal_attention(jnp.asarray(q), *_as_cache(k, v), jnp.asarray(q_pos),
                                            query_block=query_block, key_block=key_block)
    np.testing.assert_allclose(np.asarray(dense), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(prefix), expected, rtol=0, atol=1e-5)


def test_prefix_causal_attention_reads_no_block_past_the_last_query():
    """Keys in blocks after the one holding the last query position are never read: NaN there changes nothing."""
    q, k, v, q_pos = _attention_inputs(t=9, s=45, offsets=(0, 12))  # last position 20: blocks of 8 → keys 0..23
    expected = _reference_attention(q, k[:, :24], v[:, :24], q_pos)
    k[:, 24:], v[:, 24:] = np.nan, np.nan
    out = models.prefix_causal_attention(jnp.asarray(q), *_as_cache(k, v), jnp.asarray(q_pos),
                                         key_block=8)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-5)


def test_prefix_causal_attention_rejects_an_empty_key_block():
    q, k, v, q_pos = _attention_inputs(t=3, s=8, offsets=(0,))
    with pytest.raises(models.ModelError, match="key_block must be >= 1"):
        models.prefix_causal_attention(jnp.asarray(q), *_as_cache(k, v), jnp.asarray(q_pos), key_block=0)


def _hf_greedy(model, prompt, new_tokens, eos_ids):
    """transformers' greedy continuation, cut before its first EOS (jaxkv excludes EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=list(eos_ids) or None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[:cut]


def test_greedy_generation_matches_transformers(reference, loaded):
    """24 greedy tokens, token for token (logits agree to ~3e-6, far below the top-2 gaps)."""
    import jaxkv

    _, directory, tokens, _ = reference
    config, params = loaded
    prompt = tokens[0, :20].tolist()
    ours = jaxkv.generate(params, config, [prompt], max_new_tokens=24).tokens[0]
    assert ours == _hf_greedy(reload_transformers_model(directory), prompt, 24, config.eos_token_ids)



# ----------------------------------------------------------------------------
# bfloat16 against transformers' bfloat16 forward.
#
# bfloat16 keeps 8 significant bits (unit roundoff 2^-8 ≈ 0.4 %): a logit of 5 moves by
# up to 0.02 when the output alone is rounded, and each layer rounds ~10 intermediates
# (norms, projections, scores, softmax, MLP). Two correct bfloat16 forwards that round
# at different points therefore differ by ~0.1 at the worst logit of these models
# (measured 0.09-0.16), the size of either one's distance from the float32 forward
# (measured 0.13-0.20). No fixed tolerance separates that from a bug, so the tests
# measure transformers' own bfloat16 error against its float32 forward (its bfloat16
# model reloaded from the same float32 checkpoint) and hold jaxkv's bfloat16 forward to
# it: worst logit within 1.5x, mean within 1.25x (measured ratios 0.76-1.07 and
# 0.99-1.03). A floor (a quarter of transformers' mean error) checks that jaxkv did
# round, i.e. computed in bfloat16.
BF16_MAX_RATIO, BF16_MEAN_RATIO, BF16_FLOOR_RATIO = 1.5, 1.25, 0.25


@pytest.fixture(scope="module")
def bfloat16_reference(build_reference):
    """kind -> (directory, tokens, float32 logits, transformers' bfloat16 logits as float32)."""
    built = {}

    def build(kind):
        if kind not in built:
            _, directory, tokens, logits = build_reference(kind)
            with torch.no_grad():
                half = reload_transformers_model(directory, "bfloat16")
                assert half.model.rotary_emb.inv_freq.dtype == torch.float32  # reloaded, not cast
                built[kind] = directory, tokens, logits, half(torch.tensor(tokens)).logits.float().numpy()
        return built[kind]

    return build


def _assert_as_close_as_transformers_bfloat16(ours, full, half):
    """jaxkv's bfloat16 logits are as close to the float32 ones as transformers' bfloat16 logits are."""
    ours_err, their_err = np.abs(ours - full), np.abs(half - full)
    assert ours_err.max() <= BF16_MAX_RATIO * their_err.max(), (ours_err.max(), their_err.max())
    assert ours_err.mean() <= BF16_MEAN_RATIO * their_err.mean(), (ours_err.mean(), their_err.mean())
    assert ours_err.mean() >= BF16_FLOOR_RATIO * their_err.mean(), "no bfloat16 rounding: computed in float32?"


@pytest.mark.parametrize("kind", sorted(TINY_HF_CONFIGS))
def test_bfloat16_forward_matches_transformers_bfloat16(bfloat16_reference, kind):
    directory, tokens, full, half = bfloat16_reference(kind)
    config, params, _ = models.load(directory, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    logits = forward(params, config, jnp.asarray(tokens, jnp.int32))  # float32 from bfloat16 hidden states
    _assert_as_close_as_transformers_bfloat16(np.asarray(logits), full, half)


def test_bfloat16_decode_with_cache_matches_transformers_bfloat16(bfloat16_reference):
    """Llama-3.1: prefill, then one token at a time through the bfloat16 cache (held as bits)."""
    directory, tokens, full, half = bfloat16_reference("llama31")
    config, params, _ = models.load(directory, jnp.bfloat16)
    cache = models.init_cache(config, BATCH, PROMPT, jnp.bfloat16)
    assert cache.dtype == jnp.bfloat16 and cache.k.dtype == models.ROW_BITS
    logits, cache = forward(params, config, jnp.asarray(tokens[:, :PREFILL], jnp.int32), cache)
    steps = [logits]
    for pos in range(PREFILL, PROMPT):
        logits, cache = forward(params, config, jnp.asarray(tokens[:, pos:pos + 1], jnp.int32), cache,
                                positions=jnp.full((BATCH, 1), pos, jnp.int32))
        steps.append(logits)
    _assert_as_close_as_transformers_bfloat16(np.concatenate(steps, axis=1), full, half)
