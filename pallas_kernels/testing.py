"""Helpers for testing kernels on any machine: interpret mode off GPU, CUDA lowering on CPU."""
from __future__ import annotations

import re

import jax

# Kernels run compiled on a GPU backend and in Pallas interpret mode elsewhere.
INTERPRET = jax.default_backend() != "gpu"


def lower_for_cuda(fn, *args: jax.ShapeDtypeStruct) -> str:
    """StableHLO text of ``fn`` lowered for CUDA, with its Pallas kernels lowered to
    Triton IR: fails on block shapes or ops Triton cannot compile, without a GPU."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels(hlo_text: str) -> list[str]:
    """Names of the Triton kernels (Pallas calls) in a lowered module, one per call."""
    calls = hlo_text.split("@__gpu$xla.gpu.triton(")[1:]
    return [re.search(r'name = "([^"]+)"', call).group(1) for call in calls]
