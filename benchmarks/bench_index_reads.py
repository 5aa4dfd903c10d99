"""What bounds a ParisKV step once its index is out of cache: the cache lines its selection
reads, how fast this machine reads them, and what jaxkv's kernels take, in one run.

    python benchmarks/bench_index_reads.py [--sizes 262144 1048576] [--head-dim 64] [--heads 3]
                                           [--cached-rows 16384] [--repeats 7] [--evict-mb MB]
                                           [--out results/bench_index_reads]

A ParisKV step reads its index twice (docs/methods/pariskv.md): the coarse stage streams
every key's B sign bytes; the rerank reads the sign bytes and the record (3P/8 magnitude
bytes, B/2 weight bytes, a bfloat16 scale) of its C candidates, C = N/10 at the official
ratio for N >= 30k, scattered in ascending row order. The bytes model counts C × (B + record)
bytes for the rerank; the memory moves whole 64-byte lines, and at 1 candidate in 10 most
sign lines and a third of the record lines hold one. ``index_lines.cc`` (built here with the
system's C++ compiler) reads, on every thread:

- ``signs``: every sign row of each head, in order (the coarse stage's read);
- ``candidates``: each candidate's sign row and record, fetched into L2 48 candidates ahead
  as the rerank kernel does and read by one load at each end: its memory traffic without
  its arithmetic (candidates drawn at the same ratio);
- ``padded``: the same from records padded to a power of two of bytes, none straddling two
  lines: a layout the index does not have (40 B a key at SmolLM2's d = 64, 15.6 % of its
  bfloat16 K and V, over the 15 % the issue allows): what it would gain.

Then jaxkv's own kernels over a ParisKV index of the same shape (``pariskv.build`` of
Gaussian keys, one query per head) in this process:

- ``coarse kernel``: ``jaxkv.native.coarse_rows`` (vote table, votes, the top-C), after an
  eviction write;
- ``rerank kernel``: ``jaxkv.native.rerank`` of the coarse stage's C candidates, after an
  eviction write;
- ``rerank kernel, rows cached``: the same candidates folded into the first
  ``--cached-rows`` rows (0.6 MB of index a head at d = 64), no eviction: its arithmetic
  alone.

Each pass follows a write that evicts the index from the caches (``--evict-mb``, by default
twice the largest CPU cache and at least 128 MB); the program's modes alternate pass by
pass, and so do the kernels'. Reported: median and [min–max] ms, MB of the bytes read, MB of
the lines they lie in, GB/s of those lines, and each mode's time against the stream of the
signs. Prints a markdown table and writes JSON + the table.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scattered_rows  # noqa: E402

from jaxkv import native  # noqa: E402
from jaxkv.attention import pariskv, rsq  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "index_lines.cc"
LINE = 64


def lines_touched(rows: np.ndarray, stride: int, nbytes: int) -> int:
    """Distinct 64-byte lines holding bytes [r·stride, r·stride + nbytes) of each row r of each
    head (rows [heads, C]; nbytes <= 64, so a row spans at most two lines)."""
    starts = rows.astype(np.int64) * stride
    return sum(np.unique(np.concatenate([s // LINE, (s + nbytes - 1) // LINE])).size for s in starts)


def program_modes(binary: Path, n: int, sign_bytes: int, record_bytes: int, ratio: float, args) -> dict:
    result = subprocess.run([str(binary), str(n), str(args.heads), str(sign_bytes), str(record_bytes), str(ratio),
                             str(args.repeats), str(args.evict_mb)], check=True, capture_output=True, text=True)
    return json.loads(result.stdout)


def kernel_modes(n: int, args) -> dict:
    """Seconds of jaxkv's coarse and rerank kernels over a built index of n keys a head, with
    the rows, bytes and lines each reads."""
    cfg = pariskv.ParisKVConfig(kernels="native")
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.standard_normal((args.heads, n, args.head_dim), np.float32))
    index = jax.jit(jax.vmap(lambda k: pariskv.build(cfg, k, n)))(keys)
    del keys
    q = jnp.asarray(rng.standard_normal((args.heads, args.head_dim), np.float32))
    q_rot, q_norm = pariskv.rotate(cfg, q), jnp.linalg.norm(q, axis=-1)
    centres = jnp.asarray(rsq.magnitude_levels(cfg.m, cfg.official_levels)[1])
    count = pariskv.n_candidates(cfg, n)
    scores, caps = jax.vmap(lambda qr: pariskv.pattern_scores_and_caps(cfg, qr, n, n))(q_rot)
    # The index is an argument: closed over, it would be folded into the program as a constant.
    coarse = jax.jit(lambda index: native.coarse_rows(index.signs, scores, index.bucket_counts, caps, n, count))
    rerank = jax.jit(lambda codes, rows: native.rerank(codes, q_rot, q_norm, centres, rows))
    candidates = coarse(index)
    cached = candidates % args.cached_rows
    calls = {"coarse kernel": (lambda: coarse(index), True),
             "rerank kernel": (lambda: rerank(index.codes, candidates), True),
             "rerank kernel, rows cached": (lambda: rerank(index.codes, cached), False)}
    seconds = bench_scattered_rows.time_calls(calls, args.repeats, args.evict_mb)
    sign_bytes, record_bytes = index.codes.signs.shape[-1], index.codes.record.shape[-1]

    def rerank_lines(rows: jax.Array) -> int:  # each candidate's sign row and record
        rows = np.asarray(rows)
        return lines_touched(rows, sign_bytes, sign_bytes) + lines_touched(rows, record_bytes, record_bytes)

    reranked = candidates.size
    return {"sign_bytes": sign_bytes, "record_bytes": record_bytes, "candidates": count,
            "rows": {"coarse kernel": args.heads * n, "rerank kernel": reranked, "rerank kernel, rows cached": reranked},
            "bytes": {"coarse kernel": args.heads * n * sign_bytes, "rerank kernel": reranked * (sign_bytes + record_bytes),
                      "rerank kernel, rows cached": reranked * (sign_bytes + record_bytes)},
            "lines": {"coarse kernel": args.heads * -(-n * sign_bytes // LINE), "rerank kernel": rerank_lines(candidates),
                      "rerank kernel, rows cached": rerank_lines(cached)},
            "seconds": seconds}


def measure(binary: Path, n: int, args) -> dict:
    kernel = kernel_modes(n, args)
    program = program_modes(binary, n, kernel["sign_bytes"], kernel["record_bytes"], kernel["candidates"] / n, args)
    out = {"N": n, "head_dim": args.head_dim, "heads": args.heads, "evict_mb": args.evict_mb,
           "threads": program["threads"], "sign_bytes": kernel["sign_bytes"], "record_bytes": kernel["record_bytes"],
           "padded_record_bytes": program["padded_bytes"], "candidates_per_head": kernel["candidates"],
           "cached_rows": args.cached_rows, "modes": {}}
    for source in (program, kernel):
        for mode, seconds in source["seconds"].items():
            line_bytes = source["lines"][mode] * LINE
            out["modes"][mode] = {"rows": source["rows"][mode], "bytes": source["bytes"][mode], "line_bytes": line_bytes,
                                  **bench_scattered_rows.pass_times(seconds)}
            out["modes"][mode]["line_Bps"] = line_bytes / out["modes"][mode]["median_s"]
    stream = out["modes"]["signs"]["median_s"]
    for mode in out["modes"].values():
        mode["of_stream_time"] = mode["median_s"] / stream
    return out


def markdown(results: list[dict], command: str) -> str:
    r0 = results[0]
    lines = [f"Command: `{command}`  ",
             f"{platform.machine()}, {r0['threads']} threads, {r0['heads']} heads, d = {r0['head_dim']}: a key's "
             f"{r0['sign_bytes']} sign bytes and {r0['record_bytes']}-byte record ({r0['padded_record_bytes']} B "
             "padded); median [min–max] of the passes, each after a write of "
             f"{r0['evict_mb']} MB that evicts the caches (but 'rerank kernel, rows cached': its candidates folded "
             f"into the first {r0['cached_rows']:,} rows, not evicted). MB = the bytes the modes need; MB of lines = "
             "the 64-byte lines those lie in.", "",
             "| N | mode | rows | MB | MB of lines | ms [min–max] | GB/s of lines | × signs' time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for mode, m in r["modes"].items():
            lines.append(f"| {r['N']:,} | {mode} | {m['rows']:,} | {m['bytes'] / 1e6:.1f} | {m['line_bytes'] / 1e6:.1f} "
                         f"| {m['median_s'] * 1e3:.2f} [{m['min_s'] * 1e3:.2f}–{m['max_s'] * 1e3:.2f}] "
                         f"| {m['line_Bps'] / 1e9:.1f} | {m['of_stream_time']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[262144, 1048576])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--cached-rows", type=int, default=16384,
                        help="rows the 'rerank kernel, rows cached' mode folds the candidates into")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mb", type=int, default=max(128, 2 * bench_scattered_rows.largest_cache_bytes() >> 20),
                        help="MB written before each pass to evict the index (default: 2x the largest cache)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_index_reads"))
    args = parser.parse_args()
    if min(args.sizes) < 1024 or min(args.head_dim, args.heads, args.cached_rows, args.repeats, args.evict_mb) < 1:
        parser.error("--sizes must be >= 1024; --head-dim, --heads, --cached-rows, --repeats and --evict-mb >= 1")
    reason = native.unavailable_reason("jaxkv_pariskv_coarse", "jaxkv_pariskv_rerank")
    if reason is not None:
        raise SystemExit(f"bench_index_reads: ParisKV's CPU kernels are not available here: {reason}")
    command = "python benchmarks/bench_index_reads.py " + " ".join(
        [f"--sizes {' '.join(map(str, args.sizes))}", f"--head-dim {args.head_dim}", f"--heads {args.heads}",
         f"--cached-rows {args.cached_rows}", f"--repeats {args.repeats}", f"--evict-mb {args.evict_mb}",
         f"--out {args.out}"])
    with tempfile.TemporaryDirectory() as tmp:
        binary = bench_scattered_rows.build(Path(tmp), SOURCE)
        results = [measure(binary, n, args) for n in args.sizes]
    table = markdown(results, command)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_index_reads.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    (args.out / "bench_index_reads.md").write_text(table)
    print(f"wrote {args.out}/bench_index_reads.{{json,md}}")


if __name__ == "__main__":
    main()
