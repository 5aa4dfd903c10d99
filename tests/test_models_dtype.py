"""The model dtype: ``models.load(path, dtype)`` (default: the checkpoint's own), a bfloat16
model's cache held in bfloat16 in every region through generate(), and ``--dtype`` on
``jaxkv generate`` and ``jaxkv convert``. Parity of the bfloat16 forward with
transformers' is in test_models_parity.py.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from helpers_tiny_models import VOCAB, tiny_config, write_random_hf_checkpoint
from jaxkv import cache as kvcache
from jaxkv.cli import main as cli_main
from jaxkv.generate import generate, prefill_prompts


@pytest.mark.parametrize("method", ["dense", "pariskv"])
def test_bfloat16_model_keeps_a_bfloat16_cache_in_every_region(tmp_path, method):
    """The prefill's staging cache and every decode state (dense cache, sink, window,
    retrieval region) hold bfloat16 rows as their bits, and generate() decodes from them."""
    config = tiny_config(max_position_embeddings=4096)
    write_random_hf_checkpoint(tmp_path, config, hf_overrides={"dtype": "bfloat16"})
    config, params, _ = models.load(tmp_path)  # the checkpoint's own dtype
    assert models.activation_dtype(params) == jnp.bfloat16
    prompt = np.random.default_rng(0).integers(3, VOCAB, 300).tolist()
    new_tokens = 8
    cache_config = None if method == "dense" else kvcache.CacheConfig(sink=4, local=32, buffer=16,
                                                                        dense_threshold=0)
    backend = kvcache.make_backend(config, method, None, cache_config, len(prompt), new_tokens)
    prefilled = prefill_prompts(params, config, [prompt], capacity=backend.staging_capacity)
    assert prefilled.staging.dtype == jnp.bfloat16
    states = backend.from_prefill(prefilled.staging, jnp.asarray([len(prompt)], jnp.int32))
    for state in states:
        rows = ((state.k, state.v) if isinstance(state, models.KVCache) else
                (state.sink_k, state.sink_v, state.win_k, state.win_v, state.retr_k, state.retr_v))
        assert {x.dtype for x in rows} == {jnp.dtype(models.ROW_BITS)}
    result = generate(params, config, None, prefilled=prefilled, max_new_tokens=new_tokens, method=method,
                      cache_config=cache_config, eos_ids=())
    assert len(result.tokens[0]) == new_tokens


def test_load_takes_the_checkpoints_own_dtype_unless_told(tmp_path):
    config = tiny_config()
    declared = write_random_hf_checkpoint(tmp_path / "bf16", config, hf_overrides={"torch_dtype": "bfloat16"})
    plain = write_random_hf_checkpoint(tmp_path / "plain", config)
    dtypes = lambda params: {x.dtype for x in jax.tree.leaves(params)}
    assert dtypes(models.load(declared)[1]) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(models.load(declared, "float32")[1]) == {jnp.dtype(jnp.float32)}
    assert dtypes(models.load(plain)[1]) == {jnp.dtype(jnp.float32)}
    _, params, _ = models.load(plain, jnp.bfloat16)
    models.save(tmp_path / "saved", config, params)
    assert dtypes(models.load(tmp_path / "saved")[1]) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(models.load(tmp_path / "saved", "float32")[1]) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("dtype", ["float16", "int8", "bf16", 3])
def test_load_rejects_an_unsupported_dtype(tmp_path, dtype):
    directory = write_random_hf_checkpoint(tmp_path, tiny_config())
    with pytest.raises(models.ModelError, match="dtype: expected one of"):
        models.load(directory, dtype)


def test_cli_convert_writes_the_requested_dtype(tmp_path):
    source = write_random_hf_checkpoint(tmp_path / "hf", tiny_config())
    assert cli_main(["convert", str(source), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "out" / "jaxkv_checkpoint.json").read_text())["dtype"] == "bfloat16"


def _word_tokenizer(directory) -> None:
    """A tokenizer.json of one word per id (VOCAB words), enough for the CLI to run a tiny model."""
    import tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cli_generate_takes_a_dtype(tmp_path, capsys, monkeypatch, dtype):
    directory = write_random_hf_checkpoint(tmp_path, tiny_config(), hf_overrides={"dtype": "float16"})
    _word_tokenizer(directory)
    loaded = []
    load = models.ModelSource.load
    monkeypatch.setattr(models.ModelSource, "load", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    assert cli_main(["generate", "--model", str(directory), "--prompt", "w5 w6 w7", "--max-new-tokens", "4",
                     "--dtype", dtype, "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert len(out.out.split()) == 4 and "generated 4 tokens;" in out.err
    assert models.activation_dtype(loaded[0][1]) == jnp.dtype(dtype)
