"""The drift study: recall while decode-time keys join the pool, indexes never retrained.

    jaxkv eval drift [--tokens 8192] [--prefill 4000] [--step 250] [--queries-per-step 8]
                     [--capture-cache F] [--out results/drift]

One prefill captures SmolLM2's keys for a ``tokens``-token Wikipedia text and
the queries at every position from ``prefill`` on (real decode-time keys and
queries of continued text, not generated text). Every index (ParisKV, PQCache,
MagicPIG; sink 4 and local 512 for all, as in :mod:`jaxkv.eval.recall`) is
built over the prefill's pool [S, prefill − W): PQCache's k-means centroids
and MagicPIG's centring mean come from these keys only. At decode step j
(position prefill + j) the pool is [S, prefill + j − W): keys leaving the
local window are inserted in blocks of ``step`` (what the update buffer hands
over). At every checkpoint j = 0, step, 2·step, … the queries at positions
prefill + j … prefill + j + queries_per_step − 1 are scored against the exact
top-k over the pool (per query head and group mean, see :mod:`jaxkv.eval.recall`).

The indexes are queried through a view of capacity n = the pool size (rows
past n dropped), so ParisKV's length-adaptive ratios follow the current length
as in the official code; nothing depends on the larger capacity otherwise.
Writes results.json, table.md and recall_vs_step.png under ``--out``.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import numpy as np

from jaxkv import plots
from jaxkv.eval import capture as capture_mod
from jaxkv.eval import recall
from models import files

def at_capacity(indexes: recall.Indexes, n: int) -> recall.Indexes:
    """The indexes of one KV head cut to capacity n (n = their valid rows, static)."""
    p, q, g = indexes.pariskv, indexes.pqcache, indexes.magicpig
    return recall.Indexes(
        pariskv=dataclasses.replace(p, codes=jax.tree.map(lambda x: x[:n], p.codes)),
        pqcache=dataclasses.replace(q, codes=q.codes[:n]),
        magicpig=dataclasses.replace(g, sorted_ids=g.sorted_ids[:, :n]),
    )


@functools.partial(jax.jit, static_argnames="methods")
def build_heads(methods: recall.Methods, pool, n, key) -> recall.Indexes:
    """Per-KV-head indexes of the first n rows of pool[H, cap, d]."""
    return jax.vmap(lambda keys: recall.build_indexes(methods, keys, n, key))(pool)


@functools.partial(jax.jit, static_argnames="methods", donate_argnames="indexes")
def insert_heads(methods: recall.Methods, indexes: recall.Indexes, block) -> recall.Indexes:
    """Append block[H, U, d] (all U rows) to every head's indexes."""
    return jax.vmap(lambda idx, b: recall.insert_keys(methods, idx, b, b.shape[0]))(indexes, block)


@functools.partial(jax.jit, static_argnames=("methods", "n"))
def checkpoint_recalls(methods: recall.Methods, n: int, indexes, pool, queries) -> dict:
    """Recalls of queries[H, G, Qc, d] against the first n rows of pool[H, cap, d] (n = indexes' n)."""
    def head(idx, keys, qs):
        view = at_capacity(idx, n)
        return jax.vmap(lambda q: recall.query_recalls(methods, view, keys[:n], q), in_axes=1)(qs)

    return jax.vmap(head)(indexes, pool, queries)


def checkpoint_steps(n_tokens: int, prefill: int, step: int, per_step: int) -> list[int]:
    """Decode steps j = 0, step, … whose queries prefill + j … + per_step − 1 lie in the text."""
    if step < 1 or per_step < 1:
        raise ValueError(f"step and queries per step must be >= 1, got step={step}, per_step={per_step}")
    last = n_tokens - prefill - per_step
    if last < 0:
        raise ValueError(f"a {n_tokens}-token text has no decode steps after a {prefill}-token prefill "
                         f"with {per_step} queries per step")
    return list(range(0, last + 1, step))


def study(captured, methods: recall.Methods, prefill: int, step: int, per_step: int, seed: int = 0,
          log=print, layer_ids=None) -> dict:
    """Recall per checkpoint (JSON-ready) for a capture with queries at every position >= prefill.

    layer_ids: the model's layer numbers of the captured layers (for the log; default 0, 1, …).
    """
    layer_ids = list(range(captured.num_layers)) if layer_ids is None else layer_ids
    n_tokens = captured.keys.shape[2]
    steps = checkpoint_steps(n_tokens, prefill, step, per_step)
    first_query = int(captured.query_positions[0])
    if first_query > prefill:
        raise ValueError(f"the capture's queries start at position {first_query}; the study needs them "
                         f"from the prefill end {prefill} (capture with queries = tokens − prefill)")
    n0 = prefill - methods.local - methods.sink
    if n0 < methods.k:
        raise ValueError(f"prefill={prefill} leaves a pool of {n0} keys after sink {methods.sink} + local "
                         f"{methods.local}, fewer than the recall depth k={methods.k}")
    cap = n0 + steps[-1]
    names = [f"{name}/{t}" for name in recall.FOUND_SETS for t in recall.TARGETS]
    rows = {name: [[] for _ in steps] for name in names + ["magicpig_sampled_fraction"]}
    for layer in range(captured.num_layers):
        t0 = time.time()
        pool = jax.numpy.asarray(captured.keys[layer][:, methods.sink:methods.sink + cap])
        queries = captured.queries[layer]
        indexes = build_heads(methods, pool, n0, jax.random.fold_in(jax.random.key(seed), layer))
        n = n0
        for i, j in enumerate(steps):
            while n < n0 + j:
                indexes = insert_heads(methods, indexes, pool[:, n:n + step])
                n += step
            at = prefill + j - first_query
            r = jax.device_get(checkpoint_recalls(methods, n, indexes, pool, queries[:, :, at:at + per_step]))
            for name in recall.FOUND_SETS:
                for t, value in zip(recall.TARGETS, r[name]):
                    rows[f"{name}/{t}"][i].append(np.asarray(value).reshape(-1))
            rows["magicpig_sampled_fraction"][i].append(np.asarray(r["magicpig_sampled"]).reshape(-1) / n)
        log(f"layer {layer_ids[layer]:2d}: ParisKV {rows['pariskv/head'][-1][-1].mean():.3f}, "
            f"PQCache {rows['pqcache/head'][-1][-1].mean():.3f}, "
            f"MagicPIG {rows['magicpig/head'][-1][-1].mean():.3f} at step {steps[-1]} ({time.time() - t0:.0f} s)")
    checkpoints = []
    for i, j in enumerate(steps):
        entry = {"decode_step": j, "pool_keys": n0 + j}
        for name, per_checkpoint in rows.items():
            mean, sem = recall.mean_sem(np.concatenate(per_checkpoint[i]))
            entry[name] = {"mean": mean, "sem": sem}
        checkpoints.append(entry)
    return {"context_tokens": n_tokens, "prefill": prefill, "step": step, "queries_per_step": per_step,
            "k": methods.k, "layers": captured.num_layers, "checkpoints": checkpoints}


COLUMNS = (("pariskv", "ParisKV"), ("pariskv_candidates", "ParisKV coarse candidates"),
           ("pqcache", "PQCache"), ("magicpig", "MagicPIG sampled"))


def markdown(result: dict) -> str:
    k = result["k"]
    head = " | ".join(f"{label} (head / mean)" for _, label in COLUMNS)
    lines = [f"Recall@{k} against the exact top-{k} of the pool, per query head / group mean "
             f"(mean over {result['layers']} layers × KV heads × {result['queries_per_step']} positions)", "",
             f"| decode step | pool keys | {head} | MagicPIG sampled (% of pool) |",
             "|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for c in result["checkpoints"]:
        cells = " | ".join(f"{c[f'{name}/head']['mean']:.1%} / {c[f'{name}/mean']['mean']:.1%}"
                           for name, _ in COLUMNS)
        lines.append(f"| {c['decode_step']} | {c['pool_keys']} | {cells} | "
                     f"{c['magicpig_sampled_fraction']['mean']:.2%} |")
    return "\n".join(lines)


def plot(result: dict, path: Path, title: str):
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [c["decode_step"] for c in result["checkpoints"]]
    for name, label in COLUMNS:
        line = ax.plot(steps, [c[f"{name}/head"]["mean"] for c in result["checkpoints"]], marker="o", ms=3,
                       label=f"{label} (per query head)")[0]
        ax.plot(steps, [c[f"{name}/mean"]["mean"] for c in result["checkpoints"]], ls="--",
                color=line.get_color(), alpha=0.6, label=f"{label} (group mean)")
    ax.set_xlabel(f"decode step after a {result['prefill']}-token prefill")
    ax.set_ylabel(f"Recall@{result['k']}")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with files.atomic_file(path) as staging:
        fig.savefig(staging, dpi=120)
    plt.close(fig)


def check_args(args) -> None:
    """The flags checked before any model is loaded (ValueError naming the flag)."""
    capture_mod.parse_layers(args.layers)
    if args.prefill >= args.tokens:
        raise ValueError(f"--prefill {args.prefill} must be below --tokens {args.tokens}")
    checkpoint_steps(args.tokens, args.prefill, args.step, args.queries_per_step)
    methods = recall.default_methods(args.top_k)
    pool = args.prefill - methods.local - methods.sink
    if pool < methods.k:
        raise ValueError(f"--prefill {args.prefill} leaves a pool of {pool} keys after sink {methods.sink} + "
                         f"local {methods.local}, fewer than --top-k {methods.k}")


def main(args) -> int:
    plots.require()  # before the work: the figure is its last output
    t0 = time.time()
    captured, layers = recall.select_layers(recall.load_capture(args, args.tokens, args.tokens - args.prefill),
                                            args.layers)
    print(f"{captured.num_layers} layers, {args.tokens} tokens, queries from {args.prefill} "
          f"({time.time() - t0:.0f} s)")
    result = study(captured, recall.default_methods(args.top_k), args.prefill, args.step,
                   args.queries_per_step, seed=args.seed, layer_ids=layers)
    result["layer_ids"] = layers
    result["command"] = (f"jaxkv eval drift --tokens {args.tokens} --prefill {args.prefill} --step {args.step} "
                         f"--queries-per-step {args.queries_per_step} --top-k {args.top_k} --seed {args.seed}"
                         + (f" --layers {args.layers}" if args.layers else ""))
    result["seconds"] = time.time() - t0
    table = markdown(result)
    recall.write_outputs(Path(args.out), result, table, lambda out: plot(
        result, out / "recall_vs_step.png", f"SmolLM2-135M, Wikipedia, pool built at {args.prefill} tokens"))
    print(table)
    print(f"wrote {args.out}/table.md, results.json, recall_vs_step.png in {time.time() - t0:.0f} s")
    return 0
