"""The hybrid study: ParisKV head + an estimated tail vs both papers and the hybrid oracle.

    jaxkv eval hybrid [--tokens 8000] [--queries 64] [--sweep-layers 1,8,15,22,29] [--layers all]
                      [--capture-cache FILE.npz] [--out results/hybrid]

On SmolLM2's captured K/V/Q (8k-token Wikipedia context, every layer and KV
head, the last ``queries`` positions, decode view of :mod:`jaxkv.eval.decode_view`)
and at budgets of 2, 4 and 8 % of the context (distinct keys read per KV head,
the exact sink + local + buffer set included; sink 4 + local 64 for every
sparse method so budgets compare):

1. sweep, on ``--sweep-layers`` only (CPU time): MagicPIG (K, L) and LSH-tail
   hybrid (top_k, K, L) settings; each one's best setting per budget is the
   lowest error among those reading at most the budget. ParisKV and the
   regression-tail hybrid (``hybrid``, the default; its tail reads no K/V row)
   take the largest top_k that fits and the candidate ratio (index bytes, not
   K/V rows) with the lowest error;
2. final, on ``--layers`` (default every layer): those best settings and the hybrid
   oracle (top half exact, rest sampled from the true weights) with the budget per
   query head (attention_error's convention: the group of G heads reads up to G×)
   and per group (budget/G per head, so the group reads at most the budget).

Writes sweep.json, results.json, table.md and error_vs_budget.png under ``--out``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import plots
from jaxkv.attention import hybrid, magicpig, oracles, pariskv
from jaxkv.eval import attention_error, decode_view
from jaxkv.eval import capture as capture_mod
from models import files

BUDGETS = (0.02, 0.04, 0.08)
SINK, LOCAL = 4, 64
# Tail LSH settings: larger K samples fewer keys. MagicPIG alone sweeps them all.
TAIL_SETTINGS = ((14, 100), (13, 150), (13, 100), (12, 150), (12, 100), (11, 150), (11, 100), (10, 150), (10, 120))
# Head share of the retrieval budget tried for the LSH-tail hybrid (the tail gets the rest).
HEAD_SHARES = (0.25, 0.5, 0.75)
# ParisKV's candidate share (None: its length-adaptive rule, 25% at 8k). More candidates
# read more index bytes (never more K/V rows): a better head for both, and a wider tail
# for the regression hybrid.
CANDIDATE_RATIOS = (None, 0.5, 1.0)
MASK_SCORE = -1e6  # extra-coordinate score of a key hidden from the oracle (exp underflows to 0)


@dataclasses.dataclass
class Result:
    method: str
    setting: str
    budget: float | None  # the budget it was chosen for (None: sweep only)
    layers: str  # the layers it ran on ("all" or a list)
    keys_read_fraction: float
    error: float
    error_sem: float
    extra: dict = dataclasses.field(default_factory=dict)


def _magicpig_config(k_bits, tables):
    # Room for the samples; 2 × capacity inverted-index entries per query head (tables
    # beyond it are not read and u uses the tables read, so the estimator stays consistent).
    return magicpig.MagicPIGConfig(K=k_bits, L=tables, sink=SINK, local=LOCAL, capacity=0.25,
                                   candidate_capacity=2.0)


def _hybrid_lsh_config(top_k, k_bits, tables):
    return hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=top_k), tail="lsh",
                               magicpig=magicpig.MagicPIGConfig(K=k_bits, L=tables, capacity=0.25,
                                                                candidate_capacity=2.0),
                               sink=SINK, local=LOCAL)


def _head_settings(cfg) -> pariskv.ParisKVConfig | None:
    """The ParisKV settings of a swept config: ParisKV's own, a hybrid's head; None for MagicPIG."""
    if isinstance(cfg, hybrid.HybridConfig):
        return cfg.pariskv
    return cfg if isinstance(cfg, pariskv.ParisKVConfig) else None


def retrieval_keys(fraction: float, n: int, n_queries: int) -> int:
    """Retrieval-region keys a method may read at this budget: the budget minus the mean exact set."""
    mean_exact = SINK + LOCAL + (n_queries + 1) / 2  # the buffer holds 1..Q decode tokens
    return max(1, math.floor(fraction * n - mean_exact))


def _hidden_by_extra_coordinate(q, k, v, visible):
    """(q', k', v') over d + 1 coordinates with q'·k'/√(d+1) = q·k/√d on visible keys and ≈ −1.2e5 elsewhere.

    The oracles take no mask; causality is imposed through the scores instead.
    """
    d = q.shape[-1]
    q1 = jnp.concatenate([q * math.sqrt((d + 1) / d), jnp.ones((q.shape[0], 1), q.dtype)], axis=1)
    k1 = jnp.concatenate([k, jnp.where(visible, 0.0, MASK_SCORE)[:, None].astype(k.dtype)], axis=1)
    return q1, k1, jnp.pad(v, ((0, 0), (0, 1)))


@functools.partial(jax.jit, static_argnames=("budget",))
def _hybrid_oracle_layer(budget, keys, values, queries, positions, key):
    """[H, G, Q] errors and [H, Q] distinct keys read of the hybrid oracle on one layer."""
    n, d = keys.shape[1], keys.shape[2]

    def head(k, v, qs, hkey):
        def one(q, t, qkey):
            out, read = oracles.hybrid_oracle(*_hidden_by_extra_coordinate(q, k, v, jnp.arange(n) <= t),
                                              budget, qkey)
            return out[:, :d], read
        return jax.vmap(one, in_axes=(1, 0, 0), out_axes=(1, 0))(
            qs, positions, jax.random.split(hkey, positions.shape[0]))

    out, read = jax.vmap(head)(keys, values, queries, jax.random.split(key, keys.shape[0]))
    truth = jax.vmap(decode_view.dense_truth, in_axes=(0, 0, 0, None))(keys, values, queries, positions)
    return decode_view.relative_error(out, truth), read


@functools.partial(jax.jit, static_argnames=("cfg", "n_queries"))
def _hybrid_reads_layer(cfg, keys, values, queries, n_queries, key):
    """Mean ReadStats of the hybrid over one layer's KV heads and query positions."""
    n = keys.shape[1]
    start, end = SINK, n - n_queries - LOCAL

    def head(k, v, qs):
        index = hybrid.build(cfg, k[start:end], jnp.int32(end - start), key, values=v[start:end])

        def one(q):
            return hybrid.read_stats(cfg, index, q, hybrid.select(cfg, index, q))
        return jax.vmap(one, in_axes=1)(qs)

    stats = jax.vmap(head)(keys, values, queries)
    return jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32)), stats)


def _tensors(captured, layers):
    return [(l, *(jnp.asarray(x[l]) for x in (captured.keys, captured.values, captured.queries)))
            for l in layers]


def _run_method(module, cfg, tensors, positions, seed):
    errs, reads, retrieved = [], [], []
    for l, k, v, q in tensors:
        # attention_error's per-layer evaluation, shared so both studies measure alike.
        e, r, got = attention_error._method_layer(module, cfg, k, v, q, positions,
                                                  jax.random.fold_in(jax.random.key(seed), l))
        errs.append(np.asarray(e))
        reads.append(np.asarray(r))
        retrieved.append(np.asarray(got))
    err, sem, frac = attention_error._summarise(errs, reads, np.asarray(positions))
    return err, sem, frac, float(np.mean(np.concatenate([g.reshape(-1) for g in retrieved])))


def _run_oracle(budget_keys, tensors, positions, seed):
    errs, reads = [], []
    for l, k, v, q in tensors:
        e, r = _hybrid_oracle_layer(budget_keys, k, v, q, positions, jax.random.key(seed * 1000 + l))
        errs.append(np.asarray(e))
        reads.append(np.asarray(r))
    return attention_error._summarise(errs, reads, np.asarray(positions))


def _setting(method, cfg) -> str:
    if method == "magicpig":
        return f"K{cfg.K}L{cfg.L}"
    if method == "hybrid_lsh":
        return f"top_k={cfg.pariskv.top_k} K{cfg.magicpig.K}L{cfg.magicpig.L}"
    # pariskv, and hybrid (the regression tail has no setting of its own)
    head = _head_settings(cfg)
    ratio = "adaptive" if head.candidate_ratio is None else f"{head.candidate_ratio:.0%}"
    return f"top_k={head.top_k} candidates {ratio}"


# "hybrid" is the regression tail (the default), "hybrid_lsh" the MagicPIG-sampled one.
MODULES = {"pariskv": pariskv.METHOD, "magicpig": magicpig.METHOD, "hybrid_lsh": hybrid.METHOD,
           "hybrid": hybrid.METHOD}
HYBRIDS = ("hybrid", "hybrid_lsh")


def sweep(captured, layers, *, seed=0, log=print):
    """(method, cfg, read fraction, error, retrieval rows read) for every swept setting, on ``layers``."""
    n, n_queries = captured.keys.shape[2], captured.queries.shape[3]
    positions = jnp.asarray(captured.query_positions)
    tensors = _tensors(captured, layers)
    runs = []

    def run(method, cfg):
        t0 = time.time()
        err, sem, frac, got = _run_method(MODULES[method], cfg, tensors, positions, seed)
        runs.append((method, cfg, frac, err, got))
        log(f"sweep {method:>8} {_setting(method, cfg):>22}: read {frac:.2%} "
            f"(retrieval rows {got:.0f}), error {err:.4f}  [{time.time() - t0:.0f} s]")
        return got

    tail_rows = {}
    for k_bits, tables in TAIL_SETTINGS:
        tail_rows[(k_bits, tables)] = run("magicpig", _magicpig_config(k_bits, tables))
    tried = set()
    for fraction in BUDGETS:
        room = retrieval_keys(fraction, n, n_queries)
        for ratio in CANDIDATE_RATIOS:
            run("pariskv", pariskv.ParisKVConfig(top_k=room, sink=SINK, local=LOCAL, candidate_ratio=ratio))
            run("hybrid", hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=room, candidate_ratio=ratio),
                                              sink=SINK, local=LOCAL))
        for share in HEAD_SHARES:
            # The tail setting whose MagicPIG sample best fills the rest of the room.
            tail_room = room * (1 - share)
            fits = [s for s, rows in tail_rows.items() if rows <= tail_room]
            if not fits:
                continue
            k_bits, tables = max(fits, key=lambda s: tail_rows[s])
            top_k = max(1, math.floor(room - tail_rows[(k_bits, tables)]))
            if (top_k, k_bits, tables) not in tried:
                tried.add((top_k, k_bits, tables))
                run("hybrid_lsh", _hybrid_lsh_config(top_k, k_bits, tables))
    return runs


def best_per_budget(runs, n, n_queries):
    """{(method, budget): cfg} the lowest-error setting reading at most the budget.

    ParisKV and the regression hybrid read exactly their head (K/V rows), so their
    top_k is the room the budget leaves; the candidate ratio (index bytes only) is
    the swept one with the lowest error.
    """
    best = {}
    for fraction in BUDGETS:
        room = retrieval_keys(fraction, n, n_queries)
        for method in ("pariskv", "hybrid"):
            fits = [r for r in runs if r[0] == method and _head_settings(r[1]).top_k == room]
            if fits:
                best[(method, fraction)] = min(fits, key=lambda r: r[3])[1]
        for method in ("magicpig", "hybrid_lsh"):
            fits = [r for r in runs if r[0] == method and r[2] <= fraction]
            if fits:
                best[(method, fraction)] = min(fits, key=lambda r: r[3])[1]
    return best


def final(captured, best, layers, *, seed=0, log=print):
    """Results on ``layers`` for the chosen settings and the hybrid oracle."""
    n, g = captured.keys.shape[2], captured.queries.shape[2]
    positions = jnp.asarray(captured.query_positions)
    tensors = _tensors(captured, layers)
    label = "all" if len(layers) == captured.num_layers else ",".join(map(str, layers))
    results = []
    for fraction in BUDGETS:
        # The oracle's budget is per query head (as in attention_error), so the group
        # reads up to G times it; the budget split over the G heads bounds the group's reads.
        for per, budget_keys in (("query head", round(fraction * n)), ("group", round(fraction * n / g))):
            t0 = time.time()
            err, sem, frac = _run_oracle(max(1, budget_keys), tensors, positions, seed)
            results.append(Result("hybrid oracle", f"{budget_keys} keys per {per}", fraction, label, frac, err, sem))
            log(f"final hybrid oracle {fraction:.0%} per {per}: read {frac:.2%}, error {err:.4f}  "
                f"[{time.time() - t0:.0f} s]")
        for method in MODULES:
            cfg = best.get((method, fraction))
            if cfg is None:
                log(f"final {method} {fraction:.0%}: no swept setting fits the budget")
                continue
            for cfg in _with_default_candidates(cfg):
                t0 = time.time()
                err, sem, frac, got = _run_method(MODULES[method], cfg, tensors, positions, seed)
                results.append(Result(method, _setting(method, cfg), fraction, label, frac, err, sem,
                                      {"retrieval_rows_read": got}))
                log(f"final {method:>13} {fraction:.0%} {_setting(method, cfg):>22}: read {frac:.2%}, "
                    f"error {err:.4f}  [{time.time() - t0:.0f} s]")
    return results


def _with_default_candidates(cfg) -> list:
    """[cfg], and before it the same setting with ParisKV's default candidate ratio when cfg
    chose another: the cheaper index read is reported beside the best one."""
    head = _head_settings(cfg)
    if head is None or head.candidate_ratio is None:  # MagicPIG, the LSH hybrid, or already the default
        return [cfg]
    default = dataclasses.replace(head, candidate_ratio=None)
    return [default if cfg is head else dataclasses.replace(cfg, pariskv=default), cfg]


def hybrid_reads(captured, best, layers, seed=0):
    """{(label, budget): mean ReadStats as a dict} of the chosen ParisKV and hybrid settings on ``layers``.

    ParisKV is measured as the hybrid without a tail: the same selection and index.
    """
    n_queries = captured.queries.shape[3]
    out = {}
    for label, fraction in ((h, f) for h in ("pariskv", *HYBRIDS) for f in BUDGETS):
        cfg = best.get((label, fraction))
        if cfg is None:
            continue
        if label == "pariskv":
            cfg = hybrid.HybridConfig(pariskv=cfg, tail="none", sink=SINK, local=LOCAL)
        per_layer = [_hybrid_reads_layer(cfg, jnp.asarray(captured.keys[l]), jnp.asarray(captured.values[l]),
                                         jnp.asarray(captured.queries[l]),
                                         n_queries, jax.random.fold_in(jax.random.key(seed), l))
                     for l in layers]
        out[(label, fraction)] = {f.name: float(np.mean([getattr(s, f.name) for s in per_layer]))
                         for f in dataclasses.fields(hybrid.ReadStats)}
    return out


def markdown(results, reads) -> str:
    lines = ["| budget | method | best setting | keys read (% of context) | mean relative error ± s.e. |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.budget:.0%} | {r.method} | {r.setting} | {r.keys_read_fraction:.2%} | "
                     f"{r.error:.4f} ± {r.error_sem:.4f} |")
    if reads:
        lines += ["", "| method | budget | head rows | tail rows | head index bytes | tail index bytes |",
                  "|---|---|---|---|---|---|"]
        for (label, fraction), s in reads.items():
            lines.append(f"| {label} | {fraction:.0%} | {s['head_rows']:.1f} | {s['tail_rows']:.1f} | "
                         f"{s['head_index_bytes']:.0f} | {s['tail_index_bytes']:.0f} |")
    return "\n".join(lines)


def plot(results, runs, path: Path, title: str):
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"hybrid oracle": "o", "pariskv": "s", "magicpig": "^", "hybrid_lsh": "v", "hybrid": "D"}
    curves = {}  # one curve per method and kind of setting, so budgets join like with like
    for r in results:
        kind = next((k for k in ("per query head", "per group", "candidates adaptive") if k in r.setting), "")
        curves.setdefault((r.method, kind), []).append((r.keys_read_fraction * 100, r.error))
    for (method, kind), pts in curves.items():
        label = f"{method}, {kind}" if kind else f"{method}, best setting"
        ax.plot(*zip(*sorted(pts)), marker=markers[method], ls="--" if kind else "-", label=label)
    swept = [(r[2] * 100, r[3]) for r in runs if r[0] == "hybrid_lsh"]
    if swept:
        ax.scatter(*zip(*swept), marker="x", color="grey", label="hybrid_lsh settings swept (sweep layers)")
    for fraction in BUDGETS:
        ax.axvline(fraction * 100, color="k", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distinct keys read per KV head (% of context, exact set included)")
    ax.set_ylabel("mean ‖ô − o‖ / ‖o‖")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with files.atomic_file(path) as staging:
        fig.savefig(staging, dpi=120)
    plt.close(fig)


def check_args(args) -> None:
    """The flags checked before any model is loaded (ValueError naming the flag)."""
    capture_mod.parse_layers(args.sweep_layers, "--sweep-layers")
    capture_mod.parse_layers(args.layers, "--layers")
    capture_mod.check_sizes(args.tokens, args.queries)


def main(args) -> int:
    plots.require()  # before the work: the figure is its last output
    t0 = time.time()
    captured = capture_mod.load_or_capture(args)
    n = captured.keys.shape[2]
    sweep_layers = capture_mod.check_layers(capture_mod.parse_layers(args.sweep_layers, "--sweep-layers"),
                                            captured.num_layers, "--sweep-layers")
    final_layers = capture_mod.check_layers(capture_mod.parse_layers(args.layers, "--layers"),
                                            captured.num_layers, "--layers")
    print(f"{captured.num_layers} layers × {captured.keys.shape[1]} KV heads, {n} tokens, "
          f"{captured.queries.shape[3]} queries ({time.time() - t0:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = sweep(captured, sweep_layers, seed=args.seed)
    best = best_per_budget(runs, n, captured.queries.shape[3])
    files.write_text(out / "sweep.json", json.dumps([
        {"method": m, "setting": _setting(m, c), "keys_read_fraction": f, "error": e,
         "retrieval_rows_read": g} for m, c, f, e, g in runs], indent=2))
    results = final(captured, best, final_layers, seed=args.seed)
    reads = hybrid_reads(captured, best, sweep_layers, seed=args.seed)
    table = markdown(results, reads)
    files.write_text(out / "table.md", table + "\n")
    files.write_text(out / "results.json", json.dumps({
        "command": (f"jaxkv eval hybrid --tokens {args.tokens} --queries {args.queries} "
                    f"--sweep-layers {args.sweep_layers} --layers {args.layers} --seed {args.seed}"),
        "context_tokens": n, "sweep_layers": sweep_layers, "final_layers": final_layers,
        "final": [dataclasses.asdict(r) for r in results],
        "hybrid_reads_on_sweep_layers": {f"{label} {f:.0%}": v for (label, f), v in reads.items()},
        "seconds": time.time() - t0}, indent=2))
    plot(results, runs, out / "error_vs_budget.png", f"SmolLM2-135M, {n}-token Wikipedia context")
    print(table)
    print(f"wrote {out}/table.md, results.json, error_vs_budget.png in {time.time() - t0:.0f} s")
    return 0
