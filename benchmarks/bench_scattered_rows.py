"""How fast this machine reads K and V rows scattered as a sparse step reads them, against a
streamed read of the same regions, in one run: the bandwidth that bounds MagicPIG's step.

    python benchmarks/bench_scattered_rows.py [--sizes 262144 1048576] [--density 0.0727]
                                              [--head-dim 64] [--heads 3] [--repeats 7]
                                              [--evict-mb MB] [--out results/bench_scattered_rows]

A MagicPIG step reads the K and V rows of every slot its query heads sample: at the
official K10L150 about 7.27 % of the keys of each KV head (the union over a GQA group of
3; `bench_attention`'s "rows gathered/head", e.g. 19,060 of 262,144 and 76,143 of
1,048,576 for SmolLM2's shape), each row d float32 (256 B at d = 64), in ascending order.
`scattered_rows.cc` (built here with the system's C++ compiler) reads, on every thread:

- ``stream``: every row of each head's K and V regions, in order (dense's bytes);
- ``scattered``: the rows of a random sample at ``--density``, K and V rows from their own
  regions, fetched into L2 16 rows ahead as jaxkv's attention kernels do;
- ``interleaved``: the same rows from one region of [K row | V row] records (a layout
  the cache does not have: what it would gain).

Then jaxkv's own MagicPIG attention kernel (``jaxkv.native.magicpig_attend``, the
correction included) over a sample of the same size, in this process:

- ``kernel``: the sampled rows of float32 K and V regions of N rows, each pass after the
  eviction write, as ``scattered`` reads them;
- ``kernel, rows cached``: the same slots with their row ids folded into the first
  ``--cached-rows`` rows (1,024: 1.5 MB of K and V at d = 64 and 3 heads, within a
  core's L2 here), no eviction: what the kernel's arithmetic alone costs.

Each query head of a group of ``--group`` samples each row of its KV head's sample with
probability ``--head-share`` (at least one head every row): 0.45 by default, between
independent heads (0.34 of the union at density 0.0727 for 3 heads) and identical ones (1).

Each pass follows a write that evicts the regions from the caches: ``--evict-mb``, by
default twice the largest CPU cache sysfs reports and at least 128 MB (an EPYC's 32 MB L3
and a Xeon's 300 MB one were both seen here); the modes alternate pass by pass (the
program's three among themselves, then the kernel's two).
Reported: median and [min–max] seconds, GB/s of the bytes read (rows × row bytes), and
each mode's bandwidth as a fraction of the stream's. Prints a markdown table and writes
JSON + the table.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import native
from jaxkv.attention import common, magicpig

SOURCE = Path(__file__).resolve().parent / "scattered_rows.cc"


def build(directory: Path, source: Path = SOURCE) -> Path:
    """Compiles a benchmark program (scattered_rows.cc by default) into directory, with the
    kernels' compiler; the sums may be reordered (vectorised)."""
    try:
        compiler = native.cxx_compiler()
    except native.NativeUnavailable as error:
        raise SystemExit(f"{source.stem}: {error}") from None
    binary = directory / source.stem
    subprocess.run([compiler, "-O3", "-march=native", "-ffast-math", "-std=c++17", "-pthread", str(source),
                    "-o", str(binary)], check=True)
    return binary


def largest_cache_bytes() -> int:
    """The largest CPU cache sysfs reports (0 where it reports none)."""
    units, sizes = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}, [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        sizes.append(int(text.rstrip("KMG")) * units.get(text[-1], 1))
    return max(sizes)


def measure(binary: Path, n: int, args) -> dict:
    result = subprocess.run([str(binary), str(n), str(args.head_dim), str(args.heads), str(args.density),
                             str(args.repeats), str(args.evict_mb)], check=True, capture_output=True, text=True)
    raw = json.loads(result.stdout)
    kernel = kernel_modes(n, args.head_dim, args.heads, args.group, args.density, args.head_share, args.cached_rows,
                          args.repeats, args.evict_mb)
    out = {"N": n, "head_dim": args.head_dim, "heads": args.heads, "density": args.density,
           "evict_mb": args.evict_mb, "threads": raw["threads"], "group": args.group, "head_share": args.head_share,
           "cached_rows": args.cached_rows, "kernel_pairs": kernel["pairs"], "modes": {}}
    for source in (raw, kernel):
        for mode, seconds in source["seconds"].items():
            nbytes = source["rows"][mode] * 2 * args.head_dim * 4  # a float32 K and V row each
            out["modes"][mode] = {"rows": source["rows"][mode], "bytes": nbytes, **pass_times(seconds)}
            out["modes"][mode]["Bps"] = nbytes / out["modes"][mode]["median_s"]
    stream = out["modes"]["stream"]["Bps"]
    for mode in out["modes"].values():
        mode["of_stream"] = mode["Bps"] / stream
    return out


def pass_times(seconds) -> dict:
    """Median, min and max seconds of a mode's passes."""
    seconds = np.asarray(seconds)
    return {"median_s": float(np.median(seconds)), "min_s": float(seconds.min()), "max_s": float(seconds.max())}


def sample_slots(rng, n: int, heads: int, group: int, density: float, head_share: float):
    """Each KV head's sample (ascending rows of n, each kept with probability density, in
    n/8 slots as MagicPIG's capacity) and which of its group's query heads sampled each row."""
    slots = n // 8
    idx, mask, sampled = np.zeros((heads, slots), np.int32), np.zeros((heads, group, slots), bool), 0
    for h in range(heads):
        rows = np.flatnonzero(rng.random(n) < density)[:slots]
        by_head = rng.random((group, rows.size)) < head_share
        by_head[0] |= ~by_head.any(axis=0)
        idx[h, :rows.size], mask[h, :, :rows.size] = rows, by_head
        sampled += rows.size
    return idx, mask, sampled


def kernel_modes(n: int, head_dim: int, heads: int, group: int, density: float, head_share: float,
                 cached_rows: int, repeats: int, evict_mb: int) -> dict:
    """Seconds of jaxkv's MagicPIG attention kernel over a sample: ``kernel`` after each eviction
    write, ``kernel, rows cached`` with the row ids folded into the first cached_rows rows."""
    rng = np.random.default_rng(0)
    keys, values = (jnp.asarray(rng.standard_normal((heads, n, head_dim), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((heads, group, head_dim), np.float32))
    mu = jnp.asarray(0.1 * rng.standard_normal((heads, head_dim), np.float32))
    idx, mask, sampled = sample_slots(rng, n, heads, group, density, head_share)
    cfg = magicpig.MagicPIGConfig()
    tables_used = jnp.full((heads, group), cfg.L, jnp.int32)
    # The regions are arguments: closed over, they would be folded into the program as constants.
    attend = jax.jit(lambda idx, keys, values: native.magicpig_attend(
        q, keys, values, mu, idx, jnp.asarray(mask), tables_used, K=cfg.K, min_hits=cfg.min_hits,
        tail_terms=magicpig.TAIL_TERMS, log_u_floor=magicpig.LOG_U_FLOOR, masked_score=common.MASKED_SCORE))
    rows, cached = jnp.asarray(idx), jnp.asarray(idx % cached_rows)
    calls = {"kernel": (lambda: attend(rows, keys, values), True),
             "kernel, rows cached": (lambda: attend(cached, keys, values), False)}
    return {"rows": {mode: sampled for mode in calls}, "pairs": int(mask.sum()),
            "seconds": time_calls(calls, repeats, evict_mb)}


def time_calls(calls: dict, repeats: int, evict_mb: int) -> dict:
    """Seconds of each jitted call of ``calls`` (mode -> (call, evicted)) over ``repeats`` rounds,
    the modes alternating: an evicted mode's call follows a write of evict_mb MB, the others
    follow a call of their own (their data cached). A first round, which compiles, is left out."""
    evict = np.zeros(evict_mb << 20, np.uint8)
    seconds = {mode: [] for mode in calls}
    for _ in range(repeats + 1):
        for mode, (call, evicted) in calls.items():
            if evicted:
                evict[::64] += 1
            else:
                jax.block_until_ready(call())
            start = time.perf_counter()
            jax.block_until_ready(call())
            seconds[mode].append(time.perf_counter() - start)
    return {mode: s[1:] for mode, s in seconds.items()}


def markdown(results: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`  ", f"{platform.machine()}, {results[0]['threads']} threads; median "
             f"[min–max] of the passes, each after a write of {results[0]['evict_mb']} MB that evicts the "
             "caches (but 'kernel, rows cached': its slots' rows folded into the first "
             f"{results[0]['cached_rows']:,}, not evicted). The kernel's modes: jaxkv.native.magicpig_attend, "
             f"{results[0]['group']} query heads per KV head, each sampling a row with probability "
             f"{results[0]['head_share']}.", "",
             "| N | mode | rows | MB | ms [min–max] | GB/s | × stream's GB/s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for mode, m in r["modes"].items():
            lines.append(f"| {r['N']:,} | {mode} | {m['rows']:,} | {m['bytes'] / 1e6:.1f} | {m['median_s'] * 1e3:.2f} "
                         f"[{m['min_s'] * 1e3:.2f}–{m['max_s'] * 1e3:.2f}] | {m['Bps'] / 1e9:.1f} | "
                         f"{m['of_stream']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[262144, 1048576])
    parser.add_argument("--density", type=float, default=0.0727,
                        help="fraction of each head's rows read (MagicPIG K10L150 at GQA 3: 0.0727)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head (the kernel's modes)")
    parser.add_argument("--head-share", type=float, default=0.45,
                        help="probability that a query head sampled a row of its KV head's sample")
    parser.add_argument("--cached-rows", type=int, default=1024,
                        help="rows the 'kernel, rows cached' mode folds the sample into")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mb", type=int, default=max(128, 2 * largest_cache_bytes() >> 20),
                        help="MB written before each pass to evict the regions (default: 2x the largest cache)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_scattered_rows"))
    args = parser.parse_args()
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if not 0 < args.head_share <= 1:
        parser.error(f"--head-share must be in (0, 1], got {args.head_share}")
    if min(args.sizes) < 8 or min(args.head_dim, args.heads, args.group, args.cached_rows, args.repeats,
                                  args.evict_mb) < 1:
        parser.error("--sizes must be >= 8; --head-dim, --heads, --group, --cached-rows, --repeats and "
                     "--evict-mb >= 1")
    command = "python benchmarks/bench_scattered_rows.py " + " ".join(
        [f"--sizes {' '.join(map(str, args.sizes))}", f"--density {args.density}", f"--head-dim {args.head_dim}",
         f"--heads {args.heads}", f"--group {args.group}", f"--head-share {args.head_share}",
         f"--cached-rows {args.cached_rows}", f"--repeats {args.repeats}", f"--evict-mb {args.evict_mb}",
         f"--out {args.out}"])
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        results = [measure(binary, n, args) for n in args.sizes]
    table = markdown(results, command)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scattered_rows.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    (args.out / "bench_scattered_rows.md").write_text(table)
    print(f"wrote {args.out}/bench_scattered_rows.{{json,md}}")


if __name__ == "__main__":
    main()
