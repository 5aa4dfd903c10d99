"""Per-decode-step attention time of one layer, all heads: dense vs MagicPIG vs ParisKV.

    jaxkv bench [--quick] [--sizes N ...] [--shapes ...] [--methods ...]
                [--repeats 5] [--loop-steps 8] [--out results/bench_attention]
    python benchmarks/bench_attention.py [same flags]

What is timed (jitted, compiled before timing): a step runs ``--loop-steps``
times, then twice as many, inside one jitted ``fori_loop`` (as generate()'s
decode loop runs it), each length the fastest of three calls, and a repeat's
time per step is the difference over the extra iterations; median and
[min–max] over ``--repeats``. Timing separate
calls instead charged each step what the loop pays once: dispatch and the
kernel's page faults on freshly allocated temporaries (MagicPIG at 8k: 12.5 ms
per call, 3.8 ms per step in the loop). Each iteration's input depends on the
previous iteration's output, so XLA can neither hoist the work out of the loop
nor drop it.

- dense: ``models.dense_causal_attention`` over N keys laid out as
  ``models.KVCache`` holds them, on the device, f32 — what a dense layer of
  generate() runs; every ratio is to it. ``dense-native`` (run only when
  ``--methods`` names it; ``dense-native-bf16`` over bfloat16 K and V) is the
  same step in ``jaxkv.native``'s CPU kernel (``DenseConfig(kernels="native")``);
  each row is then also given as a ratio to it ("× dense native").
- sparse: ``jaxkv.cache.region_attention`` with ``dense_threshold=0`` on a
  RegionKV from ``jaxkv.cache.regions_from_prefill`` (retrieval K/V in
  pinned_host memory), the state threaded through the loop as generate()
  does: append, the method's select, the host gather, the correction,
  attention over the selection, the exact sink + window partial and the merge.
  ``magicpig-native``, ``pariskv-100-native`` and ``pariskv-2048-native`` (run
  only when ``--methods`` names them) are the methods with their selection in
  ``jaxkv.native``'s CPU kernels (MagicPIG's insertion too, its id lists on the
  device); with ``-bf16`` (``magicpig-native-bf16``, ...) the cache's K and V
  are bfloat16 (a bfloat16 model's), read in place by the kernels, and the run
  also times dense over the same bfloat16 K and V ("dense bf16"). Ratios stay
  to the float32 dense step.
- flush: the move of U window rows into retrieval and the index, timed alone
  in the same way (the lengths put back each iteration). generate() runs it
  once every U steps; the step loop keeps the window from filling, and the
  ratios use step + flush / U.
- stages of the same step, each a separate jitted call over the same state:
  select (ParisKV: coarse votes, coarse top-C, rerank + top-k), host gather of
  K and V, the correction (MagicPIG), attention over the gathered rows; for
  the native methods, whose kernels read the rows in place, select and that
  one call (under "attend"). They show where the time goes, not parts that
  sum to the looped step.

Keys: synthetic, fitted to SmolLM2's real keys (:mod:`jaxkv.bench.synthetic_keys`).
Bytes per step are what each stage must read (its floor), and the bandwidth
reference is measured in the same run: a read (sum) and a copy of 512 MiB.
Every ratio compares numbers of the same run: the machine is shared and noisy.
Configurations that would not fit in the memory available are skipped and listed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import models
from jaxkv import cache as kvcache
from jaxkv import plots
from jaxkv.attention import common, dense, magicpig, pariskv
from jaxkv.bench import synthetic_keys

GiB = 1 << 30
# Peak memory of one configuration, in units of its K+V (f32) and of its largest
# index: staging, the padded head-major copy and the retrieval copy of K and V;
# the index, its stacked copy and the build temporaries. The machine is shared:
# a configuration that does not fit in what is available when it starts is
# skipped and reported (others may still take memory while it runs).
# Calibrated on two OOM kills of this script: Llama shape at 64k (3.8 GB resident)
# and SmolLM2 at 1M with ParisKV only (9.1 GB resident, K+V 1.5 GB).
KV_COPIES = 5
INDEX_COPIES = 3
PROCESS_BYTES = 3 * GiB // 2  # JAX runtime, executables, stage-timing temporaries


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    kv_heads: int
    head_dim: int
    group: int


SHAPES = (Shape("SmolLM2", 3, 64, 3), Shape("Llama-3.1-8B", 8, 128, 4))


class Method(NamedTuple):
    label: str
    method: object  # a jaxkv.attention.method.SparseMethod
    config: object
    kv_dtype: object = jnp.float32  # of the cache's K and V rows


_NATIVE = {"magicpig-native": ("magicpig K10L150 native", magicpig.METHOD,
                                 magicpig.MagicPIGConfig(kernels="native")),
           "pariskv-100-native": ("pariskv top100 native", pariskv.METHOD,
                                  pariskv.ParisKVConfig(top_k=100, kernels="native")),
           "pariskv-2048-native": ("pariskv top2048 native", pariskv.METHOD,
                                   pariskv.ParisKVConfig(top_k=2048, kernels="native"))}
# name → (label, K and V dtype) of the dense step in jaxkv.native's CPU kernel, run when named.
DENSE_NATIVE = {"dense-native": ("dense native", jnp.float32), "dense-native-bf16": ("dense native bf16", jnp.bfloat16)}
# name → Method of every sparse method benchmarked (official defaults).
METHODS = {
    "magicpig": Method("magicpig K10L150", magicpig.METHOD, magicpig.MagicPIGConfig()),
    "pariskv-100": Method("pariskv top100", pariskv.METHOD, pariskv.ParisKVConfig(top_k=100)),
    "pariskv-2048": Method("pariskv top2048", pariskv.METHOD, pariskv.ParisKVConfig(top_k=2048)),
    # The same selection in jaxkv.native's CPU kernels (not in the default run: AVX-512 VBMI and VBMI2 only),
    # and with a bfloat16 cache, whose rows the kernels read in place.
    **{name: Method(*spec) for name, spec in _NATIVE.items()},
    **{f"{name}-bf16": Method(f"{label} bf16", method, cfg, jnp.bfloat16) for name, (label, method, cfg) in _NATIVE.items()},
}
DEFAULT_METHODS = [name for name, method in METHODS.items() if not method.config.kernels.uses_native()]


# ---------------------------------------------------------------- timing

@dataclasses.dataclass(frozen=True)
class Timing:
    repeats: int  # timed repeats: median, min and max over them
    steps: int  # loop iterations of one timed call (and twice as many)


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def time_calls(fn, repeats: int) -> dict:
    """Median/min/max seconds of fn() after one untimed call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return summary(times)


LOOP_TRIALS = 3


def time_in_loop(body, carry, args, timing: Timing, donate: bool = False) -> tuple[dict, object]:
    """Seconds per iteration of ``carry = body(i, carry, *args)`` inside one jitted fori_loop.

    Each repeat times a loop of ``steps`` and one of ``2 * steps`` iterations,
    each the fastest of ``LOOP_TRIALS`` calls; its time per iteration is their
    difference over ``steps``, so what a call pays once (dispatch, first touch
    of its temporaries) cancels. The minimum drops the delays a loaded machine
    adds to single calls: with one call each, a 0.1 ms step (dense at 4k keys)
    came out at -0.0 ms. Returns the summary and the last carry (donated and
    threaded when ``donate``).
    """
    loop = jax.jit(lambda n, c, *a: jax.lax.fori_loop(0, n, lambda i, c: body(i, c, *a), c),
                   static_argnums=0, donate_argnums=(1,) if donate else ())

    def timed(n):
        nonlocal carry
        start = time.perf_counter()
        carry = jax.block_until_ready(loop(n, carry, *args))
        return time.perf_counter() - start

    for _ in range(2):  # compile both lengths, the second time for the loop's own output types
        timed(timing.steps), timed(2 * timing.steps)
    def fastest(n):
        return min(timed(n) for _ in range(LOOP_TRIALS))

    per_step = [(fastest(2 * timing.steps) - fastest(timing.steps)) / timing.steps for _ in range(timing.repeats)]
    return summary(per_step), carry


def memory_bandwidth(repeats: int) -> dict:
    """Read (sum) and copy (x + 1, in place) bandwidth over 512 MiB of f32, bytes/s.

    The copy is donated so it rewrites the same pages: a fresh 512 MiB output
    would time the kernel's page faults, not the memory.
    """
    x = [jnp.ones((GiB // 2 // 4,), jnp.float32)]
    size = x[0].nbytes
    read = time_calls(lambda: _sum(x[0]), repeats)["median_s"]

    def copy():
        x[0] = _plus_one(x[0])
        return x[0]

    copy_s = time_calls(copy, repeats)["median_s"]
    return {"read_Bps": size / read, "copy_Bps": 2 * size / copy_s}


_sum = jax.jit(jnp.sum)
_plus_one = jax.jit(lambda x: x + 1.0, donate_argnums=0)


# ---------------------------------------------------------------- state

class _MagicPIGIndexApart(magicpig.MagicPIG):
    """MagicPIG with no index in regions_from_prefill: :func:`magicpig_index` builds it, a head at a time."""

    def build(self, cfg, keys, values, n, key):
        return ()


@functools.partial(jax.jit, static_argnames=("method", "mcfg", "ccfg", "capacity"))
def _regions(staging_k, staging_v, lengths, *, method, mcfg, ccfg, capacity):
    return kvcache.regions_from_prefill(staging_k, staging_v, lengths, method=method, mcfg=mcfg,
                                        ccfg=ccfg, capacity=capacity)


def magicpig_index(cfg, retr_k, n: int):
    """Index of one layer, [1, H] leading axes, built one KV head at a time (μ over all n keys)."""
    def head_keys(h):
        return models.row_values(jax.device_put(retr_k[0, h], kvcache.DEVICE))

    heads = [jax.block_until_ready(magicpig.build(cfg, head_keys(h), n)) for h in range(retr_k.shape[1])]
    return jax.tree.map(lambda *x: jnp.stack(x)[None], *heads)


def region_state(method, mcfg, staging_k, staging_v, n: int):
    """The RegionKV generate() would hold after prefilling n tokens, and its CacheConfig
    (``method`` a ``jaxkv.attention.method.SparseMethod``)."""
    # Every index on the device, so sparse_stages can time the select as a call of its own (on
    # the CPU the device's memory is host memory: the same arrays, the same work).
    ccfg = kvcache.CacheConfig(dense_threshold=0, host_index=False).resolve(mcfg)
    capacity = n - ccfg.sink - ccfg.local + ccfg.buffer
    lengths = jnp.full((1,), n, jnp.int32)
    build_here = method != magicpig.METHOD
    state = _regions(staging_k, staging_v, lengths, method=method if build_here else _MagicPIGIndexApart(),
                     mcfg=mcfg, ccfg=ccfg, capacity=capacity)
    if not build_here:
        index = magicpig_index(mcfg, state.retr_k, int(state.retr_len[0]))
        state = dataclasses.replace(state, index=kvcache.place_index(index, method, mcfg, ccfg))
    return jax.block_until_ready(state), ccfg


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------- one configuration

def step_inputs(stats, n: int, rng):
    """(q [1,1,Hq,d], k, v [1,1,Hkv,d], positions [1,1]) of the decode step after n tokens."""
    hkv, g, d = stats.queries.shape
    q = jnp.asarray(stats.queries.reshape(1, 1, hkv * g, d), jnp.float32)
    z = rng.standard_normal((2, hkv, d))
    k = np.einsum("hde,he->hd", stats.key_chol, z[0]) + stats.key_mean
    v = np.einsum("hde,he->hd", stats.value_chol, z[1]) + stats.value_mean
    as_step = lambda x: jnp.asarray(x.reshape(1, 1, hkv, d), jnp.float32)
    return q, as_step(k), as_step(v), jnp.full((1, 1), n, jnp.int32)


def bench_dense(staging_k, staging_v, q, n, timing: Timing, native: bool = False):
    """Step time of a dense layer over staging K, V (their dtype is the cache's), in XLA or
    in the native CPU kernel."""
    cache_k = models.transpose_keys(staging_k)  # a copy, freed on return
    q_positions = jnp.full((1, 1), n - 1, jnp.int32)

    def attend(q, k, v):
        if native:
            return dense.native_decode_attention(q, k, v, q_positions)
        return models.dense_causal_attention(q, k, v, q_positions, jnp.arange(n, dtype=jnp.int32))

    def body(i, out, q, k, v):  # each step's query tied to the last output: nothing hoisted or dropped
        return attend(q + out.ravel()[0] * 0.0, k, v)

    return time_in_loop(body, jnp.zeros_like(q), (q, cache_k, staging_v), timing)[0]


def bench_full_step(state, ccfg, method, mcfg, q, k, v, positions, timing: Timing):
    """Step time of region_attention with the state threaded through the loop, as generate() runs it.

    The window length is put back after each step, so the flush (every U
    steps in generate()) never falls inside the timed loops: bench_flush times it.
    """
    def body(i, carry, q, k, v, positions, win_len):
        out, state = carry
        out, state = kvcache.region_attention(q + out.ravel()[0] * 0.0, k, v, positions + i, state,
                                              method=method, mcfg=mcfg, ccfg=ccfg)
        return out, dataclasses.replace(state, win_len=win_len)

    return time_in_loop(body, (jnp.zeros_like(q), state), (q, k, v, positions, jnp.copy(state.win_len)), timing,
                        donate=True)


def bench_flush(state, ccfg, method, mcfg, timing: Timing):
    """Time of one flush (U window rows into retrieval and the index), the lengths put back each time.

    Only the work is measured: the index's contents drift from one iteration
    to the next (the same rows are inserted again), and the state returned is
    for discarding. The index's lengths put back are its n and MagicPIG's
    bucket starts (whose last entry is the id lists' length: the native merge
    refuses lists that would overflow).
    """
    full = jnp.full_like(state.win_len, ccfg.local + ccfg.buffer)
    fields = ("n", "bucket_starts") if method == magicpig.METHOD else ("n",)
    lengths = {f: jnp.copy(getattr(state.index, f)) for f in fields}

    def body(i, state, retr_len, lengths):
        state = dataclasses.replace(state, win_len=full, retr_len=retr_len,
                                    index=dataclasses.replace(state.index, **lengths))
        return kvcache.flush(state, method=method, mcfg=mcfg, ccfg=ccfg)

    return time_in_loop(body, state, (jnp.copy(state.retr_len), lengths), timing, donate=True)


def sparse_stages(state, ccfg, method, mcfg, qg, repeats) -> tuple[dict, object]:
    """Stage times of _retrieval_sparse's composition (separate calls) and the selection they work on.

    Timed per call, not in a loop: looped alone, stages ran slower than inside
    the looped step (ParisKV's votes at 64k: 5.8 ms, the whole step 6.3 ms).
    """
    select = jax.jit(kvcache.over_batch_heads(lambda ix, qq: method.select(mcfg, ix, qq)))
    sel = jax.block_until_ready(select(state.index, qg))
    stages = {"select": time_calls(lambda: select(state.index, qg), repeats)}
    if method == pariskv.METHOD:
        stages.update(pariskv_select_stages(state.index, mcfg, qg, repeats))
    if kvcache.attends_in_place(method, mcfg, state.retr_k):  # one call gathers, corrects and attends
        attend = jax.jit(lambda qq, st, s: kvcache.attend_rows_in_place(qq, st, s, method=method, mcfg=mcfg))
        stages["attend"] = time_calls(lambda: attend(qg, state, sel), repeats)
        return stages, sel
    gather = jax.jit(lambda rk, rv, idx: (kvcache.gather_rows(rk, idx, ccfg), kvcache.gather_rows(rv, idx, ccfg)))
    k_rows, v_rows = jax.block_until_ready(gather(state.retr_k, state.retr_v, sel.idx))
    correct = jax.jit(kvcache.over_batch_heads(lambda ix, qq, kr, s: method.correction(mcfg, ix, qq, kr, s)))
    log_weight = correct(state.index, qg, k_rows, sel)
    attend_sel = jax.jit(kvcache.over_batch_heads(common.attend_selection))
    sel_w = dataclasses.replace(sel, log_weight=log_weight)
    stages["gather"] = time_calls(lambda: gather(state.retr_k, state.retr_v, sel.idx), repeats)
    stages["attend"] = time_calls(lambda: attend_sel(qg, k_rows, v_rows, sel_w), repeats)
    if log_weight is not None:
        stages["correction"] = time_calls(lambda: correct(state.index, qg, k_rows, sel), repeats)
    return stages, sel


def pariskv_select_stages(index, cfg, qg, repeats) -> dict:
    """ParisKV's select split: the coarse stage (on the XLA path also its votes and their top-C
    apart), then the rerank + final top-k of the candidates, each as the config runs it."""
    cap, n_subspaces = index.signs.shape[-2:]
    coarse = jax.jit(kvcache.over_batch_heads(lambda ix, qq: pariskv.coarse_candidates(cfg, ix, qq)))
    rerank = jax.jit(kvcache.over_batch_heads(lambda ix, qq, c: pariskv.final_top_k(
        cfg, pariskv.rerank_scores(cfg, ix, qq, c), pariskv.n_retrieved(cfg, cap))))
    candidates = coarse(index, qg)
    stages = {"coarse": time_calls(lambda: coarse(index, qg), repeats),
              "rerank": time_calls(lambda: rerank(index, qg, candidates), repeats)}
    if cfg.kernels.uses_native():  # the CPU kernel counts the votes and takes the top-C in one call
        return stages
    votes = jax.jit(kvcache.over_batch_heads(
        lambda ix, qq: pariskv.coarse_votes(cfg, ix, pariskv.rotate(cfg, jnp.mean(qq, axis=0)))))
    top_c = jax.jit(kvcache.over_batch_heads(lambda v: pariskv.most_voted_rows(
        v, pariskv.n_candidates(cfg, cap), pariskv.N_TIERS * n_subspaces)))
    vote_totals = votes(index, qg)
    stages["coarse.votes"] = time_calls(lambda: votes(index, qg), repeats)
    stages["coarse.top_C"] = time_calls(lambda: top_c(vote_totals), repeats)
    return stages


def magicpig_entries_read(cfg, index, qg) -> float:
    """Inverted-index entries a step reads per KV head: Σ over query heads of min(bucket sizes summed over tables, cap)."""
    def per_head(ix, qq):
        codes = magicpig.hash_codes(cfg, magicpig.hyperplanes(cfg, ix), qq).astype(jnp.int32)  # [G, L]
        tables = jnp.arange(cfg.L)[None, :]
        sizes = ix.bucket_starts[tables, codes + 1] - ix.bucket_starts[tables, codes]
        return jnp.sum(jnp.minimum(jnp.cumsum(sizes, axis=-1), cfg.candidate_entries(ix.sorted_ids.shape[-1]))
                       .max(axis=-1))
    return float(jnp.mean(jax.jit(kvcache.over_batch_heads(per_head))(index, qg)))


def step_bytes(method, mcfg, shape: Shape, n: int, ccfg, sel_rows: float, entries: float, kv_dtype) -> dict:
    """Bytes one step must read per layer (all KV heads), by stage, K/V rows of kv_dtype."""
    d, h = shape.head_dim, shape.kv_heads
    row = 2 * d * jnp.dtype(kv_dtype).itemsize  # one key and value
    exact = (ccfg.sink + ccfg.local + 1) * row
    if method == pariskv.METHOD:
        cap = n - ccfg.sink - ccfg.local + ccfg.buffer
        b = pariskv.n_subspaces(mcfg, d)
        # every key's sign bytes (its bucket ids) are voted on; the candidates' other code bytes reranked
        per_candidate = pariskv.index_bytes_per_key(mcfg, d) - b
        per_head = {"select": n * b + pariskv.n_candidates(mcfg, cap) * per_candidate,
                    "gather": sel_rows * row, "exact": exact}
        per_step = 0
    else:
        per_head = {"select": entries * 4, "gather": sel_rows * row, "exact": exact}  # select: bucket ids read
        per_step = d * mcfg.K * mcfg.L * 4  # the projection: one for every head (and layer)
    total = {stage: value * h for stage, value in per_head.items()}
    total["select"] += per_step
    return total


def sparse_methods(names) -> list[Method]:
    """The sparse methods among the --methods names (none for a run of dense alone)."""
    return [METHODS[name] for name in names if name in METHODS]


def memory_needed(shape: Shape, n: int, names) -> int:
    kv = 2 * n * shape.kv_heads * shape.head_dim * 4
    index = max((magicpig.index_bytes_per_key(cfg) if method == magicpig.METHOD
                  else pariskv.index_bytes_per_key(cfg, shape.head_dim)
                  for _, method, cfg, _ in sparse_methods(names)), default=0) * n * shape.kv_heads
    return KV_COPIES * kv + INDEX_COPIES * index + PROCESS_BYTES


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); unbounded where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return sys.maxsize


def bench_config(shape: Shape, n: int, stats, timing: Timing, bandwidth: dict, names) -> list[dict]:
    """All methods at one (shape, N): dense first, then each sparse method; arrays freed between."""
    sparse = sparse_methods(names)
    dense_native = [DENSE_NATIVE[name] for name in names if name in DENSE_NATIVE]
    rng = np.random.default_rng(0)
    staging_k, staging_v = synthetic_keys.synthesise(stats, n)
    q, k, v, positions = step_inputs(stats, n, rng)
    qg = q[:, 0].reshape(1, shape.kv_heads, shape.group, shape.head_dim)
    dense_bytes = 2 * n * shape.kv_heads * shape.head_dim * 4
    dense = bench_dense(staging_k, staging_v, q, n, timing)
    rows = [{"shape": shape.name, "N": n, "method": "dense", "step": dense, "bytes": {"kv": dense_bytes},
             "index_B_per_token_head": 0}]
    print(f"  {shape.name} N={n} dense {dense['median_s'] * 1e3:.1f} ms", flush=True)
    if any(kv_dtype == jnp.bfloat16 for *_, kv_dtype in sparse + dense_native):  # dense over the same bfloat16 K, V
        dense_bf16 = bench_dense(staging_k.astype(jnp.bfloat16), staging_v.astype(jnp.bfloat16), q, n, timing)
        rows.append({"shape": shape.name, "N": n, "method": "dense bf16", "step": dense_bf16,
                     "bytes": {"kv": dense_bytes // 2}, "index_B_per_token_head": 0})
        print(f"  {shape.name} N={n} dense bf16 {dense_bf16['median_s'] * 1e3:.1f} ms", flush=True)
    for label, kv_dtype in dense_native:
        step = bench_dense(staging_k.astype(kv_dtype), staging_v.astype(kv_dtype), q, n, timing, native=True)
        rows.append({"shape": shape.name, "N": n, "method": label, "step": step,
                     "bytes": {"kv": dense_bytes * jnp.dtype(kv_dtype).itemsize // 4}, "index_B_per_token_head": 0})
        print(f"  {shape.name} N={n} {label} {step['median_s'] * 1e3:.1f} ms", flush=True)
    for label, method, mcfg, kv_dtype in sparse:
        t0 = time.perf_counter()
        state, ccfg = region_state(method, mcfg, staging_k.astype(kv_dtype), staging_v.astype(kv_dtype), n)
        build_s = time.perf_counter() - t0
        stages, sel = sparse_stages(state, ccfg, method, mcfg, qg, timing.repeats)
        sel_rows = float(jnp.mean(kvcache.over_batch_heads(lambda s: s.distinct_rows())(sel)))
        entries = magicpig_entries_read(mcfg, state.index, qg) if method == magicpig.METHOD else 0.0
        cap = state.retr_k.shape[2]
        row = {"shape": shape.name, "N": n, "method": label, "build_s": build_s,
               "index_B_per_token_head": nbytes(state.index) / (cap * shape.kv_heads),
               "index_formula_B_per_token_head": (magicpig.index_bytes_per_key(mcfg) if method == magicpig.METHOD
                                                  else pariskv.index_bytes_per_key(mcfg, shape.head_dim)),
               "rows_gathered_per_head": sel_rows, "index_entries_read_per_head": entries,
               "bytes": step_bytes(method, mcfg, shape, n, ccfg, sel_rows, entries, kv_dtype), "stages": stages}
        row["step"], (_, state) = bench_full_step(state, ccfg, method, mcfg, q, k, v, positions, timing)
        row["flush"], state = bench_flush(state, ccfg, method, mcfg, timing)
        row["flush_every"] = ccfg.buffer
        del state, sel
        gc.collect()
        rows.append(row)
        print(f"  {shape.name} N={n} {label} {row['step']['median_s'] * 1e3:.1f} ms + flush "
              f"{row['flush']['median_s'] * 1e3:.1f} ms every {ccfg.buffer} steps (build {build_s:.0f} s)", flush=True)
    native_step = next((row["step"] for row in rows if row["method"] == DENSE_NATIVE["dense-native"][0]), None)
    for row in rows:
        total = sum(row["bytes"].values())
        # A step's share of the flush, which generate() runs once every U steps.
        step_s = row["step"]["median_s"] + (row["flush"]["median_s"] / row["flush_every"] if "flush" in row else 0.0)
        row["step_with_flush_s"] = step_s
        row["bytes_total"] = total
        row["ratio_to_dense"] = step_s / dense["median_s"]
        if native_step is not None:
            row["ratio_to_dense_native"] = step_s / native_step["median_s"]
        row["achieved_Bps"] = total / step_s
        row["floor_s"] = total / bandwidth["read_Bps"]
        row["x_floor"] = step_s / row["floor_s"]
        row["kv_bf16_B_per_token_head"] = 2 * shape.head_dim * 2
    return rows


# ---------------------------------------------------------------- reporting

def ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x >= 1e-3 else f"{x * 1e3:.2f}"


def markdown(rows: list[dict], skipped: list[str], bandwidth: dict, meta: dict) -> str:
    lines = [f"Command: `{meta['command']}`  ", f"jax {meta['jax']}, {meta['machine']}, "
             f"{meta['repeats']} repeats (median, [min–max]) of the time per step in a jitted loop "
             f"({meta['loop_steps']} vs {2 * meta['loop_steps']} steps).  ",
             f"Measured bandwidth, same run: read {bandwidth['read_Bps'] / 1e9:.1f} GB/s, "
             f"copy (read+write) {bandwidth['copy_Bps'] / 1e9:.1f} GB/s. Floor = bytes / read bandwidth.", "",
             "Step = the loop step, without the flush; + flush/U = with its share of the flush "
             "(every U steps); × dense, GB/s and × floor use the latter.", "",
             "| shape | N | method | step ms [min–max] | flush ms (U) | + flush/U | × dense | × dense native | MB read | "
             "GB/s | × floor | index B/token/head | KV bf16 B/token/head |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["step"]
        flush = f"{ms(r['flush']['median_s'])} ({r['flush_every']})" if "flush" in r else ""
        to_native = f"{r['ratio_to_dense_native']:.3f}" if "ratio_to_dense_native" in r else ""
        lines.append(
            f"| {r['shape']} | {r['N']:,} | {r['method']} | {ms(s['median_s'])} [{ms(s['min_s'])}–{ms(s['max_s'])}] | "
            f"{flush} | {ms(r['step_with_flush_s'])} | {r['ratio_to_dense']:.3f} | {to_native} | "
            f"{r['bytes_total'] / 1e6:.1f} | {r['achieved_Bps'] / 1e9:.2f} | "
            f"{r['x_floor']:.1f} | {r['index_B_per_token_head']:.0f} | {r['kv_bf16_B_per_token_head']} |")
    staged = [r for r in rows if "stages" in r]  # the sparse methods' rows
    if staged:
        lines += ["", "Stages (each jitted alone over the same state, separate calls: a call pays what the "
                  "loop pays once, so they are not parts of the step above; ms, median). A method that "
                  "attends in place (the native ones) has no gather or correction: its attend is all three.", "",
                  "| shape | N | method | select | (coarse: votes / top-C) | (rerank) | gather | correction | attend | "
                  "rows gathered/head | MagicPIG entries read/head |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in staged:
        st = {k: v["median_s"] for k, v in r["stages"].items()}
        coarse = ms(st["coarse"]) if "coarse" in st else ""
        if "coarse.votes" in st:
            coarse += f" ({ms(st['coarse.votes'])} / {ms(st['coarse.top_C'])})"
        lines.append(
            f"| {r['shape']} | {r['N']:,} | {r['method']} | {ms(st['select'])} | {coarse} | "
            f"{ms(st['rerank']) if 'rerank' in st else ''} | {ms(st['gather']) if 'gather' in st else ''} | "
            f"{ms(st['correction']) if 'correction' in st else ''} | {ms(st['attend'])} | "
            f"{r['rows_gathered_per_head']:.0f} | {r['index_entries_read_per_head']:.0f} |")
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, bandwidth: dict) -> None:
    plt = plots.pyplot()

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r["N"], r["step_with_flush_s"] * 1e3) for r in mine if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method)
        dense = sorted((r["N"], r["floor_s"] * 1e3) for r in mine if r["method"] == "dense")
        ax.plot(*zip(*dense), "k--", lw=1, label="dense read floor")
        ax.set(xscale="log", yscale="log", xlabel="keys N", ylabel="ms per step (one layer, all heads)",
               title=shape)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out: Path, rows, skipped, bandwidth, meta) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_attention.json").write_text(json.dumps(
        {"meta": meta, "bandwidth": bandwidth, "skipped": skipped, "rows": rows}, indent=1))
    (out / "bench_attention.md").write_text(markdown(rows, skipped, bandwidth, meta))
    if rows:
        plot(rows, out / "bench_attention.png", bandwidth)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxkv bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: SmolLM2 shape, N = 8k and 16k")
    parser.add_argument("--sizes", type=int, nargs="+", help="key counts N (default 16k 64k 256k 1M)")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], help="head shapes (default both)")
    parser.add_argument("--methods", nargs="+", choices=[*METHODS, *DENSE_NATIVE], default=DEFAULT_METHODS,
                        help="sparse methods (dense always runs: every ratio is to it), and dense-native(-bf16); "
                             "the *-native ones only when named")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-steps", type=int, default=8,
                        help="iterations of one timed loop (and twice as many): see the module docstring")
    parser.add_argument("--out", default="results/bench_attention")
    parser.add_argument("--stats", default="results/bench_attention/smollm2_key_stats.npz",
                        help="fitted SmolLM2 key statistics (computed by a prefill when missing)")
    args = parser.parse_args(argv)
    plots.require()  # before the work: the figure is its last output
    sizes = args.sizes or ([1 << 13, 1 << 14] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 20])
    shapes = [s for s in SHAPES if s.name in (args.shapes or ([SHAPES[0].name] if args.quick else [s.name for s in SHAPES]))]
    out = Path(args.out)
    base = synthetic_keys.fit_smollm2(Path(args.stats))
    bandwidth = memory_bandwidth(args.repeats)
    print(f"bandwidth: read {bandwidth['read_Bps'] / 1e9:.1f} GB/s, copy {bandwidth['copy_Bps'] / 1e9:.1f} GB/s")
    rows, skipped = [], []
    meta = {"command": " ".join(["python", *sys.argv]), "jax": jax.__version__,
            "machine": f"{platform.machine()}, {jax.devices()[0].platform}", "repeats": args.repeats,
            "loop_steps": args.loop_steps}
    for shape in shapes:
        stats = synthetic_keys.for_shape(base, shape.kv_heads, shape.head_dim, shape.group)
        for n in sizes:
            needed, available = memory_needed(shape, n, args.methods), memory_available()
            if needed > available:
                skipped.append(f"{shape.name} N={n:,}: needs ~{needed / GiB:.1f} GiB "
                               f"(K+V f32 {2 * n * shape.kv_heads * shape.head_dim * 4 / GiB:.1f} GiB, the largest "
                               f"index, and their copies), "
                               f"{available / GiB:.1f} GiB available on the shared machine")
                print("  skipped", skipped[-1], flush=True)
                continue
            rows += bench_config(shape, n, stats, Timing(args.repeats, args.loop_steps), bandwidth, args.methods)
            gc.collect()
            write_results(out, rows, skipped, bandwidth, meta)  # after every size: a partial run still reports
    write_results(out, rows, skipped, bandwidth, meta)
    print(markdown(rows, skipped, bandwidth, meta))
    print(f"wrote {out}/bench_attention.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
