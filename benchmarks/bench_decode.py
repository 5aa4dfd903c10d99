"""Decode speed vs context length on SmolLM2: dense vs sparse methods, one run.

    python benchmarks/bench_decode.py [--contexts 2048 4096 8000] [--new-tokens 32] [--out results/bench_decode.json]

For each context one prompt (real Wikipedia text) is prefilled once and shared
by every method; each method then decodes `new-tokens` tokens twice — the first
call compiles, the second is timed. The dense fallback is disabled so the
sparse paths really run; ParisKV and MagicPIG use their default settings
(MagicPIG keeps layers 0 and 16 dense). Reports tokens/s, the ratio to dense in
the same run and the fraction of keys each method read.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import jax


def methods():
    from jaxkv.attention import magicpig, pariskv

    return {"dense": None, "magicpig": magicpig.MagicPIGConfig(), "pariskv": pariskv.ParisKVConfig()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="results/bench_decode.json")
    args = parser.parse_args(argv)

    import jaxkv
    import models
    from jaxkv.cache import CacheConfig
    from jaxkv.eval import text

    config, params, tokenizer = models.load(models.default_model_path())
    rows = []
    for n in args.contexts:
        _, ids = text.long_text(tokenizer, n)
        ids = list(ids[:n])
        shared = jaxkv.prefill_prompts(params, config, [ids], capacity=n + args.new_tokens)
        for name, mcfg in methods().items():
            kwargs = {} if mcfg is None else dict(method=name, method_config=mcfg,
                                                   cache_config=CacheConfig(dense_threshold=0))
            run = lambda: jaxkv.generate(params, config, None, max_new_tokens=args.new_tokens, eos_ids=(),
                                         prefilled=shared, **kwargs)
            run()  # compile
            out = run()
            read = out.keys_read_fraction[0] if out.keys_read_fraction else 1.0
            rows.append({"context": n, "method": name, "decode_tok_s": out.decode_tokens_per_second,
                         "keys_read_fraction": read})
            print(f"context {n} {name}: {out.decode_tokens_per_second:.2f} tok/s, read {read:.1%}", flush=True)
    dense = {r["context"]: r["decode_tok_s"] for r in rows if r["method"] == "dense"}
    print("| context | method | decode tok/s | × dense | keys read |\n|---|---|---|---|---|")
    for r in rows:
        r["vs_dense"] = r["decode_tok_s"] / dense[r["context"]]
        print(f"| {r['context']} | {r['method']} | {r['decode_tok_s']:.2f} | {r['vs_dense']:.2f} | "
              f"{r['keys_read_fraction']:.1%} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "machine": platform.machine(), "jax": jax.__version__,
            "new_tokens": args.new_tokens}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
