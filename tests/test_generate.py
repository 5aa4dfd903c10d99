"""generate(): batching, determinism, EOS, sampling, sparse == dense when reading all, errors."""
import importlib

import jax
import numpy as np
import pytest

import jaxkv
import models
from jaxkv.attention import topk
from jaxkv.cache import CacheConfig
from models.params import init_params

CONFIG = models.ModelConfig(
    model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True,
    attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def params():
    # std 0.02 init makes every logit nearly equal; scale up so greedy choices are clear-cut.
    p = init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, p)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in lengths]


def test_batch_of_different_lengths_equals_one_at_a_time(params):
    prompts = _prompts([5, 17, 9])
    batch = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=8, eos_ids=(), prefill_chunk=8)
    for prompt, tokens in zip(prompts, batch.tokens):
        alone = jaxkv.generate(params, CONFIG, [prompt], max_new_tokens=8, eos_ids=(), prefill_chunk=8)
        assert alone.tokens[0] == tokens
        assert len(tokens) == 8


def test_greedy_matches_step_by_step_argmax_of_the_full_forward(params):
    prompt = _prompts([11])[0]
    out = jaxkv.generate(params, CONFIG, [prompt], max_new_tokens=6, eos_ids=())
    seq = list(prompt)
    for _ in range(6):
        logits = models.forward(params, CONFIG, np.asarray([seq], np.int32))
        seq.append(int(np.argmax(logits[0, -1])))
    assert out.tokens[0] == seq[len(prompt):]


def test_stops_at_eos_per_row(params):
    prompts = _prompts([7, 12], seed=3)
    free = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=10, eos_ids=())
    eos = free.tokens[0][3]  # make the 4th token of row 0 an EOS
    stopped = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=10, eos_ids=(eos,))
    for free_row, stopped_row in zip(free.tokens, stopped.tokens):
        cut = free_row.index(eos) if eos in free_row else 10
        assert stopped_row == free_row[:cut]
    assert len(stopped.tokens[0]) <= 3


def test_sampling_is_seeded_and_respects_top_k(params):
    prompts = _prompts([6, 6], seed=5)
    a = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=12, temperature=1.0, seed=7, eos_ids=())
    b = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=12, temperature=1.0, seed=7, eos_ids=())
    assert a.tokens == b.tokens
    one = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=12, temperature=1.0, top_k=1, eos_ids=())
    greedy = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=12, eos_ids=())
    assert one.tokens == greedy.tokens  # top_k = 1 leaves only the argmax


@pytest.mark.parametrize("lengths", [[40, 23], [3]])
def test_sparse_generate_reading_everything_equals_dense(params, lengths):
    prompts = _prompts(lengths, seed=9)
    dense = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=20, eos_ids=())
    method = topk.TopKConfig(top_k=256, sink=2, local=4, buffer=3)
    sparse = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=20, eos_ids=(), method="topk",
                            method_config=method, cache_config=CacheConfig(dense_threshold=0))
    assert sparse.tokens == dense.tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[1, 97]]), "token id 97 outside the vocabulary"),
    (dict(prompts=[[1, -1]]), "token id -1 outside the vocabulary"),
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (dict(max_new_tokens=600), "exceeds the model's max_position_embeddings = 512"),
    (dict(method="nope"), "unknown method 'nope'"),
    (dict(method="topk", method_config=CacheConfig()), "must be a TopKConfig"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
])
def test_bad_requests_raise_clear_errors(params, kwargs, message):
    request = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        jaxkv.generate(params, CONFIG, request.pop("prompts"), **request)


def test_one_prefill_shared_by_several_methods(params):
    prompts = _prompts([30, 12], seed=11)
    shared = jaxkv.prefill_prompts(params, CONFIG, prompts, capacity=64, prefill_chunk=16)
    method = topk.TopKConfig(top_k=256, sink=2, local=4, buffer=3)
    for kwargs in (dict(), dict(method="topk", method_config=method, cache_config=CacheConfig(dense_threshold=0))):
        fresh = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=10, eos_ids=(), **kwargs)
        reused = jaxkv.generate(params, CONFIG, None, max_new_tokens=10, eos_ids=(), prefilled=shared, **kwargs)
        assert reused.tokens == fresh.tokens
    sparse = jaxkv.generate(params, CONFIG, None, max_new_tokens=10, eos_ids=(), prefilled=shared, method="topk",
                            method_config=topk.TopKConfig(top_k=2, sink=2, local=4, buffer=3),
                            cache_config=CacheConfig(dense_threshold=0))
    # Row 0 (30 tokens): per step sink 2 + window ≥ 4 + top-2 of the rest are read.
    assert 0 < sparse.keys_read_fraction[0] < 0.5
    with pytest.raises(ValueError, match="prefilled cache holds 64 positions"):
        jaxkv.generate(params, CONFIG, None, max_new_tokens=40, prefilled=shared)


def test_weights_split_by_the_caller_decode_the_same_without_a_split_per_call(params, monkeypatch):
    generate_module = importlib.import_module("jaxkv.generate")  # jaxkv.generate is also the function
    prompts = _prompts([21, 9], seed=13)
    split = models.unstack_layers(params, CONFIG.num_layers)
    method = dict(method="topk", method_config=topk.TopKConfig(top_k=4, sink=2, local=4, buffer=3),
                  cache_config=CacheConfig(dense_threshold=0))
    stacked_tokens = [jaxkv.generate(params, CONFIG, prompts, max_new_tokens=12, eos_ids=(), **kwargs).tokens
                      for kwargs in (dict(), method)]

    def no_split(*args):
        raise AssertionError("generate() split weights that were already split")

    monkeypatch.setattr(generate_module, "_split_layers", no_split)
    for kwargs, expected in zip((dict(), method), stacked_tokens):
        assert jaxkv.generate(split, CONFIG, prompts, max_new_tokens=12, eos_ids=(), **kwargs).tokens == expected
    short = models.Params(split.embed, split.layers[:1], split.final_norm, split.unembed)
    with pytest.raises(ValueError, match="params holds 1 split layers; the config has num_layers = 2"):
        jaxkv.generate(short, CONFIG, prompts, max_new_tokens=2)
    with pytest.raises(ValueError, match="params holds 1 split layers; the config has num_layers = 2"):
        jaxkv.prefill_prompts(short, CONFIG, prompts, capacity=32)


def test_prefills_of_one_capacity_share_one_compiled_decode_loop(params):
    decode_chunk = importlib.import_module("jaxkv.generate")._ONE_DEVICE.decode_chunk

    method = dict(method="topk", method_config=topk.TopKConfig(top_k=8, sink=2, local=4, buffer=3),
                  cache_config=CacheConfig(dense_threshold=0))
    batches = [_prompts([30, 12], seed=11), _prompts([25, 41], seed=12)]  # needs 40 and 51 positions
    reused, compiled = [], []
    for prompts in batches:
        shared = jaxkv.prefill_prompts(params, CONFIG, prompts, capacity=64, prefill_chunk=16)
        reused.append(jaxkv.generate(params, CONFIG, None, max_new_tokens=10, eos_ids=(), prefilled=shared,
                                     **method).tokens)
        compiled.append(decode_chunk._cache_size())
    assert compiled[1] == compiled[0]  # the second batch ran the first one's program
    for prompts, tokens in zip(batches, reused):  # and the larger caches change no token
        assert tokens == jaxkv.generate(params, CONFIG, prompts, max_new_tokens=10, eos_ids=(), **method).tokens
