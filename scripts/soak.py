"""Soak test of the four-region cache: many decode steps, invariants checked after every flush.

Not part of the test suite (minutes of CPU). For each method (MagicPIG, ParisKV)
it drives ``jaxkv.cache.region_attention`` — the decode step generate() runs for
a sparse layer: append, flush into the index, select, gather, attend — for
``--steps`` steps on a batch of rows with different prompt lengths (so rows
flush at different steps). Keys and queries are seeded random; each value
carries its own identity (position, row, head) in its first three coordinates,
so ``cache.all_tokens`` proves exactly which token sits where.

After every chunk of ``buffer`` steps (each row flushes once per chunk in the
steady state) it checks:
  * every row holds prompt + steps tokens, each in exactly one region, in
    position order (all_tokens' values carry positions 0..len-1, row, head);
  * sink_len = min(len, S); W <= win_len <= W + U once len >= S + W;
  * the index holds exactly the retrieval region (index.n == retr_len), nothing dropped;
  * every attention output is finite;
and records the process RSS (VmRSS from /proc/self/status). Memory is "flat"
when the steady RSS level (the median) of the last quarter of the checks exceeds
that of the second quarter by at most --rss-slack-mb. A median, not the maximum:
single checks spike by tens of MiB (the check's own host copies) and fall back at
the next one; a leak moves the level. The largest spike is reported beside it.

    python scripts/soak.py --steps 20000 --json results/soak.json
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvcache
from jaxkv.attention import magicpig, pariskv


def rss_mb() -> float:
    """Resident set size of this process in MiB, from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def tagged_values(key, positions, b: int, h: int, d: int):
    """Values [B, H, d] (or [B, T, H, d] for positions [B, T]) whose first coordinates are (pos, row, head)."""
    shape = (*positions.shape, h, d)
    v = jax.random.normal(key, shape, jnp.float32)
    rows = jnp.arange(b).reshape(b, *([1] * (positions.ndim - 1)), 1)
    heads = jnp.arange(h)
    tag = jnp.stack(jnp.broadcast_arrays(positions[..., None].astype(jnp.float32),
                                         rows.astype(jnp.float32), heads.astype(jnp.float32)), axis=-1)
    return v.at[..., :3].set(tag)


def prefill_state(method, mcfg, ccfg, prompt_lengths, capacity, h, d, seed):
    b, t = len(prompt_lengths), max(prompt_lengths)
    key_k, key_v = jax.random.split(jax.random.key(seed))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    k = jax.random.normal(key_k, (b, t, h, d), jnp.float32)
    v = tagged_values(key_v, positions, b, h, d)
    state = kvcache.regions_from_prefill(  # the staging cache is head-major
        k.swapaxes(1, 2), v.swapaxes(1, 2), jnp.asarray(prompt_lengths, jnp.int32), method=method, mcfg=mcfg, ccfg=ccfg,
        capacity=capacity, key=jax.random.key(seed + 1))
    # Un-jitted, keys_read and keys_seen share one zeros buffer: copy before donating.
    return jax.tree.map(jnp.copy, state)


@functools.partial(jax.jit, static_argnames=("method", "mcfg", "ccfg", "n_steps", "g"),
                   donate_argnames=("state",))
def decode_chunk(state, lengths, key, *, method, mcfg, ccfg, n_steps: int, g: int):
    """n_steps decode steps; returns (state, new lengths, whether every output was finite)."""
    b, h, _, d = state.win_k.shape

    def step(carry, key):
        state, lengths, finite = carry
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (b, 1, h * g, d), jnp.float32)
        k = jax.random.normal(kk, (b, 1, h, d), jnp.float32)
        v = tagged_values(kv, lengths[:, None], b, h, d)
        out, state = kvcache.region_attention(q, k, v, lengths[:, None], state,
                                              method=method, mcfg=mcfg, ccfg=ccfg)
        return (state, lengths + 1, finite & jnp.all(jnp.isfinite(out))), None

    (state, lengths, finite), _ = jax.lax.scan(
        step, (state, lengths, jnp.bool_(True)), jax.random.split(key, n_steps))
    return state, lengths, finite


def check_invariants(state, lengths, ccfg) -> list[str]:
    """Every violated region invariant, as text (empty when all hold)."""
    problems = []
    _, v, held = kvcache.all_tokens(state)
    v, held, lengths = np.asarray(v), np.asarray(held), np.asarray(lengths)
    if not np.array_equal(held, lengths):
        problems.append(f"regions hold {held.tolist()} tokens, expected {lengths.tolist()}")
    s, w, u = ccfg.sink, ccfg.local, ccfg.buffer
    sink, win, retr = (np.asarray(x) for x in (state.sink_len, state.win_len, state.retr_len))
    for row, n in enumerate(lengths):
        tags = v[row, :, :n, :3]
        want_pos = np.broadcast_to(np.arange(n, dtype=np.float32)[None, :], tags.shape[:2])
        if not np.array_equal(tags[..., 0], want_pos):
            first = np.argwhere(tags[..., 0] != want_pos)[0]
            problems.append(f"row {row}: head {first[0]} slot {first[1]} holds position "
                            f"{tags[first[0], first[1], 0]}")
        if not (np.all(tags[..., 1] == row) and np.all(tags[..., 2] == np.arange(tags.shape[0])[:, None])):
            problems.append(f"row {row}: a value of another row or head is in its regions")
        if sink[row] != min(n, s):
            problems.append(f"row {row}: sink_len {sink[row]}, expected {min(n, s)}")
        if n >= s + w and not w <= win[row] <= w + u:
            problems.append(f"row {row}: win_len {win[row]} outside [{w}, {w + u}]")
    index_n = np.asarray(state.index.n)
    if not np.array_equal(index_n, np.broadcast_to(retr[:, None], index_n.shape)):
        problems.append(f"index.n {index_n.tolist()} != retr_len {retr.tolist()}")
    dropped = getattr(state.index, "n_dropped", None)
    if dropped is not None and np.any(np.asarray(dropped)):
        problems.append(f"index dropped keys: {np.asarray(dropped).tolist()}")
    return problems


def soak(name, method, mcfg, args) -> dict:
    ccfg = kvcache.CacheConfig(dense_threshold=0, offload=True).resolve(mcfg)
    prompts = [args.prompt - 97 * i for i in range(args.batch)]
    capacity = max(max(prompts) + args.steps - ccfg.sink - ccfg.local, 0) + ccfg.buffer
    state = prefill_state(method, mcfg, ccfg, prompts, capacity, args.kv_heads, args.head_dim, args.seed)
    lengths = jnp.asarray(prompts, jnp.int32)
    chunk = ccfg.buffer
    record = {"method": name, "config": repr(mcfg), "cache": repr(ccfg), "prompts": prompts,
              "steps_done": 0, "flush_checks": 0, "rss_mb": [], "problems": []}
    key = jax.random.key(args.seed + 2)
    t0 = time.perf_counter()
    done = 0
    while done < args.steps:
        n = min(chunk, args.steps - done)
        key, sub = jax.random.split(key)
        state, lengths, finite = decode_chunk(state, lengths, sub, method=method, mcfg=mcfg, ccfg=ccfg,
                                              n_steps=n, g=args.group)
        done += n
        problems = check_invariants(state, lengths, ccfg)
        if not bool(finite):
            problems.append("a non-finite attention output")
        record.update(steps_done=done, flush_checks=record["flush_checks"] + 1,
                      seconds=round(time.perf_counter() - t0, 1))
        record["rss_mb"].append(round(rss_mb(), 1))
        record["problems"] += [f"step {done}: {p}" for p in problems]
        print(f"{name} step {done}/{args.steps}: rss {record['rss_mb'][-1]} MiB, "
              f"{'OK' if not problems else problems}", flush=True)
        if problems:
            break
        if args.json:
            _write(args.json, record, args)
    record.update(memory_report(record["rss_mb"], args.rss_slack_mb))
    record["passed"] = not record["problems"] and record["memory_flat"] and done == args.steps
    return record


def memory_report(rss: list[float], slack_mb: float) -> dict:
    """Whether RSS is flat: the last quarter's median level against the second quarter's."""
    quarter = max(len(rss) // 4, 1)
    settled = float(np.median(rss[quarter:2 * quarter] or rss))
    final = float(np.median(rss[-quarter:]))
    return {"rss_settled_mb": round(settled, 1), "rss_final_mb": round(final, 1),
            "rss_growth_mb": round(final - settled, 1),
            "rss_largest_spike_mb": round(max(rss[quarter:] or rss) - settled, 1),
            "memory_flat": final - settled <= slack_mb}


_RESULTS: list[dict] = []


def _write(path, current, args):
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": _RESULTS + [current]}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1500, help="longest prompt; row i has 97·i fewer tokens")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=2, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--methods", default="magicpig,pariskv")
    parser.add_argument("--rss-slack-mb", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here (updated after every check)")
    args = parser.parse_args(argv)
    configs = {
        # Official defaults (K10L150, S=4, W=64); the update buffer defaults to W.
        "magicpig": (magicpig.METHOD, magicpig.MagicPIGConfig()),
        # Official defaults (top-k 100, S=4, W=512, U=512).
        "pariskv": (pariskv.METHOD, pariskv.ParisKVConfig()),
    }
    ok = True
    for name in args.methods.split(","):
        method, mcfg = configs[name]
        record = soak(name, method, mcfg, args)
        _RESULTS.append(record)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": _RESULTS}, f, indent=1)
        print(json.dumps({k: v for k, v in record.items() if k != "rss_mb"}), flush=True)
        ok &= record["passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
