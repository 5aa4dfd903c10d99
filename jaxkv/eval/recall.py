"""The recall study: ParisKV's coarse stage and rerank vs PQCache and MagicPIG on real keys.

    jaxkv eval recall [--tokens 8000] [--queries 64] [--capture-cache F] [--out results/recall]

On SmolLM2's captured keys and queries (a Wikipedia context, every layer and KV
head, the last ``queries`` positions) in the decode view of
:mod:`jaxkv.eval.decode_view`: every index is built over the same retrieval
region [S, N − Q − W) with ParisKV's defaults S = 4, W = 512, so every method
sees the same pool of keys and the same exact set.

Targets. The exact top-k of q·k over the pool, defined two ways:
*per query head* (the paper's recall: each of the G query heads against its own
top-k) and *group mean* (the top-k of q̄·k, q̄ the mean of the G queries — what
ParisKV and PQCache actually retrieve for). Both are reported.

Found sets, each compared with both targets:

- ``pariskv``: the final top-k after the RSQ-IP rerank (end to end);
- ``pariskv_candidates``: the candidate_ratio·n keys the coarse stage keeps
  (what fraction of the target survives the coarse stage);
- ``pariskv_votes``: the k keys with the most votes, no rerank (the coarse
  stage as a retriever on its own); ties at the k-th vote total are broken
  uniformly at random and the *expected* recall is reported (vote totals are
  small integers with many ties, so a fixed tie order would be arbitrary);
- ``pqcache``: the PQ top-k (prefill k-means centroids);
- ``magicpig``: the keys a query head samples (K10L150, ≥ 2 collisions); for
  the group-mean target the union over the group. Its sample size varies, so
  the sampled fraction is reported beside it.

Also the attention-output error ‖ô − o‖/‖o‖ at the same exact set for
ParisKV, PQCache, MagicPIG and the oracle retriever (the exact top-k of the
pool, by group mean — the same keys read as ParisKV — and per query head).
Writes results.json, table.md and recall_by_layer.png under ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import plots
from jaxkv.attention import common, magicpig, pariskv, pqcache
from jaxkv.attention.method import SparseMethod
from jaxkv.eval import capture as capture_mod
from jaxkv.eval import decode_view
from models import files

SINK, LOCAL = 4, 512  # ParisKV's defaults, used by every method so the pools coincide
FOUND_SETS = ("pariskv", "pariskv_candidates", "pariskv_votes", "pqcache", "magicpig")
TARGETS = ("head", "mean")


@dataclasses.dataclass(frozen=True)
class Methods:
    """The compared methods' configurations and the recall depth k (static)."""

    pariskv: pariskv.ParisKVConfig
    pqcache: pqcache.PQCacheConfig
    magicpig: magicpig.MagicPIGConfig
    k: int

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"Methods.k (recall depth) must be >= 1, got {self.k}")
        for name in ("pqcache", "magicpig"):
            other = getattr(self, name)
            if (other.sink, other.local) != (self.sink, self.local):
                raise ValueError(
                    f"Methods.{name} has sink {other.sink}, local {other.local}; every method must share "
                    f"ParisKV's sink {self.sink}, local {self.local} so the pools coincide")

    @property
    def sink(self) -> int:
        return self.pariskv.sink

    @property
    def local(self) -> int:
        return self.pariskv.local


def default_methods(top_k: int = 100) -> Methods:
    """Official defaults, one exact set (S = 4, W = 512); recall depth = ParisKV's top_k.

    MagicPIG gets room for its samples (a quarter of the pool) and 4 × pool
    inverted-index entries per query head, so its capacities do not cut the
    sample the recall is measured on (``tables_used`` reports when they do).
    """
    return Methods(
        pariskv=pariskv.ParisKVConfig(top_k=top_k, sink=SINK, local=LOCAL),
        pqcache=pqcache.PQCacheConfig(top_k=top_k, sink=SINK, local=LOCAL),
        magicpig=magicpig.MagicPIGConfig(sink=SINK, local=LOCAL, capacity=0.25, candidate_capacity=4.0),
        k=top_k,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Indexes:
    """One KV head's index per method, over the same pool."""

    pariskv: pariskv.ParisKVIndex
    pqcache: pqcache.PQCacheIndex
    magicpig: magicpig.MagicPIGIndex


def build_indexes(methods: Methods, pool: jax.Array, n, key: jax.Array) -> Indexes:
    """Every method's index of the first n rows of pool[cap, d] (capacity cap)."""
    return Indexes(
        pariskv=pariskv.build(methods.pariskv, pool, n),
        pqcache=pqcache.build(methods.pqcache, pool, n),
        magicpig=magicpig.build(methods.magicpig, pool, n, key),
    )


def insert_keys(methods: Methods, indexes: Indexes, keys_new: jax.Array, count) -> Indexes:
    """Append keys_new[U, d] (the first ``count`` rows) to every index; nothing is retrained."""
    return Indexes(
        pariskv=pariskv.insert(methods.pariskv, indexes.pariskv, keys_new, count),
        pqcache=pqcache.insert(methods.pqcache, indexes.pqcache, keys_new, count),
        magicpig=magicpig.insert(methods.magicpig, indexes.magicpig, keys_new, count),
    )


def exact_top(pool: jax.Array, n, q: jax.Array, k: int) -> jax.Array:
    """Rows [..., k] of the k largest q·k_i among the first n rows of pool[cap, d]; q[..., d]."""
    s = jnp.einsum("...d,nd->...n", q.astype(jnp.float32), pool.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return jax.lax.top_k(jnp.where(jnp.arange(pool.shape[0]) < n, s, -jnp.inf), k)[1]


def rows_mask(rows: jax.Array, valid: jax.Array, cap: int) -> jax.Array:
    """bool [cap]: True at the valid entries of rows[C]."""
    return jnp.zeros((cap,), bool).at[jnp.where(valid, rows, cap)].set(True, mode="drop")


def recall(found: jax.Array, truth: jax.Array) -> jax.Array:
    """Fraction of the target rows truth[..., k] in found[..., cap] (bool, same leading axes)."""
    return jnp.mean(jnp.take_along_axis(found, truth, axis=-1), axis=-1)


def vote_recall(votes: jax.Array, truth: jax.Array, k: int) -> jax.Array:
    """Expected recall of the k keys with the most votes, ties at the k-th total broken at random.

    votes [cap] (−1 on unused rows), truth [..., k] target rows. Keys above the
    k-th total are all taken; the remaining slots go uniformly to the tied
    keys, so each tied target key is taken with probability slots / tied.
    """
    kth = jax.lax.top_k(votes, k)[0][-1]
    above, tied = votes > kth, votes == kth
    slots = k - jnp.sum(above)
    taken = above + tied * slots / jnp.sum(tied)  # probability each key is among the k
    return jnp.mean(taken[truth], axis=-1)


def query_recalls(methods: Methods, indexes: Indexes, pool: jax.Array, q: jax.Array) -> dict:
    """One query group q[G, d] against the pool[n, d] all indexes hold (capacity = n).

    Returns {found set: (recall per query head [G], recall vs the group-mean target [])}
    plus MagicPIG's sample sizes and tables read per query head.
    """
    cap, k = pool.shape[0], methods.k
    targets = {"head": exact_top(pool, cap, q, k), "mean": exact_top(pool, cap, jnp.mean(q, axis=0), k)}
    found_rows = {
        "pariskv": pariskv.retrieve(methods.pariskv, indexes.pariskv, q),
        "pariskv_candidates": pariskv.coarse_candidates(methods.pariskv, indexes.pariskv, q),
        "pqcache": pqcache.retrieve(methods.pqcache, indexes.pqcache, q),
    }
    out = {}
    for name, rows in found_rows.items():
        mask = rows_mask(rows, rows < cap, cap)  # rows past the valid count are padding
        out[name] = (recall(jnp.broadcast_to(mask, (q.shape[0], cap)), targets["head"]),
                     recall(mask, targets["mean"]))
    q_rot = pariskv.rotate(methods.pariskv, jnp.mean(q.astype(jnp.float32), axis=0))
    votes = pariskv.coarse_votes(methods.pariskv, indexes.pariskv, q_rot)
    out["pariskv_votes"] = (vote_recall(votes, targets["head"], k), vote_recall(votes, targets["mean"], k))
    selection, stats = magicpig.select_with_stats(methods.magicpig, indexes.magicpig, q)
    sampled = jax.vmap(lambda m: rows_mask(selection.idx, m, cap))(selection.mask)  # [G, cap]
    out["magicpig"] = (recall(sampled, targets["head"]), recall(jnp.any(sampled, axis=0), targets["mean"]))
    out["magicpig_sampled"] = stats.n_sampled
    out["magicpig_tables_used"] = stats.tables_used
    return out


@functools.partial(jax.jit, static_argnames="methods")
def layer_recalls(methods: Methods, pool: jax.Array, queries: jax.Array, key: jax.Array) -> dict:
    """pool [H, n, d], queries [H, G, Q, d] → :func:`query_recalls`'s dict, leading axes [H, Q]."""
    def head(keys, qs):
        indexes = build_indexes(methods, keys, keys.shape[0], key)
        return jax.vmap(lambda q: query_recalls(methods, indexes, keys, q), in_axes=1)(qs)

    return jax.vmap(head)(pool, queries)


# ---------------------------------------------------------------- the oracle retriever

@dataclasses.dataclass(frozen=True)
class OracleRetrieverConfig:
    """Exact top-k of the pool: by the group-mean score (k keys per KV head) or per query head."""

    top_k: int
    per_head: bool
    sink: int
    local: int


class OracleRetriever(SparseMethod):
    """The exact top-k of the pool, as :mod:`jaxkv.eval.decode_view` drives a method."""

    config_class = OracleRetrieverConfig

    def build(self, cfg, keys, values, n, key):
        del values, n, key  # decode_view passes exactly the pool
        return keys

    def insert(self, cfg, index, keys_new, values_new, count):
        raise NotImplementedError("the oracle retriever scores a fixed pool: nothing is inserted")

    def select(self, cfg, keys, q, take=None):
        s = common.scores(q, keys)  # [G, cap]
        if not cfg.per_head:
            s = jnp.mean(s, axis=0, keepdims=True)  # the mean of the scores is the score of q̄
        top = jax.lax.top_k(s, min(cfg.top_k, keys.shape[0]))[1]
        mask = jax.vmap(lambda rows: rows_mask(rows, rows >= 0, keys.shape[0]))(top)
        return common.Selection(idx=jnp.arange(keys.shape[0]),
                                mask=jnp.broadcast_to(mask, (q.shape[0], keys.shape[0])))


ORACLE_RETRIEVER = OracleRetriever()


@functools.partial(jax.jit, static_argnames=("method", "cfg"))
def layer_errors(method, cfg, keys, values, queries, positions, key):
    """([H, G, Q] relative output errors, [H, Q] distinct keys read) of a method on one layer."""
    out, read, _ = jax.vmap(
        lambda k, v, q: decode_view.method_outputs(method, cfg, k, v, q, positions, key))(keys, values, queries)
    truth = jax.vmap(decode_view.dense_truth, in_axes=(0, 0, 0, None))(keys, values, queries, positions)
    return decode_view.relative_error(out, truth), read


def error_methods(methods: Methods) -> dict:
    """label → (method, config) of the output-error comparison."""
    return {
        "pariskv": (pariskv.METHOD, methods.pariskv),
        "pqcache": (pqcache.METHOD, methods.pqcache),
        "magicpig": (magicpig.METHOD, methods.magicpig),
        "oracle top-k (group mean)": (ORACLE_RETRIEVER, OracleRetrieverConfig(
            methods.k, per_head=False, sink=methods.sink, local=methods.local)),
        "oracle top-k (per head)": (ORACLE_RETRIEVER, OracleRetrieverConfig(
            methods.k, per_head=True, sink=methods.sink, local=methods.local)),
    }


# ---------------------------------------------------------------- captured tensors

def restrict(captured, n_tokens: int, n_queries: int):
    """The capture of the first n_tokens tokens with queries at the last n_queries of them.

    Attention is causal, so a longer capture holds a shorter one exactly; this
    lets one capture (e.g. the drift study's) serve both studies.
    """
    from jaxkv.eval.capture import Captured

    n_have = captured.keys.shape[2]
    positions = np.asarray(captured.query_positions)
    wanted = np.arange(n_tokens - n_queries, n_tokens)
    if n_tokens > n_have or not np.isin(wanted, positions).all():
        raise ValueError(
            f"the capture holds {n_have} tokens and queries at positions {positions[0]}..{positions[-1]}; "
            f"{n_tokens} tokens with queries at {wanted[0]}..{wanted[-1]} need a larger capture")
    first = int(np.searchsorted(positions, wanted[0]))
    return Captured(keys=captured.keys[:, :, :n_tokens], values=captured.values[:, :, :n_tokens],
                    queries=captured.queries[:, :, :, first:first + n_queries], query_positions=wanted)


def select_layers(captured, layers: str | None):
    """The capture restricted to a comma-separated list of layers (None: all), and their numbers."""
    from jaxkv.eval.capture import Captured, check_layers, parse_layers

    chosen = check_layers(parse_layers(layers), captured.num_layers)
    if chosen == list(range(captured.num_layers)):
        return captured, chosen
    return Captured(keys=captured.keys[chosen], values=captured.values[chosen], queries=captured.queries[chosen],
                    query_positions=captured.query_positions), chosen


def check_args(args) -> None:
    """The flags checked before any model is loaded (ValueError naming the flag)."""
    capture_mod.parse_layers(args.layers)
    capture_mod.check_sizes(args.tokens, args.queries)


def load_capture(args, n_tokens: int, n_queries: int):
    """Captured tensors for the study: from ``args.capture_cache`` if it exists, else a fresh capture."""

    capture_args = argparse.Namespace(tokens=n_tokens, queries=n_queries, seed=args.seed, model=args.model,
                                      capture_cache=args.capture_cache)
    return restrict(capture_mod.load_or_capture(capture_args), n_tokens, n_queries)


# ---------------------------------------------------------------- the study

def mean_sem(x) -> tuple[float, float]:
    """Mean and its standard error over all entries of x."""
    x = np.asarray(x, np.float64).reshape(-1)
    sem = float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else 0.0
    return float(x.mean()), sem


def study(captured, methods: Methods, seed: int = 0, log=print, layer_ids=None) -> dict:
    """Recall and output-error results (JSON-ready) for a decode-view capture.

    layer_ids: the model's layer numbers of the captured layers (for the log; default 0, 1, …).
    """
    layer_ids = list(range(captured.num_layers)) if layer_ids is None else layer_ids
    n, q_len = captured.keys.shape[2], captured.queries.shape[3]
    start, end = methods.sink, n - q_len - methods.local
    if end - start < methods.k:
        raise ValueError(f"the pool [{start}, {end}) holds fewer keys than the recall depth k={methods.k}")
    positions = jnp.asarray(captured.query_positions)
    per_layer = {f"{name}/{t}": [] for name in FOUND_SETS for t in TARGETS}
    sampled, tables = [], []
    errors = {label: ([], []) for label in error_methods(methods)}
    for layer in range(captured.num_layers):
        t0 = time.time()
        key = jax.random.fold_in(jax.random.key(seed), layer)
        keys, values, queries = (jnp.asarray(x[layer]) for x in (captured.keys, captured.values, captured.queries))
        r = jax.device_get(layer_recalls(methods, keys[:, start:end], queries, key))
        for name in FOUND_SETS:
            for t, value in zip(TARGETS, r[name]):
                per_layer[f"{name}/{t}"].append(np.asarray(value))
        sampled.append(r["magicpig_sampled"] / (end - start))
        tables.append(r["magicpig_tables_used"] / methods.magicpig.L)
        for label, (method, cfg) in error_methods(methods).items():
            err, read = layer_errors(method, cfg, keys, values, queries, positions, key)
            errors[label][0].append(np.asarray(err))
            errors[label][1].append(np.asarray(read) / (np.asarray(captured.query_positions) + 1))
        log(f"layer {layer_ids[layer]:2d}: ParisKV recall {per_layer['pariskv/head'][-1].mean():.3f}, "
            f"PQCache {per_layer['pqcache/head'][-1].mean():.3f}, "
            f"MagicPIG {per_layer['magicpig/head'][-1].mean():.3f} ({time.time() - t0:.0f} s)")
    recalls = {}
    for name_target, values in per_layer.items():
        mean, sem = mean_sem(np.concatenate([v.reshape(-1) for v in values]))
        recalls[name_target] = {"mean": mean, "sem": sem, "by_layer": [float(v.mean()) for v in values]}
    error_rows = []
    for label, (errs, reads) in errors.items():
        mean, sem = mean_sem(np.concatenate([e.reshape(-1) for e in errs]))
        error_rows.append({"method": label, "error": mean, "error_sem": sem,
                           "keys_read_fraction": float(np.mean(np.concatenate([r.reshape(-1) for r in reads])))})
    return {
        "context_tokens": n, "queries": q_len, "pool": [start, end], "k": methods.k,
        "sink": methods.sink, "local": methods.local,
        "pariskv_candidates": pariskv.n_candidates(methods.pariskv, end - start),
        "recall": recalls, "errors": error_rows,
        "magicpig_sampled_fraction": float(np.mean(np.concatenate([s.reshape(-1) for s in sampled]))),
        "magicpig_tables_read_fraction": float(np.mean(np.concatenate([t.reshape(-1) for t in tables]))),
    }


FOUND_SET_LABELS = {
    "pariskv": "ParisKV end to end (coarse + RSQ-IP rerank, top-k)",
    "pariskv_candidates": "ParisKV coarse candidates (target found among the candidate_ratio·n kept)",
    "pariskv_votes": "ParisKV coarse alone: top-k by votes (ties at random, expected)",
    "pqcache": "PQCache top-k (prefill centroids)",
    "magicpig": "MagicPIG K10L150 sampled set",
}


def markdown(result: dict) -> str:
    k = result["k"]
    lines = [f"Recall@{k} (mean ± s.e. over layers × KV heads × query heads × positions; "
             f"group-mean target: over layers × KV heads × positions)", "",
             f"| found set | vs per-query-head top-{k} | vs group-mean top-{k} |", "|---|---|---|"]
    for name in FOUND_SETS:
        cells = [f"{result['recall'][f'{name}/{t}']['mean']:.1%} ± {result['recall'][f'{name}/{t}']['sem']:.1%}"
                 for t in TARGETS]
        lines.append(f"| {FOUND_SET_LABELS[name]} | {cells[0]} | {cells[1]} |")
    lines += ["", f"ParisKV keeps {result['pariskv_candidates']} coarse candidates of "
              f"{result['pool'][1] - result['pool'][0]} pool keys; MagicPIG samples "
              f"{result['magicpig_sampled_fraction']:.2%} of the pool per query head and reads "
              f"{result['magicpig_tables_read_fraction']:.1%} of its tables within its capacities.", "",
              f"| method (same exact set: sink {result['sink']} + local {result['local']} + decode buffer) "
              "| keys read (% of context) "
              "| mean ‖ô − o‖/‖o‖ ± s.e. |", "|---|---|---|"]
    for row in result["errors"]:
        lines.append(f"| {row['method']} | {row['keys_read_fraction']:.2%} | {row['error']:.4f} ± {row['error_sem']:.4f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path, title: str):
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in FOUND_SETS:
        by_layer = result["recall"][f"{name}/head"]["by_layer"]
        ax.plot(range(len(by_layer)), by_layer, marker="o", ms=3, label=FOUND_SET_LABELS[name])
    ax.set_xlabel("layer")
    ax.set_ylabel(f"Recall@{result['k']} vs per-query-head top-{result['k']}")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with files.atomic_file(path) as staging:
        fig.savefig(staging, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, result: dict, table: str, plot_fn) -> None:
    """results.json, table.md and the plot under out; each file written whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.json", json.dumps(result, indent=2)), ("table.md", table + "\n")):
        files.write_text(out / name, text)
    plot_fn(out)


def main(args) -> int:
    plots.require()  # before the work: the figure is its last output
    t0 = time.time()
    captured, layers = select_layers(load_capture(args, args.tokens, args.queries), args.layers)
    print(f"{captured.num_layers} layers, {captured.keys.shape[2]} tokens, {args.queries} queries "
          f"({time.time() - t0:.0f} s)")
    result = study(captured, default_methods(args.top_k), seed=args.seed, layer_ids=layers)
    result["layers"] = layers
    result["command"] = (f"jaxkv eval recall --tokens {args.tokens} --queries {args.queries} "
                         f"--top-k {args.top_k} --seed {args.seed}"
                         + (f" --layers {args.layers}" if args.layers else ""))
    result["seconds"] = time.time() - t0
    table = markdown(result)
    write_outputs(Path(args.out), result, table, lambda out: plot(
        result, out / "recall_by_layer.png", f"SmolLM2-135M, {result['context_tokens']}-token Wikipedia context"))
    print(table)
    print(f"wrote {args.out}/table.md, results.json, recall_by_layer.png in {time.time() - t0:.0f} s")
    return 0
