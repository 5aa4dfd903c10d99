"""GPU kernels (Pallas, Triton backend) for the hot steps of sparse decode attention.

One module per kernel, each holding the kernel, its wrapper and a ``*_reference``
in plain jnp that defines what it computes: ``simhash`` (MagicPIG codes),
``collide`` (MagicPIG candidate selection), ``vote`` (ParisKV coarse stage),
``rsq_rerank`` (ParisKV 4-bit rerank) and ``gather_attention`` (split-K attention
over gathered rows, with the log-sum-exp merge). ``dispatch`` picks the kernel on
a GPU backend and the XLA reference elsewhere. A leaf package: imports only JAX.

Mosaic GPU, Pallas's other GPU backend, has no row gather on Hopper; if Triton
support ends, the gathers here are the parts to port.
"""
