"""GPU kernels (Pallas, Triton backend) for the hot steps of sparse decode attention.

One module per kernel, each holding the kernel, its wrapper and a ``*_reference``
in plain jnp that defines what it computes: ``simhash`` (MagicPIG codes),
``collide`` (MagicPIG candidate selection), ``vote`` (ParisKV coarse stage),
``rsq_rerank`` (ParisKV 4-bit rerank) and ``gather_attention`` (split-K attention
over gathered rows, with the log-sum-exp merge). ``dispatch`` picks the kernel on
a GPU backend and the XLA reference elsewhere. A leaf package: imports only JAX.

Backend: Triton, for every kernel. collide, vote, rsq_rerank and gather_attention
load rows (or table entries) by a vector of indices, which Mosaic GPU does not lower
("int_indexer_shape non-empty" on JAX 0.10.2 and 0.12.1), and Triton compiles for an
H100 (tests/test_gpu_compile.py). simhash gathers nothing and could move, but it runs
at prefill and flush only, where XLA's path is as fast on an H200; if the deprecated
Triton backend goes, it keeps its XLA path. docs/results/gpu.md has the evidence.
"""
