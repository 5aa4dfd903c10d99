"""Bytes between host and device memory per decode step and per flush, read off the cache's code.

For each method, one layer's decode state is traced (not run) from the real prefill
(``jaxkv.cache.regions_from_prefill``) at a model's shapes; its flush
(``jaxkv.cache.flush``) and its decode step without a flush
(``jaxkv.cache.region_step``) are traced on that state, and
``jaxkv.offload.transfers`` sums the bytes of their host↔device transfers. A step
is summed over the model's layers (dense layers move nothing: their KV is on the
device), and so is a flush (every sparse layer's window fills on the same step).
Resident bytes come from the traced state's arrays and their memory kinds.

    python benchmarks/data_movement.py                 # Llama-3.1-8B shapes, 32k and 128k
    python benchmarks/data_movement.py --json out.json --markdown out.md

Selections are counted at their static capacity: a method that fills part of it
(MagicPIG's sample, when its index is on the device: up to N/8 slots) moves at most that much.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import models
from jaxkv import cache as kvcache
from jaxkv import offload
from jaxkv.attention import dense, hybrid, magicpig, pariskv, pqcache, topk


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The decoder shapes the cache depends on."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    group: int  # query heads per KV head
    dtype: str = "bfloat16"
    batch: int = 1


LLAMA_31_8B = Shapes("Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128, group=4)


@dataclasses.dataclass(frozen=True)
class Row:
    """One method as the table lists it: the cache's method and configs."""

    label: str
    method: str  # a jaxkv.cache method, or "dense" (KV on the device)
    method_config: object = None
    cache_config: kvcache.CacheConfig | None = None
    placement: str = ""


def rows(context: int) -> list[Row]:
    """The table's methods at their defaults (offloaded, no dense fallback unless said)."""
    offloaded = kvcache.CacheConfig(dense_threshold=0)
    magicpig_on_host = dataclasses.replace(offloaded, host_index=True)
    return [
        Row("dense, KV on the device", "dense", dense.DenseConfig(), None, "device"),
        Row("dense reading host KV", "pariskv", pariskv.ParisKVConfig(),
            kvcache.CacheConfig(dense_threshold=context + 1), "every row from the host"),
        Row("MagicPIG, index on the host", "magicpig", magicpig.MagicPIGConfig(), magicpig_on_host,
            "index on the host"),
        # One block of slots: the block loop's trip count is data (the slots in use), its bound
        # is the selection's capacity, which is what one pass over all slots moves.
        Row("MagicPIG (default)", "magicpig", magicpig.MagicPIGConfig(),
            dataclasses.replace(offloaded, slot_block=context), "index on the device"),
        Row("ParisKV", "pariskv", pariskv.ParisKVConfig(), offloaded, "index on the device"),
        Row("hybrid", "hybrid", hybrid.HybridConfig(), offloaded, "index on the device"),
        Row("TopK oracle", "topk", topk.TopKConfig(), offloaded, "index on the device"),
        Row("PQCache", "pqcache", pqcache.PQCacheConfig(), offloaded, "index on the device"),
    ]


def _model_config(shapes: Shapes) -> models.ModelConfig:
    # Only the layer count and the attention shapes matter to the cache; the rest is filler.
    return models.ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=shapes.num_kv_heads * shapes.group * shapes.head_dim,
        intermediate_size=256, num_layers=shapes.num_layers, num_heads=shapes.num_kv_heads * shapes.group,
        num_kv_heads=shapes.num_kv_heads, head_dim=shapes.head_dim, rms_norm_eps=1e-5, rope_theta=5e5,
        rope_scaling=None, max_position_embeddings=1 << 20, tie_word_embeddings=False, attention_bias=False,
        qk_norm=False)


def _abstract(shape, dtype, space=offload.DEVICE):
    return jax.core.ShapedArray(shape, jnp.dtype(dtype), memory_space=space)


def layer_state(backend: kvcache.Backend, shapes: Shapes, context: int):
    """One sparse layer's decode state after a prefill of ``context`` tokens, as abstract arrays
    that keep their memory kinds: the real prefill, traced."""
    b, h, d = shapes.batch, shapes.num_kv_heads, shapes.head_dim
    staging = _abstract((b, h, backend.staging_capacity, d), shapes.dtype)
    prefill = functools.partial(kvcache.regions_from_prefill, method=backend.sparse_method,
                                mcfg=backend.method_config, ccfg=backend.cache, capacity=backend.retrieval_capacity)
    traced = jax.jit(prefill).trace(staging, staging, _abstract((b,), jnp.int32))
    return jax.tree.unflatten(jax.tree.structure(traced.out_info), traced.jaxpr.out_avals)


def _step_inputs(shapes: Shapes):
    b, h, g, d = shapes.batch, shapes.num_kv_heads, shapes.group, shapes.head_dim
    return (_abstract((b, 1, h * g, d), shapes.dtype), _abstract((b, 1, h, d), shapes.dtype),
            _abstract((b, 1, h, d), shapes.dtype), _abstract((b, 1), jnp.int32))


def _resident(tree) -> dict[str, int]:
    held = {"host": 0, "device": 0}
    for aval in jax.tree.leaves(tree):
        held["host" if aval.memory_space == offload.HOST else "device"] += math.prod(aval.shape) * aval.dtype.itemsize
    return held


def measure(row: Row, shapes: Shapes, context: int) -> dict:
    """Bytes each way per decode step and per flush over all layers, and resident bytes, for one row."""
    config = _model_config(shapes)
    backend = kvcache.make_backend(config, row.method, row.method_config, row.cache_config, context, 1)
    dense_layers = len(backend.dense_layers)
    sparse_layers = shapes.num_layers - dense_layers
    b, h, d = shapes.batch, shapes.num_kv_heads, shapes.head_dim
    dense_kv = 2 * b * h * backend.staging_capacity * d * jnp.dtype(shapes.dtype).itemsize
    step = flush = offload.Transfers()
    resident = {"host": 0, "device": dense_layers * dense_kv}
    if sparse_layers:
        kw = dict(method=backend.sparse_method, mcfg=backend.method_config, ccfg=backend.cache)
        state = layer_state(backend, shapes, context)
        step = offload.transfers(functools.partial(kvcache.region_step, **kw), *_step_inputs(shapes), state)
        flush = offload.transfers(functools.partial(kvcache.flush, **kw), state)
        layer = _resident(state)
        resident = {k: resident[k] + sparse_layers * layer[k] for k in resident}
    if dense_layers:  # the dense layers' step, traced on their on-device cache
        cache = models.KVCache(k=_abstract((b, h, d, backend.staging_capacity), models.ROW_BITS),
                               v=_abstract((b, h, backend.staging_capacity, d), models.ROW_BITS))
        dense_step = offload.transfers(backend.attention[backend.dense_layers[0]], *_step_inputs(shapes), cache)
        if dense_step != offload.Transfers():
            raise AssertionError(f"a dense layer moves data: {dense_step}")
    implicit = sorted(set(step.implicit + flush.implicit))
    if implicit:
        raise AssertionError(f"{row.label}: ops outside a host computation read host memory: {implicit}")
    return dict(method=row.label, placement=row.placement, context=context, sparse_layers=sparse_layers,
                step_to_device=sparse_layers * step.to_device, step_to_host=sparse_layers * step.to_host,
                flush_to_device=sparse_layers * flush.to_device, flush_to_host=sparse_layers * flush.to_host,
                flush_every=backend.cache.buffer if backend.cache else None,
                host_resident=resident["host"], device_resident=resident["device"])


def table(shapes: Shapes, contexts) -> list[dict]:
    return [measure(row, shapes, n) for n in contexts for row in rows(n)]


def _size(n: int) -> str:
    """Bytes in the unit that keeps 3 significant digits readable."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def markdown(shapes: Shapes, results: list[dict]) -> str:
    lines = [f"{shapes.name} shapes: {shapes.num_layers} layers, {shapes.num_kv_heads} KV heads × "
             f"{shapes.head_dim}, GQA {shapes.group}, {shapes.dtype} K/V, batch {shapes.batch}.", "",
             "| context | method | placement | step h→d | step d→h | flush h→d | flush d→h | flush every "
             "| on host | on device (cache + index) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        every = f"{r['flush_every']} steps" if r["flush_every"] else "—"
        lines.append(f"| {r['context']:,} | {r['method']} | {r['placement']} | {_size(r['step_to_device'])} "
                     f"| {_size(r['step_to_host'])} | {_size(r['flush_to_device'])} | {_size(r['flush_to_host'])} "
                     f"| {every} | {_size(r['host_resident'])} | {_size(r['device_resident'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32_768, 131_072])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table as markdown here")
    args = parser.parse_args(argv)
    with jax.default_device(jax.devices("cpu")[0]):
        results = table(LLAMA_31_8B, args.contexts)
    text = markdown(LLAMA_31_8B, results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"shapes": dataclasses.asdict(LLAMA_31_8B), "rows": results}, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
