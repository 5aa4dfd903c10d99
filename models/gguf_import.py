"""llama.cpp GGUF files: config and tokenizer from the metadata, dequantised weights.

Tensors are renamed to their HF names and layouts and go through the same
validation and conversion as safetensors checkpoints
(:func:`models.hf.params_from_hf_tensors`). llama.cpp's converter permutes
Llama's q/k projection rows into its interleaved RoPE layout; we undo that so
the split-halves RoPE of the decoder applies unchanged.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

import jax.numpy as jnp
import numpy as np

from models import quantized
from models.config import ModelConfig
from models.errors import ModelError, ModelNotFoundError
from models.hf import params_from_hf_tensors
from models.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass
class GGUFModel:
    """A GGUF file with its metadata read: the config and tokenizer, the weights not yet."""

    path: pathlib.Path
    config: ModelConfig
    tokenizer: Tokenizer
    tensors: dict  # name -> gguf.ReaderTensor (memory-mapped; read by params())

    def params(self, dtype=jnp.float32, *, keep_quantized: bool = False):
        """The weights, dequantised to ``dtype`` (``keep_quantized``: see :func:`load_gguf`)."""
        import gguf  # here, not at the top: the rest of models runs without the package (a GPU machine)

        by_hf_name = {_hf_name(name): name for name in self.tensors}

        def get_tensor(hf_name):
            tensor = self.tensors[by_hf_name[hf_name]]
            # GGUF lists dims fastest-first; numpy (and HF) want them slowest-first.
            shape = tuple(reversed([int(n) for n in tensor.shape]))
            fmt = tensor.tensor_type.name.lower()
            if keep_quantized and len(shape) == 2 and fmt in quantized.BLOCK_BYTES:
                weights = quantized.from_gguf_blocks(tensor.data, fmt, *shape)
            else:
                weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            return _unpermute_qk(self.config, hf_name, weights)

        return params_from_hf_tensors(self.config, by_hf_name, get_tensor, dtype, source=str(self.path))


def read_gguf(path) -> GGUFModel:
    """Read a GGUF file's metadata: config and tokenizer, every value checked (errors name the GGUF key)."""
    import gguf  # see GGUFModel.params

    path = pathlib.Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as err:  # IndexError: cut inside the metadata
        raise ModelError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(err).__name__}: {err})") from err
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    hf, labels = _hf_config(meta, tensors, path)
    config = ModelConfig.from_hf(hf, where=str(path), key_names=labels)
    # The tokenizer is read before any weight: an unsupported one fails before the slow dequantisation.
    try:
        tokenizer = Tokenizer.from_gguf_metadata(
            {k.removeprefix("tokenizer."): v for k, v in meta.items() if k.startswith("tokenizer.")})
    except ModelError as err:
        raise ModelError(f"{path}: {err}") from None
    return GGUFModel(path, config, tokenizer, tensors)


def load_gguf(path, dtype=jnp.float32, *, keep_quantized: bool = False):
    """(config, params, tokenizer) from a llama.cpp GGUF file (weights dequantised to ``dtype``).

    ``keep_quantized``: weight matrices stored as Q4_1 or Q8_0 stay in their blocks
    (:class:`models.quantized.QuantizedMatrix`, the decoder computes in float32 from
    them); the rest is dequantised to ``dtype``.
    """
    model = read_gguf(path)
    return model.config, model.params(dtype, keep_quantized=keep_quantized), model.tokenizer


def _hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; unknown names pass through (and are reported as unexpected)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return gguf_name


def _hf_config(meta: dict, tensors: dict, path: pathlib.Path) -> tuple[dict, dict[str, str]]:
    """The HF config.json equivalent of the GGUF metadata, and each HF key's GGUF key (for errors)."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelError(f"{path}: GGUF key 'general.architecture': expected llama, qwen2 or qwen3, found {arch!r}")
    if "rope_freqs.weight" in tensors:
        raise ModelError(f"{path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, Llama-3.1 GGUFs) "
                         "is not supported")
    labels: dict[str, str] = {}

    def key(hf_key, name, default=None, required=True):
        labels[hf_key] = f"GGUF key '{arch}.{name}'"
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise ModelError(f"{path}: GGUF key '{arch}.{name}' is missing")
        return value

    tokens = meta.get("tokenizer.ggml.tokens")
    hf = {
        "model_type": arch,
        "hidden_size": key("hidden_size", "embedding_length"),
        "vocab_size": len(tokens) if isinstance(tokens, list) and tokens else key("vocab_size", "vocab_size"),
        "intermediate_size": key("intermediate_size", "feed_forward_length"),
        "num_hidden_layers": key("num_hidden_layers", "block_count"),
        "num_attention_heads": key("num_attention_heads", "attention.head_count"),
        "num_key_value_heads": key("num_key_value_heads", "attention.head_count_kv", required=False),
        "head_dim": key("head_dim", "attention.key_length", required=False),
        "rms_norm_eps": key("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope_theta", "rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, path),
        "max_position_embeddings": key("max_position_embeddings", "context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    labels.update(rope_scaling=f"GGUF key '{arch}.rope.scaling.factor'",
                  bos_token_id="GGUF key 'tokenizer.ggml.bos_token_id'",
                  eos_token_id="GGUF key 'tokenizer.ggml.eos_token_id'")
    if arch != "qwen2":
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return hf, labels


def _rope_scaling(meta: dict, arch: str, path: pathlib.Path) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.get(f"{arch}.rope.scaling.factor")}
    raise ModelError(f"{path}: GGUF key '{arch}.rope.scaling.type': {kind!r} is not supported (none, linear)")


def _unpermute_qk(config: ModelConfig, hf_name: str, weights: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's Llama q/k row permutation (interleaved -> split-halves RoPE pairs)."""
    if config.model_type != "llama":
        return weights
    if hf_name.endswith("q_proj.weight") or hf_name.endswith("q_proj.bias"):
        heads = config.num_heads
    elif hf_name.endswith("k_proj.weight") or hf_name.endswith("k_proj.bias"):
        heads = config.num_kv_heads
    else:
        return weights
    order = np.arange(weights.shape[0]).reshape(heads, config.head_dim // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(weights, quantized.QuantizedMatrix):
        return quantized.permute_rows(weights, order)
    return weights[order]
