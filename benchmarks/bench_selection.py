"""ParisKV's coarse top-C on this backend: lax.top_k against selections by vote threshold, one run.

    python benchmarks/bench_selection.py [--sizes 65536 262144] [--repeats 5]
                                         [--out results/bench_selection]

The coarse stage keeps the C = n_candidates(N) keys with the most votes (10% of
N at 64k and beyond). Votes are small integers (≤ 6 per subspace), so the same
set can be found without a top-k: the largest threshold t with at least C keys
voting ≥ t, every key above t, and the lowest-numbered keys at t until C (the
ties lax.top_k keeps). This script times, for the 3 KV heads of SmolLM2 (vmapped,
as the decode step runs them) over real ParisKV votes of keys synthesised from
SmolLM2's statistics (benchmarks/synthetic_keys.py):

- ``lax_top_k``: ``pariskv.top_indices`` on float32 votes (what the code runs);
- ``threshold``: only finding t (a histogram by compare-and-sum over the vote values);
- ``threshold_nonzero``: t, the tie cut by a cumsum, ``jnp.nonzero(size=C)``;
- ``threshold_blocks``: t, then compaction by blocks of 256 (in-block cumsum, scatter);
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synthetic_keys  # noqa: E402

from jaxkv.attention import pariskv  # noqa: E402

ROW_BITS = 20  # packed_sort: rows < 2^20 (1M keys)
BLOCK = 256


def real_votes(stats, n: int, cfg: pariskv.ParisKVConfig) -> jax.Array:
    """int32 [H, n]: ParisKV's coarse votes of each KV head's real query group over n synthesised keys."""
    keys, _ = synthetic_keys.synthesise(stats, n)
    queries = jnp.asarray(stats.queries, jnp.float32)

    def per_head(k, q):
        index = pariskv.build(cfg, k, jnp.int32(n))
        return pariskv.coarse_votes(cfg, index, pariskv.rotate(cfg, jnp.mean(q, axis=0)))

    return jax.jit(jax.vmap(per_head))(keys[0], queries)


def vote_threshold(votes: jax.Array, count: int, most: int) -> tuple[jax.Array, jax.Array]:
    """(t, how many keys at t to take): the largest t with ≥ count keys voting ≥ t (votes in [-1, most])."""
    values = jnp.arange(-1, most + 1, dtype=jnp.int32)
    at_least = jnp.sum(votes[:, None] >= values[None, :], axis=0, dtype=jnp.int32)
    t_index = jnp.sum(at_least >= count) - 1
    above = jnp.where(t_index + 1 < values.shape[0], at_least[jnp.minimum(t_index + 1, values.shape[0] - 1)], 0)
    return values[t_index], count - above


def _taken(votes, count, most):
    t, ties = vote_threshold(votes, count, most)
    at_t = votes == t
    return (votes > t) | (at_t & (jnp.cumsum(at_t, dtype=jnp.int32) <= ties))


def threshold_nonzero(votes, count, most):
    return jnp.nonzero(_taken(votes, count, most), size=count)[0]


def threshold_blocks(votes, count, most):
    taken = _taken(votes, count, most).reshape(-1, BLOCK)
    within = jnp.cumsum(taken, axis=1, dtype=jnp.int32)
    starts = jnp.cumsum(within[:, -1]) - within[:, -1]
    slot = jnp.where(taken, starts[:, None] + within - 1, count).reshape(-1)
    rows = jnp.arange(votes.shape[0], dtype=jnp.int32)
    return jnp.zeros(count + 1, jnp.int32).at[slot].set(rows, mode="drop")[:count]


def packed_sort(votes, count, most):
    rows = jnp.arange(votes.shape[0], dtype=jnp.int32)
    return (jnp.sort(((most - votes) << ROW_BITS) | rows)[:count]) & ((1 << ROW_BITS) - 1)


def strategies(count: int, most: int) -> dict:
    return {
        "lax_top_k": lambda v: pariskv.top_indices(v.astype(jnp.float32), count),
        "threshold": lambda v: vote_threshold(v, count, most)[0],
        "threshold_nonzero": lambda v: threshold_nonzero(v, count, most),
        "threshold_blocks": lambda v: threshold_blocks(v, count, most),
        "packed_sort": lambda v: packed_sort(v, count, most),
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
        most = int(jnp.max(votes))
        count = pariskv.n_candidates(cfg, n)
        reference = None
        for name, fn in strategies(count, most).items():
            out, seconds = timed(jax.jit(jax.vmap(fn)), votes, args.repeats)
            if name == "lax_top_k":
                reference = np.sort(np.asarray(out), axis=-1)
            elif out.ndim == 2 and not np.array_equal(np.sort(np.asarray(out), axis=-1), reference):
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
