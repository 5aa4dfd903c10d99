"""Helpers for testing kernels on any machine: interpret mode off GPU, CUDA lowering on CPU."""
from __future__ import annotations

import re

import jax

# Kernels run compiled on a GPU backend and in Pallas interpret mode elsewhere.
INTERPRET = jax.default_backend() != "gpu"

# The GPU that kernels are lowered for without one: Pallas's Triton lowering reads
# the target's compute capability from the abstract mesh's device (JAX >= 0.12 has
# no other way without a GPU; older versions accept it too).
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def lower_for_cuda(fn, *args: jax.ShapeDtypeStruct) -> str:
    """StableHLO text of ``fn`` lowered for CUDA (an H100), with its Pallas kernels lowered to
    Triton IR: fails on block shapes or ops Triton cannot compile, without a GPU."""
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels(hlo_text: str) -> list[str]:
    """Names of the Triton kernels (Pallas calls) in a lowered module, one per call."""
    calls = hlo_text.split("@__gpu$xla.gpu.triton(")[1:]
    return [re.search(r'name = "([^"]+)"', call).group(1) for call in calls]
