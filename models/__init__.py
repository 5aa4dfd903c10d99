"""Llama / Qwen2 / Qwen3 decoders in JAX: config, parameters, forward pass, checkpoint import.

Public entry points: :func:`load` (any source; :func:`open_model` reads only its config
and tokenizer), :func:`load_hf`, :func:`load_gguf`,
:func:`forward` (dense), :func:`forward_hidden` (attention as a plug-in),
:func:`save` / :func:`restore` (orbax), :class:`Tokenizer`.
"""
from models.checkpoint import restore, save
from models.config import ModelConfig
from models.decoder import (
    ROW_BITS,
    KVCache,
    cached_attention,
    dense_causal_attention,
    forward,
    forward_hidden,
    init_cache,
    lm_head,
    prefix_causal_attention,
    rms_norm,
    row_dtype,
    row_values,
    rows_to_store,
    stored_rows,
    transpose_keys,
    write_if,
)
from models.errors import ModelError, ModelNotFoundError
from models.gguf_import import load_gguf
from models.hf import load_hf
from models.files import LeftoverRemovedWarning
from models.loading import ModelSource, default_model_path, load, open_model
from models.params import (LayerParams, Params, activation_dtype, cast_params, check_tree, init_params,
                           layers_are_split, param_shapes, params_to_dict, unstack_layers)
from models.tokenizer import Tokenizer

__all__ = [
    "KVCache", "LeftoverRemovedWarning", "ModelSource", "ROW_BITS", "activation_dtype", "cached_attention", "cast_params", "LayerParams", "ModelConfig", "ModelError", "ModelNotFoundError", "Params", "Tokenizer",
    "default_model_path", "dense_causal_attention", "forward", "forward_hidden", "init_cache", "init_params",
    "check_tree", "lm_head", "load", "load_gguf", "load_hf", "open_model", "params_to_dict", "param_shapes", "prefix_causal_attention", "restore", "rms_norm", "row_dtype", "row_values", "rows_to_store", "save", "stored_rows",
    "layers_are_split", "transpose_keys", "unstack_layers", "write_if",
]
