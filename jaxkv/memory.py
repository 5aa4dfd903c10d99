"""Whether a generate() request's caches fit in memory, checked before anything is allocated.

The need counted is a lower bound: the KV arrays alone (indexes, weights and
activations come on top), at the request's peak, when the prefill's staging cache
and the per-layer decode caches built from it are alive together. A request is
refused when even that exceeds the memory available, with both sizes in the message.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from jaxkv import cache as kvcache


class RequestTooLargeError(ValueError):
    """A request whose caches cannot fit in the memory available."""


@dataclasses.dataclass(frozen=True)
class Need:
    """Bytes a request allocates at its peak: on the accelerator and in host memory."""

    device: int
    host: int
    why: str  # how the bytes were counted, for the error message


def request_need(backend: kvcache.Backend, config, *, batch: int, dtype, max_new_tokens: int,
                 prefilled: bool = False) -> Need:
    """The KV bytes of a request sized by ``backend`` (kvcache.make_backend) for ``batch`` prompts.

    Args:
        backend: the request's cache sizes (staging and retrieval capacities, dense layers, offload).
        config: the model's ModelConfig (layers, KV heads, head dim).
        batch: number of prompts.
        dtype: the cache dtype (the activations').
        max_new_tokens: tokens to generate (the output buffer).
        prefilled: the staging cache exists already (a caller's prefill_prompts()).
    """
    row = 2 * batch * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize  # K and V of one position
    staging = 0 if prefilled else row * backend.staging_capacity * config.num_layers
    dense_layers = len(backend.dense_layers)
    sparse_layers = config.num_layers - dense_layers
    exact = retrieval = 0
    if sparse_layers:
        ccfg = backend.cache
        exact = row * (ccfg.sink + ccfg.local + ccfg.buffer) * sparse_layers
        retrieval = row * backend.retrieval_capacity * sparse_layers
    offload = bool(backend.cache and backend.cache.offload and sparse_layers)
    device = staging + row * backend.staging_capacity * dense_layers + exact + 4 * batch * max_new_tokens
    why = (f"{batch} prompt(s) x {backend.staging_capacity} positions (prompt + max_new_tokens, rounded up to "
           f"a compiled capacity) x {config.num_layers} layers x "
           f"{config.num_kv_heads} KV heads x {config.head_dim} x K and V x {np.dtype(dtype).itemsize} bytes"
           + ("" if prefilled else ", the prefill's cache and the decode caches alive together"))
    return Need(device=device + (0 if offload else retrieval), host=retrieval if offload else 0, why=why)


def check_fits(need: Need, devices=None) -> None:
    """Raise RequestTooLargeError if ``need`` exceeds the free memory of ``devices`` (default: the first device).

    On the CPU backend, device and host memory are one pool (the host's available memory).
    """
    devices = list(devices) if devices is not None else jax.devices()[:1]
    host_free = host_available_bytes()
    device_free = device_available_bytes(devices)
    if device_free is None:
        total = need.device + need.host
        if total > host_free:
            raise RequestTooLargeError(f"the request's KV cache needs {format_bytes(total)} of memory "
                                       f"({need.why}); {format_bytes(host_free)} is available")
        return
    if need.device > device_free:
        raise RequestTooLargeError(f"the request's KV cache needs {format_bytes(need.device)} of device memory "
                                   f"({need.why}); {format_bytes(device_free)} is free on "
                                   f"{', '.join(str(d) for d in devices)}")
    if need.host > host_free:
        raise RequestTooLargeError(f"the request's offloaded KV cache needs {format_bytes(need.host)} of host "
                                   f"memory ({need.why}); {format_bytes(host_free)} is available")


def device_available_bytes(devices) -> int | None:
    """Free accelerator memory summed over ``devices``; None where the device's memory is host memory."""
    total = 0
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return None
        total += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return total


def host_available_bytes() -> int:
    """The host memory available to a new allocation (Linux MemAvailable; else free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(n: int) -> str:
    """n bytes in binary units: '512 B', '3.2 GiB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    exponent = 0
    while exponent < len(units) - 1 and n >= 1024 ** (exponent + 1):
        exponent += 1
    return f"{n} B" if exponent == 0 else f"{n / 1024 ** exponent:.1f} {units[exponent]}"
