"""The decoder (Llama, Qwen2, Qwen3) as pure functions, with attention as a plug-in.

:func:`forward_hidden` runs every layer's math except attention itself, which
it calls through a hook — how ``jaxkv.generate`` plugs a sparse method into a
layer. :func:`forward` is the dense model: forward_hidden with the plain causal
attention of :func:`dense_causal_attention`, over the prompt itself or over a
dense :class:`KVCache`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from models import quantized
from models.config import ModelConfig
from models.errors import ModelError
from models.params import LayerParams, Params, layer_params, layers_are_split
from models.rope import apply_rope, inverse_frequencies

# One layer's attention step, for a sequence of per-layer hooks:
# attention(q [B,T,Hq,hd], k [B,T,Hkv,hd], v [B,T,Hkv,hd], positions [B,T], state) -> (out [B,T,Hq,hd], state)
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, object], tuple[jax.Array, object]]
# One hook for every layer: it gets all layers' states (leading num_layers axis) and
# the layer's index, and returns all of them, updating only its layer:
# attention(q, k, v, positions, states, layer) -> (out, states)
StackedAttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, object, jax.Array],
                              tuple[jax.Array, object]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Dense cache of keys and values (after k-norm and RoPE), by KV head.

    For one layer, ``v`` is [B, num_kv_heads, max_len, head_dim] (head-major)
    and ``k`` is [B, num_kv_heads, head_dim, max_len] (each head's keys as
    columns); every layer's cache has a leading num_layers axis on both. Laid
    out so that both of a decode step's contractions run along the cache's
    minor axis and read it where it lies (docs/results/implementation_notes.md,
    "The decoder"); a position-major cache made XLA transpose K and V on every step.

    A bfloat16 cache from :func:`init_cache` holds its rows' bits (:data:`ROW_BITS`, see
    :func:`stored_rows`); ``dtype`` is the dtype of the rows it holds. A cache of bfloat16
    arrays works too, but XLA CPU widens and copies it for every write.
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        """Positions the cache holds."""
        return self.v.shape[-2]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the keys and values the cache holds (bfloat16 for a store of bits)."""
        return row_dtype(self.v)


# XLA CPU (jax 0.10.2) widens a whole bfloat16 buffer to float32 and back, and copies it, for
# any write into it (docs/results/implementation_notes.md, "The decoder"). So a buffer a
# decode step writes into (this cache, and jaxkv.cache's regions) holds a bfloat16 row's
# bits as uint16, written as integers in place; readers take the rows back as bfloat16 (the
# CPU kernels read the bits in place). A bitcast of a whole bfloat16 buffer to write through
# is no way round it: XLA CPU copies the buffer for that too.
ROW_BITS = jnp.uint16


def stored_rows(x: jax.Array) -> jax.Array:
    """Rows as a cache stores them: bfloat16 as its bits (:data:`ROW_BITS`), others as they are."""
    return jax.lax.bitcast_convert_type(x, ROW_BITS) if x.dtype == jnp.bfloat16 else x


def row_values(x: jax.Array) -> jax.Array:
    """The rows a cache's store x holds (the inverse of :func:`stored_rows`)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == ROW_BITS else x


def row_dtype(store) -> jnp.dtype:
    """The dtype of the rows a cache's store holds."""
    return jnp.dtype(jnp.bfloat16) if store.dtype == ROW_BITS else jnp.dtype(store.dtype)


def rows_to_store(x: jax.Array, store: jax.Array) -> jax.Array:
    """Rows x as ``store`` holds them: of its rows' dtype, as bits where it holds bits."""
    x = x.astype(row_dtype(store))
    return stored_rows(x) if store.dtype == ROW_BITS else x


# Every layer's cache, axis by axis: V head-major, K with its last two axes swapped.
_V_AXES = ("num_layers", "B", "num_kv_heads", "max_len", "head_dim")
_K_AXES = (*_V_AXES[:3], "head_dim", "max_len")


def _cache_sizes(config: ModelConfig, batch: int, max_len) -> dict[str, int]:
    return dict(num_layers=config.num_layers, B=batch, num_kv_heads=config.num_kv_heads, max_len=max_len,
                head_dim=config.head_dim)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An all-zero cache for ``batch`` sequences of up to ``max_len`` tokens of ``dtype``, every layer."""
    sizes = _cache_sizes(config, batch, max_len)
    return KVCache(*(stored_rows(jnp.zeros(tuple(sizes[a] for a in axes), dtype)) for axes in (_K_AXES, _V_AXES)))


def transpose_keys(k: jax.Array) -> jax.Array:
    """Head-major keys [..., S, hd] to :class:`KVCache`'s layout [..., hd, S], and back."""
    return jnp.swapaxes(k, -1, -2)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back before the weight (as HF)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


# Scores per KV head in one key block of prefix_causal_attention: the fastest block size
# for a prefill chunk (docs/results/implementation_notes.md, "The decoder").
SCORES_PER_BLOCK = 512 * 1536

# A finite floor for masked scores, not -inf: a row that sees nothing stays finite instead of NaN.
_SCORE_FLOOR = float(jnp.finfo(jnp.float32).min)


def dense_causal_attention(q, k_all, v_all, q_positions, kv_positions, *, query_block: int = 512) -> jax.Array:
    """Softmax attention where a query at position p sees the keys at positions <= p.

    q [B, T, Hq, hd]; k_all [B, Hkv, hd, S] and v_all [B, Hkv, S, hd], as one
    layer of :class:`KVCache`; q_positions [B, T]; kv_positions [B, S] or [S]. Query head h uses KV head
    h // (Hq/Hkv), as HF's ``repeat_kv``. Scores and softmax in float32; returns
    [B, T, Hq, hd] in q's dtype. Queries go ``query_block`` at a time
    (``lax.map``), so a long prefill holds [Hq, query_block, S] scores at once,
    not [Hq, T, S].
    """
    _check_attention_shapes("dense_causal_attention", q, k_all, v_all)
    kv_positions = jnp.broadcast_to(kv_positions, (q.shape[0], v_all.shape[2]))

    def attend(q, q_positions):
        _, sums, acc = jax.vmap(_softmax_partial)(q, k_all, v_all, q_positions, kv_positions)
        return jax.vmap(_normalise)(q, sums, acc)

    return _by_query_block(attend, q, q_positions, query_block)


def prefix_causal_attention(q, k_all, v_all, q_positions, *, query_block: int = 512,
                            key_block: int | None = None) -> jax.Array:
    """:func:`dense_causal_attention` over a cache whose key at index i has position i.

    Keys go ``key_block`` at a time (an online softmax in a ``fori_loop``) and the
    loop stops at the block holding the last query's position, so a prefill chunk
    reads the prefix it can see, not the whole cache: chunked prefill costs half
    the attention work of attending to every slot. key_block=None takes as many
    keys as hold a block's scores to :data:`SCORES_PER_BLOCK` per KV head: 512 keys
    for a 512-token chunk of SmolLM2 (G = 3), the whole cache for a decode step,
    where blocks would only add copies.
    """
    _check_attention_shapes("prefix_causal_attention", q, k_all, v_all)
    if key_block is not None and key_block < 1:
        raise ModelError(f"prefix_causal_attention: key_block must be >= 1 or None, got {key_block}")
    b, s = q.shape[0], v_all.shape[2]
    queries_per_kv_head = min(q.shape[1], query_block) * q.shape[2] // k_all.shape[1]
    block = min(key_block or max(SCORES_PER_BLOCK // queries_per_kv_head, 1), s)
    n_blocks = -(-s // block)
    never = jnp.iinfo(jnp.int32).max  # a position no query reaches

    def attend(q, q_positions):
        def add_block(j, carry):
            m, sums, acc = carry
            # The last block is shifted back to end at s; its keys before j * block were counted already.
            start = jnp.minimum(j * block, s - block)
            index = start + jnp.arange(block, dtype=jnp.int32)
            kv_positions = jnp.broadcast_to(jnp.where(index >= j * block, index, never), (b, block))
            keys = jax.lax.dynamic_slice_in_dim(k_all, start, block, axis=3)
            values = jax.lax.dynamic_slice_in_dim(v_all, start, block, axis=2)
            m_block, sums_block, acc_block = jax.vmap(_softmax_partial)(q, keys, values, q_positions, kv_positions)
            m_new = jnp.maximum(m, m_block)
            old, new = jnp.exp(m - m_new), jnp.exp(m_block - m_new)
            return m_new, sums * old + sums_block * new, acc * old[..., None] + acc_block * new[..., None]

        hkv, rows, hd = k_all.shape[1], q.shape[1] * q.shape[2] // k_all.shape[1], q.shape[3]
        empty = (jnp.full((b, hkv, rows), _SCORE_FLOOR), jnp.zeros((b, hkv, rows)), jnp.zeros((b, hkv, rows, hd)))
        last = jnp.clip(jnp.max(q_positions) // block + 1, 1, n_blocks)
        _, sums, acc = jax.lax.fori_loop(0, last, add_block, empty)
        return jax.vmap(_normalise)(q, sums, acc)

    return _by_query_block(attend, q, q_positions, query_block)


def _check_attention_shapes(name, q, k_all, v_all) -> None:
    b, _, hq, hd = q.shape
    keys_shape = (*v_all.shape[:-2], v_all.shape[-1], v_all.shape[-2])  # V's with the last two axes swapped
    if hq % v_all.shape[1] or k_all.shape != keys_shape or v_all.shape[0] != b or v_all.shape[3] != hd:
        raise ModelError(f"{name}: q {q.shape} does not fit k {k_all.shape} / v {v_all.shape} "
                         "(expected k [B, Hkv, hd, S] and v [B, Hkv, S, hd], as KVCache)")


def _by_query_block(attend, q, q_positions, query_block: int):
    """attend(q [B, T', Hq, hd], q_positions [B, T']) over at most query_block queries at a time."""
    b, t, hq, hd = q.shape
    if t <= query_block:
        return attend(q, q_positions)
    n = -(-t // query_block)
    pad = n * query_block - t
    # Padding queries sit at position -1: they see no key, and are cut off below.
    q_blocks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, query_block, hq, hd)
    p_blocks = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1).reshape(b, n, query_block)
    out = jax.lax.map(lambda qp: attend(*qp), (q_blocks.swapaxes(0, 1), p_blocks.swapaxes(0, 1)))
    return out.swapaxes(0, 1).reshape(b, n * query_block, hq, hd)[:, :t]


def _softmax_partial(q, k, v, q_positions, kv_positions):
    """One sequence's softmax over some keys, unnormalised: (row max, row sum) [Hkv, T·G] and Σ p·v [Hkv, T·G, hd].

    q [T, Hq, hd]; k [Hkv, hd, S], v [Hkv, S, hd] (as :class:`KVCache`);
    q_positions [T]; kv_positions [S]. Scores are laid out [Hkv, T·G, S] and
    normalised after the value contraction, so both contractions run along the
    cache's minor axis (docs/results/implementation_notes.md, "The decoder").
    """
    t, hq, hd = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qg = q.reshape(t, hkv, g, hd).transpose(1, 0, 2, 3).reshape(hkv, t * g, hd)
    s = jnp.einsum("hds,hqd->hqs", k, qg, preferred_element_type=jnp.float32) / math.sqrt(hd)
    visible = jnp.repeat(q_positions, g)[:, None] >= kv_positions[None, :]
    s = jnp.where(visible[None], s, _SCORE_FLOOR)
    m = jnp.max(s, axis=2)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("hqs,hsd->hqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, jnp.sum(p, axis=2), acc


def _normalise(q, sums, acc):
    """[Hkv, T·G] sums and [Hkv, T·G, hd] Σ p·v of one sequence → its output [T, Hq, hd] in q's dtype."""
    t, hq, hd = q.shape
    hkv = acc.shape[0]
    out = acc / sums[..., None]
    return out.reshape(hkv, t, hq // hkv, hd).transpose(1, 0, 2, 3).reshape(t, hq, hd).astype(q.dtype)


def forward_hidden(params: Params, config: ModelConfig, tokens, positions, states,
                   attention: StackedAttentionFn | Sequence[AttentionFn]):
    """Embed, run every layer with the given attention step, final-norm.

    tokens, positions: [B, T] int32. ``attention`` is either

    * one :data:`StackedAttentionFn` for every layer: ``states`` has a leading
      num_layers axis on every leaf and rides in the carry of a ``lax.scan``
      over layers; the hook gets the layer index and updates that layer in
      place (scanning the states as xs → ys would copy every layer's cache on
      every decode step), or
    * a sequence of num_layers :data:`AttentionFn` (``states`` a tuple of
      per-layer states; a Python loop, for layers of different kinds).

    With ``params`` from :func:`models.params.unstack_layers` the layers run as a
    Python loop in both cases (the hook gets a constant layer index), reading
    each layer's weights where they lie instead of slicing them from the stack.

    Returns (hidden [B, T, D] after the final norm, new states).
    """
    _check_tokens(tokens, positions)
    inv_freq = inverse_frequencies(config)
    x = quantized.take_rows(params.embed, tokens)

    def layer_step(x, layer, state, attend):
        return _layer(layer, config, inv_freq, x, positions, state, attend)

    if callable(attention):
        _check_stacked_states(states, config.num_layers)

        def scan_body(carry, layer_and_index):
            x, states = carry
            layer, index = layer_and_index
            x, states = layer_step(x, layer, states, lambda q, k, v, pos, st: attention(q, k, v, pos, st, index))
            return (x, states), None
        if layers_are_split(params):
            for i in range(config.num_layers):
                (x, states), _ = scan_body((x, states), (layer_params(params, i), jnp.int32(i)))
        else:
            (x, states), _ = jax.lax.scan(scan_body, (x, states), (params.layers, jnp.arange(config.num_layers)))
    elif isinstance(attention, Sequence) and len(attention) == config.num_layers:
        if len(states) != config.num_layers:
            raise ModelError(f"states: expected {config.num_layers} per-layer states, found {len(states)}")
        new_states = []
        for i, (attend, state) in enumerate(zip(attention, states)):
            x, state = layer_step(x, layer_params(params, i), state, attend)
            new_states.append(state)
        states = tuple(new_states)
    else:
        raise ModelError(
            f"attention: expected a callable or a sequence of {config.num_layers} callables, found {attention!r}")
    return rms_norm(x, params.final_norm, config.rms_norm_eps), states


def lm_head(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits [..., V] in float32 from final hidden states [..., D]."""
    unembed = params.embed if config.tie_word_embeddings else params.unembed
    return quantized.unembed(hidden, unembed)


def forward(params: Params, config: ModelConfig, tokens, cache: KVCache | None = None, *, positions=None):
    """Dense decoder: logits [B, T, V] float32, or (logits, cache) when given a cache.

    positions [B, T] (default arange(T) for every row). With a cache, token t of
    row b is written at cache index positions[b, t] and attends the cache
    indices <= its position, so right-padded batches work; writes past the
    cache's length are dropped (JAX scatter semantics), so size it to fit.
    """
    tokens = jnp.asarray(tokens)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    if cache is None:
        hidden, _ = forward_hidden(params, config, tokens, positions, (), _self_attention)
        return lm_head(params, config, hidden)
    _check_cache(cache, config, tokens.shape[0])
    hidden, cache = forward_hidden(params, config, tokens, positions, cache, cached_attention)
    return lm_head(params, config, hidden), cache


def _self_attention(q, k, v, positions, states, layer):
    """Dense attention over the tokens of this call only (no cache, no state)."""
    return dense_causal_attention(q, transpose_keys(k.swapaxes(1, 2)), v.swapaxes(1, 2), positions, positions), states


def write_if(pred, write, *buffers):
    """write(*buffers) if pred holds, else the buffers as they are: one cond.

    For buffers a decode loop carries and then reads. In line, XLA CPU fused a
    row write into such a buffer with the reshape of each reader that attends
    it (batch 1) and copied the whole buffer twice per step; a cond's result is
    read where it lies.
    """
    return jax.lax.cond(pred, write, lambda *unchanged: unchanged, *buffers)


def cached_attention(q, k, v, positions, cache: KVCache, layer=None, *, attend=None):
    """Write this call's k, v at their positions, then attend to the cache.

    ``cache`` is one layer's (an :data:`AttentionFn`), or every layer's with
    ``layer`` the one to use (a :data:`StackedAttentionFn`). Only the new
    tokens are written; positions past max_len are dropped. ``attend(q, k_all,
    v_all, q_positions)`` attends to one layer's rows (bfloat16 ones given back from their
    bits, :func:`row_values`): by default
    :func:`prefix_causal_attention` (jaxkv passes a CPU kernel for decode steps).
    """
    rows = jnp.arange(q.shape[0])[:, None]
    lead = (rows,) if layer is None else (layer, rows)
    at_k, at_v = (*lead, slice(None), slice(None), positions), (*lead, slice(None), positions)

    def write(cache_k, cache_v):
        # Indexing [B,1] rows and [B,T] positions around the slices puts them first: [B, T, Hkv, hd].
        return (cache_k.at[at_k].set(rows_to_store(k, cache_k), mode="drop"),
                cache_v.at[at_v].set(rows_to_store(v, cache_v), mode="drop"))
    if layer is None:  # one layer's cache, e.g. a decode-loop carry: see write_if
        cache = KVCache(*write_if(jnp.any(positions < cache.max_len), write, cache.k, cache.v))
    else:
        cache = KVCache(*write(cache.k, cache.v))
    layer_k, layer_v = (cache.k, cache.v) if layer is None else (
        jax.lax.dynamic_index_in_dim(cache.k, layer, 0, keepdims=False),
        jax.lax.dynamic_index_in_dim(cache.v, layer, 0, keepdims=False))
    return (attend or prefix_causal_attention)(q, row_values(layer_k), row_values(layer_v), positions), cache


def _layer(layer: LayerParams, config: ModelConfig, inv_freq, x, positions, state, attention):
    """One pre-norm decoder layer: x + attention(norm(x)), then x + MLP(norm(x))."""
    eps = config.rms_norm_eps
    h = rms_norm(x, layer.attn_norm, eps)
    q, k, v = _project_qkv(h, layer)
    if config.qk_norm:
        q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    out, state = attention(q, k, v, positions, state)
    attn = quantized.contract(out.astype(x.dtype), layer.wo, 2, "bthk,hkd->btd")
    if layer.bo is not None:
        attn = attn + layer.bo
    x = x + attn
    h = rms_norm(x, layer.mlp_norm, eps)
    gated = jax.nn.silu(_matmul(h, layer.w_gate)) * _matmul(h, layer.w_up)
    return x + _matmul(gated, layer.w_down), state


def _project_qkv(h, layer: LayerParams):
    """h [B, T, D] through the q, k and v matrices, apart or joined (models.params.join_projections)."""
    if layer.wqkv is None:
        return _project(h, layer.wq, layer.bq), _project(h, layer.wk, layer.bk), _project(h, layer.wv, layer.bv)
    qkv = jnp.einsum("btd,dngk->btngk", h, layer.wqkv)  # [B, T, Hkv, G + 2, hd]
    if layer.bqkv is not None:
        qkv = qkv + layer.bqkv
    group = qkv.shape[3] - 2
    return qkv[..., :group, :].reshape(*qkv.shape[:2], -1, qkv.shape[-1]), qkv[..., group, :], qkv[..., group + 1, :]


def _matmul(h, w):
    """h [..., D] @ w [D, F] (an array or a QuantizedMatrix)."""
    return quantized.contract(h, w, 1, "...d,df->...f")


def _project(h, w, bias):
    """h [B, T, D] through w [D, H, hd] (+ bias [H, hd]) -> [B, T, H, hd]."""
    out = quantized.contract(h, w, 1, "btd,dhk->bthk")
    return out if bias is None else out + bias


def _check_cache(cache: KVCache, config: ModelConfig, batch: int) -> None:
    sizes = _cache_sizes(config, batch, None)
    for name, array, axes in (("cache.k", cache.k, _K_AXES), ("cache.v", cache.v, _V_AXES)):
        if array.ndim != 5 or any(sizes[a] not in (None, f) for a, f in zip(axes, array.shape)):
            expected = ", ".join(a if sizes[a] is None else f"{a}={sizes[a]}" for a in axes)
            raise ModelError(f"{name}: expected shape [{expected}], found {array.shape}")
    if cache.k.shape[-1] != cache.v.shape[-2]:
        raise ModelError(f"cache.k holds {cache.k.shape[-1]} positions and cache.v {cache.v.shape[-2]}")


def _check_stacked_states(states, num_layers: int) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(states)[0]:
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != num_layers:
            raise ModelError(f"states{jax.tree_util.keystr(path)}: expected a leading num_layers axis of "
                             f"{num_layers}, found shape {jnp.shape(leaf)}")


def _check_tokens(tokens, positions) -> None:
    if tokens.ndim != 2:
        raise ModelError(f"tokens: expected shape [B, T], found {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ModelError(f"positions: expected shape {tokens.shape} (as tokens), found {positions.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ModelError(f"tokens: expected an integer dtype, found {tokens.dtype}")
