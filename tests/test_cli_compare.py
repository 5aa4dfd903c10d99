"""`jaxkv generate --compare METHOD`: dense and METHOD decode from one prefill, side by side.

In process on a tiny random Llama (the model loader is swapped for it), so no real model loads.
"""
import re

import jax
import pytest

from jaxkv import cli
from models.params import init_params
from helpers_tiny_models import tiny_config

CONFIG = tiny_config(max_position_embeddings=1024, eos_token_ids=(2,))
PROMPT_TOKENS = 200


class ByteTokenizer:
    """Token id = byte value mod the vocabulary, enough for the CLI's encode and decode."""

    def encode(self, text):
        return [3 + b % (CONFIG.vocab_size - 3) for b in text.encode()][:PROMPT_TOKENS]

    def decode(self, ids):
        return " ".join(map(str, ids))


class TinySource:
    """What ``cli._model_source`` returns (a ``models.ModelSource``), for the tiny model."""

    path, kind, config, tokenizer = "tiny", "hf", CONFIG, ByteTokenizer()

    def __init__(self, params):
        self.params = params

    def load(self, dtype=None, *, keep_quantized=False):
        return CONFIG, self.params, self.tokenizer


@pytest.fixture
def tiny_model(monkeypatch):
    # std 0.02 init makes every logit nearly equal; scale up so greedy choices are clear-cut.
    params = jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, init_params(CONFIG, jax.random.key(0)))
    monkeypatch.setattr(cli, "_model_source", lambda path, flag="--model": TinySource(params))


def compare(capsys, *flags):
    code = cli.main(["generate", "--prompt", "the quick brown fox jumps over the lazy dog " * 8,
                     "--max-new-tokens", "6", "--ignore-eos", "--no-dense-fallback",
                     "--sink", "4", "--local", "16", "--buffer", "16", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def answers_and_reads(out: str, err: str) -> dict:
    """{label: (answer, fraction of keys read)} from --compare's output."""
    answers = dict(re.findall(r"^\[([^]]+)\] (.*)$", out, re.M))
    reads = {m: float(f) / 100 for m, f in re.findall(
        r"^\[([^]]+)\] prompt \d+ tokens, .* decode [\d.]+ tok/s .* read ([\d.]+)% of the keys$", err, re.M)}
    return {m: (answers[m], reads[m]) for m in answers}


def test_a_method_reading_every_key_answers_as_dense_does(tiny_model, capsys):
    code, out, err = compare(capsys, "--compare", "topk", "--set", "top_k=1000")
    assert code == 0, err
    found = answers_and_reads(out, err)
    assert set(found) == {"dense", "topk, top_k=1000"}
    assert found["topk, top_k=1000"] == found["dense"]
    assert found["dense"][1] == 1.0
    assert err.count("one prefill for both") == 2


def test_a_small_budget_reads_a_fraction_of_the_keys(tiny_model, capsys):
    code, out, err = compare(capsys, "--compare", "topk", "--set", "top_k=8")
    assert code == 0, err
    found = answers_and_reads(out, err)
    # 8 of ~180 retrieval-region keys plus 36 exact ones, in every layer: about a quarter.
    assert 0.1 < found["topk, top_k=8"][1] < 0.5
    assert len(found["topk, top_k=8"][0].split()) == len(found["dense"][0].split()) == 6


def test_set_goes_to_the_compared_method(tiny_model, capsys):
    code, _, err = compare(capsys, "--compare", "topk", "--set", "kernels=native")  # a field of dense's only
    assert code == 2
    assert "TopKConfig has no field 'kernels'" in err


def test_compare_runs_dense_so_another_method_is_an_error(tiny_model, capsys):
    code, _, err = compare(capsys, "--method", "pariskv", "--compare", "topk")
    assert code == 2
    assert "--compare runs dense beside topk" in err
