"""The decode variants the GPU checks compile and time: a method and where its KV lives.

``dense`` with offload off is generate()'s dense cache on the device. ``dense``
with offload on is the four-region cache with the dense fallback forced: every
step moves the whole retrieval region from pinned host memory to the device and
attends it exactly, the baseline a sparse method that reads host KV must beat.
"""
from __future__ import annotations

from jaxkv import cache as kvcache
from jaxkv.attention import registry

METHODS = ("dense", "pariskv", "magicpig", "hybrid", "topk", "pqcache")
# The region cache that carries the host-KV dense baseline: TopK's index is the
# cheapest to build, and its sparse branch never runs under a forced fallback.
_HOST_DENSE_CARRIER = "topk"
_ALWAYS_DENSE = 2**31 - 1
# The methods whose config has a ``kernels`` setting (Pallas kernels or XLA).
_KERNEL_METHODS = ("pariskv", "magicpig")


def decode_setup(method: str, offload: bool, kernels: str = "pallas", host_index: bool = False):
    """(generate()'s method, method_config, cache_config) for one variant.

    Args:
        method: one of METHODS.
        offload: retrieval K/V (and the index's bulk) in pinned host memory.
        kernels: the ``kernels`` setting of a method config that has one
            ("pallas" is what "auto" picks on a GPU).
        host_index: with offload, MagicPIG's index in host memory (``CacheConfig.host_index``).
    Returns:
        (method name, method config or None, CacheConfig or None), as generate() takes them.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if method == "dense":
        if not offload:
            return "dense", None, None
        return _HOST_DENSE_CARRIER, None, kvcache.CacheConfig(dense_threshold=_ALWAYS_DENSE, offload=True)
    config_class = registry.get(method).config_class
    mcfg = config_class(kernels=kernels) if method in _KERNEL_METHODS else config_class()
    return method, mcfg, kvcache.CacheConfig(offload=offload, host_index=host_index)


def label(method: str, offload: bool) -> str:
    """How tables name a variant: the method and where its retrieval KV lives."""
    return f"{method} ({'host KV' if offload else 'KV on device'})"
