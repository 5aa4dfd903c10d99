"""Decode step time and memory per device: one device vs meshes of 8 simulated CPU devices.

    python benchmarks/bench_sharding.py [--context 8192] [--batch 8] [--new-tokens 16]
        [--meshes 8,1 4,2 1,8] [--methods dense pariskv magicpig] [--out results/sharding/bench_sharding.json]

A random tiny-but-long model (2 layers, 16 query / 8 KV heads of 64, hidden 256)
and a synthetic context: a batch of `context`-token "prompts" whose prefilled
cache is random keys and values (standard normal), built directly instead of
running a prefill (an 8×8k prefill takes many minutes on 2 cores and is not
what is measured), shared by every run. Each (method, mesh) decodes `new-tokens`
tokens: once to compile, then `--repeats` timed rounds that run every mesh
once each, interleaved (the median per mesh is reported). The step time is
the decode loop's wall time over its forward steps. Sparse methods run with
the dense fallback off and their default settings. Bytes per device are those
of the decode state right after the prefill is split into regions (retrieval
and MagicPIG's id lists in pinned_host memory), measured from the arrays'
shards.

What this shows on a 2-core CPU machine: that sharded decoding runs at a long
context and gives the single-device tokens (checked here), that the state each
device holds divides by the mesh size, and the order of magnitude of the
partitioning overhead. What it does not show: how decoding scales on real
devices. The 8 "devices" are threads of one process sharing 2 cores and one
memory bus; one device's program and 8 concurrent per-device programs use the
cores differently (XLA:CPU's intra-op threads vs 8 programs), and smaller
per-device arrays change cache behaviour. Ratios to one device here, above or
below 1, reflect those CPU effects and a shared, noisy machine — not what 8
accelerators with their own memory bandwidth and interconnect would do.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

DEVICES = 8
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402


def tiny_long_config(context: int, new_tokens: int):
    import models

    return models.ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
        num_heads=16, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e6,
        rope_scaling=None, max_position_embeddings=context + new_tokens, tie_word_embeddings=True,
        attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))


def method_kwargs(name: str) -> dict:
    from jaxkv.attention import magicpig, pariskv
    from jaxkv.cache import CacheConfig

    configs = {"magicpig": magicpig.MagicPIGConfig(), "pariskv": pariskv.ParisKVConfig()}
    if name == "dense":
        return {}
    return dict(method=name, method_config=configs[name], cache_config=CacheConfig(dense_threshold=0))


def synthetic_prefill(config, batch: int, context: int, new_tokens: int):
    """A Prefilled of `batch` rows of `context` tokens whose cache holds random keys and values."""
    import jaxkv
    import models

    key_k, key_v, key_logits = jax.random.split(jax.random.key(1), 3)
    shape = (config.num_layers, batch, config.num_kv_heads, context + new_tokens, config.head_dim)
    staging = models.KVCache(k=models.transpose_keys(jax.random.normal(key_k, shape)), v=jax.random.normal(key_v, shape))
    rows = np.random.default_rng(0).integers(3, config.vocab_size, (batch, context)).tolist()
    first_logits = jax.random.normal(key_logits, (batch, config.vocab_size))
    return jaxkv.Prefilled(rows, staging, first_logits, seconds=0.0)


def state_bytes(params, config, prefilled, kwargs, mesh) -> dict[str, int]:
    """Bytes per device of the decode state generate() builds from this prefill."""
    from jaxkv import cache as kvcache
    from jaxkv import sharding

    lengths = jax.numpy.asarray([len(r) for r in prefilled.rows], np.int32)
    backend = kvcache.make_backend(config, kwargs.get("method", "dense"), kwargs.get("method_config"),
                                   kwargs.get("cache_config"), int(lengths.max()), 0)
    if mesh is None:
        return sharding.bytes_per_device(backend.from_prefill(prefilled.staging, lengths))
    regions = jax.jit(functools.partial(sharding.regions_per_shard, backend=backend, mesh=mesh))
    return sharding.bytes_per_device(regions(sharding.shard_states(prefilled.staging, mesh), lengths))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--meshes", nargs="+", default=["8,1", "4,2", "1,8"],
                        help="data,model sizes; one device (no mesh) is always run first")
    parser.add_argument("--methods", nargs="+", default=["dense", "pariskv", "magicpig"])
    parser.add_argument("--out", default="results/sharding/bench_sharding.json")
    args = parser.parse_args(argv)

    import jaxkv
    import models
    from jaxkv import sharding

    config = tiny_long_config(args.context, args.new_tokens)
    params = models.init_params(config, jax.random.key(0))
    # std 0.02 init makes every logit nearly equal; scale up so greedy choices are clear-cut.
    params = jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, params)
    prefilled = synthetic_prefill(config, args.batch, args.context, args.new_tokens)

    meshes = [None] + [tuple(int(x) for x in m.split(",")) for m in args.meshes]
    rows = []
    for method in args.methods:
        kwargs = method_kwargs(method)
        runs, method_rows = [], []
        for shape in meshes:
            mesh = None if shape is None else sharding.make_mesh(*shape)
            run = functools.partial(jaxkv.generate, params, config, None, prefilled=prefilled, eos_ids=(),
                                    max_new_tokens=args.new_tokens, mesh=mesh, **kwargs)
            tokens = run().tokens  # compiles
            one_device_tokens = method_rows[0]["tokens"] if method_rows else tokens
            runs.append(run)
            method_rows.append({"method": method, "mesh": "1 device" if shape is None else f"{shape[0]}×{shape[1]}",
                                "tokens": tokens, "same_tokens_as_one_device": tokens == one_device_tokens,
                                "bytes_per_device": state_bytes(params, config, prefilled, kwargs, mesh),
                                "step_ms_runs": []})
        # Interleaved (one run of every mesh per round): load changes on the shared machine hit all alike.
        for _ in range(args.repeats):
            for row, run in zip(method_rows, runs):
                out = run()
                row["step_ms_runs"].append(1e3 * out.decode_seconds / (out.decode_steps - 1))
        for row in method_rows:
            del row["tokens"]
            row["step_ms"] = statistics.median(row["step_ms_runs"])
            print(f"{method} {row['mesh']}: {row['step_ms']:.1f} ms/step", flush=True)
        rows += method_rows

    one = {r["method"]: r["step_ms"] for r in rows if r["mesh"] == "1 device"}
    print(f"\ncontext {args.context}, batch {args.batch}, {DEVICES} simulated devices on "
          f"{os.cpu_count()} cores; decode step = median of {args.repeats} runs of {args.new_tokens - 1} steps\n")
    print("| method | mesh | step ms | × one device | same tokens | state MiB/device (device) | (pinned_host) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["vs_one_device"] = r["step_ms"] / one[r["method"]]
        mib = {k: v / 2**20 for k, v in r["bytes_per_device"].items()}
        print(f"| {r['method']} | {r['mesh']} | {r['step_ms']:.1f} | {r['vs_one_device']:.2f} | "
              f"{r['same_tokens_as_one_device']} | {mib.get('device', 0):.1f} | {mib.get('pinned_host', 0):.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "machine": platform.machine(), "cores": os.cpu_count(),
            "jax": jax.__version__, "devices": jax.device_count(), "context": args.context, "batch": args.batch,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "config": str(config)}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
