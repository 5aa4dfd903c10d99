"""ParisKV's coarse top-C on this backend: lax.top_k against selections by vote threshold, one run.

    python benchmarks/bench_selection.py [--sizes 65536 262144] [--repeats 5]
                                         [--out results/bench_selection]

The coarse stage keeps the C = n_candidates(N) keys with the most votes (10% of
N at 64k and beyond). Votes are small integers (≤ 6 per subspace), so the same
set can be found without a top-k: the largest threshold t with at least C keys
voting ≥ t, every key above t, and the lowest-numbered keys at t until C (the
ties lax.top_k keeps). This script times, for the 3 KV heads of SmolLM2 (vmapped,
as the decode step runs them) over real ParisKV votes of keys synthesised from
SmolLM2's statistics (jaxkv.bench.synthetic_keys):

- ``lax_top_k``: ``pariskv.top_indices`` on float32 votes (the code until 2026-11-30);
- ``threshold``: ``pariskv.most_voted_rows`` — t by bisection over the vote values
  (``pariskv.vote_threshold``), the rows as 32-row bit words, the first ties kept
  by popcounts, compaction word by word (what the code runs since 2026-12-01);
- ``threshold_only``: ``pariskv.vote_threshold`` alone (what finding t costs);
- ``histogram``: the ``bincount`` of the vote values that found t until 2026-11-30
  (what finding t cost then);
- ``packed_sort``: one ``jnp.sort`` of (max − votes) << 20 | row, the first C.

Each selection's set is checked against lax_top_k's. Median and [min–max] of
``--repeats`` timed calls after a compiling one; ratio to lax_top_k from the same
run. Prints a markdown table and writes JSON + the table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import pariskv
from jaxkv.bench import synthetic_keys

ROW_BITS = 20  # packed_sort: rows < 2^20 (1M keys)


def real_votes(stats, n: int, cfg: pariskv.ParisKVConfig) -> jax.Array:
    """int32 [H, n]: ParisKV's coarse votes of each KV head's real query group over n synthesised keys."""
    keys, _ = synthetic_keys.synthesise(stats, n)
    queries = jnp.asarray(stats.queries, jnp.float32)

    def per_head(k, q):
        index = pariskv.build(cfg, k, jnp.int32(n))
        return pariskv.coarse_votes(cfg, index, pariskv.rotate(cfg, jnp.mean(q, axis=0)))

    return jax.jit(jax.vmap(per_head))(keys[0], queries)


def packed_sort(votes, count, most):
    rows = jnp.arange(votes.shape[0], dtype=jnp.int32)
    return (jnp.sort(((most - votes) << ROW_BITS) | rows)[:count]) & ((1 << ROW_BITS) - 1)


def strategies(count: int, most: int) -> dict:
    """name → (selection of votes[N], whether it returns C rows to check against lax_top_k's)."""
    return {
        "lax_top_k": (lambda v: pariskv.top_indices(v.astype(jnp.float32), count), True),
        "threshold": (lambda v: pariskv.most_voted_rows(v, count, most), True),
        "threshold_only": (lambda v: pariskv.vote_threshold(v, count, most), False),
        "histogram": (lambda v: jnp.bincount(v + 1, length=most + 2), False),
        "packed_sort": (lambda v: packed_sort(v, count, most), True),
    }


def timed(fn, x, repeats: int) -> tuple[jax.Array, list[float]]:
    out = jax.block_until_ready(fn(x))
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        seconds.append(time.perf_counter() - t0)
    return out, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 18])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stats", default="results/bench_attention/smollm2_key_stats.npz")
    parser.add_argument("--out", default="results/bench_selection")
    args = parser.parse_args(argv)
    if max(args.sizes) > 1 << ROW_BITS:
        parser.error(f"--sizes: at most {1 << ROW_BITS} keys (packed_sort's row bits)")
    cfg = pariskv.ParisKVConfig()
    stats = synthetic_keys.fit_smollm2(Path(args.stats))
    rows = []
    for n in args.sizes:
        votes = real_votes(stats, n, cfg)
        most = pariskv.N_TIERS * pariskv.n_subspaces(cfg, int(stats.queries.shape[-1]))
        count = pariskv.n_candidates(cfg, n)
        reference = None
        for name, (fn, selects) in strategies(count, most).items():
            out, seconds = timed(jax.jit(jax.vmap(fn)), votes, args.repeats)
            if name == "lax_top_k":
                reference = np.sort(np.asarray(out), axis=-1)
            elif selects and not np.array_equal(np.sort(np.asarray(out), axis=-1), reference):
                raise AssertionError(f"{name} selects another set than lax.top_k at N={n}")
            rows.append({"n": n, "candidates": count, "strategy": name, "ms_median": 1e3 * float(np.median(seconds)),
                         "ms_min": 1e3 * min(seconds), "ms_max": 1e3 * max(seconds)})
        base = next(r["ms_median"] for r in rows if r["n"] == n and r["strategy"] == "lax_top_k")
        for r in rows:
            if r["n"] == n:
                r["vs_lax_top_k"] = r["ms_median"] / base
    table = ["| N | C | strategy | ms [min–max] | × lax_top_k |", "|---|---|---|---|---|"]
    table += [f"| {r['n']:,} | {r['candidates']:,} | {r['strategy']} | {r['ms_median']:.1f} "
              f"[{r['ms_min']:.1f}–{r['ms_max']:.1f}] | {r['vs_lax_top_k']:.2f} |" for r in rows]
    print("\n".join(table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "jax": jax.__version__,
            "machine": f"{platform.machine()}, {jax.devices()[0].platform}", "kv_heads": int(stats.queries.shape[0])}
    (out / "bench_selection.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "bench_selection.md").write_text(f"Command: `{meta['command']}`\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
