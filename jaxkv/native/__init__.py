"""CPU kernels for ParisKV's selection (``pariskv_cpu.cc``), MagicPIG's sampling
(``magicpig_cpu.cc``) and a dense decode step (``dense_cpu.cc``), as XLA FFI custom calls.

Built on first use by ``models.native.build.KernelLibrary`` (a C++ compiler and a CPU
with AVX-512 VBMI, VBMI2, GFNI and BMI2; on a CPU with AVX2 only ParisKV's selection,
``AVX2_TARGETS``, in its AVX2 form). :func:`available` says whether kernels are
registered, :func:`unavailable_reason` why not. A config's ``kernels="native"`` runs them:
docs/architecture.md says which steps each method's config moves here.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from models.native.build import AVX512_FLAGS, KernelLibrary
from models.native.build import NativeUnavailable, cxx_compiler  # noqa: F401 (this package's public names too)

TARGETS = {"jaxkv_pariskv_coarse": "PariskvCoarse", "jaxkv_pariskv_rerank": "PariskvRerank",
           "jaxkv_top_k": "TopK", "jaxkv_magicpig_query_buckets": "MagicpigQueryBuckets",
           "jaxkv_magicpig_collide": "MagicpigCollide",
           "jaxkv_magicpig_merge": "MagicpigMerge", "jaxkv_magicpig_attend": "MagicpigAttend",
           "jaxkv_attend_rows": "AttendRows", "jaxkv_dense_decode": "DenseDecode"}
REQUIRED_CPU_FLAGS = AVX512_FLAGS
# Without REQUIRED_CPU_FLAGS, ParisKV's selection alone, in its AVX2 form (pariskv_cpu.cc).
AVX2_CPU_FLAGS = ("avx2", "fma", "bmi2", "popcnt")
AVX2_TARGETS = ("jaxkv_pariskv_coarse", "jaxkv_pariskv_rerank", "jaxkv_top_k")
# K and V rows the attention kernels read in place (widened in registers): float32, bfloat16,
# or uint16 holding bfloat16 bits (how jaxkv.cache stores a bfloat16 retrieval region).
ROW_DTYPES = (jnp.float32, jnp.bfloat16, jnp.uint16)

LIBRARY = KernelLibrary("jaxkv.native", "jaxkv_cpu", pathlib.Path(__file__).parent.glob("*.cc"), TARGETS,
                        REQUIRED_CPU_FLAGS, fallback=(AVX2_CPU_FLAGS, AVX2_TARGETS))


def unavailable_reason(*targets: str) -> str | None:
    """None once the kernels ``targets`` (FFI target names; default: every kernel) are
    registered, building them if needed; else why not: the CPU flags missing or the
    compiler's error."""
    return LIBRARY.unavailable_reason(*targets)


def available(*targets: str) -> bool:
    """Whether the kernels ``targets`` (default: every kernel) are built and registered
    (building them if needed)."""
    return LIBRARY.available(*targets)


def _load(target: str) -> None:
    LIBRARY.load(target)


def coarse_rows(signs: jax.Array, scores: jax.Array, bucket_counts: jax.Array, caps: jax.Array, n,
                count: int) -> jax.Array:
    """``pariskv.most_voted_rows(coarse_votes(...), count, ...)``, the vote table included:
    int32 [..., count].

    signs uint8 [..., cap, B]; scores float32 [..., B, 256] and caps float32 [..., tiers]
    (ascending) from ``pariskv.pattern_scores_and_caps``; bucket_counts int32 [..., B, 256];
    n [...] the valid rows. Leading axes are batch axes (here and in every function of this
    module).
    """
    _load("jaxkv_pariskv_coarse")
    batch = signs.shape[:-2]
    call = jax.ffi.ffi_call("jaxkv_pariskv_coarse", jax.ShapeDtypeStruct((*batch, count), jnp.int32),
                            vmap_method="broadcast_all")
    return call(signs, scores.astype(jnp.float32), bucket_counts.astype(jnp.int32), caps.astype(jnp.float32),
                jnp.broadcast_to(jnp.asarray(n, jnp.int32), batch))


def rerank(codes, q_rot: jax.Array, q_norm, centres, rows: jax.Array) -> jax.Array:
    """``rsq.estimate`` of code rows ``rows`` [..., C] (m = 8): float32 [..., C], read in place.

    codes: ``rsq.RSQCodes`` with leaves [..., cap, ...]; q_rot [..., P], q_norm [...].
    """
    p = q_rot.shape[-1]
    if p not in (16, 32, 64, 128) or codes.signs.shape[-1] * 8 != p:
        raise ValueError(f"jaxkv.native's rerank needs m = 8 and a padded dimension P in (16, 32, 64, 128), "
                         f"got P = {p} with {codes.signs.shape[-1]} sign bytes per key")
    _load("jaxkv_pariskv_rerank")
    call = jax.ffi.ffi_call("jaxkv_pariskv_rerank", jax.ShapeDtypeStruct(rows.shape, jnp.float32),
                            vmap_method="broadcast_all")
    batch = codes.signs.shape[:-2]
    return call(codes.signs, codes.record, q_rot.astype(jnp.float32),
                jnp.broadcast_to(jnp.asarray(q_norm, jnp.float32), batch),
                jnp.broadcast_to(jnp.asarray(centres, jnp.float32), (*batch, 8)), rows.astype(jnp.int32))


def top_k(values: jax.Array, k: int) -> jax.Array:
    """Positions [..., k] of the k largest of values [..., C] (float32, no NaN), largest
    first, ties to the lower position: ``lax.top_k(values, k)[1]``, the values first cut to
    those within a bound from a sample of them (to all of them when fewer than k pass)."""
    _load("jaxkv_top_k")
    if not 1 <= k <= values.shape[-1]:
        raise ValueError(f"top_k: need 1 <= k <= {values.shape[-1]}, got k = {k}")
    call = jax.ffi.ffi_call("jaxkv_top_k", jax.ShapeDtypeStruct((*values.shape[:-1], k), jnp.int32),
                            vmap_method="broadcast_all")
    return call(values.astype(jnp.float32))


def magicpig_query_buckets(q: jax.Array, projection: jax.Array, bucket_starts: jax.Array, *, K: int, limit: int):
    """A query group's codes and the tables each head reads: ``magicpig.select_with_stats``'s
    (codes, tables_used, entries_read), int32 [..., G, L], [..., G] and [..., G].

    q [..., G, d]; projection float32 [d, K·L] (or with q's batch axes); bucket_starts int32
    [..., L, 2^K + 1]. A head reads its tables in order while the running total of its
    buckets' sizes is at most ``limit``. A code's bit is the sign of a float32 product whose
    terms are summed in another order than XLA's: a product within rounding of 0 may take
    the other sign.
    """
    _load("jaxkv_magicpig_query_buckets")
    heads = q.shape[:-1]
    call = jax.ffi.ffi_call(
        "jaxkv_magicpig_query_buckets",
        (jax.ShapeDtypeStruct((*heads, bucket_starts.shape[-2]), jnp.int32), jax.ShapeDtypeStruct(heads, jnp.int32),
         jax.ShapeDtypeStruct(heads, jnp.int32)),
        vmap_method="expand_dims")  # an unbatched projection stays one matrix, not a copy per head
    rank = q.ndim  # the kernel takes operands of one rank; an axis of 1 is shared by the batch
    return call(q.astype(jnp.float32), _with_rank(jnp.asarray(projection, jnp.float32), rank),
                _with_rank(bucket_starts.astype(jnp.int32), rank), k_bits=np.int64(K), limit=np.int64(limit))


def _with_rank(x: jax.Array, rank: int) -> jax.Array:
    return x.reshape((1,) * (rank - x.ndim) + x.shape)


def magicpig_collide(sorted_ids: jax.Array, bucket_starts: jax.Array, codes: jax.Array, tables_used: jax.Array,
                     capacity: int, min_hits: int):
    """MagicPIG's sampled keys, read from the buckets only: ``magicpig.select_with_stats``'s hits.

    sorted_ids int32 [..., L, cap] and bucket_starts int32 [..., L, 2^K + 1] (the index),
    codes [..., G, L] the query heads' codes, tables_used [..., G] the tables each reads.
    Key i is sampled for head g iff it lies in at least ``min_hits`` of g's buckets.
    Returns (idx int32 [..., capacity]: the lowest ``capacity`` ids of the union over the
    heads, ascending, 0 past it; mask bool [..., G, capacity]: head g sampled idx[c];
    n_sampled int32 [..., G]; n_union int32 [...], the union's size before the capacity).
    """
    _load("jaxkv_magicpig_collide")
    batch, heads = sorted_ids.shape[:-2], codes.shape[-2]
    call = jax.ffi.ffi_call(
        "jaxkv_magicpig_collide",
        (jax.ShapeDtypeStruct((*batch, capacity), jnp.int32), jax.ShapeDtypeStruct((*batch, heads, capacity), jnp.bool_),
         jax.ShapeDtypeStruct((*batch, heads), jnp.int32), jax.ShapeDtypeStruct(batch, jnp.int32)),
        vmap_method="broadcast_all")
    return call(sorted_ids.astype(jnp.int32), bucket_starts.astype(jnp.int32), codes.astype(jnp.int32),
                tables_used.astype(jnp.int32), min_hits=np.int64(min_hits))


def magicpig_merge(sorted_ids: jax.Array, bucket_starts: jax.Array, new_codes: jax.Array, n):
    """``magicpig.insert``'s merge, each table's entries moved once, in place: (sorted_ids, bucket_starts).

    new_codes int32 [..., U, L]: the codes of new keys n, n+1, ... (2^K for a row not
    inserted). The new keys must fit in the id lists (refused otherwise).
    """
    _load("jaxkv_magicpig_merge")
    call = jax.ffi.ffi_call(
        "jaxkv_magicpig_merge",
        (jax.ShapeDtypeStruct(sorted_ids.shape, jnp.int32), jax.ShapeDtypeStruct(bucket_starts.shape, jnp.int32)),
        vmap_method="broadcast_all", input_output_aliases={0: 0})
    return call(sorted_ids.astype(jnp.int32), bucket_starts.astype(jnp.int32), new_codes.astype(jnp.int32),
                jnp.broadcast_to(jnp.asarray(n, jnp.int32), sorted_ids.shape[:-2]))


def _partial_shapes(q: jax.Array):
    batch, (heads, d) = q.shape[:-2], q.shape[-2:]
    return (jax.ShapeDtypeStruct((*batch, heads, d), jnp.float32), jax.ShapeDtypeStruct((*batch, heads), jnp.float32),
            jax.ShapeDtypeStruct((*batch, heads), jnp.float32))


def attend_rows(q: jax.Array, keys: jax.Array, values: jax.Array, idx: jax.Array, mask: jax.Array, *,
                masked_score: float):
    """The partial (o [..., G, d], l [..., G], m [..., G]) of q [..., G, d] over the rows idx [..., C]
    of keys, values [..., cap, d] (both float32, bfloat16 or bfloat16 bits as uint16, read in
    place and widened to float32) that head g attends (mask [..., G, C]):
    ``common.partial_attention`` over the gathered rows, up to float32 rounding, with no copy
    of them.
    """
    _load("jaxkv_attend_rows")
    call = jax.ffi.ffi_call("jaxkv_attend_rows", _partial_shapes(q), vmap_method="broadcast_all")
    return call(q.astype(jnp.float32), keys, values, idx.astype(jnp.int32), mask,
                masked_score=np.float32(masked_score))


def magicpig_attend(q: jax.Array, keys: jax.Array, values: jax.Array, mu: jax.Array, idx: jax.Array,
                    mask: jax.Array, tables_used: jax.Array, *, K: int, min_hits: int, tail_terms: int,
                    log_u_floor: float, masked_score: float):
    """The partial (o [..., G, d], l [..., G], m [..., G]) of q [..., G, d] over MagicPIG's sample:
    the rows idx [..., C] of keys, values [..., cap, d] (both float32, bfloat16 or bfloat16 bits
    as uint16, read in place and widened to float32) that head g sampled (mask [..., G, C]),
    each score corrected by −max(log u, log_u_floor), log u = ``magicpig.collision_log_prob``
    of the cosine between q_g and the row − mu [..., d] over tables_used [..., G] tables.
    ``common.partial_attention``'s result up to float32 rounding.
    """
    _load("jaxkv_magicpig_attend")
    call = jax.ffi.ffi_call("jaxkv_magicpig_attend", _partial_shapes(q), vmap_method="broadcast_all")
    return call(q.astype(jnp.float32), keys, values, mu.astype(jnp.float32), idx.astype(jnp.int32), mask,
                tables_used.astype(jnp.int32), k_bits=np.int64(K), min_hits=np.int64(min_hits),
                tail_terms=np.int64(tail_terms), log_u_floor=np.float32(log_u_floor),
                masked_score=np.float32(masked_score))


def dense_decode(q: jax.Array, keys: jax.Array, values: jax.Array, visible) -> jax.Array:
    """Softmax attention of q [..., H, G, d] (query head g of KV head h) over the first
    ``visible`` [...] keys of keys [..., H, d, S] and values [..., H, S, d] (one layer of a
    ``models.KVCache``: both float32, bfloat16 or bfloat16 bits as uint16, read in place):
    float32 [..., H, G, d], 0 where no key is visible. Scores scaled by 1/sqrt(d), summed in
    float32; the keys past ``visible`` are not read.
    """
    if keys.dtype != values.dtype or keys.dtype not in ROW_DTYPES:
        raise ValueError(f"dense_decode: keys and values must both be float32, bfloat16 or uint16 "
                         f"(bfloat16 bits), got {keys.dtype} and {values.dtype}")
    lead, (h, d, s) = q.shape[:-3], (q.shape[-3], q.shape[-1], keys.shape[-1])
    if keys.shape != (*lead, h, d, s) or values.shape != (*lead, h, s, d):
        raise ValueError(f"dense_decode: q {q.shape} needs keys [..., {h}, {d}, S] and values [..., {h}, S, {d}] "
                         f"with its leading axes, got {keys.shape} and {values.shape}")
    _load("jaxkv_dense_decode")
    call = jax.ffi.ffi_call("jaxkv_dense_decode", jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return call(q.astype(jnp.float32), keys, values, jnp.broadcast_to(jnp.asarray(visible, jnp.int32), lead))
