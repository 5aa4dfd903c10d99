"""Tiny checkpoints for the models tests: transformers-built references and raw safetensors."""
from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from models.config import ModelConfig
from models.hf import hf_shape, hf_tensor_table

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=512, rms_norm_eps=1e-6)

# The three families of the acceptance criteria, each exercising what sets it apart.
TINY_HF_CONFIGS = {
    # Llama-3.1: llama3 rope scaling; positions up to 200 pass original_max_position_embeddings=64.
    "llama31": ("llama", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # Qwen2: q/k/v biases, MQA (one KV head), tied embeddings.
    "qwen2": ("qwen2", dict(_COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    # Qwen3: q/k RMSNorm, head_dim 32 != 64 / 4 heads; saved sharded.
    "qwen3": ("qwen3", dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            tie_word_embeddings=False)),
}


def save_transformers_model(kind: str, directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A transformers model of TINY_HF_CONFIGS[kind] with random weights, saved to ``directory``.

    Every weight is redrawn, norms and biases included (HF initialises norms to
    1 and biases to 0, which would hide a missing norm or bias), at a scale that
    gives logits of order 1, so 1e-4 tolerances are meaningful.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = TINY_HF_CONFIGS[kind]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.copy_(1.0 + 0.3 * torch.randn_like(weight))
            else:
                weight.normal_(0.0, 0.15 if weight.ndim > 1 else 0.3)
    # Shards of ~50 kB split the tiny Qwen3 into several files.
    model.save_pretrained(directory, max_shard_size="50KB" if kind == "qwen3" else "1GB")
    return directory


def reload_transformers_model(directory: pathlib.Path, dtype: str = "float32"):
    """The reference in ``dtype`` (float32 or bfloat16): reloaded from disk (see DESIGN.md on casting live models)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()


def write_random_hf_checkpoint(directory: pathlib.Path, config: ModelConfig, *, drop=(), extra=None,
                               hf_overrides=None, seed: int = 0, dtype=np.float32) -> pathlib.Path:
    """A HF directory for ``config`` written without transformers: random tensors of the HF shapes.

    drop: tensor names to leave out; extra: {name: array} to add;
    hf_overrides: config.json keys to change after writing the weights.
    """
    rng = np.random.default_rng(seed)
    tensors = {name: rng.standard_normal(hf_shape(shape, n_in)).astype(dtype)
               for name, (_, shape, n_in) in hf_tensor_table(config).items() if name not in drop}
    tensors.update(extra or {})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({**config.to_hf(), **(hf_overrides or {})}))
    return directory


def tiny_config(**changes) -> ModelConfig:
    """A small Llama ModelConfig for tests that need no reference model."""
    fields = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                  rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False,
                  attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))
    return ModelConfig(**{**fields, **changes})
