"""jaxkv: long-context decoding that reads only part of the KV cache."""
from jaxkv.generate import Generation, Prefilled, generate, prefill_prompts

__all__ = ["generate", "prefill_prompts", "Generation", "Prefilled"]
