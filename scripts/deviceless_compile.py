"""Compile generate()'s decode loop for an H100 on a machine without a GPU.

JAX's deviceless ahead-of-time compilation: ``jax.experimental.topologies``
describes one H100 from its target config (``h100_target_config.txtpb``), and the
decode loop is compiled against a mesh of that topology by the JAX CUDA plugin, so
XLA's GPU passes run here: the host offloader, memory-space assignment, fusion,
Triton compilation of the Pallas kernels (shared-memory limits included). The
abstract inputs keep their memory kinds (the retrieval K/V in ``pinned_host``).

Needs the plugin wheels ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` of jaxlib's
version (``make cuda-plugin``) and ``JAX_PLATFORMS=cpu``. One variant per call:

    python scripts/deviceless_compile.py --method pariskv --offload --json out.json

prints one line of facts (compile time, the compiled program's device and
pinned-host bytes, the Triton kernels in it, how many ops XLA's host offloader
turned into host compute) and writes them as JSON. It never runs the program.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import models
from jaxkv import cache as kvcache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from decode_variants import METHODS, decode_setup  # noqa: E402
from llama_shapes import HF_CONFIGS, llama_config  # noqa: E402

TARGET_CONFIG = pathlib.Path(__file__).resolve().parent / "h100_target_config.txtpb"
# generate() is the package's function; its module holds the decode loop.
_generate = importlib.import_module("jaxkv.generate")
HOST_COMPUTE_WARNING = "Converting into host compute"


def h100_mesh() -> jax.sharding.Mesh:
    """A one-device mesh of a compile-only H100 (no GPU needed, the CUDA plugin is)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG.read_text(),
                                            topology="1x1x1")
    return jax.sharding.Mesh(np.array(topology.devices), ("device",))


def placed(shape_dtype, mesh: jax.sharding.Mesh, memory_kind: str = "device") -> jax.ShapeDtypeStruct:
    """An abstract array on ``mesh``'s device in ``memory_kind``.

    The sharding is on the mesh's abstract mesh: compile-only devices have no
    memories, so a concrete NamedSharding would drop the memory kind.
    """
    sharding = jax.sharding.NamedSharding(mesh.abstract_mesh, jax.sharding.PartitionSpec(),
                                          memory_kind=memory_kind)
    return jax.ShapeDtypeStruct(shape_dtype.shape, shape_dtype.dtype, sharding=sharding)


def _memory_kind(aval) -> str:
    return "pinned_host" if aval.memory_space == jax.memory.Space.Host else "device"


def state_types(backend: kvcache.Backend, staging, lengths):
    """(tree structure, types) of every layer's decode state from a prefilled staging cache,
    traced, not run. The types keep their memory space (``jax.eval_shape`` would lose it)."""
    jaxpr, tree = jax.make_jaxpr(backend.from_prefill, return_shape=True)(staging, lengths)
    treedef = jax.tree.structure(tree)
    assert treedef.num_leaves == len(jaxpr.out_avals)
    return treedef, jaxpr.out_avals


def pinned_host_bytes(types) -> int:
    """Bytes of the types (``state_types``) that live in pinned host memory."""
    return sum(int(np.prod(t.shape)) * t.dtype.itemsize for t in types if _memory_kind(t) == "pinned_host")


def abstract_states(backend: kvcache.Backend, staging, lengths, mesh):
    """Every layer's decode state as abstract arrays on ``mesh`` in the memory kinds generate() puts them in."""
    treedef, types = state_types(backend, staging, lengths)
    return jax.tree.unflatten(treedef, [placed(t, mesh, _memory_kind(t)) for t in types])


@dataclasses.dataclass(frozen=True)
class Request:
    """One variant's compile: the model shape, the method and where its KV lives, the sizes."""

    model: str = "llama-3.1-8b"
    layers: int = 2
    method: str = "pariskv"
    offload: bool = True
    context: int = 131072
    new_tokens: int = 16
    batch: int = 1
    dtype: str = "bfloat16"
    host_index: bool = False  # with offload, MagicPIG's index in host memory


def decode_chunk_args(request: Request, mesh):
    """(params, state, spec) of generate()'s decode-chunk program, params and state abstract on ``mesh``."""
    config = llama_config(request.model, request.layers)
    dtype = jnp.dtype(request.dtype)
    method, mcfg, ccfg = decode_setup(request.method, request.offload, host_index=request.host_index)
    backend = kvcache.make_backend(config, method, mcfg, ccfg, request.context - request.new_tokens,
                                   request.new_tokens)
    params = jax.eval_shape(lambda: models.unstack_layers(
        models.init_params(config, jax.random.key(0), dtype), config.num_layers))
    staging = jax.eval_shape(lambda: models.init_cache(config, request.batch, backend.staging_capacity, dtype))
    b = request.batch
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    row = lambda dtype, *shape: placed(jax.ShapeDtypeStruct((b, *shape), dtype), mesh)
    state = _generate.DecodeState(
        caches=abstract_states(backend, staging, lengths, mesh), token=row(jnp.int32), position=row(jnp.int32),
        emitted=row(jnp.int32), budget=row(jnp.int32), done=row(jnp.bool_), keys=row(jnp.uint32, 2),
        temperature=row(jnp.float32), top_p=row(jnp.float32))
    spec = _generate.DecodeSpec(config, backend, _generate._ONE_DEVICE.per_shard, tuple(config.eos_token_ids))
    return jax.tree.map(lambda x: placed(x, mesh), params), state, spec


@contextlib.contextmanager
def captured_stderr():
    """Capture what C++ code (XLA's warnings) writes to file descriptor 2; yields a list
    that holds the text once the block ends. The text is written back to stderr too."""
    sys.stderr.flush()
    saved = os.dup(2)
    out: list[str] = []
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            out.append(log.read().decode(errors="replace"))
            sys.stderr.write(out[0])


def triton_kernel_names(hlo_text: str) -> list[str]:
    """Names of the Pallas (Triton) kernels called in a compiled HLO module, sorted."""
    calls = [line for line in hlo_text.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line]
    return sorted(re.search(r'name = \\?"([^"\\]+)', line).group(1) for line in calls)


def memory_facts(compiled) -> dict[str, int]:
    """The compiled program's memory analysis, with the peaks XLA's figures imply: arguments
    plus outputs not aliased to them plus temporaries, on the device and in pinned host memory."""
    stats = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp")
    facts = {f"device_{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes")) for f in fields}
    facts |= {f"host_{f}_bytes": int(getattr(stats, f"host_{f}_size_in_bytes")) for f in fields}
    for where in ("device", "host"):
        facts[f"{where}_peak_bytes"] = (facts[f"{where}_argument_bytes"] + facts[f"{where}_output_bytes"]
                                        - facts[f"{where}_alias_bytes"] + facts[f"{where}_temp_bytes"])
    return facts


def state_bytes(states) -> dict[str, int]:
    """Bytes of the decode states by memory kind."""
    totals = {"device": 0, "pinned_host": 0}
    for x in jax.tree.leaves(states):
        totals[x.sharding.memory_kind] += int(np.prod(x.shape)) * x.dtype.itemsize
    return totals


def compile_decode_loop(request: Request) -> dict:
    """Lower and compile the decode loop of ``request`` for an H100; the facts as a dict.

    A failure to lower or compile is reported in the dict (``ok`` False, ``stage``,
    ``error``), not raised.
    """
    import jaxlib

    report = {"request": dataclasses.asdict(request), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "plugin": _plugin_version(), "ok": False}
    stage = "trace"
    try:
        mesh = h100_mesh()
        report["device_kind"] = mesh.devices.flat[0].device_kind
        params, state, spec = decode_chunk_args(request, mesh)
        report["state_bytes"] = state_bytes(state.caches)
        stage = "lower"
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            lowered = _generate._ONE_DEVICE.decode_chunk.trace(params, state, spec=spec,
                                                                steps=request.new_tokens).lower()
        report["lower_seconds"] = time.perf_counter() - start
        stage = "compile"
        start = time.perf_counter()
        with captured_stderr() as log:
            compiled = lowered.compile()
        report["compile_seconds"] = time.perf_counter() - start
        report["memory"] = memory_facts(compiled)
        report["triton_kernels"] = triton_kernel_names(compiled.as_text())
        report["host_compute_ops"] = log[0].count(HOST_COMPUTE_WARNING)
        report["ok"] = True
    except Exception as error:  # reported: the caller decides what a failure means
        report |= {"stage": stage, "error": f"{type(error).__name__}: {error}",
                   "traceback": traceback.format_exc(limit=6)}
    return report


def _plugin_version() -> str | None:
    """The installed ``jax-cuda12-plugin``'s version (None when it is missing)."""
    from importlib import metadata

    try:
        return metadata.version("jax-cuda12-plugin")
    except metadata.PackageNotFoundError:
        return None


def summary(report: dict) -> str:
    """One line per report, for people."""
    r = report["request"]
    head = f"{r['method']:<9} offload={'on ' if r['offload'] else 'off'}"
    if not report["ok"]:
        return f"{head} FAILED at {report['stage']}: {report['error'].splitlines()[0]}"
    m, gib = report["memory"], 2**30
    return (f"{head} compiled in {report['compile_seconds']:.1f} s; device peak {m['device_peak_bytes'] / gib:.2f} GiB, "
            f"pinned host {m['host_argument_bytes'] / gib:.2f} GiB args + {m['host_temp_bytes'] / gib:.2f} GiB temp; "
            f"{report['host_compute_ops']} ops turned into host compute; "
            f"Triton kernels: {', '.join(report['triton_kernels']) or 'none'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=Request.model, choices=sorted(HF_CONFIGS))
    parser.add_argument("--layers", type=int, default=Request.layers,
                        help="decoder layers (the per-layer shapes stay the model's)")
    parser.add_argument("--method", default=Request.method, choices=METHODS)
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=Request.offload,
                        help="retrieval K/V in pinned host memory (dense: the four-region cache, dense fallback forced)")
    parser.add_argument("--context", type=int, default=Request.context, help="prompt + new tokens")
    parser.add_argument("--new-tokens", type=int, default=Request.new_tokens)
    parser.add_argument("--batch", type=int, default=Request.batch)
    parser.add_argument("--dtype", default=Request.dtype, choices=("float32", "bfloat16"))
    parser.add_argument("--host-index", action="store_true",
                        help="with --offload, MagicPIG's index in host memory (CacheConfig.host_index)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    request = Request(args.model, args.layers, args.method, args.offload, args.context, args.new_tokens,
                      args.batch, args.dtype, args.host_index)
    report = compile_decode_loop(request)
    print(summary(report), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
