"""The pieces under the server: decoding in chunks, per-row sampling, text released as it is final."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.sampling import sample_rows
from jaxkv.serve.engine import TextStream, batch_rows
from tests.test_generate import CONFIG, _prompts, params  # noqa: F401  (params is a fixture)


def test_decoding_in_chunks_equals_generate(params):  # noqa: F811
    prompts = _prompts([9, 23, 14], seed=21)
    whole = jaxkv.generate(params, CONFIG, prompts, max_new_tokens=11, eos_ids=())
    prefilled = jaxkv.prefill_prompts(params, CONFIG, prompts, capacity=jaxkv.capacity_for(23, 11))
    decoding = jaxkv.start_decoding(params, CONFIG, prefilled, max_new_tokens=[11, 11, 5])
    tokens = [[t] for t in decoding.first_tokens]
    while not decoding.finished:
        for row, new in zip(tokens, decoding.advance(3)):
            row += new
    assert tokens[:2] == whole.tokens[:2]
    assert tokens[2] == whole.tokens[2][:5]  # its own budget
    assert decoding.steps == 11


def test_a_cancelled_row_emits_nothing_more(params):  # noqa: F811
    prompts = _prompts([8, 8], seed=2)
    prefilled = jaxkv.prefill_prompts(params, CONFIG, prompts, capacity=64)
    decoding = jaxkv.start_decoding(params, CONFIG, prefilled, max_new_tokens=20)
    decoding.advance(2)
    decoding.cancel([0])
    after = decoding.advance(4)
    assert after[0] == [] and len(after[1]) == 4
    assert decoding.done == [True, False]


def test_sample_rows_takes_each_rows_settings():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    temperature = jnp.asarray([0.0, 1.0, 1.0, 0.0])
    top_p = jnp.asarray([1.0, 1e-6, 1.0, 0.5])
    tokens = np.asarray(sample_rows(logits, keys, temperature, top_p))
    argmax = np.argmax(np.asarray(logits), axis=-1)
    assert tokens[0] == argmax[0] and tokens[3] == argmax[3]  # greedy rows, whatever their top_p
    assert tokens[1] == argmax[1]  # a nucleus of (almost) no mass keeps only the most likely token
    # Row 2 draws from the full distribution: over many keys it is not always the argmax.
    draws = [int(sample_rows(logits, jax.random.split(jax.random.key(s), 4), temperature, top_p)[2])
             for s in range(40)]
    assert len(set(draws)) > 3


def test_text_is_held_back_while_it_could_become_a_stop_string():
    class Chars:  # a tokenizer whose tokens are characters
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    stream = TextStream(Chars(), ["END"])
    # The last len("END") - 1 characters wait: they may start "END".
    assert stream.push([ord(c) for c in "abcE"]) == ("ab", False)
    assert stream.push([ord("N")]) == ("c", False)
    assert stream.push([ord(c) for c in "Dxyz"]) == ("", True)  # the text ends before the stop string
    plain = TextStream(Chars(), [])
    assert plain.push([ord("a"), 0xFFFD]) == ("a", False)  # an unfinished UTF-8 character waits
    assert plain.rest() == "\ufffd"


@pytest.mark.parametrize("n, max_batch, rows", [(1, 16, 1), (3, 16, 4), (5, 16, 8), (16, 16, 16), (5, 6, 6)])
def test_batches_are_padded_to_a_power_of_two_rows(n, max_batch, rows):
    assert batch_rows(n, max_batch) == rows
