"""Llama-3.1-8B's and Llama-3.2-1B's shapes as ModelConfigs, for random-weight GPU runs.

The fields are those of the models' Hugging Face ``config.json`` (no weights ship
here); ``num_layers`` may be reduced, every per-layer shape stays the real one.
"""
from __future__ import annotations

import dataclasses

import models

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_COMMON = {"model_type": "llama", "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "attention_bias": False, "bos_token_id": 128000}

HF_CONFIGS = {
    "llama-3.1-8b": {**_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "head_dim": 128, "tie_word_embeddings": False, "eos_token_id": 128001,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "llama-3.2-1b": {**_COMMON, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "head_dim": 64, "tie_word_embeddings": True, "eos_token_id": 128001,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}},
}


def llama_config(name: str, num_layers: int | None = None) -> models.ModelConfig:
    """The ModelConfig of ``name`` (a key of HF_CONFIGS), with ``num_layers`` layers if given.

    Raises:
        ValueError: for an unknown name or a layer count below 1.
    """
    if name not in HF_CONFIGS:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(HF_CONFIGS)}")
    config = models.ModelConfig.from_hf(HF_CONFIGS[name])
    if num_layers is None:
        return config
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return dataclasses.replace(config, num_layers=num_layers)
