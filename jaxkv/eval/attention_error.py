"""The estimator study: attention-output error vs keys read, on a real model.

    jaxkv eval attention-error [--tokens 8000] [--queries 64] [--layers L,...] [--budgets F,...]
                               [--magicpig KxL,...] [--out results/attention_error]

Captures SmolLM2's keys, values and queries on a long Wikipedia context (every
layer and head, the last `queries` positions), then reports the mean relative
error ‖ô − o‖/‖o‖ over all (layer, query head, position) rows for

- the TopK, sampling and hybrid oracles at 1, 2, 4, 8, 16 % of the context,
- MagicPIG at several (K, L), with and without key centring,

against the distinct keys each one read (exact set included), per attention
row (query head) as in the seed's study. MagicPIG and every index-based method
run as in decoding (see :mod:`jaxkv.eval.decode_view`).
Writes results.json, a markdown table and a PNG plot.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import plots
from jaxkv.attention import magicpig, oracles
from jaxkv.eval import decode_view
from models import files

BUDGETS = (0.01, 0.02, 0.04, 0.08, 0.16)
# (K, L): the official K10L150 / K10L170 / K11L300 plus cheaper tables that read more.
MAGICPIG_SETTINGS = ((11, 300), (10, 170), (10, 150), (9, 120), (8, 100), (7, 64))
ORACLES = ("topk", "sampling", "hybrid")


@dataclasses.dataclass
class Row:
    method: str
    setting: str
    target_budget: float | None  # the oracle's budget; None for index methods
    keys_read_fraction: float  # mean distinct keys read / context length
    error: float  # mean relative error over rows
    error_sem: float  # its standard error
    extra: dict = dataclasses.field(default_factory=dict)


def _oracle_fn(name, budget):
    def run(q, k, v, mask, key):
        if name == "topk":
            return oracles.topk_oracle(q, k, v, budget, mask=mask)
        if name == "sampling":
            return oracles.sampling_oracle(q, k, v, budget, key, mask=mask)
        return oracles.hybrid_oracle(q, k, v, budget, key, mask=mask)
    return run


@functools.partial(jax.jit, static_argnames=("name", "budget"))
def _oracle_layer(name, budget, keys, values, queries, positions, key):
    """[H, G, Q] errors and [H, Q] keys read of one oracle on one layer."""
    n = keys.shape[1]
    fn = _oracle_fn(name, budget)

    def head(k, v, qs, hkey):
        def one(q, t, qkey):
            return fn(q, k, v, jnp.arange(n) <= t, qkey)
        keys_q = jax.random.split(hkey, positions.shape[0])
        return jax.vmap(one, in_axes=(1, 0, 0), out_axes=(1, 0))(qs, positions, keys_q)

    out, read = jax.vmap(head)(keys, values, queries, jax.random.split(key, keys.shape[0]))
    truth = jax.vmap(decode_view.dense_truth, in_axes=(0, 0, 0, None))(keys, values, queries, positions)
    return decode_view.relative_error(out, truth), read


@functools.partial(jax.jit, static_argnames=("method", "cfg"))
def _method_layer(method, cfg, keys, values, queries, positions, key):
    """[H, G, Q] errors, [H, Q] keys read and retrieval rows read of an index method on one layer."""
    out, read, retrieved = jax.vmap(
        lambda k, v, q: decode_view.method_outputs(method, cfg, k, v, q, positions, key))(keys, values, queries)
    truth = jax.vmap(decode_view.dense_truth, in_axes=(0, 0, 0, None))(keys, values, queries, positions)
    return decode_view.relative_error(out, truth), read, retrieved


def _summarise(errors, reads, positions):
    errors = np.concatenate([e.reshape(-1) for e in errors])
    fractions = np.concatenate([(r / (positions + 1)[None, :]).reshape(-1) for r in reads])
    return float(errors.mean()), float(errors.std(ddof=1) / np.sqrt(errors.size)), float(fractions.mean())


def per_row_tensors(captured, layer: int):
    """One layer's tensors with every query head as its own group of one.

    Budgets are per attention row (query head), as in the seed's study: a head's
    keys are its KV head's, and each head selects for itself. (ParisKV in
    generate() shares one retrieval per KV head; the study measures the
    estimator per row.) Returns keys, values [Hq, N, d] and queries [Hq, 1, Q, d].
    """
    g = captured.queries.shape[2]
    keys = jnp.repeat(jnp.asarray(captured.keys[layer]), g, axis=0)
    values = jnp.repeat(jnp.asarray(captured.values[layer]), g, axis=0)
    q = jnp.asarray(captured.queries[layer])
    return keys, values, q.reshape(q.shape[0] * g, 1, *q.shape[2:])


def study(captured, *, budgets=BUDGETS, magicpig_settings=MAGICPIG_SETTINGS, seed=0, log=print):
    """All rows of the study for a :class:`jaxkv.eval.capture.Captured`."""
    n = captured.keys.shape[2]
    positions = jnp.asarray(captured.query_positions)
    layers = range(captured.num_layers)
    tensors = [per_row_tensors(captured, l) for l in layers]
    rows = []
    for name in ORACLES:
        for fraction in budgets:
            budget = max(1, round(fraction * n))
            errs, reads = [], []
            for l, (k, v, q) in zip(layers, tensors):
                e, r = _oracle_layer(name, budget, k, v, q, positions, jax.random.key(seed * 1000 + l))
                errs.append(np.asarray(e))
                reads.append(np.asarray(r))
            err, sem, frac = _summarise(errs, reads, np.asarray(positions))
            rows.append(Row(name, f"{fraction:.0%}", fraction, frac, err, sem))
            log(f"{name:>9} budget {fraction:>4.0%}: read {frac:.2%}, error {err:.4f}")
    for (k_bits, tables) in magicpig_settings:
        for center in (True, False) if (k_bits, tables) == (10, 150) else (True,):
            # Generous static capacities (half the keys sampled, 2N bucket entries
            # read) so truncation is rare; what was read is what u accounts for.
            cfg = magicpig.MagicPIGConfig(K=k_bits, L=tables, center=center, capacity=0.5,
                                          candidate_capacity=2.0)
            errs, reads, retrieved = [], [], []
            for l, (k, v, q) in zip(layers, tensors):
                e, r, got = _method_layer(magicpig.METHOD, cfg, k, v, q, positions,
                                          jax.random.fold_in(jax.random.key(seed), l))
                errs.append(np.asarray(e))
                reads.append(np.asarray(r))
                retrieved.append(np.asarray(got))
            err, sem, frac = _summarise(errs, reads, np.asarray(positions))
            retrieval_rows = n - captured.queries.shape[3] - cfg.sink - cfg.local
            collision = float(np.mean(np.concatenate([g.reshape(-1) for g in retrieved])) / retrieval_rows)
            setting = f"K{k_bits}L{tables}" + ("" if center else " uncentred")
            rows.append(Row("magicpig", setting, None, frac, err, sem,
                            {"sampled_fraction_of_retrieval": collision}))
            log(f" magicpig {setting:>16}: read {frac:.2%} (sampled {collision:.3%} of retrieval), error {err:.4f}")
    return rows


def markdown(rows) -> str:
    lines = ["| method | setting | keys read (% of context) | mean relative error ± s.e. |",
             "|---|---|---|---|"]
    for r in rows:
        extra = ""
        if "sampled_fraction_of_retrieval" in r.extra:
            extra = f" (sampled {r.extra['sampled_fraction_of_retrieval']:.3%} of retrieval keys)"
        lines.append(f"| {r.method} | {r.setting}{extra} | {r.keys_read_fraction:.2%} | "
                     f"{r.error:.4f} ± {r.error_sem:.4f} |")
    return "\n".join(lines)


def plot(rows, path: Path, title: str):
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ORACLES:
        pts = sorted((r.keys_read_fraction, r.error) for r in rows if r.method == name)
        ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=f"{name} oracle")
    for label, keep in (("MagicPIG", lambda r: "uncentred" not in r.setting),
                        ("MagicPIG uncentred", lambda r: "uncentred" in r.setting)):
        pts = [r for r in rows if r.method == "magicpig" and keep(r)]
        ax.scatter([r.keys_read_fraction * 100 for r in pts], [r.error for r in pts], label=label,
                   marker="x" if "uncentred" in label else "s", zorder=3)
        for r in pts:
            ax.annotate(r.setting.split()[0], (r.keys_read_fraction * 100, r.error), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("distinct keys read (% of context, exact set included)")
    ax.set_ylabel("mean ‖ô − o‖ / ‖o‖")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with files.atomic_file(path) as staging:
        fig.savefig(staging, dpi=120)
    plt.close(fig)


def _budgets(text: str | None) -> tuple[float, ...]:
    if not text:
        return BUDGETS
    try:
        budgets = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--budgets must be comma-separated fractions, got {text!r}") from None
    if not all(0 < b <= 1 for b in budgets):
        raise ValueError(f"--budgets must lie in (0, 1], got {text!r}")
    return budgets


def _magicpig_settings(text: str | None) -> tuple[tuple[int, int], ...]:
    if not text:
        return MAGICPIG_SETTINGS
    try:
        settings = tuple(tuple(int(v) for v in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        settings = ()
    if not settings or any(len(s) != 2 or min(s) < 1 for s in settings):
        raise ValueError(f"--magicpig must be comma-separated KxL settings such as 10x150, got {text!r}")
    return settings


def check_args(args) -> None:
    """The flags checked before any model is loaded (ValueError naming the flag)."""
    from jaxkv.eval import recall

    _budgets(args.budgets)
    _magicpig_settings(args.magicpig)
    recall.check_args(args)


def main(args) -> int:
    plots.require()  # before the work: the figure is its last output
    from jaxkv.eval import capture as capture_mod
    from jaxkv.eval import recall

    budgets, settings = _budgets(args.budgets), _magicpig_settings(args.magicpig)
    t0 = time.time()
    captured, layers = recall.select_layers(capture_mod.load_or_capture(args), args.layers)
    n_tokens = captured.keys.shape[2]
    print(f"captured {captured.num_layers} layers × {captured.keys.shape[1]} KV heads, {n_tokens} tokens, "
          f"{captured.queries.shape[3]} queries in {time.time() - t0:.0f} s")
    rows = study(captured, budgets=budgets, magicpig_settings=settings, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    files.write_text(out / "table.md", table + "\n")
    files.write_text(out / "results.json", json.dumps({
        "command": (f"jaxkv eval attention-error --tokens {args.tokens} --queries {args.queries} --seed {args.seed}"
                    + "".join(f" --{flag} {getattr(args, flag)}" for flag in ("layers", "budgets", "magicpig")
                              if getattr(args, flag))),
        "model": str(args.model or "SmolLM2-135M-Instruct (embedded GGUF)"), "context_tokens": n_tokens,
        "layers": layers,
        "rows": [dataclasses.asdict(r) for r in rows], "seconds": time.time() - t0}, indent=2))
    plot(rows, out / "error_vs_budget.png", f"SmolLM2-135M, {n_tokens}-token Wikipedia context")
    print(table)
    print(f"wrote {out}/table.md, results.json, error_vs_budget.png in {time.time() - t0:.0f} s")
    return 0
