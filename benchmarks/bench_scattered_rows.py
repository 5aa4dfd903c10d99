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

Each pass follows a write that evicts the regions from the caches: ``--evict-mb``, by
default twice the largest CPU cache sysfs reports and at least 128 MB (an EPYC's 32 MB L3
and a Xeon's 300 MB one were both seen here); the modes alternate pass by pass.
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
from pathlib import Path

import numpy as np

from jaxkv import native

SOURCE = Path(__file__).resolve().parent / "scattered_rows.cc"
MODES = ("stream", "scattered", "interleaved")


def build(directory: Path) -> Path:
    """Compiles scattered_rows.cc into directory, with the kernels' compiler; the sums may be
    reordered (vectorised)."""
    try:
        compiler = native.cxx_compiler()
    except native.NativeUnavailable as error:
        raise SystemExit(f"bench_scattered_rows: {error}") from None
    binary = directory / "scattered_rows"
    subprocess.run([compiler, "-O3", "-march=native", "-ffast-math", "-std=c++17", "-pthread", str(SOURCE),
                    "-o", str(binary)], check=True)
    return binary


def largest_cache_bytes() -> int:
    """The largest CPU cache sysfs reports (0 where it reports none)."""
    units, sizes = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}, [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        sizes.append(int(text.rstrip("KMG")) * units.get(text[-1], 1))
    return max(sizes)


def measure(binary: Path, n: int, head_dim: int, heads: int, density: float, repeats: int, evict_mb: int) -> dict:
    result = subprocess.run([str(binary), str(n), str(head_dim), str(heads), str(density), str(repeats),
                             str(evict_mb)], check=True, capture_output=True, text=True)
    raw = json.loads(result.stdout)
    out = {"N": n, "head_dim": head_dim, "heads": heads, "density": density, "evict_mb": evict_mb,
           "threads": raw["threads"], "modes": {}}
    for mode in MODES:
        seconds = np.asarray(raw["seconds"][mode])
        median = float(np.median(seconds))
        nbytes = raw["rows"][mode] * raw["row_bytes"]
        out["modes"][mode] = {"rows": raw["rows"][mode], "bytes": nbytes, "median_s": median,
                              "min_s": float(seconds.min()), "max_s": float(seconds.max()), "Bps": nbytes / median}
    stream = out["modes"]["stream"]["Bps"]
    for mode in MODES:
        out["modes"][mode]["of_stream"] = out["modes"][mode]["Bps"] / stream
    return out


def markdown(results: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`  ", f"{platform.machine()}, {results[0]['threads']} threads; median "
             f"[min–max] of the passes, each after a write of {results[0]['evict_mb']} MB that evicts the "
             "caches.", "",
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
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mb", type=int, default=max(128, 2 * largest_cache_bytes() >> 20),
                        help="MB written before each pass to evict the regions (default: 2x the largest cache)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_scattered_rows"))
    args = parser.parse_args()
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if min(args.sizes) < 1 or min(args.head_dim, args.heads, args.repeats, args.evict_mb) < 1:
        parser.error("--sizes, --head-dim, --heads, --repeats and --evict-mb must be >= 1")
    command = "python benchmarks/bench_scattered_rows.py " + " ".join(
        [f"--sizes {' '.join(map(str, args.sizes))}", f"--density {args.density}", f"--head-dim {args.head_dim}",
         f"--heads {args.heads}", f"--repeats {args.repeats}", f"--evict-mb {args.evict_mb}",
         f"--out {args.out}"])
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        results = [measure(binary, n, args.head_dim, args.heads, args.density, args.repeats, args.evict_mb)
                   for n in args.sizes]
    table = markdown(results, command)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scattered_rows.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    (args.out / "bench_scattered_rows.md").write_text(table)
    print(f"wrote {args.out}/bench_scattered_rows.{{json,md}}")


if __name__ == "__main__":
    main()
