"""llama.cpp (through llama-cpp-python) driven as a benchmark row: prefill given token ids,
then greedy decode from them, as many times as asked, from the same prefilled KV cache.

llama-cpp-python is the optional ``bench`` extra and must be built for the host CPU
(``make install-llamacpp``); :func:`unavailable_reason` says why it cannot be used here.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from bench_decode import Decoded

INSTALL_HINT = ("install it built for this CPU: `make install-llamacpp` (pip builds llama.cpp from source with "
                "CMAKE_ARGS=\"-DGGML_NATIVE=ON\", about 10 minutes on 2 cores)")


def unavailable_reason() -> str | None:
    """Why llama.cpp cannot run here (None where llama-cpp-python is installed)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    return None


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


class LlamaCpp:
    """One llama.cpp context over a GGUF file, on the CPU.

    Args:
        gguf: the model file.
        n_ctx: positions the KV cache holds (prompt + new tokens); past the model's trained
            window llama.cpp warns and runs anyway.
        threads: threads for prefill and decode alike.
        flash_attn: llama.cpp's flash-attention kernels on or off (off is llama-cpp-python's
            default). The KV cache keeps llama.cpp's default type (f16).
    """

    def __init__(self, gguf: Path, *, n_ctx: int, threads: int, flash_attn: bool):
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   flash_attn=flash_attn, verbose=False)
        self.prompt_length = 0
        self.first_logits: np.ndarray | None = None

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's token ids of `text`, no BOS added, special tokens read as text."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def _last_logits(self) -> np.ndarray:
        pointer = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.llm.n_vocab(),)).copy()

    def prefill(self, ids: list[int]) -> float:
        """Evaluate `ids` from an empty cache, keep the last token's logits; return the seconds taken."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        self.first_logits = self._last_logits()
        seconds = time.perf_counter() - t0
        self.prompt_length = len(ids)
        return seconds

    def decode(self, new_tokens: int) -> Decoded:
        """Greedy-decode `new_tokens` tokens after the prefilled prompt (the first from the
        prefill's logits, as jaxkv's decode loop does; the other new_tokens - 1 steps timed)."""
        if self.first_logits is None:
            raise RuntimeError("LlamaCpp.decode: prefill a prompt first")
        # Back to the prompt: eval() drops the KV rows at positions >= n_tokens (a previous decode's).
        self.llm.n_tokens = self.prompt_length
        tokens = [int(np.argmax(self.first_logits))]
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(int(np.argmax(self._last_logits())))
        seconds = time.perf_counter() - t0
        return Decoded(tokens, (new_tokens - 1) / max(seconds, 1e-9))

    def close(self) -> None:
        """Free the context and its KV cache now."""
        self.llm.close()
