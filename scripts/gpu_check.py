"""Time each Pallas kernel against its XLA path (the reference) and dense attention.

Llama-8B-like decode step: 8 KV heads × head dim 128, GQA 4, bf16 K/V; every
kernel runs per KV head under vmap. Prints one table (median ms over repeats,
in one run: compare within a column, not across machines). Run by gpu_check.sh.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import collide, gather_attention, rsq_rerank, simhash, vote

HEADS, GROUP, DIM = 8, 4, 128
N_BITS, N_TABLES = 10, 150         # MagicPIG K10 L150
SUBSPACE = 8                       # ParisKV m
SELECTED = 2048                    # keys attended after selection


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def dense_attention(q, k, v):
    """Plain XLA decode attention over all keys: q [H, G, d], k, v [H, N, d]."""
    s = jnp.einsum("hgd,hnd->hgn", q, k.astype(jnp.float32)) / math.sqrt(q.shape[-1])
    return jnp.einsum("hgn,hnd->hgd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))


def inputs(n: int, key):
    ks = jax.random.split(key, 10)
    q = jax.random.normal(ks[0], (HEADS, GROUP, DIM), jnp.float32)
    k = jax.random.normal(ks[1], (HEADS, n, DIM), jnp.bfloat16)
    v = jax.random.normal(ks[2], (HEADS, n, DIM), jnp.bfloat16)
    proj = jax.random.normal(ks[3], (DIM, N_BITS * N_TABLES), jnp.float32)
    codes = jax.random.randint(ks[4], (HEADS, N_TABLES, n), 0, 2**N_BITS)
    sorted_ids = jnp.argsort(codes, axis=-1, stable=True).astype(jnp.int32)
    sizes = jax.vmap(jax.vmap(lambda c: jnp.bincount(c, length=2**N_BITS)))(codes)
    bucket_start = jnp.concatenate([jnp.zeros((HEADS, N_TABLES, 1), jnp.int32),
                                    jnp.cumsum(sizes, -1).astype(jnp.int32)], -1)
    query_codes = codes[:, :, 0].astype(jnp.uint16)  # key 0's buckets: a non-empty selection
    n_sub = DIM // SUBSPACE
    signs = jax.random.randint(ks[5], (HEADS, n, n_sub), 0, 256).astype(jnp.uint8)
    lut = jax.random.randint(ks[6], (HEADS, n_sub, 256), 0, 7)
    packed = jax.random.randint(ks[7], (HEADS, n, DIM // 2), 0, 256).astype(jnp.uint8)
    weight = jax.random.uniform(ks[8], (HEADS, n, n_sub))
    centres = jnp.linspace(0.04, 0.76, 8)
    idx = jax.random.randint(ks[9], (HEADS, SELECTED), 0, n)
    return dict(q=q, k=k, v=v, proj=proj, query_codes=query_codes, sorted_ids=sorted_ids,
                bucket_start=bucket_start, signs=signs, lut=lut, packed=packed, weight=weight,
                centres=centres, idx=idx)


def cases(n: int, x, interpret: bool):
    """name → (kernel fn, XLA fn, args); all but simhash map over the KV heads."""
    sample_cap = max(1, n // 32)                    # MagicPIG reads ≈2-3% of keys
    bucket_cap = 4 * max(1, n >> N_BITS)            # 4× the mean bucket size
    candidates = max(1, n // 10)                    # ParisKV candidate_ratio 0.1
    mask = jnp.ones((HEADS, GROUP, SELECTED), bool)
    log_w = jnp.zeros((HEADS, GROUP, SELECTED), jnp.float32)
    q_rot = x["q"].mean(1)
    cand_idx = jax.random.randint(jax.random.key(1), (HEADS, candidates), 0, n)

    def pair(kernel, reference, per_head=True, **kw):
        over_heads = jax.vmap if per_head else (lambda f: f)
        return (jax.jit(over_heads(lambda *a: kernel(*a, interpret=interpret, **kw))),
                jax.jit(over_heads(lambda *a: reference(*a, **kw))))

    return {
        # One head's keys: the XLA path materialises N × K·L projections (3 GB at 512k).
        "simhash (N keys, 1 head)": (*pair(simhash.simhash, simhash.simhash_reference, per_head=False,
                                           n_bits=N_BITS), (x["k"][0], x["proj"])),
        f"collide (C={sample_cap})": (*pair(collide.collide, collide.collide_reference, capacity=sample_cap,
                                            bucket_capacity=bucket_cap),
                                      (x["query_codes"], x["sorted_ids"], x["bucket_start"])),
        f"vote (C={candidates})": (*pair(vote.vote, vote.vote_reference, capacity=candidates),
                                   (x["signs"], x["lut"])),
        f"rsq_rerank (C={candidates})": (*pair(rsq_rerank.rsq_rerank, rsq_rerank.rsq_rerank_reference),
                                         (q_rot, jnp.ones((HEADS,)), x["packed"], x["weight"],
                                          jnp.broadcast_to(x["centres"], (HEADS, 8)), cand_idx)),
        f"gather_attention (C={SELECTED})": (*pair(gather_attention.gather_attention,
                                                   gather_attention.gather_attention_reference),
                                             (x["q"], x["k"], x["v"], x["idx"], mask, log_w)),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32768,131072,524288")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interpret", action="store_true", help="dry run of this script on CPU")
    parser.add_argument("--json", help="also write the rows here (after every size: a partial run still reports)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"jax {jax.__version__} on {jax.devices()[0]}; {HEADS} KV heads × {DIM}, GQA {GROUP}, bf16 K/V; "
          f"median of {args.repeats} runs, ms")
    print(f"{'N':>7}  {'step':<28} {'kernel':>9} {'XLA':>9} {'XLA/kernel':>10} {'dense':>9}")
    failures = 0
    report = {"jax": jax.__version__, "device": str(jax.devices()[0]), "python": platform.python_version(),
              "shape": {"kv_heads": HEADS, "group": GROUP, "head_dim": DIM}, "repeats": args.repeats, "rows": []}
    for n in sizes:
        x = inputs(n, jax.random.key(n))
        dense_ms = median_ms(jax.jit(dense_attention), x["q"], x["k"], x["v"], repeats=args.repeats)
        for name, (kernel, reference, call_args) in cases(n, x, args.interpret).items():
            try:
                k_ms = median_ms(kernel, *call_args, repeats=args.repeats)
                r_ms = median_ms(reference, *call_args, repeats=args.repeats)
                print(f"{n:>7}  {name:<28} {k_ms:>9.3f} {r_ms:>9.3f} {r_ms / k_ms:>10.2f} {dense_ms:>9.3f}",
                      flush=True)
                report["rows"].append({"n": n, "step": name, "kernel_ms": k_ms, "xla_ms": r_ms, "dense_ms": dense_ms})
            except Exception:  # report every failing kernel, then fail the run
                failures += 1
                print(f"{n:>7}  {name:<28} FAILED", flush=True)
                traceback.print_exc()
                report["rows"].append({"n": n, "step": name, "failed": traceback.format_exc(limit=3)})
        del x
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    if failures:
        print(f"gpu_check: {failures} timing(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
