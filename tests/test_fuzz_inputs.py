"""Property-based fuzzing of the input boundaries: config construction and generate()'s arguments.

Every drawn input either raises a ValueError or TypeError whose one-line message names
the field or argument at fault, or is accepted, and then the result is sound: a config
that hashes (a jit static argument) with every field of its annotated type, finite RoPE
frequencies and norms, sampled tokens inside the allowed set, generated ids inside the
vocabulary. Any other exception (OverflowError, ZeroDivisionError, AttributeError, a
JAX error from deep inside) fails the test. Example counts follow the hypothesis profile
of tests/conftest.py.
"""
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import models
from helpers_tiny_models import tiny_config
from jaxkv import cache as kvcache
from jaxkv.attention import dense, hybrid, magicpig, pariskv, pqcache, topk
from jaxkv.generate import generate
from jaxkv.sampling import SamplingConfig, sample_rows
from models import fields, rope

CONFIG = tiny_config()
NAN, INF = float("nan"), float("inf")

# Values of every kind a caller might pass: edge integers, floats with NaN and inf, bools,
# None, strings, lists and tuples, and the valid names of the string fields.
ANY_VALUE = st.one_of(
    st.integers(-3, 70),
    st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1.0, 2.0, 1e-30, 1e300]),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.lists(st.integers(-2, 40), max_size=3),
    st.tuples(st.integers(-2, 40), st.integers(-2, 40)),
    st.sampled_from(["auto", "xla", "native", "pallas", "interpret", "regression", "lsh", "none", "llama", "qwen3"]),
)

CONFIG_CLASSES = [magicpig.MagicPIGConfig, pariskv.ParisKVConfig, pqcache.PQCacheConfig, topk.TopKConfig,
                  hybrid.HybridConfig, kvcache.CacheConfig, SamplingConfig, dense.DenseConfig, models.ModelConfig]


def _base(cls) -> dict:
    """Valid values for every required field (ModelConfig has no defaults)."""
    return dict(CONFIG.__dict__) if cls is models.ModelConfig else {}


def _names_a_field(message: str, cls) -> bool:
    return any(re.search(rf"\b{re.escape(f.name)}\b", message) for f in dataclasses.fields(cls))


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_config_construction_is_checked(cls, data):
    names = [f.name for f in dataclasses.fields(cls)]
    overrides = data.draw(st.dictionaries(st.sampled_from(names), ANY_VALUE, min_size=1, max_size=3))
    try:
        config = cls(**{**_base(cls), **overrides})
    except (ValueError, TypeError) as err:
        message = str(err)
        assert "\n" not in message and _names_a_field(message, cls), message
        return
    hash(config)  # usable as a static argument
    hints = fields.type_hints(cls)
    for f in dataclasses.fields(cls):
        fields.check_value(f.name, getattr(config, f.name), hints[f.name])  # the stored value has its type


FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 1e-45, 1e-30, 1e38]),
                   st.integers(-5, 10**6))


@given(eps=FLOATS, theta=FLOATS, factor=st.one_of(st.none(), FLOATS))
def test_accepted_model_numbers_give_finite_frequencies_and_norms(eps, theta, factor):
    scaling = None if factor is None else (("factor", factor), ("rope_type", "linear"))
    try:
        config = models.ModelConfig(**{**CONFIG.__dict__, "rms_norm_eps": eps, "rope_theta": theta,
                                       "rope_scaling": scaling})
    except ValueError as err:
        assert re.search(r"rms_norm_eps|rope_theta|rope_scaling", str(err)), err
        return
    inv_freq = rope.inverse_frequencies(config)
    assert np.all(np.isfinite(inv_freq)) and np.all(inv_freq >= 0)
    x = jax.random.normal(jax.random.key(0), (1, 3, config.num_heads, config.head_dim))
    positions = jnp.array([[0, 1, config.max_position_embeddings - 1]])
    assert jnp.all(jnp.isfinite(rope.apply_rope(x, positions, inv_freq)))
    hidden = jax.random.normal(jax.random.key(1), (2, config.hidden_size))
    assert jnp.all(jnp.isfinite(models.rms_norm(hidden, jnp.ones(config.hidden_size), config.rms_norm_eps)))


def mostly(valid, invalid):
    """Valid values four times in five: a request with every argument valid must come up often."""
    return st.integers(0, 4).flatmap(lambda i: invalid if i == 0 else valid)


TEXT_OR_NONE = st.one_of(st.text(max_size=3), st.none())
SAMPLING = dict(
    temperature=mostly(st.sampled_from([0.0, 0.7]),
                       st.one_of(st.floats(max_value=-1e-9), st.sampled_from([NAN, INF, 1e-30]), TEXT_OR_NONE)),
    top_k=mostly(st.sampled_from([None, 3]), st.one_of(st.integers(-3, 0), st.sampled_from([2.5, True]), st.text())),
    top_p=mostly(st.sampled_from([None, 0.9]),
                 st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001), st.sampled_from([NAN]), st.text())),
)


@given(logits=st.lists(st.floats(-1e4, 1e4), min_size=16, max_size=16), seed=st.integers(0, 2**32 - 1),
       **SAMPLING)
def test_accepted_sampling_settings_pick_an_allowed_token(logits, seed, temperature, top_k, top_p):
    try:
        cfg = SamplingConfig(temperature, top_k, top_p)
    except (ValueError, TypeError) as err:
        assert re.search(r"temperature|top_k|top_p", str(err)), err
        return
    row = np.asarray(logits, np.float32)
    top_p_row = jnp.asarray([1.0 if cfg.top_p is None else cfg.top_p], jnp.float32)
    token = int(sample_rows(jnp.asarray(row)[None], jax.random.key(seed)[None],
                            jnp.asarray([cfg.temperature], jnp.float32), top_p_row, cfg.top_k)[0])
    assert 0 <= token < row.size
    if cfg.temperature == 0:
        assert row[token] == row.max()
        return
    if cfg.top_k is not None:
        assert row[token] >= np.sort(row)[::-1][min(cfg.top_k, row.size) - 1]
    if cfg.top_p is not None:
        # The nucleus: tokens whose preceding probability mass (most likely first) is below top_p.
        scaled = row.astype(np.float64) / cfg.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        order = np.argsort(-row, kind="stable")
        before = dict(zip(order.tolist(), (np.cumsum(probs[order]) - probs[order]).tolist()))
        assert before[token] < cfg.top_p + 1e-5, (before[token], cfg.top_p)


V = CONFIG.vocab_size
PROMPTS = mostly(
    st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=4), min_size=1, max_size=2),
    st.one_of(
        st.lists(st.integers(0, V - 1), max_size=3),  # flat: one prompt
        st.lists(st.lists(st.one_of(st.integers(-3, V + 3), st.floats(), st.booleans(), st.integers(2**63, 2**70)),
                          max_size=3), max_size=2),
        st.sampled_from([None, "hello", [], [[]], [[[1, 2]]], [[1], 2], np.ones((1, 2, 2), np.int32),
                         np.array([1.5, 2.0])]),
    ))
GENERATE_ARGUMENTS = dict(
    prompts=PROMPTS,
    max_new_tokens=mostly(st.sampled_from([0, 1, 2]),
                          st.one_of(st.integers(-5, -1), st.sampled_from([2.5, True, "3", None, 10**30, 300]))),
    seed=mostly(st.integers(0, 2**32 - 1), st.one_of(st.integers(-2**70, -1), st.integers(2**32, 2**70),
                                                      st.sampled_from([1.5, "0", None]))),
    eos_ids=mostly(st.sampled_from([None, (), (2,)]),
                   st.one_of(st.integers(0, 5), st.sampled_from([[1.5], (-1,), (V,), "2"]))),
    method=mostly(st.just("dense"), st.one_of(st.sampled_from(["lsh", "", "DENSE", None]), st.integers())),
    prefill_chunk=mostly(st.just(16), st.one_of(st.integers(-3, 0), st.sampled_from([2.5, True, "16"]))),
    allow_beyond_context=mostly(st.booleans(), st.sampled_from(["yes", 1, None])),
    **SAMPLING,
)
ARGUMENT_WORDS = r"prompt|max_new_tokens|temperature|top_k|top_p|seed|eos_ids|method|prefill_chunk|" \
                 r"allow_beyond_context"


@pytest.fixture(scope="module")
def params():
    return models.init_params(CONFIG, jax.random.key(0))


@given(data=st.data())
def test_generate_arguments_are_checked(params, data):
    kwargs = {name: data.draw(strategy, label=name) for name, strategy in GENERATE_ARGUMENTS.items()}
    prompts = kwargs.pop("prompts")
    try:
        result = generate(params, CONFIG, prompts, **kwargs)
    except (ValueError, TypeError) as err:
        message = str(err)
        assert "\n" not in message and re.search(ARGUMENT_WORDS, message), message
        return
    rows = [prompts] if prompts and not isinstance(prompts[0], list) else prompts
    assert len(result.tokens) == len(rows) == len(result.prompt_lengths)
    for tokens in result.tokens:
        assert len(tokens) <= kwargs["max_new_tokens"] and all(0 <= t < V for t in tokens)
    assert math.isfinite(result.prefill_seconds) and math.isfinite(result.decode_seconds)
