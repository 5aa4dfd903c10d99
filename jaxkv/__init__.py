"""jaxkv: long-context decoding that reads only part of the KV cache."""
from jaxkv.generate import Generation, generate

__all__ = ["generate", "Generation"]
