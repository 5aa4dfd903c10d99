"""Prefill and decode speed of SmolLM2: jaxkv vs transformers (PyTorch CPU), same run.

    python benchmarks/bench_model.py [--contexts 1024 4096] [--new-tokens 32] [--out results/bench_model.json]

Both run the same dequantised GGUF weights in float32 on the same prompt (real
Wikipedia text). jaxkv is timed after a warm-up call with identical shapes, so
compilation is excluded; transformers runs eagerly with a KV cache. Decode
tokens/s counts the tokens after the first (the first comes from prefill).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import platform
import time
from pathlib import Path

import jax
import numpy as np


def bench_jaxkv(params, config, ids, new_tokens, method="dense"):
    import jaxkv

    run = lambda: jaxkv.generate(params, config, [ids], max_new_tokens=new_tokens, eos_ids=(), method=method)
    run()  # compile
    out = run()
    return {"prefill_tok_s": out.prefill_tokens_per_second, "decode_tok_s": out.decode_tokens_per_second,
            "prefill_s": out.prefill_seconds, "decode_s": out.decode_seconds}


def bench_transformers(model, ids, new_tokens):
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        model(x[:, :16], use_cache=True)  # warm-up
        t0 = time.perf_counter()
        out = model(x, use_cache=True)
        t1 = time.perf_counter()
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t3 = time.perf_counter()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": (new_tokens - 1) / (t3 - t2),
            "prefill_s": t1 - t0, "decode_s": t3 - t2}


def load_transformers(gguf_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 torch_dtype=torch.float32)
    return model.eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="results/bench_model.json")
    args = parser.parse_args(argv)

    import models
    from jaxkv.eval import text

    path = models.default_model_path()
    config, params, tokenizer = models.load(path)
    hf_model = load_transformers(path)
    rows = []
    for n in args.contexts:
        _, ids = text.long_text(tokenizer, n)
        ids = list(ids[:n])
        rows.append({"context": n, "engine": "jaxkv", **bench_jaxkv(params, config, ids, args.new_tokens)})
        rows.append({"context": n, "engine": "transformers",
                     **bench_transformers(hf_model, ids, args.new_tokens)})
    print(f"| context | engine | prefill tok/s | decode tok/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['engine']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]),
            "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
            "new_tokens": args.new_tokens}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
