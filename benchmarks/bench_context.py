"""One sparse layer's decode step against the number of context shards: work per shard and bytes moved.

    python benchmarks/bench_context.py [--keys 262144 1048576] [--shards 1 2 4 8]
        [--methods pariskv magicpig] [--steps 8] [--out results/context]

One KV head of a Llama-like layer (4 query heads of 64, as a GQA group), a batch of
one row whose context is `keys` random keys and values (standard normal, float32;
all but the sink and window in the retrieval region), split over a (1, 1, C) mesh of simulated CPU devices
(``jaxkv.sharding.make_mesh(1, 1, context=C)``). Per (keys, method, C): the
regions are built per shard, the attention step (``sharding.LocalAttention`` of
the layer's ``cache.region_attention``) is compiled, and `steps` steps are timed
(median). Reported per row: retrieval rows and bytes each device holds (K/V, index
and count, from the arrays' shards), the step's keys read, and the bytes its
collectives move per step, read from the compiled program: every all-reduce /
all-gather / all-to-all / collective-permute's result, counted once per device
and step (an upper bound: the flush's choice of shard counts although a step
flushes once per update buffer), and the bytes each device sends for them (ring
collectives: an all-gather sends (C − 1)/C of its result, an all-reduce twice that).

The C simulated devices share this machine's cores and memory, so a step's wall
time here says nothing about a speed-up on C accelerators; the table's time column
is the whole step as this CPU runs it, for the order of magnitude only.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

DEVICES = 8
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                        r"(?:-start)?\(")
ARRAY = re.compile(r"(pred|[suf]\d+|bf16)\[([\d,]*)\]")
ITEM_BYTES = {"pred": 1, "bf16": 2}


def sent_bytes(moved: dict[str, int], shards: int) -> float:
    """Bytes each device sends for collectives of these result sizes: a ring all-gather sends
    (C − 1)/C of its result, a ring all-reduce twice that; nothing on one shard."""
    share = (shards - 1) / shards
    factor = {"all-gather": share, "all-reduce": 2 * share}
    return sum(size * factor.get(kind, share) for kind, size in moved.items())


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes of every collective's result in a compiled program's text, per kind of collective."""
    moved: dict[str, int] = {}
    for match in COLLECTIVE.finditer(hlo):
        for dtype, dims in ARRAY.findall(match.group(1)):
            size = ITEM_BYTES.get(dtype) or int(dtype[1:]) // 8
            moved[match.group(2)] = moved.get(match.group(2), 0) + size * int(np.prod(
                [int(d) for d in dims.split(",") if d]))
    return moved


def layer_config(keys: int, steps: int):
    import models

    return models.ModelConfig(
        model_type="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=1,
        num_heads=4, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e6,
        rope_scaling=None, max_position_embeddings=keys + steps + 1024, tie_word_embeddings=True,
        attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))


def method_config(name: str):
    from jaxkv.attention import registry

    return registry.get(name).config_class(dense_layers=())


def run_row(config, staging, length: int, method: str, shards: int, steps: int) -> dict:
    """Build one layer's regions on a (1, 1, shards) mesh and time its attention step."""
    from jaxkv import cache as kvcache
    from jaxkv import sharding

    mesh = sharding.make_mesh(1, 1, context=shards)
    backend = kvcache.make_backend(config, method, method_config(method), kvcache.CacheConfig(dense_threshold=0),
                                   length, steps, context=sharding.context_split(mesh))
    started = time.perf_counter()
    (state,) = jax.jit(lambda st, ln: sharding.regions_per_shard(st, ln, backend=backend, mesh=mesh))(
        sharding.shard_states(staging, mesh), jnp.array([length], jnp.int32))
    jax.block_until_ready(state)
    build_s = time.perf_counter() - started
    held = sharding.bytes_per_device({name: getattr(state, name) for name in kvcache.RETRIEVAL_FIELDS})

    step = jax.jit(sharding.LocalAttention(backend.attention[0], mesh), donate_argnums=(4,))
    rng = np.random.default_rng(0)
    g, hd = config.num_heads, config.head_dim

    def args(i):
        q = jnp.asarray(rng.standard_normal((1, 1, g, hd)), jnp.float32)
        kv = jnp.asarray(rng.standard_normal((2, 1, 1, 1, hd)), jnp.float32)
        return q, kv[0], kv[1], jnp.array([[length + i]], jnp.int32)

    moved = collective_bytes(step.lower(*args(0), state).compile().as_text())
    times = []
    for i in range(steps + 1):  # the first call compiles
        started = time.perf_counter()
        out, state = step(*args(i), state)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - started)
    reads = float(np.asarray(state.keys_read)[0]) / float(np.asarray(state.keys_seen)[0])
    return {"keys": length, "method": method, "shards": shards, "rows_per_shard": backend.context.rows_per_shard,
            "retrieval_bytes_per_device": sum(held.values()), "step_ms": 1e3 * statistics.median(times[1:]),
            "build_s": build_s, "keys_read_fraction": reads, "collective_bytes": moved,
            "collective_bytes_per_step": sum(moved.values()), "sent_bytes_per_step": sent_bytes(moved, shards)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[262144, 1048576])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["pariskv", "magicpig"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="results/context")
    args = parser.parse_args(argv)
    if max(args.shards) > DEVICES:
        parser.error(f"--shards at most {DEVICES} (the simulated devices)")

    import models

    rows = []
    for n in args.keys:
        config = layer_config(n, args.steps)
        total = n + args.steps
        k, v = (jax.random.normal(key, (1, 1, 1, total, config.head_dim))
                for key in jax.random.split(jax.random.key(1)))
        staging = models.KVCache(k=models.transpose_keys(k), v=v)
        for method in args.methods:
            for shards in args.shards:
                row = run_row(config, staging, n, method, shards, args.steps)
                rows.append(row)
                print(f"{n} keys {method} {shards} shards: {row['step_ms']:.1f} ms/step, "
                      f"{row['sent_bytes_per_step']:.0f} B sent", flush=True)
    table = ["| context | method | shards | rows per shard | retrieval MiB / device | keys read | "
             "collective results B / step | sent B / device / step | step ms (shared CPU) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['keys']:,} | {r['method']} | {r['shards']} | {r['rows_per_shard']:,} | "
                     f"{r['retrieval_bytes_per_device'] / 2**20:.1f} | {100 * r['keys_read_fraction']:.2f}% | "
                     f"{r['collective_bytes_per_step']:,} | {r['sent_bytes_per_step']:,.0f} | {r['step_ms']:.1f} |")
    print("\n".join(table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "machine": platform.machine(), "cores": os.cpu_count(),
            "jax": jax.__version__, "devices": jax.device_count(), "steps": args.steps}
    (out / "bench_context.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "bench_context.md").write_text("\n".join(table) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
