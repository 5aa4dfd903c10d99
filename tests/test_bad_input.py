"""Every public entry point refuses bad input with an exception naming the offending thing.

Complements tests/test_models_errors.py (not repeated here): config keys and
values it does not cover (config.json, GGUF metadata, a checkpoint's config),
checkpoint directories (corrupt, tampered, damaged files, another version,
interrupted writes), tokenizers, generate() requests (types, prompt shapes, sizes
that cannot fit), sampling, cache and method configurations, the per-head
attention methods and the kernel references. Each case asserts the exception type
and the part of the message that names the problem.
"""
import json
import pathlib
import re
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

import models
from helpers_tiny_models import tiny_config
from jaxkv import cache as kvcache
from jaxkv.attention import dense, hybrid, magicpig, oracles, pariskv, pqcache, topk
from jaxkv import memory
from jaxkv.generate import generate, prefill_prompts
from jaxkv.sampling import SamplingConfig
from models import checkpoint
from pallas_kernels import gather_attention as gather_kernel
from pallas_kernels import simhash as simhash_kernel

CONFIG = tiny_config()
HF = CONFIG.to_hf()
# A character-level tokenizer: enough to save, restore and compare encodings.
_TOKENIZER = models.Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE(
    vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[])))


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
    ({"head_dim": 7}, r"config key 'head_dim': RoPE needs an even head_dim, found 7"),
    ({"num_hidden_layers": -2}, r"config key 'num_hidden_layers' must be > 0, got -2"),
    ({"max_position_embeddings": 1.5}, r"config key 'max_position_embeddings' must be an int > 0, got 1.5"),
    # Counts that make the model impossible (a ZeroDivisionError or TypeError before they were checked).
    ({"num_attention_heads": 0}, r"config key 'num_attention_heads' must be > 0, got 0"),
    ({"num_attention_heads": 2.5}, r"config key 'num_attention_heads' must be an int > 0, got 2.5"),
    ({"num_key_value_heads": 0}, r"config key 'num_key_value_heads' must be > 0, got 0"),
    ({"num_attention_heads": 64, "head_dim": None},
     r"'hidden_size' \(32\) must be at least config key 'num_attention_heads' \(64\)"),
    ({"hidden_size": [32]}, r"config key 'hidden_size' must be an int > 0, got \[32\]"),
    ({"intermediate_size": "64"}, r"config key 'intermediate_size' must be an int > 0, got '64'"),
    ({"vocab_size": True}, r"config key 'vocab_size' must be an int > 0, got True"),
    ({"rms_norm_eps": "1e-6"}, r"config key 'rms_norm_eps' must be a finite number in \(0, 1\], got '1e-6'"),
    ({"tie_word_embeddings": "no"}, r"config key 'tie_word_embeddings' must be a bool, got 'no'"),
    ({"bos_token_id": 1.5}, r"config key 'bos_token_id' must be an int >= 0 or None, got 1.5"),
    ({"eos_token_id": [2, "x"]}, r"config key 'eos_token_id' must be a sequence of ints >= 0, got \[2, 'x'\]"),
    ({"eos_token_id": 500}, r"config key 'eos_token_id': token id 500 is outside the vocabulary \[0, 128\)"),
    ({"layer_types": "full_attention"}, r"config key 'layer_types': expected a list"),
    # Values that load and then decode NaN (a negative epsilon, a zero or negative RoPE base).
    ({"rms_norm_eps": -1e-6}, r"config key 'rms_norm_eps' must be in \(0, 1\], got -1e-06"),
    ({"rms_norm_eps": float("nan")}, r"config key 'rms_norm_eps' must be a finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, r"config key 'rope_theta' must be >= 1, got 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1e4}}, r"'rope_theta' must be >= 1, got -10000.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, r"'rope_theta' must be a finite"),
    ({"rope_parameters": "linear"}, r"config key 'rope_parameters': expected an object, found 'linear'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 1e4}},
     r"config key 'rope_parameters'\['factor'\] must be >= 1, got 0.0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64, "rope_theta": 1e4}},
     r"llama3 needs high_freq_factor > low_freq_factor, found 4.0 and 4.0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 6.5, "rope_theta": 1e4}},
     r"\['original_max_position_embeddings'\] must be an int > 0, got 6.5"),
])
def test_invalid_hf_config(changes, pattern):
    with pytest.raises(models.ModelError, match=pattern):
        models.ModelConfig.from_hf({**HF, **changes})


@pytest.mark.parametrize("field, value, pattern", [
    ("rms_norm_eps", -1.0, r"ModelConfig\.rms_norm_eps must be in \(0, 1\], got -1.0"),
    ("rope_theta", 0.0, r"ModelConfig\.rope_theta must be >= 1, got 0.0"),
    ("num_heads", 0, r"ModelConfig\.num_heads must be > 0, got 0"),
    ("head_dim", 8.0, r"ModelConfig\.head_dim must be an int > 0, got 8.0"),
    ("model_type", "gpt2", r"ModelConfig\.model_type must be one of \('llama', 'qwen2', 'qwen3'\), got 'gpt2'"),
    ("eos_token_ids", (2, -1), r"ModelConfig\.eos_token_ids must be >= 0, got \(2, -1\)"),
    ("rope_scaling", (("rope_type", "linear"), ("factor", 0.5)), r"rope_scaling\['factor'\] must be >= 1, got 0.5"),
])
def test_invalid_model_config_fields(field, value, pattern):
    with pytest.raises(models.ModelError, match=pattern):
        models.ModelConfig(**{**CONFIG.__dict__, field: value})


def test_config_json_names_the_file_and_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF, "num_attention_heads": 0}))
    with pytest.raises(models.ModelError, match=rf"{tmp_path / 'config.json'}: config key 'num_attention_heads'"):
        models.load_hf(tmp_path)


@pytest.mark.parametrize("content, pattern", [
    ("[1, 2]", r"config\.json: expected a JSON object, found list"),
    ('"a string"', r"config\.json: expected a JSON object, found str"),
    (b"\xff\xfe{}", r"config\.json: not UTF-8 text"),
])
def test_config_json_that_is_not_an_object(tmp_path, content, pattern):
    file = tmp_path / "config.json"
    file.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(models.ModelError, match=pattern):
        models.load_hf(tmp_path)


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
    """A save interrupted mid-write (Ctrl-C after the arrays, before the manifest) leaves nothing behind."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "_file_records", interrupted)  # runs between the arrays and the manifest
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
    with pytest.raises(models.ModelError, match=r"expected format 'jaxkv-model/2', found 'jaxkv-model/0'"):
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


_GGUF_METADATA = {  # a valid tiny Llama's metadata, key -> (writer method, value)
    "llama.block_count": ("add_uint32", 1), "llama.context_length": ("add_uint32", 64),
    "llama.embedding_length": ("add_uint32", 32), "llama.feed_forward_length": ("add_uint32", 64),
    "llama.attention.head_count": ("add_uint32", 4), "llama.attention.head_count_kv": ("add_uint32", 2),
    "llama.attention.layer_norm_rms_epsilon": ("add_float32", 1e-5), "llama.rope.freq_base": ("add_float32", 1e4),
    "tokenizer.ggml.model": ("add_string", "gpt2"),
}


def _gguf_with(path: pathlib.Path, **changes) -> pathlib.Path:
    """A GGUF file of the tiny Llama's metadata with ``changes`` ({key with '__' for '.': (method, value)})."""
    meta = {**_GGUF_METADATA, **{k.replace("__", "."): v for k, v in changes.items()}}
    writer = gguf.GGUFWriter(path, "llama")
    for key, (method, value) in meta.items():
        getattr(writer, method)(key, value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    writer.add_array("tokenizer.ggml.merges", [])
    writer.add_tensor("token_embd.weight", np.ones((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("changes, pattern", [
    ({"llama__attention__head_count": ("add_uint32", 0)},
     r"GGUF key 'llama\.attention\.head_count' must be > 0, got 0"),
    ({"llama__attention__head_count": ("add_float32", 2.5)},
     r"GGUF key 'llama\.attention\.head_count' must be an int > 0, got 2.5"),
    ({"llama__block_count": ("add_string", "30")}, r"GGUF key 'llama\.block_count' must be an int > 0, got '30'"),
    ({"llama__attention__layer_norm_rms_epsilon": ("add_float32", -1.0)},
     r"GGUF key 'llama\.attention\.layer_norm_rms_epsilon' must be in \(0, 1\], got -1.0"),
    ({"llama__rope__freq_base": ("add_float32", 0.0)}, r"GGUF key 'llama\.rope\.freq_base' must be >= 1, got 0.0"),
    ({"llama__attention__head_count_kv": ("add_uint32", 3)},
     r"GGUF key 'llama\.attention\.head_count' \(4\) must be a multiple of GGUF key "
     r"'llama\.attention\.head_count_kv' \(3\)"),
    ({"llama__embedding_length": ("add_uint32", 2)},
     r"GGUF key 'llama\.embedding_length' \(2\) must be at least GGUF key 'llama\.attention\.head_count' \(4\)"),
    ({"tokenizer__ggml__bos_token_id": ("add_uint32", 99)},
     r"GGUF key 'tokenizer\.ggml\.bos_token_id': token id 99 is outside the vocabulary \[0, 16\)"),
])
def test_gguf_metadata_names_the_file_and_the_key(tmp_path, changes, pattern):
    path = _gguf_with(tmp_path / "m.gguf", **changes)
    with pytest.raises(models.ModelError, match=rf"m\.gguf: .*{pattern}"):
        models.load_gguf(path)


def test_gguf_metadata_with_a_valid_config_reads(tmp_path):
    """The helper's metadata is valid: the failures above are the changes', not the helper's."""
    source = models.open_model(_gguf_with(tmp_path / "m.gguf"))
    assert (source.config.num_heads, source.config.head_dim, source.tokenizer.vocab_size) == (4, 8, 16)


# --------------------------------------------------------------------------- damaged checkpoints


def _array_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's orbax data files, largest first."""
    return sorted((f for f in (path / "params").rglob("*") if f.is_file() and f.parent.name == "d"),
                  key=lambda f: -f.stat().st_size)


def _no_array_read(monkeypatch):
    """Fail the test if orbax reads an array (the damage must be found first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("an array was read before the damage was reported")
    monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "restore", refuse)
    monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "metadata", refuse)


@pytest.mark.parametrize("damage, pattern", [
    (lambda f: f.unlink(), r": missing \(the checkpoint is damaged\)"),
    (lambda f: f.write_bytes(f.read_bytes()[:-7]), r": (\d+) bytes where the manifest records \d+ \(truncated"),
    (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]),
     r": sha256 does not match the manifest \(damaged or modified\)"),
])
def test_damaged_array_file_is_named_before_any_array_is_read(saved, tmp_path, monkeypatch, damage, pattern):
    path = _copy(saved, tmp_path)
    victim = _array_files(path)[0]
    damage(victim)
    _no_array_read(monkeypatch)
    with pytest.raises(models.ModelError, match=re.escape(str(victim)) + pattern):
        models.restore(path)


def test_deleted_metadata_file_is_named(saved, tmp_path, monkeypatch):
    path = _copy(saved, tmp_path)
    (path / "params" / "_METADATA").unlink()
    _no_array_read(monkeypatch)
    with pytest.raises(models.ModelError, match=r"params/_METADATA: missing"):
        models.restore(path)


def test_damaged_format_1_checkpoint_is_one_clear_error(saved, tmp_path):
    """A checkpoint of the first format has no file list: orbax's error becomes one line naming params/."""
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    del manifest["files"]
    (path / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "format": "jaxkv-model/1"}))
    (path / "params" / "_METADATA").unlink()
    with pytest.raises(models.ModelError, match=r"copy/params: the saved arrays cannot be read \(") as info:
        models.restore(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("manifest_changes, pattern", [
    ({"dtype": None}, r"key 'dtype' is not a dtype name: None"),
    ({"sha256": []}, r"key 'sha256' must map tensor names to digests"),
    ({"files": {"params/x": {"size": "1"}}}, r"key 'files' must map file names to"),
])
def test_manifest_of_the_wrong_shape(saved, tmp_path, manifest_changes, pattern):
    path = _copy(saved, tmp_path)
    _edit_json(path / checkpoint.MANIFEST, **manifest_changes)
    with pytest.raises(models.ModelError, match=pattern):
        models.restore(path)


def test_checkpoint_tokenizer_damaged_or_absent(saved, tmp_path, params):
    assert checkpoint.restore_tokenizer(saved) is None  # saved without one: None, not an error
    path = tmp_path / "with_tokenizer"
    models.save(path, CONFIG, params, _TOKENIZER)
    assert checkpoint.restore_tokenizer(path).encode("ab") == _TOKENIZER.encode("ab")
    (path / checkpoint.TOKENIZER_FILE).write_text('{"format": "jaxkv-tokenizer/1"')
    with pytest.raises(models.ModelError, match=r"jaxkv_tokenizer\.json: tokenizer JSON: not valid JSON"):
        checkpoint.restore_tokenizer(path)


@pytest.mark.parametrize("file, content, pattern", [
    ("tokenizer.json", "{not json", r"tokenizer\.json: not a readable tokenizer definition"),
    ("tokenizer_config.json", "{not json", r"tokenizer_config\.json: not valid JSON"),
    ("tokenizer_config.json", "[]", r"tokenizer_config\.json: expected a JSON object, found list"),
    ("generation_config.json", '{"eos_token_id": "x"}', r"eos token ids: expected a list of token ids"),
])
def test_hf_tokenizer_files_are_named(tmp_path, file, content, pattern):
    (tmp_path / "tokenizer.json").write_text(_TOKENIZER.backend.to_str())
    (tmp_path / file).write_text(content)
    with pytest.raises(models.ModelError, match=pattern):
        models.Tokenizer.from_hf_dir(tmp_path)


# --------------------------------------------------------------------------- generate()


@pytest.mark.parametrize("prompts, kwargs, pattern", [
    ([], {}, r"prompts is empty"),
    ([[1, 2], []], {}, r"prompt 1 is empty"),
    ([[1, CONFIG.vocab_size]], {}, rf"prompt 0 has token id {CONFIG.vocab_size} outside the vocabulary \[0, "),
    ([[3, -1]], {}, r"prompt 0 has token id -1 outside the vocabulary"),
    ([[1, 2]], {"max_new_tokens": -1}, r"max_new_tokens must be >= 0, got -1"),
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
    ([[1, 2]], {"temperature": 1e-30}, r"temperature must be 0 \(greedy\) or >= 1e-06, got 1e-30"),
    ([[1, 2]], {"temperature": 1.0, "top_k": 0}, r"SamplingConfig\.top_k must be >= 1, got 0"),
    ([[1, 2]], {"temperature": 1.0, "top_p": 1.5}, r"SamplingConfig\.top_p must be in \(0, 1\], got 1.5"),
    ([[1, 2]], {"eos_ids": (CONFIG.vocab_size + 3,)}, rf"eos_ids: token id {CONFIG.vocab_size + 3} "
                                                      r"outside the vocabulary"),
    ([[1, 2]], {"seed": -1}, r"seed must be in \[0, 4294967295\], got -1"),
    ([[1, 2]], {"seed": 2**64}, r"seed must be in \[0, 4294967295\], got 18446744073709551616"),
    # A nested prompt was silently flattened.
    ([[[1, 2]]], {}, r"prompt 0 must be a flat sequence of token ids, got shape \(1, 2\)"),
    ([[[1, 2], [3]]], {}, r"prompt 0 must be a flat sequence of token ids, got nested sequences"),
    (np.ones((1, 2, 3), np.int32), {}, r"prompts: expected a 1-D array \(one prompt\) or a 2-D array"),
])
def test_generate_rejects(params, prompts, kwargs, pattern):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        generate(params, CONFIG, prompts, **kwargs)


@pytest.mark.parametrize("prompts, kwargs, pattern", [
    ([[1.5, 2.0]], {}, r"prompt 0 must be a sequence of int token ids \(found float64 elements\)"),
    ([[True, False]], {}, r"prompt 0 must be a sequence of int token ids \(found bool elements\)"),
    ("hello", {}, r"prompts must be token ids, not text \(encode it with the model's tokenizer first\)"),
    (["hello"], {}, r"prompt 0 must be token ids, not text"),
    (None, {}, r"prompts must be a list of prompts, each a sequence of int token ids, got None"),
    ([[1, 2], 3], {}, r"prompt 1 must be a sequence of int token ids, got 3"),
    ([[1, 2]], {"max_new_tokens": 2.5}, r"max_new_tokens must be an int >= 0, got 2.5"),
    ([[1, 2]], {"max_new_tokens": True}, r"max_new_tokens must be an int >= 0, got True"),
    ([[1, 2]], {"prefill_chunk": 2.5}, r"prefill_chunk must be an int >= 1 or None, got 2.5"),
    ([[1, 2]], {"seed": 1.5}, r"seed must be an int in \[0, 4294967295\], got 1.5"),
    ([[1, 2]], {"temperature": 1.0, "top_k": 2.5}, r"SamplingConfig\.top_k must be an int >= 1 or None, got 2.5"),
    ([[1, 2]], {"temperature": float("inf")}, r"SamplingConfig\.temperature must be a finite number >= 0"),
    ([[1, 2]], {"temperature": float("nan")}, r"SamplingConfig\.temperature must be a finite number >= 0"),
    ([[1, 2]], {"eos_ids": 5}, r"eos_ids must be a sequence of ints, got 5"),
    ([[1, 2]], {"eos_ids": [1.5]}, r"eos_ids must be a sequence of ints, got \[1.5\]"),
    ([[1, 2]], {"method": 3}, r"method must be a str, got 3"),
    ([[1, 2]], {"method": "topk", "cache_config": {"sink": 4}}, r"cache_config must be a CacheConfig or None"),
    ([[1, 2]], {"allow_beyond_context": "yes"}, r"allow_beyond_context must be a bool, got 'yes'"),
    ([[1, 2]], {"dtype": "int32"}, r"dtype must be a floating dtype \(e\.g\. jnp\.float32\) or None"),
])
def test_generate_rejects_wrong_types(params, prompts, kwargs, pattern):
    """Wrong types are TypeErrors (and ValueErrors, like every bad argument), raised before any work."""
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(TypeError, match=pattern) as info:
        generate(params, CONFIG, prompts, **kwargs)
    assert isinstance(info.value, ValueError)


def test_params_of_another_config_are_refused(params):
    """They would run (the matmuls take their shapes from the weights) and give wrong tokens."""
    with pytest.raises(models.ModelError, match=r"params do not match the config: tensor 'layers\.wo': "
                                                r"expected shape \(2, 8, 8, 32\), found \(2, 4, 8, 32\)"):
        generate(params, tiny_config(num_heads=8), [[1, 2]], max_new_tokens=1)
    split = models.unstack_layers(params, CONFIG.num_layers)
    with pytest.raises(models.ModelError, match=r"tensor 'embed': expected shape \(64, 32\), found \(128, 32\)"):
        prefill_prompts(split, tiny_config(vocab_size=64), [[1, 2]], capacity=4)
    with pytest.raises(TypeError, match=r"config must be a ModelConfig, got \{'vocab_size': 3\}"):
        generate(params, {"vocab_size": 3}, [[1, 2]], max_new_tokens=1)


def test_a_flat_list_of_ids_is_one_prompt(params):
    """Documented choice: [5, 6, 7] is the prompt [[5, 6, 7]] (as a 1-D array is), not three prompts."""
    one = generate(params, CONFIG, [[5, 6, 7]], max_new_tokens=2, eos_ids=())
    assert generate(params, CONFIG, [5, 6, 7], max_new_tokens=2, eos_ids=()).tokens == one.tokens
    assert generate(params, CONFIG, np.array([5, 6, 7]), max_new_tokens=2, eos_ids=()).tokens == one.tokens
    assert len(one.tokens) == 1 and len(one.tokens[0]) == 2


def test_a_request_too_large_for_memory_is_refused_before_allocating(params):
    """1e9 positions of the tiny model's cache (~0.5 TiB) cannot fit: both sizes are in the message."""
    with pytest.raises(memory.RequestTooLargeError,
                       match=r"KV cache needs [\d.]+ GiB of memory \(1 prompt\(s\) x \d+ positions "
                             r"\(prompt \+ max_new_tokens, rounded up to a compiled capacity\) x 2 layers"
                             r".*; [\d.]+ [GMT]iB is available") as refused:
        generate(params, CONFIG, [[1]], max_new_tokens=10**9, allow_beyond_context=True)
    assert int(re.search(r"x (\d+) positions", str(refused.value)).group(1)) >= 10**9 + 1


def test_memory_need_counts_the_staging_and_decode_caches():
    """Dense: the staging cache and the per-layer copies (each K and V of every position) are alive together."""
    backend = kvcache.make_backend(CONFIG, "dense", None, None, max_prompt=90, max_new_tokens=10)
    need = memory.request_need(backend, CONFIG, batch=3, dtype=jnp.float32, max_new_tokens=10)
    kv = 2 * 3 * CONFIG.num_kv_heads * CONFIG.head_dim * 4 * 100 * CONFIG.num_layers
    assert (need.device, need.host) == (2 * kv + 4 * 3 * 10, 0)
    sparse = kvcache.make_backend(CONFIG, "topk", topk.TopKConfig(sink=4, local=8, buffer=8), None, 90, 10)
    offloaded = memory.request_need(sparse, CONFIG, batch=3, dtype=jnp.float32, max_new_tokens=10)
    row = 2 * 3 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    assert offloaded.host == row * sparse.retrieval_capacity * CONFIG.num_layers
    assert offloaded.device == kv + row * (4 + 8 + 8) * CONFIG.num_layers + 4 * 3 * 10


def test_memory_check_names_both_sizes(monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 3 * 2**30)
    memory.check_fits(memory.Need(device=2 * 2**30, host=2**30, why="x"))  # 3 GiB fits in 3 GiB
    with pytest.raises(memory.RequestTooLargeError, match=r"needs 3.0 GiB of memory \(x\); 2.0 GiB is available"):
        monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * 2**30)
        memory.check_fits(memory.Need(device=2 * 2**30, host=2**30, why="x"))
    assert [memory.format_bytes(n) for n in (512, 1536, 5 * 2**40)] == ["512 B", "1.5 KiB", "5.0 TiB"]


class _FakeGPU:
    """A device reporting its memory the way JAX's GPU devices do (the CPU device reports None)."""

    platform = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 10 * 2**30, "bytes_in_use": 4 * 2**30}

    def __str__(self):
        return "cuda:0"


def test_memory_check_on_an_accelerator(monkeypatch):
    """Device and host memory are separate pools there: each need is checked against its own."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * 2**30)
    memory.check_fits(memory.Need(device=6 * 2**30, host=2 * 2**30, why="x"), devices=[_FakeGPU()])
    with pytest.raises(memory.RequestTooLargeError, match=r"needs 7.0 GiB of device memory \(x\); 6.0 GiB is free "
                                                          r"on cuda:0"):
        memory.check_fits(memory.Need(device=7 * 2**30, host=0, why="x"), devices=[_FakeGPU()])
    with pytest.raises(memory.RequestTooLargeError, match=r"offloaded KV cache needs 3.0 GiB of host memory"):
        memory.check_fits(memory.Need(device=2**30, host=3 * 2**30, why="x"), devices=[_FakeGPU()])


def test_generate_with_a_prefill_too_small(params):
    prefilled = prefill_prompts(params, CONFIG, [[1, 2, 3]], capacity=4, prefill_chunk=4)
    with pytest.raises(ValueError, match=r"prefilled cache holds 4 positions; this request needs 8"):
        generate(params, CONFIG, None, prefilled=prefilled, max_new_tokens=5)


def test_sampling_config_rejects_nan_temperature():
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0, got nan"):
        SamplingConfig(temperature=float("nan"))


@pytest.mark.parametrize("fields, pattern", [
    ({"sink": -1}, r"CacheConfig\.sink must be >= 0, got -1"),
    ({"buffer": 0}, r"CacheConfig\.buffer must be >= 1"),
    ({"dense_threshold": -5}, r"CacheConfig\.dense_threshold must be >= 0, got -5"),
    ({"slot_block": 0}, r"CacheConfig\.slot_block must be >= 1, got 0"),
    ({"slot_block": 2.5}, r"CacheConfig\.slot_block must be an int >= 1, got 2\.5"),
    ({"sink": 1.5}, r"CacheConfig\.sink must be an int >= 0 or None, got 1\.5"),
    ({"local": True}, r"CacheConfig\.local must be an int >= 0 or None, got True"),
    ({"offload": "no"}, r"CacheConfig\.offload must be a bool, got 'no'"),
])
def test_cache_config(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        kvcache.CacheConfig(**fields)


# --------------------------------------------------------------------------- method configs


@pytest.mark.parametrize("cls, fields, pattern", [
    (magicpig.MagicPIGConfig, {"K": 17}, r"MagicPIGConfig\.K must be in \[1, 16\], got 17"),
    (magicpig.MagicPIGConfig, {"L": 1}, r"MagicPIGConfig\.L must be >= 2, got 1"),
    (magicpig.MagicPIGConfig, {"K": 16, "L": 600}, r"K\*L = 9600 hash bits per key, above 8192"),
    (magicpig.MagicPIGConfig, {"K": 16, "L": 300}, r"L\*\(2\^K\+1\) = 19661100 bucket starts"),
    (magicpig.MagicPIGConfig, {"L": 4, "min_hits": 5}, r"MagicPIGConfig\.min_hits must be an int in 1\.\.L=4"),
    (magicpig.MagicPIGConfig, {"capacity": 1.5}, r"MagicPIGConfig\.capacity must be an int >= 1 or a float"),
    (magicpig.MagicPIGConfig, {"center": "yes"}, r"MagicPIGConfig\.center must be a bool"),
    (magicpig.MagicPIGConfig, {"dense_layers": (0, -1)}, r"MagicPIGConfig\.dense_layers must be >= 0, got \(0, -1\)"),
    (magicpig.MagicPIGConfig, {"candidate_capacity": 151.0}, r"candidate_capacity must be an int >= 1 or a float in "
                                                             r"\(0, L=150\]"),
    (magicpig.MagicPIGConfig, {"candidate_capacity": float("inf")}, r"candidate_capacity must be an int or a finite"),
    (magicpig.MagicPIGConfig, {"seed": 2**40}, r"MagicPIGConfig\.seed must be in \[0, 4294967295\]"),
    (pariskv.ParisKVConfig, {"m": 9}, r"ParisKVConfig\.m must be in \[2, 8\], got 9"),
    (pariskv.ParisKVConfig, {"top_k": 0}, r"ParisKVConfig\.top_k must be >= 1, got 0"),
    (pariskv.ParisKVConfig, {"collision_ratio": 1.5}, r"ParisKVConfig\.collision_ratio must be in \(0, 1\]"),
    (pariskv.ParisKVConfig, {"m": 4, "official_levels": True}, r"official_levels needs m=8, got m=4"),
    (pqcache.PQCacheConfig, {"n_centroids": 300}, r"PQCacheConfig\.n_centroids must be in \[1, 256\], got 300"),
    (topk.TopKConfig, {"top_k": 0}, r"TopKConfig\.top_k must be >= 1, got 0"),
    (hybrid.HybridConfig, {"pariskv": None, "tail": "none"}, r"pariskv=None with tail='none' has no head to work from"),
    (hybrid.HybridConfig, {"tail": "sampled"}, r"HybridConfig\.tail must be one of \('regression', 'lsh', 'none'\)"),
    (pariskv.ParisKVConfig, {"seed": -1}, r"ParisKVConfig\.seed must be in \[0, 4294967295\], got -1"),
    (pqcache.PQCacheConfig, {"seed": 2**70}, r"PQCacheConfig\.seed must be in \[0, 4294967295\]"),
    (dense.DenseConfig, {"kernels": "gpu"},
     r"DenseConfig\.kernels must be one of \('auto', 'xla', 'pallas', 'interpret', 'native'\), got 'gpu'"),
])
def test_method_config(cls, fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        cls(**fields)


_SIZE_FIELDS = [(magicpig.MagicPIGConfig, f) for f in ("K", "L", "sink", "local", "min_hits", "seed")] + \
    [(pariskv.ParisKVConfig, f) for f in ("m", "top_k", "sink", "local", "buffer", "seed")] + \
    [(pqcache.PQCacheConfig, f) for f in ("n_sub", "n_centroids", "kmeans_iters", "top_k", "sink", "local")] + \
    [(topk.TopKConfig, f) for f in ("top_k", "sink", "local", "buffer")] + \
    [(hybrid.HybridConfig, f) for f in ("sink", "local", "buffer")] + \
    [(kvcache.CacheConfig, f) for f in ("sink", "local", "buffer", "dense_threshold", "slot_block")]


@pytest.mark.parametrize("cls, field", _SIZE_FIELDS, ids=[f"{c.__name__}.{f}" for c, f in _SIZE_FIELDS])
@pytest.mark.parametrize("value", [2.5, 4.0, True, "4", float("nan")])
def test_sizes_must_be_ints(cls, field, value):
    """A float (even 4.0), a bool or a string where a count goes: a TypeError naming the field, at construction."""
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.{field} must be an int"):
        cls(**{field: value})


@pytest.mark.parametrize("cls", [magicpig.MagicPIGConfig, pariskv.ParisKVConfig, topk.TopKConfig])
def test_layer_lists_may_be_lists_and_hold_ints(cls):
    field = "dense_layers"
    assert getattr(cls(**{field: [0, 16]}), field) == (0, 16)
    assert hash(cls(**{field: [0, 16]})) == hash(cls(**{field: (0, 16)}))
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.{field} must be a sequence of ints"):
        cls(**{field: (0, 1.5)})


def test_numpy_values_are_normalised():
    """A numpy int is an int (configs built from array arithmetic), and the config equals the plain one."""
    assert topk.TopKConfig(top_k=np.int64(7)) == topk.TopKConfig(top_k=7)
    assert type(topk.TopKConfig(top_k=np.int64(7)).top_k) is int
    assert SamplingConfig(temperature=1) == SamplingConfig(temperature=1.0)


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



# --------------------------------------------------------------------------- study inputs


@pytest.mark.parametrize("content, pattern", [
    ("{", r"summaries\.json: not valid JSON"),
    ('["a"]', r"summaries\.json: expected an object of articles"),
])
def test_text_source_that_is_damaged_is_named(tmp_path, content, pattern):
    from jaxkv.eval import text

    (tmp_path / "summaries.json").write_text(content)
    with pytest.raises(ValueError, match=pattern):
        text._read_extracts(tmp_path / "summaries.json")
