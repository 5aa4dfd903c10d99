"""Checkpoints: orbax save/restore (bit-identical, atomic, tamper-evident) and exact bf16 safetensors import."""
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from helpers_tiny_models import tiny_config, write_random_hf_checkpoint
from models import checkpoint
from models.tokenizer import _byte_alphabet


def small_tokenizer() -> models.Tokenizer:
    """A byte-level BPE tokenizer from GGUF-style metadata: 256 bytes, two merges, two control tokens."""
    tokens = [*_byte_alphabet().values(), "he", "Ġt", "<|im_start|>", "<|im_end|>"]
    return models.Tokenizer.from_gguf_metadata({
        "ggml.model": "gpt2", "ggml.pre": "smollm", "ggml.tokens": tokens, "ggml.merges": ["h e", "Ġ t"],
        "ggml.token_type": [1] * 258 + [3, 3], "ggml.eos_token_id": 259, "ggml.bos_token_id": 258,
    })


@pytest.fixture(scope="module")
def qwen3_like():
    """A config with every optional part (biases, o bias, q/k norms, untied output) and random params."""
    config = tiny_config(model_type="qwen3", attention_bias=True, attention_out_bias=True, qk_norm=True)
    return config, models.init_params(config, jax.random.key(0))


def _assert_bit_identical(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_is_bit_identical(tmp_path, qwen3_like, dtype):
    config, params = qwen3_like
    params = models.cast_params(params, dtype)
    models.save(tmp_path / "ckpt", config, params)
    restored_config, restored = models.restore(tmp_path / "ckpt")
    assert restored_config == config
    _assert_bit_identical(params, restored)


def test_tokenizer_travels_with_the_checkpoint(tmp_path, qwen3_like):
    config, params = qwen3_like
    tokenizer = small_tokenizer()
    models.save(tmp_path / "ckpt", config, params, tokenizer=tokenizer)
    loaded_config, loaded_params, loaded_tokenizer = models.load(tmp_path / "ckpt")
    assert loaded_config == config
    _assert_bit_identical(params, loaded_params)
    text = "<|im_start|>the heat<|im_end|>"
    assert loaded_tokenizer.encode(text) == tokenizer.encode(text)
    assert tokenizer.encode(" the") == [257, 256]  # merges applied: "Ġt", "he"
    assert loaded_tokenizer.eos_token_ids == (259,)
    assert loaded_tokenizer.apply_chat_template("hi") == tokenizer.apply_chat_template("hi")


def test_save_refuses_an_existing_path(tmp_path, qwen3_like):
    config, params = qwen3_like
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError, match="ckpt"):
        models.save(tmp_path / "ckpt", config, params)


def test_interrupted_save_leaves_nothing(tmp_path, qwen3_like, monkeypatch):
    """A failure after the arrays are written (here: writing the tokenizer) leaves no directory behind."""
    config, params = qwen3_like

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.Tokenizer, "to_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.save(tmp_path / "ckpt", config, params, tokenizer=small_tokenizer())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(models.ModelNotFoundError):
        models.restore(tmp_path / "ckpt")


def test_directory_without_manifest_is_refused(tmp_path, qwen3_like):
    """What a killed save would leave if it were renamed early: arrays but no manifest."""
    config, params = qwen3_like
    models.save(tmp_path / "ckpt", config, params)
    (tmp_path / "ckpt" / checkpoint.MANIFEST).unlink()
    with pytest.raises(models.ModelError, match="interrupted save"):
        models.restore(tmp_path / "ckpt")


def test_config_not_matching_the_arrays_is_refused(tmp_path, qwen3_like):
    config, params = qwen3_like
    models.save(tmp_path / "ckpt", config, params)
    config_file = tmp_path / "ckpt" / "config.json"
    hf = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**hf, "intermediate_size": 48}))
    with pytest.raises(models.ModelError, match=r"w_down.*expected shape \(2, 48, 32\), found \(2, 64, 32\)"):
        models.restore(tmp_path / "ckpt")


def test_dtype_not_matching_the_manifest_is_refused(tmp_path, qwen3_like):
    config, params = qwen3_like
    models.save(tmp_path / "ckpt", config, params)
    manifest_file = tmp_path / "ckpt" / checkpoint.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "dtype": "bfloat16"}))
    with pytest.raises(models.ModelError, match="expected dtype bfloat16, found float32"):
        models.restore(tmp_path / "ckpt")


def test_swapped_arrays_are_refused(tmp_path, qwen3_like):
    """Arrays of the right shapes but other values (another checkpoint's): their files are not the manifest's."""
    config, params = qwen3_like
    models.save(tmp_path / "a", config, params)
    models.save(tmp_path / "b", config, models.init_params(config, jax.random.key(1)))
    shutil.rmtree(tmp_path / "a" / "params")
    shutil.copytree(tmp_path / "b" / "params", tmp_path / "a" / "params")
    with pytest.raises(models.ModelError, match=r"a/params/.*: (missing|sha256 does not match)"):
        models.restore(tmp_path / "a")


def test_params_not_matching_the_config_are_not_saved(tmp_path, qwen3_like):
    config, params = qwen3_like
    with pytest.raises(models.ModelError, match="'layers.k_norm' is not part of this config"):
        models.save(tmp_path / "ckpt", dataclasses.replace(config, qk_norm=False), params)
    assert not (tmp_path / "ckpt").exists()


def test_bfloat16_safetensors_load_exactly(tmp_path):
    """Real checkpoints are bf16: loading to float32 upcasts exactly; loading to bf16 keeps the bits."""
    from safetensors.numpy import load_file

    config = tiny_config()
    write_random_hf_checkpoint(tmp_path, config, dtype=jnp.bfloat16)
    stored = load_file(str(tmp_path / "model.safetensors"))
    _, as_f32 = models.load_hf(tmp_path, dtype=jnp.float32)
    _, as_bf16 = models.load_hf(tmp_path, dtype=jnp.bfloat16)
    q_proj = stored["model.layers.1.self_attn.q_proj.weight"]
    expected_wq = q_proj.astype(np.float32).T.reshape(config.hidden_size, config.num_heads, config.head_dim)
    np.testing.assert_array_equal(np.asarray(as_f32.layers.wq[1]), expected_wq)
    assert as_bf16.layers.wq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(as_bf16.embed), stored["model.embed_tokens.weight"])
