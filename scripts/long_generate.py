"""Issue [4/10] acceptance: one long generate() run at constant memory.

    python scripts/long_generate.py [--steps 10000] [--method magicpig] [--out results/long_generate.json]

A short chat prompt, EOS disabled (no EOS id can stop it), SmolLM2 from the
embedded GGUF, `--steps` new tokens in ONE jaxkv.generate() call (its whole
decode loop is one jitted while_loop, so the run is also a test that the loop
flushes, inserts and attends correctly for thousands of steps past the prompt).

Memory: every cache array is allocated before the loop at a capacity sized for
prompt + steps (the exact regions at S + W + U tokens per layer, whatever the
length), so the device arrays cannot grow; a background thread samples the
process RSS every second to show that nothing else grows either (no leak per
step, no retracing). Reported: tokens produced, decode tokens/s, keys read,
the exact-region shapes, and RSS after compile vs at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import jax

import jaxkv
import models
from jaxkv import cache as kvcache
from soak import rss_mb

PROMPT = "Tell me a very long story about the history of the sea."


class RssSampler:
    """Samples this process's RSS (MiB) every `period` seconds in a daemon thread."""

    def __init__(self, period: float = 1.0):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)

    def _run(self, period):
        t0 = time.time()
        while not self._stop.wait(period):
            self.samples.append((round(time.time() - t0, 1), round(rss_mb(), 1)))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def rss_through_loop(samples, start: float, duration: float) -> dict:
    """RSS (MiB) at 10, 25, 50, 75 and 100 % of the decode loop's time (nearest sample)."""
    if not samples:
        raise RuntimeError("no RSS samples: the run was shorter than the sampling period")
    points = {}
    for percent in (10, 25, 50, 75, 100):
        t = start + duration * percent / 100
        points[f"{percent}%"] = min(samples, key=lambda sample: abs(sample[0] - t))[1]
    return points


def exact_region_shapes(config, method: str, prompt_len: int, steps: int) -> dict:
    """Shapes of one sparse layer's exact-region arrays as generate() allocates them."""
    backend = kvcache.make_backend(config, method, None, None, prompt_len, steps)
    c = backend.cache
    return {"sink": [config.num_kv_heads, c.sink, config.head_dim],
            "window (local + buffer)": [config.num_kv_heads, c.local + c.buffer, config.head_dim],
            "retrieval capacity (host)": [config.num_kv_heads, backend.retrieval_capacity, config.head_dim]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--method", default="magicpig")
    parser.add_argument("--out", default="results/long_generate.json")
    args = parser.parse_args()

    config, params, tokenizer = models.load(models.default_model_path())
    ids = tokenizer.encode(tokenizer.apply_chat_template(PROMPT))
    rss_loaded = rss_mb()
    with RssSampler() as sampler:
        t0 = time.time()
        # eos_ids=() : nothing stops a row early, every step runs.
        result = jaxkv.generate(params, config, [ids], max_new_tokens=args.steps, method=args.method,
                                eos_ids=(), allow_beyond_context=True)
        jax.effects_barrier()
        seconds = time.time() - t0
    loop_rss = rss_through_loop(sampler.samples, seconds - result.decode_seconds, result.decode_seconds)
    record = {
        "command": f"python scripts/long_generate.py --steps {args.steps} --method {args.method}",
        "method": args.method, "prompt_tokens": len(ids), "steps": args.steps,
        "tokens_produced": len(result.tokens[0]), "seconds": round(seconds, 1),
        "decode_seconds": round(result.decode_seconds, 1),
        "decode_tokens_per_second": round(result.decode_tokens_per_second, 2),
        "keys_read_fraction": result.keys_read_fraction,
        "exact_region_shapes_per_layer": exact_region_shapes(config, args.method, len(ids), args.steps),
        "rss_mb_after_load": round(rss_loaded, 1),
        # The loop's first seconds compile it; flat = no growth from a quarter of the way on.
        "rss_mb_through_decode_loop": loop_rss,
        "rss_growth_mb_after_first_quarter": round(loop_rss["100%"] - loop_rss["25%"], 1),
        "rss_samples": sampler.samples[:: max(1, len(sampler.samples) // 200)],
        "tail_text": tokenizer.decode(result.tokens[0][-40:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "rss_samples"}, indent=2))
    ok = record["tokens_produced"] == args.steps
    print("OK" if ok else f"FAILED: produced {record['tokens_produced']} of {args.steps} tokens")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
