"""Every public entry point refuses bad input with an exception naming the offending thing.

Complements tests/test_models_errors.py (not repeated here): config keys and
values it does not cover, checkpoint directories (corrupt, tampered, another
version, interrupted writes), generate() requests, sampling, cache and method
configurations, the per-head attention methods and the kernel references.
Each case asserts the exception type and the part of the message that names
the problem.
"""
import json
import pathlib
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from helpers_tiny_models import tiny_config
from jaxkv import cache as kvcache
from jaxkv.attention import dense, hybrid, magicpig, oracles, pariskv, pqcache, topk
from jaxkv.generate import generate, prefill_prompts
from jaxkv.sampling import SamplingConfig
from models import checkpoint
from pallas_kernels import gather_attention as gather_kernel
from pallas_kernels import simhash as simhash_kernel

CONFIG = tiny_config()
HF = CONFIG.to_hf()


@pytest.fixture(scope="module")
def params():
    return models.init_params(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, params):
    """One valid checkpoint; tests that damage it work on a copy."""
    path = tmp_path_factory.mktemp("ckpt") / "model"
    models.save(path, CONFIG, params)
    return path


def _copy(saved, tmp_path) -> pathlib.Path:
    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def _edit_json(file: pathlib.Path, **changes):
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


# --------------------------------------------------------------------------- model configs


@pytest.mark.parametrize("changes, pattern", [
    ({"num_attention_heads": None}, r"config key 'num_attention_heads' is missing"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"'layer_types'.*\['sliding_attention'\]"),
    ({"mlp_bias": True}, r"'mlp_bias'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, r"'linear'.*\['factor'\] are missing"),
    ({"rope_parameters": {"rope_type": "default"}, "rope_theta": None}, r"'rope_theta' is missing"),
    ({"head_dim": 7}, r"head_dim: RoPE needs an even head_dim, found 7"),
    ({"num_hidden_layers": -2}, r"num_layers: expected a positive int, found -2"),
    ({"max_position_embeddings": 1.5}, r"max_position_embeddings: expected a positive int, found 1.5"),
])
def test_invalid_hf_config(changes, pattern):
    with pytest.raises(models.ModelError, match=pattern):
        models.ModelConfig.from_hf({**HF, **changes})


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(models.ModelError, match=r"config\.json: not valid JSON"):
        models.load_hf(tmp_path)


def test_rope_scaling_that_is_not_items():
    fields = {**CONFIG.__dict__, "rope_scaling": (("rope_type", "linear"),)}
    with pytest.raises(models.ModelError, match=r"rope_scaling 'linear': keys \['factor'\] are missing"):
        models.ModelConfig(**fields)


# --------------------------------------------------------------------------- checkpoints


def test_save_onto_an_existing_path(tmp_path, params):
    with pytest.raises(FileExistsError, match="already exists"):
        models.save(tmp_path, CONFIG, params)


def test_save_params_of_another_config(tmp_path, params):
    other = tiny_config(intermediate_size=48)
    with pytest.raises(models.ModelError, match=r"tensor 'layers\.w_down': expected shape \(2, 48, 32\), "
                                                r"found \(2, 64, 32\)"):
        models.save(tmp_path / "ckpt", other, params)
    assert not (tmp_path / "ckpt").exists()


def test_save_mixed_dtypes(tmp_path, params):
    mixed = jax.tree.map(lambda x: x, params)
    mixed.final_norm = mixed.final_norm.astype(jnp.bfloat16)
    with pytest.raises(models.ModelError, match=r"expected one dtype for every tensor, found \['bfloat16', 'float32'\]"):
        models.save(tmp_path / "ckpt", CONFIG, mixed)


def test_interrupted_save_leaves_nothing_restore_accepts(tmp_path, params, monkeypatch):
    """A save killed mid-write (Ctrl-C after the arrays, before the manifest) leaves nothing behind."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "_digests", interrupted)  # runs between the arrays and the manifest
    with pytest.raises(KeyboardInterrupt):
        models.save(tmp_path / "ckpt", CONFIG, params)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(models.ModelNotFoundError, match="no checkpoint directory"):
        models.restore(tmp_path / "ckpt")


def test_restore_a_directory_without_manifest(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / checkpoint.MANIFEST).unlink()
    with pytest.raises(models.ModelError, match="no jaxkv_checkpoint.json; not a complete jaxkv checkpoint"):
        models.restore(path)


def test_restore_a_checkpoint_of_another_version(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_json(path / checkpoint.MANIFEST, format="jaxkv-model/0")
    with pytest.raises(models.ModelError, match=r"expected format 'jaxkv-model/1', found 'jaxkv-model/0'"):
        models.restore(path)


def test_restore_a_manifest_that_is_not_json(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / checkpoint.MANIFEST).write_text('{"format": "jaxkv-mo')
    with pytest.raises(models.ModelError, match=r"jaxkv_checkpoint\.json: not valid JSON"):
        models.restore(path)


def test_restore_with_a_config_that_does_not_match_the_weights(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_json(path / "config.json", intermediate_size=48)
    with pytest.raises(models.ModelError, match=r"copy: tensor 'layers\.w_down': expected shape \(2, 48, 32\), "
                                                r"found \(2, 64, 32\) \(config\.json or the manifest does not match"):
        models.restore(path)


def test_restore_with_a_manifest_dtype_that_does_not_match(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_json(path / checkpoint.MANIFEST, dtype="bfloat16")
    with pytest.raises(models.ModelError, match=r"expected dtype bfloat16, found float32"):
        models.restore(path)


def test_restore_tampered_tensor_digest(saved, tmp_path):
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    manifest["sha256"]["['embed']"] = "0" * 64
    (path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(models.ModelError, match=r"tensor \"\['embed'\]\" does not match its saved sha256"):
        models.restore(path)


def test_restore_with_the_params_directory_missing(saved, tmp_path):
    path = _copy(saved, tmp_path)
    shutil.rmtree(path / "params")
    with pytest.raises(models.ModelError, match=r"copy: the params/ directory is missing"):
        models.restore(path)


def _small_gguf(path: pathlib.Path) -> bytes:
    """A valid GGUF file (one metadata key, one 8 KiB tensor); its bytes."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.parametrize("cut", ["inside the metadata", "inside the tensor data"])
def test_truncated_gguf(tmp_path, cut):
    data = _small_gguf(tmp_path / "whole.gguf")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[:40] if cut == "inside the metadata" else data[:-100])
    with pytest.raises(models.ModelError, match=r"cut\.gguf: not a readable GGUF file, truncated or corrupt"):
        models.load_gguf(truncated)


# --------------------------------------------------------------------------- generate()


@pytest.mark.parametrize("prompts, kwargs, pattern", [
    ([], {}, r"prompts is empty"),
    ([[1, 2], []], {}, r"prompt 1 is empty"),
    ([[1, CONFIG.vocab_size]], {}, rf"prompt 0 has token id {CONFIG.vocab_size} outside the vocabulary \[0, "),
    ([[3, -1]], {}, r"prompt 0 has token id -1 outside the vocabulary"),
    ([[1.5, 2.0]], {}, r"prompt 0: token ids must be integers, found float"),
    ([[1, 2]], {"max_new_tokens": -1}, r"max_new_tokens must be >= 0, got -1"),
    ([[1, 2]], {"max_new_tokens": 2.5}, r"max_new_tokens must be an int, got 2.5"),
    ([[1] * 250], {"max_new_tokens": 13}, r"prompt \+ max_new_tokens = 263 tokens exceeds the model's "
                                          r"max_position_embeddings = 256"),
    ([[1, 2]], {"prefill_chunk": 0}, r"prefill_chunk must be >= 1, got 0"),
    ([[1, 2]], {"method": "lsh"}, r"unknown method 'lsh'"),
    ([[1, 2]], {"method_config": pariskv.ParisKVConfig()},
     r"method_config for 'dense' must be a DenseConfig, got ParisKVConfig"),
    ([[1, 2]], {"cache_config": kvcache.CacheConfig()}, r"method='dense' takes no cache_config"),
    ([[1, 2]], {"method": "pariskv", "method_config": magicpig.MagicPIGConfig()},
     r"method_config for 'pariskv' must be a ParisKVConfig, got MagicPIGConfig"),
    ([[1, 2]], {"temperature": -0.5}, r"temperature must be >= 0, got -0.5"),
    ([[1, 2]], {"temperature": 1.0, "top_k": 0}, r"top_k must be >= 1 or None, got 0"),
    ([[1, 2]], {"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\] or None, got 1.5"),
    ([[1, 2]], {"eos_ids": (CONFIG.vocab_size + 3,)}, rf"eos_ids: token id {CONFIG.vocab_size + 3} "
                                                      r"outside the vocabulary"),
])
def test_generate_rejects(params, prompts, kwargs, pattern):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        generate(params, CONFIG, prompts, **kwargs)


def test_generate_with_a_prefill_too_small(params):
    prefilled = prefill_prompts(params, CONFIG, [[1, 2, 3]], capacity=4, prefill_chunk=4)
    with pytest.raises(ValueError, match=r"prefilled cache holds 4 positions; this request needs 8"):
        generate(params, CONFIG, None, prefilled=prefilled, max_new_tokens=5)


def test_sampling_config_rejects_nan_temperature():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got nan"):
        SamplingConfig(temperature=float("nan"))


@pytest.mark.parametrize("fields, pattern", [
    ({"sink": -1}, r"CacheConfig\.sink must be >= 0, got -1"),
    ({"buffer": 0}, r"CacheConfig\.buffer must be >= 1"),
    ({"dense_threshold": -5}, r"CacheConfig\.dense_threshold must be >= 0, got -5"),
    ({"slot_block": 0}, r"CacheConfig\.slot_block must be an int >= 1, got 0"),
    ({"slot_block": 2.5}, r"CacheConfig\.slot_block must be an int >= 1, got 2\.5"),
])
def test_cache_config(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        kvcache.CacheConfig(**fields)


# --------------------------------------------------------------------------- method configs


@pytest.mark.parametrize("cls, fields, pattern", [
    (magicpig.MagicPIGConfig, {"K": 17}, r"MagicPIGConfig\.K must be an int in 1\.\.16"),
    (magicpig.MagicPIGConfig, {"L": 1}, r"MagicPIGConfig\.L must be an int >= 2"),
    (magicpig.MagicPIGConfig, {"K": 16, "L": 600}, r"K\*L = 9600 hash bits per key, above 8192"),
    (magicpig.MagicPIGConfig, {"K": 16, "L": 300}, r"L\*\(2\^K\+1\) = 19661100 bucket starts"),
    (magicpig.MagicPIGConfig, {"L": 4, "min_hits": 5}, r"MagicPIGConfig\.min_hits must be an int in 1\.\.L=4"),
    (magicpig.MagicPIGConfig, {"capacity": 1.5}, r"MagicPIGConfig\.capacity must be an int >= 1 or a float"),
    (magicpig.MagicPIGConfig, {"center": "yes"}, r"MagicPIGConfig\.center must be a bool"),
    (magicpig.MagicPIGConfig, {"dense_layers": (0, -1)}, r"MagicPIGConfig\.dense_layers must be a tuple"),
    (pariskv.ParisKVConfig, {"m": 9}, r"ParisKVConfig\.m must be in \[2, 8\], got 9"),
    (pariskv.ParisKVConfig, {"top_k": 0}, r"ParisKVConfig\.top_k must be >= 1, got 0"),
    (pariskv.ParisKVConfig, {"collision_ratio": 1.5}, r"ParisKVConfig\.collision_ratio must be in \(0, 1\]"),
    (pariskv.ParisKVConfig, {"m": 4, "official_levels": True}, r"official_levels needs m=8, got m=4"),
    (pqcache.PQCacheConfig, {"n_centroids": 300}, r"PQCacheConfig\.n_centroids must be in \[1, 256\], got 300"),
    (topk.TopKConfig, {"top_k": 0}, r"TopKConfig\.top_k must be >= 1, got 0"),
    (hybrid.HybridConfig, {"pariskv": None, "tail": "none"}, r"pariskv=None with tail='none' has no head to work from"),
    (hybrid.HybridConfig, {"tail": "sampled"}, r"HybridConfig\.tail must be one of \('regression', 'lsh', 'none'\)"),
])
def test_method_config(cls, fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        cls(**fields)


# --------------------------------------------------------------------------- methods (one KV head)

Q = jnp.ones((2, 16), jnp.float32)
KEYS = jnp.ones((40, 16), jnp.float32)


def test_pariskv_m_must_divide_the_padded_head_dim():
    with pytest.raises(ValueError, match=r"ParisKVConfig\.m=8 must divide the padded head dim 4 \(d=3\)"):
        pariskv.build(pariskv.ParisKVConfig(), jnp.ones((10, 3)), 10)


def test_pqcache_n_sub_must_divide_the_head_dim():
    with pytest.raises(ValueError, match=r"PQCacheConfig\.n_sub=3 must divide the head dim 16"):
        pqcache.build(pqcache.PQCacheConfig(n_sub=3), KEYS, 40, jax.random.key(0))


def test_magicpig_build_keys_must_be_a_matrix():
    with pytest.raises(ValueError, match=r"keys must be \[N >= 1, d\], got shape \(40,\)"):
        magicpig.build(magicpig.MagicPIGConfig(K=4, L=8), KEYS[:, 0], 40, jax.random.key(0))


def test_magicpig_insert_keys_of_another_head_dim():
    cfg = magicpig.MagicPIGConfig(K=4, L=8)
    index = magicpig.build(cfg, KEYS, 20, jax.random.key(0))
    with pytest.raises(ValueError, match=r"keys_new must be \[U >= 1, d=16\], got shape \(4, 8\)"):
        magicpig.insert(cfg, index, jnp.ones((4, 8)), 4)


def test_magicpig_hash_projection_of_the_wrong_shape():
    cfg = magicpig.MagicPIGConfig(K=4, L=8)
    with pytest.raises(ValueError, match=r"projection must be \[d=16, K\*L=32\], got shape \(16, 31\)"):
        magicpig.hash_codes(cfg, jnp.ones((16, 31)), Q)


@pytest.mark.parametrize("q, k, v, pattern", [
    (Q[0], KEYS, KEYS, r"q must be \[G, d\] .*got shape \(16,\)"),
    (Q, KEYS[:, :8], KEYS[:, :8], r"k must be \[N, d=16\] to match q \(2, 16\), got shape \(40, 8\)"),
    (Q, KEYS, KEYS[:39], r"v must have the shape of k \(40, 16\), got shape \(39, 16\)"),
])
def test_dense_attention_shapes(q, k, v, pattern):
    with pytest.raises(ValueError, match=pattern):
        dense.dense(q, k, v)


def test_dense_attention_mask_shape():
    with pytest.raises(ValueError, match=r"mask must be \[N=40\] or \[G=2, N=40\], got shape \(3, 40\)"):
        dense.dense(Q, KEYS, KEYS, jnp.ones((3, 40), bool))


@pytest.mark.parametrize("budget", [0, True, 2.0])
def test_oracle_budget(budget):
    with pytest.raises(ValueError, match=r"budget must be a positive int"):
        oracles.topk_oracle(Q, KEYS, KEYS, budget)


def test_sampling_oracle_count_mode():
    with pytest.raises(ValueError, match=r"count must be 'distinct' or 'draws', got 'bogus'"):
        oracles.sampling_oracle(Q, KEYS, KEYS, 4, jax.random.key(0), count="bogus")


# --------------------------------------------------------------------------- kernel wrappers


def test_gather_attention_kernel_head_dim():
    idx = jnp.arange(4, dtype=jnp.int32)
    q, k = jnp.ones((2, 12)), jnp.ones((40, 12))
    with pytest.raises(ValueError, match=r"q: the kernel needs a power-of-two head dim >= 16, found 12"):
        gather_kernel.gather_attention(q, k, k, idx, jnp.ones(4, bool), interpret=True)


def test_simhash_reference_projection_shape():
    with pytest.raises(ValueError, match=r"proj"):
        simhash_kernel.simhash_reference(Q, jnp.ones((8, 32)), n_bits=4)


def test_forward_token_dtype(params):
    with pytest.raises(models.ModelError, match=r"tokens: expected an integer dtype, found float32"):
        models.forward(params, CONFIG, jnp.zeros((1, 3), jnp.float32))

