"""generate()'s arguments, checked before any work is traced or allocated; each error names the argument.

``prompts`` is a sequence of prompts, each a sequence (list, tuple, 1-D array) of int
token ids, or a 2-D int array with one prompt per row. A flat sequence of ints (or a
1-D array) is taken as one prompt: ``generate(..., [5, 6, 7])`` is
``generate(..., [[5, 6, 7]])``. Text must be encoded first (``models.Tokenizer.encode``).
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import models
from jaxkv.cache import CacheConfig
from models import fields


def check_model(params, config) -> None:
    """``params`` must be a models.Params whose tensors have ``config``'s shapes (else they would run, wrongly).

    Weights split per layer (models.unstack_layers) must hold every layer of the config.
    """
    fields.check_value("config", config, models.ModelConfig)
    fields.check_value("params", params, models.Params)
    if models.layers_are_split(params):
        if len(params.layers) != config.num_layers:
            raise ValueError(f"params holds {len(params.layers)} split layers; the config has "
                             f"num_layers = {config.num_layers}")
        expected = {name: shape for name, shape in models.param_shapes(config).items() if name != "layers"}
        found = {name: getattr(params, name) for name in ("embed", "final_norm", "unembed")
                 if getattr(params, name) is not None}
    else:
        expected, found = models.param_shapes(config), models.params_to_dict(params)
    try:
        models.check_tree(expected, found)
    except models.ModelError as err:
        raise models.ModelError(f"params do not match the config: {err}") from None


def prompt_rows(prompts, config) -> list[list[int]]:
    """The prompts as lists of token ids, each non-empty and inside the vocabulary.

    Raises:
        TypeError: ``prompts`` (or one prompt) is not a sequence of int token ids.
        ValueError: a prompt is empty or holds an id outside [0, vocab_size).
    """
    rows = [_token_ids(prompt, i) for i, prompt in enumerate(_prompt_list(prompts))]
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in row if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    return rows


def check_generate(config, rows: list[list[int]], *, max_new_tokens, eos_ids, seed, method, cache_config,
                   prefill_chunk, allow_beyond_context, dtype, mesh) -> tuple[int, ...]:
    """Check generate()'s scalar arguments against the prompts and the model; return the EOS ids to stop on.

    Raises:
        TypeError / ValueError: naming the argument (a TypeError for a wrong type is a ValueError too).
    """
    max_new_tokens = fields.check_value("max_new_tokens", max_new_tokens, int, fields.NON_NEGATIVE)
    allow_beyond_context = fields.check_value("allow_beyond_context", allow_beyond_context, bool)
    longest = max(len(r) for r in rows) + max_new_tokens
    if longest > config.max_position_embeddings and not allow_beyond_context:
        raise ValueError(
            f"prompt + max_new_tokens = {longest} tokens exceeds the model's "
            f"max_position_embeddings = {config.max_position_embeddings} "
            "(pass allow_beyond_context=True to go past it anyway)")
    fields.check_value("seed", seed, int, fields.SEED)
    fields.check_value("method", method, str)
    fields.check_value("cache_config", cache_config, CacheConfig | None)
    check_prefill(prefill_chunk=prefill_chunk, dtype=dtype, mesh=mesh)
    return eos_token_ids(eos_ids, config)


def check_prefill(*, prefill_chunk, dtype, mesh, capacity=None) -> None:
    """Check the arguments prefill_prompts() shares with generate() (capacity: prefill_prompts' own)."""
    fields.check_value("prefill_chunk", prefill_chunk, int | None, fields.at_least(1))
    if capacity is not None:
        fields.check_value("capacity", capacity, int, fields.at_least(1))
    fields.check_value("mesh", mesh, jax.sharding.Mesh | None)
    if dtype is not None and not _is_float_dtype(dtype):
        raise fields.FieldTypeError(None, "dtype", dtype, "a floating dtype (e.g. jnp.float32) or None")


def eos_token_ids(eos_ids, config) -> tuple[int, ...]:
    """The ids that end a row: ``eos_ids`` (a sequence of ids), or the model's when None."""
    if eos_ids is None:
        return tuple(config.eos_token_ids)
    if isinstance(eos_ids, np.ndarray):
        eos_ids = eos_ids.tolist()
    ids = fields.check_value("eos_ids", eos_ids, tuple[int, ...])
    outside = [t for t in ids if not 0 <= t < config.vocab_size]
    if outside:
        raise ValueError(f"eos_ids: token id {outside[0]} outside the vocabulary [0, {config.vocab_size})")
    return ids


_IDS = "a sequence of int token ids"
_TEXT = "token ids, not text (encode it with the model's tokenizer first)"


def _prompt_list(prompts) -> list:
    """``prompts`` as a list of prompts (a flat sequence of ints is one prompt)."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim not in (1, 2):
            raise ValueError(f"prompts: expected a 1-D array (one prompt) or a 2-D array (one prompt per row), "
                             f"got shape {prompts.shape}")
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, (str, bytes)):
        raise fields.FieldTypeError(None, "prompts", prompts, _TEXT)
    if not isinstance(prompts, Sequence):
        raise fields.FieldTypeError(None, "prompts", prompts, f"a list of prompts, each {_IDS}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(_is_token(t) for t in prompts):
        return [prompts]
    return list(prompts)


def _token_ids(prompt, i: int) -> list[int]:
    if isinstance(prompt, (str, bytes)):
        raise fields.FieldTypeError(None, f"prompt {i}", prompt, _TEXT)
    if not isinstance(prompt, (Sequence, np.ndarray, jax.Array)):
        raise fields.FieldTypeError(None, f"prompt {i}", prompt, _IDS)
    try:
        array = np.asarray(prompt)
    except ValueError:  # ragged nesting
        raise ValueError(f"prompt {i} must be a flat sequence of token ids, got nested sequences") from None
    if array.ndim != 1:
        raise ValueError(f"prompt {i} must be a flat sequence of token ids, got shape {array.shape}")
    if array.size == 0:  # [] reads as float64: empty, reported by the caller
        return []
    if not np.issubdtype(array.dtype, np.integer):
        kind = "str" if array.dtype.kind in "US" else array.dtype.name
        raise fields.FieldTypeError(None, f"prompt {i}", prompt, f"{_IDS} (found {kind} elements)")
    return array.astype(np.int64).tolist()


def _is_token(value) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_float_dtype(dtype) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        return False
