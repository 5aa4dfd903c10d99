"""Decode speed vs context length on SmolLM2: dense vs sparse methods, one run.

    python benchmarks/bench_decode.py [--contexts 2048 4096 8000] [--new-tokens 32] [--rounds 3]
                                      [--out results/bench_decode.json] [--no-transformers] [--native]
                                      [--weights f32 gguf bf16]

For each context one prompt (real Wikipedia text) is prefilled once per weight set
and shared by every method; the prefill is timed after an untimed one of its first
chunk at the same capacity (which compiles it). Each method decodes `new-tokens`
tokens once to compile, then `rounds` times, the methods taking turns within each
round (a slow minute of this shared machine then slows every method, not one):
tokens/s is the median over the rounds, with the slowest and fastest next to it, and
the 1-minute load average is recorded at the start of each round. The weights are
split per layer once after loading (models.unstack_layers), so no call copies them.
The dense fallback is disabled so the sparse paths really run; ParisKV, MagicPIG and
the hybrid use their default settings (MagicPIG keeps layers 0 and 16 dense). Reports
tokens/s, the ratio to dense in the same run, the fraction of keys each method read
and the seconds its index took to build. Contexts whose prompt plus new tokens pass
the model's window run anyway (``allow_beyond_context``).

``--weights``: every method runs with the weights dequantised to float32 (``f32``) and/or
kept in the GGUF's Q4_1 / Q8_0 blocks (``gguf``, ``models.load(..., keep_quantized=True)``:
a decode step reads 96 MB of weights instead of 538 MB) and/or cast to bfloat16 (``bf16``: a
bfloat16 model's, whose activations and KV cache are bfloat16 too; not run by default), all
in the same rounds; each row's ratio is to dense with the same weights.

The reference row is transformers (PyTorch, CPU, f32) on the same weights
(dequantised from the same GGUF) and the same prompt: prefill, one warm-up
step, then `new-tokens` greedy steps through its KV cache, timed one by one;
it also reports whether its greedy tokens equal jaxkv dense's.
`--no-transformers` skips it. ``benchmarks/bench_llamacpp.py`` runs these rows beside
llama.cpp with the functions below.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Hashable

import jax
import numpy as np


def methods(native: bool = False) -> dict:
    """row name → (generate()'s method, its config); with native, dense, MagicPIG and ParisKV
    in jaxkv.native's CPU kernels as three more rows (MagicPIG's dense layers in the dense kernel),
    each where this CPU has its kernels (an AVX2 CPU: ParisKV's selection alone). The hybrid
    has no CPU kernels: it runs in XLA only."""
    from jaxkv import native as kernels
    from jaxkv.attention import dense, hybrid, magicpig, pariskv

    rows = {"dense": ("dense", None), "magicpig": ("magicpig", magicpig.MagicPIGConfig()),
            "pariskv": ("pariskv", pariskv.ParisKVConfig()), "hybrid": ("hybrid", hybrid.HybridConfig())}
    if native:
        wanted = {"dense-native": (("dense", dense.DenseConfig(kernels="native")), ("jaxkv_dense_decode",)),
                  "magicpig-native": (("magicpig", magicpig.MagicPIGConfig(kernels="native")), tuple(kernels.TARGETS)),
                  "pariskv-native": (("pariskv", pariskv.ParisKVConfig(kernels="native")), kernels.AVX2_TARGETS)}
        for name, (row, targets) in wanted.items():
            if kernels.available(*targets):
                rows[name] = row
            else:
                print(f"{name} not run: {kernels.unavailable_reason(*targets)}", flush=True)
    return rows


def transformers_decode(ids, new_tokens: int) -> dict:
    """Greedy decode of transformers' SmolLM2 after prefilling `ids`: tokens/s and the tokens."""
    import torch
    import transformers

    import models

    gguf = models.default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        tokens, seconds = [], 0.0
        for step in range(new_tokens + 1):  # step 0 warms up and is not timed
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            seconds += (time.perf_counter() - t0) if step else 0.0
    return {"decode_tok_s": new_tokens / seconds, "tokens": tokens[:new_tokens],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def load_weights(kind: str):
    """(config, params split per layer, tokenizer) of the default model: float32, the GGUF's
    blocks, or bfloat16."""
    import jax.numpy as jnp

    import models

    config, params, tokenizer = models.load(models.default_model_path(), keep_quantized=kind == "gguf")
    if kind == "bf16":
        params = models.cast_params(params, jnp.bfloat16)
    return config, models.unstack_layers(params, config.num_layers), tokenizer


@dataclasses.dataclass
class Decoded:
    """One decode of a row: its greedy tokens, decode tokens/s (the first token, which comes
    from the prefill's logits, excluded), the fraction of keys it read, and the seconds its
    sparse index took to build from the prefill (0 for a dense row)."""

    tokens: list[int]
    tok_s: float
    keys_read: float = 1.0
    index_seconds: float = 0.0


def timed_prefill(params, config, ids: list[int], capacity: int, chunk: int = 512):
    """jaxkv's prefill of `ids` into a cache of `capacity` positions, timed after an untimed
    prefill of its first chunk at the same capacity (the same compiled programs).

    Returns:
        The jaxkv.Prefilled (its ``seconds`` the timed prefill's).
    """
    import jaxkv

    # The prefill's cache holds at least the prompt padded to whole chunks: the warm-up's must
    # be as large, or the timed prefill would compile a program of its own.
    capacity = max(capacity, -(-len(ids) // chunk) * chunk)
    jaxkv.prefill_prompts(params, config, [ids[:chunk]], capacity=capacity, prefill_chunk=chunk)
    return jaxkv.prefill_prompts(params, config, [ids], capacity=capacity, prefill_chunk=chunk)


def with_kv_dtype(prefilled, dtype):
    """The same prefill with its KV cache rounded to `dtype`, stored as a cache of that dtype is
    (generate() then decodes with a cache of that dtype; the prefill's own attention was not)."""
    import models

    def cast(x):
        return models.stored_rows(models.row_values(x).astype(dtype))

    staging = dataclasses.replace(prefilled.staging, k=cast(prefilled.staging.k), v=cast(prefilled.staging.v))
    return dataclasses.replace(prefilled, staging=staging)


def jaxkv_decoder(params, config, prefilled, method: str, method_config, new_tokens: int) -> Callable[[], Decoded]:
    """A call decoding `new_tokens` greedy tokens from `prefilled` with one method (the dense
    fallback off, positions past the model's window allowed)."""
    import jaxkv
    from jaxkv.cache import CacheConfig

    cache = None if method == "dense" else CacheConfig(dense_threshold=0)
    beyond = len(prefilled.rows[0]) + new_tokens > config.max_position_embeddings

    def decode() -> Decoded:
        out = jaxkv.generate(params, config, None, max_new_tokens=new_tokens, eos_ids=(), prefilled=prefilled,
                             method=method, method_config=method_config, cache_config=cache,
                             allow_beyond_context=beyond)
        read = out.keys_read_fraction[0] if out.keys_read_fraction else 1.0
        # With a shared prefill, generate()'s prefill time is the sparse index's build alone.
        return Decoded(out.tokens[0], out.decode_tokens_per_second, read, out.prefill_seconds if cache else 0.0)

    return decode


@dataclasses.dataclass
class Turns:
    """What :func:`take_turns` measured: each run's last decode, its tokens/s per round, the
    load averages (1, 5, 15 minutes) at the start of each round, and the seconds of each run's
    untimed first call (its compile, for a jaxkv row)."""

    last: dict[Hashable, Decoded]
    speeds: dict[Hashable, list[float]]
    loads: list[tuple[float, float, float]]
    first_call_seconds: dict[Hashable, float]

    def median(self, run: Hashable) -> float:
        return float(np.median(self.speeds[run]))


def take_turns(runs: dict[Hashable, Callable[[], Decoded]], rounds: int) -> Turns:
    """Call every run once untimed (compiles, warms), then `rounds` times, the runs in turn
    within each round so that a slow minute of a shared machine slows every run."""
    last, first_call_seconds = {}, {}
    for run, decode in runs.items():
        t0 = time.perf_counter()
        last[run] = decode()
        first_call_seconds[run] = time.perf_counter() - t0
    speeds = {run: [] for run in runs}
    loads = []
    for _ in range(rounds):
        loads.append(os.getloadavg())
        for run, decode in runs.items():
            last[run] = decode()
            speeds[run].append(last[run].tok_s)
    return Turns(last, speeds, loads, first_call_seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed decodes per method, taken in turns")
    parser.add_argument("--out", default="results/bench_decode.json")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers reference row")
    parser.add_argument("--native", action="store_true",
                        help="add rows for dense, MagicPIG and ParisKV with kernels='native' (jaxkv.native's CPU kernels)")
    parser.add_argument("--weights", nargs="+", choices=("f32", "gguf", "bf16"), default=["f32", "gguf"],
                        help="weights dequantised to float32, kept in the GGUF's blocks (those two by default) "
                             "and/or cast to bfloat16")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    from jaxkv.eval import text

    # Split per layer once, as a server holding the model would: generate() otherwise
    # copies the stacked weights into per-layer arrays on every call, inside the
    # decode time (transformers' weights are per layer from loading on).
    weight_sets = {}
    for weights in dict.fromkeys(args.weights):
        config, weight_sets[weights], tokenizer = load_weights(weights)
    rows = []
    for n in args.contexts:
        _, ids = text.long_text(tokenizer, n)
        ids = list(ids[:n])
        shared = {weights: timed_prefill(params, config, ids, n + args.new_tokens)
                  for weights, params in weight_sets.items()}
        runs = {(weights, name): jaxkv_decoder(params, config, shared[weights], *spec, args.new_tokens)
                for weights, params in weight_sets.items() for name, spec in methods(args.native).items()}
        turns = take_turns(runs, args.rounds)
        for (weights, name), out in turns.last.items():
            tok_s = turns.speeds[weights, name]
            rows.append({"context": n, "method": name, "weights": weights, "decode_tok_s": turns.median((weights, name)),
                         "rounds_tok_s": tok_s, "keys_read_fraction": out.keys_read, "index_seconds": out.index_seconds,
                         "prefill_tok_s": n / shared[weights].seconds, "load_averages": turns.loads,
                         "same_tokens_as_dense": out.tokens == turns.last[weights, "dense"].tokens})
            print(f"context {n} {name} ({weights} weights): {np.median(tok_s):.2f} tok/s (rounds {min(tok_s):.2f}–"
                  f"{max(tok_s):.2f}), read {out.keys_read:.1%}", flush=True)
        if not args.no_transformers:
            ref = transformers_decode(ids, args.new_tokens)
            same = {weights: ref["tokens"] == turns.last[weights, "dense"].tokens for weights in weight_sets}
            rows.append({"context": n, "method": "transformers", "weights": "f32", "decode_tok_s": ref["decode_tok_s"],
                         "keys_read_fraction": 1.0, "same_tokens_as_dense": same,
                         "torch": ref["torch"], "torch_threads": ref["torch_threads"]})
            print(f"context {n} transformers: {ref['decode_tok_s']:.2f} tok/s, same greedy tokens as "
                  f"jaxkv dense: {same}", flush=True)
    dense = {(r["context"], r["weights"]): r["decode_tok_s"] for r in rows if r["method"] == "dense"}
    print("| context | method | weights | decode tok/s | × dense (same weights) | keys read |\n|---|---|---|---|---|---|")
    for r in rows:
        # transformers' ratio is to jaxkv dense on the first weights listed
        r["vs_dense"] = r["decode_tok_s"] / dense.get((r["context"], r["weights"]), dense[r["context"], args.weights[0]])
        print(f"| {r['context']} | {r['method']} | {r['weights']} | {r['decode_tok_s']:.2f} | {r['vs_dense']:.2f} | "
              f"{r['keys_read_fraction']:.1%} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "machine": platform.machine(), "jax": jax.__version__,
            "new_tokens": args.new_tokens, "rounds": args.rounds, "weights": args.weights}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
