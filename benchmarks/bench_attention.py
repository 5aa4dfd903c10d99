"""Per-decode-step attention time of one layer: dense vs MagicPIG vs ParisKV.

The benchmark is :mod:`jaxkv.bench.attention` (also ``jaxkv bench``); this file runs it:

    python benchmarks/bench_attention.py [--quick] [--sizes N ...] [--methods ...] [--out DIR]
"""
import sys

from jaxkv.bench import attention

if __name__ == "__main__":
    sys.exit(attention.main())
