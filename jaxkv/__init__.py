"""jaxkv: long-context decoding that reads only part of the KV cache."""
from jaxkv.generate import Decoding, Generation, Prefilled, capacity_for, generate, prefill_prompts, start_decoding

__all__ = ["generate", "prefill_prompts", "start_decoding", "capacity_for", "Decoding", "Generation", "Prefilled"]
