"""jaxkv against llama.cpp on the CPU: prefill and decode tokens/s vs context, one run.

    python benchmarks/bench_llamacpp.py [--contexts 1024 4096 8000 16384 32768] [--new-tokens 32]
                                        [--rounds 3] [--threads 2] [--all-rows-up-to 8192]
                                        [--out results/llamacpp]

Both engines run the embedded SmolLM2-135M-Instruct GGUF (Q4_1) on the same token ids (the
benchmark stops if llama.cpp's tokenizer disagrees with jaxkv's on the prompt text) and the
same number of threads (llama.cpp's ``n_threads``; XLA's intra-op pool, which jaxkv's CPU
kernels share, has one thread per core). Rows:

- llama.cpp (llama-cpp-python, the ``bench`` extra built for this CPU), its default KV cache
  type (f16), flash attention off (llama-cpp-python's default) and on;
- jaxkv dense, XLA and native kernels, weights dequantised to float32 and kept in their Q4_1
  blocks; ParisKV, MagicPIG (XLA and native kernels) and the hybrid (XLA) on the kept blocks
  (``--sparse-weights``), the dense fallback off, default settings; and the rows of
  ``--bf16-kv`` (the native dense) again with their KV cache in bfloat16, the
  bytes a token of llama.cpp's f16 cache takes (the prefill's cache rounded to bfloat16).

Per context each engine configuration prefills the prompt once, timed after an untimed
warm-up (prefill tok/s); the prefills alternate between engines. Then every row decodes
``new-tokens`` greedy tokens once untimed and ``rounds`` times, the rows in turn within each
round (bench_decode.take_turns), the load average recorded at each round and each prefill.
Past ``--all-rows-up-to`` the float32 rows are left out and llama.cpp runs in the flash
attention setting that decoded faster at the longest context up to it. Contexts whose
prompt plus new tokens pass the model's 8,192-token window run anyway (jaxkv's
``allow_beyond_context``; llama.cpp warns "n_ctx_seq > n_ctx_train") and are timed only.
Within the window, the first 16 greedy tokens of llama.cpp and jaxkv dense are compared.

What bounds each row is measured beside it: the bytes a decode step reads at least (every
weight once, K and V of the keys it reads) against the read bandwidth, and the prefill's
weight and attention products per second against XLA's float32 matmul rate, both rates
measured before and after the run.

Writes ``bench_llamacpp.json``, ``bench_llamacpp.md`` (the tables) and
``decode_vs_context.png`` under ``--out``, and prints the tables: rows, and the targets
(each ratio of one run; see docs/results/llamacpp.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import bench_decode
import llamacpp_engine

AGREEMENT_TOKENS = 16  # greedy tokens compared between llama.cpp and jaxkv dense
WEIGHT_LABELS = {"f32": "f32", "gguf": "Q4_1 kept", "bf16": "bf16"}
# Required ratios: (what, numerator rows, denominator rows) → {context label: ratio}, or a
# ratio at every context. Context labels are rounded thousands of tokens: 8000 → "8k".
TARGETS = {
    "decode: best jaxkv sparse / best llama.cpp": {"8k": 3.5, "32k": 8.0},
    "decode: best jaxkv dense / best llama.cpp": 1.5,
    "decode: best XLA sparse / XLA dense (same weights)": {"8k": 1.0, "32k": 2.0},
    "prefill: best jaxkv / best llama.cpp": 2.0,
}


def context_label(n: int) -> str:
    """A context length as rounded thousands of tokens (8000 → "8k", 32768 → "32k")."""
    return f"{round(n / 1024)}k"


def prefix_agreement(a: list[int], b: list[int], limit: int = AGREEMENT_TOKENS) -> int:
    """How many of the first `limit` tokens two greedy decodes share before they first differ."""
    count = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        count += 1
    return count


def _best(rows: list[dict], key: str) -> dict | None:
    return max(rows, key=lambda r: r[key]) if rows else None


def target_ratios(rows: list[dict]) -> list[dict]:
    """Each target of :data:`TARGETS` at every context the rows cover: the ratio, the rows it
    compares, what is required there (None: reported only) and whether it is met.

    Args:
        rows: the benchmark's rows (keys context, engine, method, kernels, weights,
            decode_tok_s, prefill_tok_s).

    Returns:
        One dict per (target, context) where both sides have rows.
    """
    out = []
    for n in sorted({r["context"] for r in rows}):
        here = [r for r in rows if r["context"] == n]
        llama = [r for r in here if r["engine"] == "llama.cpp"]
        jaxkv = [r for r in here if r["engine"] == "jaxkv"]
        sparse = [r for r in jaxkv if r["method"] != "dense"]
        xla_sparse = _best([r for r in sparse if r["kernels"] == "xla"], "decode_tok_s")
        xla_dense = [r for r in jaxkv if r["method"] == "dense" and r["kernels"] == "xla" and xla_sparse is not None
                     and (r["weights"], r.get("kv")) == (xla_sparse["weights"], xla_sparse.get("kv"))]
        pairs = {
            "decode: best jaxkv sparse / best llama.cpp": (_best(sparse, "decode_tok_s"), _best(llama, "decode_tok_s"), "decode_tok_s"),
            "decode: best jaxkv dense / best llama.cpp": (_best([r for r in jaxkv if r["method"] == "dense"], "decode_tok_s"),
                                                          _best(llama, "decode_tok_s"), "decode_tok_s"),
            "decode: best XLA sparse / XLA dense (same weights)": (xla_sparse, _best(xla_dense, "decode_tok_s"), "decode_tok_s"),
            "prefill: best jaxkv / best llama.cpp": (_best(jaxkv, "prefill_tok_s"), _best(llama, "prefill_tok_s"), "prefill_tok_s"),
        }
        for what, (top, bottom, key) in pairs.items():
            if top is None or bottom is None:
                continue
            wanted = TARGETS[what]
            required = wanted.get(context_label(n)) if isinstance(wanted, dict) else wanted
            ratio = top[key] / bottom[key]
            out.append({"target": what, "context": n, "ratio": ratio, "required": required,
                        "met": None if required is None else bool(ratio >= required),
                        "numerator": row_label(top), "denominator": row_label(bottom)})
    return out


def kv_bytes_per_position(config, itemsize: int) -> int:
    """Bytes of K and V one position holds over every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def decode_bytes_per_token(weight_bytes: int, config, context: int, itemsize: int, keys_read: float) -> float:
    """Bytes a decode step reads at least: every weight once, and K and V of the keys it reads
    (a sparse method's index not counted) at the decode's middle position."""
    return weight_bytes + keys_read * context * kv_bytes_per_position(config, itemsize)


def prefill_flops_per_token(config, context: int) -> float:
    """Multiply-adds ×2 per prompt token, averaged over a causal prefill of `context` tokens: the
    layers' weight products and attention's two products over the positions before each token
    (the embedding lookup and the final logits excluded)."""
    d, hd, hq, hkv, f = (config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                         config.intermediate_size)
    weights = d * (hq + 2 * hkv) * hd + hq * hd * d + 3 * d * f
    attention = 2 * hq * hd * (context + 1) / 2
    return 2 * config.num_layers * (weights + attention)


def machine_rates() -> dict:
    """This machine's read bandwidth (bench_attention.memory_bandwidth) and XLA's float32 matmul
    rate (2048², both cores), measured now: the references of the bytes and FLOP floors."""
    import time

    from jaxkv.bench.attention import memory_bandwidth

    a = jnp.ones((2048, 2048), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    seconds = []
    for _ in range(5):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        seconds.append(time.perf_counter() - t0)
    return {**memory_bandwidth(5), "matmul_flops": 2 * 2048 ** 3 / min(seconds)}


def row_label(row: dict) -> str:
    """A row's name in the tables: engine, method and kernels, weights."""
    if row["engine"] == "llama.cpp":
        return "llama.cpp, flash attention " + ("on" if row["flash_attn"] else "off")
    kv = ", KV bf16" if row.get("kv") == "bf16" else ""
    return f"jaxkv {row['method']} ({row['kernels']}, {WEIGHT_LABELS[row['weights']]}{kv})"


def cpu_description() -> dict:
    """The CPU's model name and the vector-extension flags that matter to both engines."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512vbmi", "avx512_vbmi2", "gfni")
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def tables(rows: list[dict], ratios: list[dict], window: int, rates: dict) -> str:
    """The rows and the targets as markdown tables; `rates` is :func:`machine_rates`' (before the run)."""
    best_llama = {}
    for r in rows:
        if r["engine"] == "llama.cpp":
            best_llama[r["context"]] = max(best_llama.get(r["context"], 0.0), r["decode_tok_s"])
    lines = ["| context | row | prefill tok/s (GFLOP/s) | decode tok/s (rounds) | × best llama.cpp decode | keys read | "
             "MB read / token | % of bytes floor | index build s | load 1-min |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = r["context"]
        mark = "*" if r["beyond_window"] else ""
        loads = [load[0] for load in r["load_averages"]]
        lines.append(
            f"| {n:,}{mark} | {row_label(r)} | {r['prefill_tok_s']:.0f} ({r['prefill_flops'] / 1e9:.0f}) | "
            f"{r['decode_tok_s']:.1f} ({min(r['rounds_tok_s']):.1f}–{max(r['rounds_tok_s']):.1f}) | "
            f"{r['decode_tok_s'] / best_llama[n]:.2f} | {r['keys_read_fraction']:.1%} | {r['bytes_per_token'] / 1e6:.0f} | "
            f"{r['bytes_floor_fraction']:.0%} | {r['index_seconds']:.2f} | {min(loads):.1f}–{max(loads):.1f} |")
    lines.append(f"\n\\* past the model's {window:,}-token window: timed only (llama.cpp warns "
                 "n_ctx_seq > n_ctx_train; jaxkv runs with allow_beyond_context). MB read / token: every weight "
                 "once and K and V of the keys read (a sparse index not counted); bytes floor: those bytes at "
                 f"the read bandwidth measured before the run, {rates['read_Bps'] / 1e9:.1f} GB/s. GFLOP/s: "
                 "the prefill's weight and attention products per second (XLA's float32 matmul, measured "
                 f"before the run: {rates['matmul_flops'] / 1e9:.0f} GFLOP/s).")
    agreement = [(r["context"], row_label(r), other, count) for r in rows if r["engine"] == "llama.cpp"
                 for other, count in r.get("greedy_agreement", {}).items()]
    if agreement:
        lines += ["", f"| context | llama.cpp row | jaxkv row | first greedy tokens equal (of {AGREEMENT_TOKENS}) |",
                  "|---|---|---|---|"]
        lines += [f"| {n:,} | {a} | {b} | {count} |" for n, a, b, count in agreement]
    lines += ["", "| target | context | ratio | required | met | rows compared |", "|---|---|---|---|---|---|"]
    for t in ratios:
        required = "—" if t["required"] is None else f"≥ {t['required']:g}"
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['context']:,} | {t['ratio']:.2f} | {required} | {met} | "
                     f"{t['numerator']} / {t['denominator']} |")
    return "\n".join(lines)


def plot(rows: list[dict], window: int, path: Path) -> None:
    """Decode tok/s against context, one line per row, the model's window marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(row_label(r) for r in rows):
        points = sorted((r["context"], r["decode_tok_s"]) for r in rows if row_label(r) == label)
        style = "--" if label.startswith("llama.cpp") else "-"
        ax.plot(*zip(*points), style, marker="o", label=label)
    ax.axvline(window, color="grey", linewidth=0.8)
    ax.text(window, ax.get_ylim()[1], " model window", va="top", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    contexts = sorted({r["context"] for r in rows})
    ax.set_xticks(contexts, [f"{n:,}" for n in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("SmolLM2-135M Q4_1, batch 1, greedy: jaxkv vs llama.cpp")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_same_tokens(engine: llamacpp_engine.LlamaCpp, text: str, ids: list[int]) -> None:
    """Stop unless llama.cpp tokenizes `text` to exactly jaxkv's ids."""
    theirs = engine.tokenize(text)
    if theirs != ids:
        at = next((i for i, (a, b) in enumerate(zip(theirs, ids)) if a != b), min(len(theirs), len(ids)))
        raise SystemExit(f"llama.cpp's tokenization differs from jaxkv's at token {at} "
                         f"({theirs[at:at + 5]} vs {ids[at:at + 5]}; lengths {len(theirs)} vs {len(ids)})")


def faster_flash_setting(rows: list[dict], up_to: int) -> bool:
    """The llama.cpp flash-attention setting that decoded faster at the longest context ≤ up_to."""
    llama = [r for r in rows if r["engine"] == "llama.cpp" and r["context"] <= up_to]
    longest = max(r["context"] for r in llama)
    return max((r for r in llama if r["context"] == longest), key=lambda r: r["decode_tok_s"])["flash_attn"]


def jaxkv_rows(names: list[str] | None) -> dict:
    """bench_decode.methods' rows (native kernels where this CPU has them), those named only if given."""
    rows = bench_decode.methods(native=True)
    unknown = sorted(set(names or ()) - set(rows))
    if unknown:
        raise SystemExit(f"--methods: no row {unknown[0]!r} here; rows: {', '.join(rows)}")
    return {name: spec for name, spec in rows.items() if names is None or name in names}


def run_context(n: int, args, weight_sets: dict, config, tokenizer, rows: list[dict], read_Bps: float) -> list[dict]:
    """Prefill and decode one context with every row in play there; the new rows (read_Bps: the
    read bandwidth their bytes floor divides by)."""
    import models
    from jaxkv.eval import text

    full = n <= args.all_rows_up_to
    flash = (False, True) if full else (faster_flash_setting(rows, args.all_rows_up_to),)
    dense_weights = list(weight_sets)
    sparse_weights = [w for w in args.sparse_weights if w in weight_sets]
    capacity = n + args.new_tokens
    beyond = capacity > config.max_position_embeddings

    prompt, ids = text.long_text(tokenizer, n)
    engines = {fa: llamacpp_engine.LlamaCpp(models.default_model_path(), n_ctx=capacity, threads=args.threads,
                                            flash_attn=fa) for fa in flash}
    check_same_tokens(engines[flash[0]], prompt, list(ids))
    ids = list(ids[:n])

    # Prefills, the engines alternating; each timed after an untimed warm-up.
    prefill_s, prefill_load, prefilled = {}, {}, {}
    order = itertools.zip_longest([("jaxkv", w) for w in dense_weights], [("llama.cpp", fa) for fa in flash])
    for engine, which in (step for pair in order for step in pair if step):
        prefill_load[engine, which] = os.getloadavg()
        if engine == "jaxkv":
            prefilled[which] = bench_decode.timed_prefill(weight_sets[which], config, ids, capacity)
            prefill_s[engine, which] = prefilled[which].seconds
        else:
            engines[which].prefill(ids[:512])
            prefill_s[engine, which] = engines[which].prefill(ids)
        print(f"context {n} prefill {engine} {which}: {n / prefill_s[engine, which]:.1f} tok/s", flush=True)

    llama_runs = [{("llama.cpp", fa): lambda e=engines[fa]: e.decode(args.new_tokens)} for fa in flash]
    caches = {(weights, "f32"): prefilled[weights] for weights in dense_weights}
    if args.bf16_kv and sparse_weights:
        caches[sparse_weights[0], "bf16"] = bench_decode.with_kv_dtype(prefilled[sparse_weights[0]], jnp.bfloat16)
    jaxkv_runs = [{("jaxkv", weights, name, kv): bench_decode.jaxkv_decoder(
        weight_sets[weights], config, cache, method, mcfg, args.new_tokens)
        for name, (method, mcfg) in jaxkv_rows(args.methods).items()
        if (method == "dense" or weights in sparse_weights) and (kv == "f32" or name in args.bf16_kv)}
        for (weights, kv), cache in caches.items()]
    # In each round: a llama.cpp setting, then one weight set's jaxkv rows, and so on.
    runs = {}
    for group in itertools.chain.from_iterable(itertools.zip_longest(llama_runs, jaxkv_runs, fillvalue={})):
        runs.update(group)
    turns = bench_decode.take_turns(runs, args.rounds)

    weight_bytes = {w: sum(x.nbytes for x in jax.tree.leaves(params)) for w, params in weight_sets.items()}
    weight_bytes["llama.cpp"] = models.default_model_path().stat().st_size  # its tensors, in their GGUF blocks
    new_rows = []
    for run, out in turns.last.items():
        engine = run[0]
        row = {"context": n, "engine": engine, "beyond_window": beyond, "decode_tok_s": turns.median(run),
               "rounds_tok_s": turns.speeds[run], "keys_read_fraction": out.keys_read,
               "index_seconds": out.index_seconds, "load_averages": turns.loads, "tokens": out.tokens,
               "first_call_seconds": turns.first_call_seconds[run]}
        if engine == "llama.cpp":
            row.update(method="dense", kernels="llama.cpp", weights="gguf", kv="f16", flash_attn=run[1],
                       prefill_tok_s=n / prefill_s[engine, run[1]], prefill_load_average=prefill_load[engine, run[1]])
        else:
            _, weights, name, kv = run
            dense = turns.last.get(("jaxkv", weights, "dense", kv))
            row.update(method=name.removesuffix("-native"), kernels="native" if name.endswith("-native") else "xla",
                       weights=weights, kv=kv, prefill_tok_s=n / prefill_s[engine, weights],
                       prefill_load_average=prefill_load[engine, weights],
                       same_tokens_as_dense=None if dense is None else out.tokens == dense.tokens)
        itemsize = {"f32": 4, "bf16": 2, "f16": 2}[row["kv"]]
        weights = "llama.cpp" if engine == "llama.cpp" else row["weights"]
        row["bytes_per_token"] = decode_bytes_per_token(weight_bytes[weights], config, n + args.new_tokens // 2,
                                                        itemsize, out.keys_read)
        row["bytes_floor_fraction"] = row["decode_tok_s"] * row["bytes_per_token"] / read_Bps
        row["prefill_flops"] = prefill_flops_per_token(config, n) * row["prefill_tok_s"]
        new_rows.append(row)
    for row in new_rows:
        if row["engine"] == "llama.cpp" and not beyond:
            row["greedy_agreement"] = {row_label(r): prefix_agreement(row["tokens"], r["tokens"]) for r in new_rows
                                       if r["engine"] == "jaxkv" and r["method"] == "dense"}
        print(f"context {n} {row_label(row)}: prefill {row['prefill_tok_s']:.1f} tok/s, decode "
              f"{row['decode_tok_s']:.2f} tok/s (rounds {min(row['rounds_tok_s']):.2f}–{max(row['rounds_tok_s']):.2f})",
              flush=True)
    for engine in engines.values():
        engine.close()
    return new_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000, 16384, 32768])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed decodes per row, taken in turns")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (prefill and decode)")
    parser.add_argument("--weights", nargs="+", choices=("f32", "gguf"), default=["f32", "gguf"],
                        help="jaxkv's weights for the dense rows: dequantised to float32 and/or kept in the GGUF's blocks")
    parser.add_argument("--sparse-weights", nargs="+", choices=("f32", "gguf"), default=["gguf"],
                        help="jaxkv's weights for the sparse rows (of those in --weights)")
    parser.add_argument("--methods", nargs="+",
                        help="jaxkv rows to run (default: all): dense, magicpig, pariskv, hybrid and, where this CPU "
                             "has the kernels, dense-native, magicpig-native, pariskv-native")
    parser.add_argument("--bf16-kv", nargs="*", default=["dense-native"],
                        help="jaxkv rows that also run with their KV cache in bfloat16 (the prefill's cache rounded), "
                             "on the first of --sparse-weights: llama.cpp's f16 cache holds as many bytes")
    parser.add_argument("--all-rows-up-to", type=int, default=8192,
                        help="longer contexts leave out the float32 rows and run llama.cpp in its faster "
                             "flash-attention setting only")
    parser.add_argument("--out", default="results/llamacpp")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 (the first token comes from the prefill), got {args.new_tokens}")
    if min(args.contexts) > args.all_rows_up_to:
        parser.error("--all-rows-up-to must cover the shortest context (llama.cpp's flash-attention setting "
                     "past it is chosen there)")
    reason = llamacpp_engine.unavailable_reason()
    if reason:
        parser.error(reason)
    jaxkv_rows(args.bf16_kv)  # names checked before anything runs

    weight_sets = {}
    for weights in dict.fromkeys(args.weights):
        config, weight_sets[weights], tokenizer = bench_decode.load_weights(weights)
    rates = machine_rates()
    rows = []
    for n in sorted(args.contexts):
        if n > args.all_rows_up_to:
            weight_sets.pop("f32", None)  # its rows are done: free its 538 MB
        rows += run_context(n, args, weight_sets, config, tokenizer, rows, rates["read_Bps"])
        jax.clear_caches()  # this context's compiled decode loops (tens of MB each) are not used again
    rates_after = machine_rates()
    ratios = target_ratios(rows)
    report = tables(rows, ratios, config.max_position_embeddings, rates)
    print(report)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "cpu": cpu_description(), "jax": jax.__version__,
            "llama_cpp_python": llamacpp_engine.version(), "threads": args.threads, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "window": config.max_position_embeddings, "rates_before": rates,
            "rates_after": rates_after}
    (out / "bench_llamacpp.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": ratios}, indent=2))
    (out / "bench_llamacpp.md").write_text(report + "\n")
    plot(rows, config.max_position_embeddings, out / "decode_vs_context.png")
    print(f"wrote {out}/bench_llamacpp.json, bench_llamacpp.md, decode_vs_context.png")


if __name__ == "__main__":
    main()
