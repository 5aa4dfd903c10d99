"""RULER-style synthetic long-context tasks: generators and string-match scoring.

In the spirit of RULER (Hsieh et al., 2024, NVIDIA/RULER): needle-in-a-haystack
(single, multi-key, multi-value, multi-query), variable tracking and
common-words extraction. The instruction, question and answer-prefix wording is
RULER's, so scores are comparable; the haystack is real Wikipedia text from
``jaxkv.eval.text`` and every key, value and word list is generated here from a
seed — nothing is downloaded.

An example of ``length`` L leaves room for the answer: its prompt (chat
template and answer prefix included) has at most ``L - max_new_tokens``
tokens, and at least 98% of that. SmolLM2's context is 8192 tokens, so
``length=8192`` fits prompt and answer exactly.

Depth of a needle = haystack tokens before it / all haystack tokens (needles
excluded). Needles go to the sentence boundary nearest the requested depth;
haystack sentences longer than ``MAX_SENTENCE_TOKENS`` are skipped, so a needle
lands within half of that many tokens of where it was asked to be.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import re
import string
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxkv.eval.text import shuffled_documents, split_sentences, wikipedia_summaries

LENGTHS = (2048, 4096, 8192)
METRICS = ("all", "part")
MAX_SENTENCE_TOKENS = 64
# RULER draws needle depths from 40 evenly spaced percentages.
DEPTH_GRID = tuple(float(d) for d in np.linspace(0.0, 1.0, 40))
# RULER's tokens_to_generate per task family.
MAX_NEW_TOKENS = types.MappingProxyType({"niah": 128, "variable_tracking": 30, "common_words": 120})
# RULER's common-words frequencies for contexts shorter than 4k tokens.
SHORT_COMMON_WORDS_BELOW = 4096
SHORT_COMMON_WORDS = types.MappingProxyType({"common_freq": 6, "uncommon_freq": 1})
# Consecutive sentences that may fail to fit the remaining budget before the
# haystack is declared full (the gap left is then only a few tokens).
_FILL_LOOKAHEAD = 64


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance.

    length:         token budget of prompt plus answer (prompt <= length - max_new_tokens).
    prompt:         chat template applied, ending with the answer prefix.
    answers:        the reference strings ``score`` looks for in a prediction.
    metric:         "all" (fraction of answers found) or "part" (any answer found).
    meta:           read-only details (keys, depths, token counts, ...); not hashed.
    max_new_tokens: how many tokens to generate (RULER's per-task value).
    """

    task: str
    length: int
    prompt: str
    answers: tuple[str, ...]
    metric: str
    meta: Mapping[str, Any] = dataclasses.field(hash=False)
    max_new_tokens: int

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"Example.metric must be one of {METRICS}, got {self.metric!r}")
        if not isinstance(self.answers, tuple) or not self.answers or not all(isinstance(a, str) and a for a in self.answers):
            raise ValueError(f"Example.answers must be a non-empty tuple of non-empty strings, got {self.answers!r}")


# --------------------------------------------------------------------- scoring


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's string_match_all: fraction of references contained in the prediction (case-insensitive)."""
    found = _contained(prediction, references)
    return sum(found) / len(found)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's string_match_part: 1.0 if any reference is contained in the prediction (case-insensitive)."""
    return float(max(_contained(prediction, references)))


def score(prediction: str, example: Example) -> float:
    """Score a model's answer to ``example`` in [0, 1] with the example's metric."""
    metric = string_match_all if example.metric == "all" else string_match_part
    return metric(prediction, example.answers)


def _contained(prediction: str, references: Sequence[str]) -> list[bool]:
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    if not references:
        raise ValueError("references must not be empty")
    lowered = prediction.lower()
    return [reference.lower() in lowered for reference in references]


# ------------------------------------------------------------------ public API


def make_example(task: str, tokenizer, length: int, seed: int, **opts) -> Example:
    """Generate one seeded, reproducible example of ``task`` for a context of ``length`` tokens.

    Options per task (RULER's defaults): niah_single ``depth`` (0..1, default
    drawn from ``DEPTH_GRID``); niah_multikey ``num_keys=4``; niah_multivalue
    ``num_values=4``; niah_multiquery ``num_queries=4``; variable_tracking
    ``num_chains=1, num_hops=4``; common_words ``num_common=10,
    common_freq=30, uncommon_freq=3``, and below 4,096 tokens ``common_freq=6,
    uncommon_freq=1`` (RULER's rule for short contexts: 300 numbered items
    alone would fill a 2k prompt).
    """
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    builder, allowed = _BUILDERS[task]
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"task {task!r} takes no option(s) {unknown}; its options are {sorted(allowed)}")
    if not isinstance(length, numbers.Integral) or length <= 0:
        raise ValueError(f"length must be a positive int, got {length!r}")
    if task == "common_words" and length < SHORT_COMMON_WORDS_BELOW:
        opts = {**SHORT_COMMON_WORDS, **opts}
    max_new_tokens = MAX_NEW_TOKENS["niah" if task.startswith("niah") else task]
    ctx = _Context(tokenizer, int(length) - max_new_tokens, np.random.default_rng(seed))
    prompt, answers, meta = builder(ctx, **opts)
    return Example(
        task=task,
        length=int(length),
        prompt=prompt,
        answers=tuple(answers),
        metric="all",  # RULER scores all of these tasks with string_match_all
        meta=types.MappingProxyType({**meta, "seed": seed, "prompt_tokens": ctx.count(prompt)}),
        max_new_tokens=max_new_tokens,
    )


def make_suite(tokenizer, lengths: Sequence[int] = LENGTHS, n_per_task: int = 1, seed: int = 0) -> list[Example]:
    """``n_per_task`` examples of every task at every length; niah_single depths evenly spread over 0..1."""
    if n_per_task < 1:
        raise ValueError(f"n_per_task must be >= 1, got {n_per_task!r}")
    examples = []
    for length in lengths:
        for task_index, task in enumerate(TASKS):
            for i in range(n_per_task):
                example_seed = int(np.random.SeedSequence([seed, length, task_index, i]).generate_state(1)[0])
                opts = {"depth": i / max(n_per_task - 1, 1)} if task == "niah_single" else {}
                examples.append(make_example(task, tokenizer, length, example_seed, **opts))
    return examples


def needle_prompt(tokenizer, n_tokens: int, depth: float, seed: int = 0) -> Example:
    """A single needle-in-a-haystack example: prompt plus a 128-token answer fit in ``n_tokens``."""
    return make_example("niah_single", tokenizer, n_tokens, seed, depth=depth)


# ------------------------------------------------------------- prompt assembly


@dataclasses.dataclass(frozen=True)
class _Frame:
    """The words around the context: RULER's instruction, question and answer prefix."""

    instruction: str
    question: str
    answer_prefix: str


@dataclasses.dataclass
class _Context:
    """What every builder needs: the tokenizer, the prompt token target and the seeded rng."""

    tokenizer: Any
    target: int
    rng: np.random.Generator

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, frame: _Frame, body: str) -> str:
        user_text = f"{frame.instruction}\n{body}\n{frame.question}"
        return self.tokenizer.apply_chat_template(user_text) + frame.answer_prefix


def _haystack_prompt(
    ctx: _Context, frame: _Frame, needles: Sequence[str], depths: Sequence[float], secrets: Sequence[str]
) -> tuple[str, dict]:
    """Wikipedia sentences with ``needles`` at ``depths``, filling the prompt up to ctx.target tokens.

    Haystack sentences containing any of ``secrets`` are skipped, so each secret
    appears only where a needle puts it.
    """
    overhead = ctx.count(ctx.render(frame, " ".join(needles)))
    sentences, counts = _fill_sentences(ctx, ctx.target - overhead, secrets)
    # Boundary effects of joining pieces can add a token or two: drop the shortest
    # sentence until it fits (the last one may be long enough to cost 2% of the target).
    while sentences:
        slots, achieved = _nearest_boundaries(counts, depths)
        prompt = ctx.render(frame, " ".join(_interleave(sentences, needles, slots)))
        if ctx.count(prompt) <= ctx.target:
            return prompt, {"needle_depths": achieved, "haystack_tokens": sum(counts), "needles": tuple(needles)}
        shortest = int(np.argmin(counts))
        del sentences[shortest], counts[shortest]
    raise ValueError(f"prompt target of {ctx.target} tokens leaves no room for a haystack ({overhead} tokens without one)")


def _fill_sentences(ctx: _Context, budget: int, secrets: Sequence[str]) -> tuple[list[str], list[int]]:
    """Wikipedia sentences in a seeded order whose token counts sum to at most ``budget``, as near as possible."""
    sentences, counts, used, misses = [], [], 0, 0
    for doc in shuffled_documents(int(ctx.rng.integers(2**32))):
        for sentence in split_sentences(doc):
            if any(secret in sentence for secret in secrets):
                continue
            n = ctx.count(" " + sentence)  # as it appears in the joined haystack
            if n > MAX_SENTENCE_TOKENS:
                continue
            if used + n > budget:  # near the end: look a little further for shorter sentences
                misses += 1
                if misses > _FILL_LOOKAHEAD:
                    return sentences, counts
                continue
            sentences.append(sentence)
            counts.append(n)
            used, misses = used + n, 0
            if used == budget:
                return sentences, counts
    return sentences, counts


def _nearest_boundaries(counts: Sequence[int], depths: Sequence[float]) -> tuple[np.ndarray, tuple[float, ...]]:
    """For each depth, the sentence boundary whose token fraction is nearest, and that fraction."""
    before = np.concatenate([[0], np.cumsum(counts)])
    total = max(int(before[-1]), 1)
    slots = np.abs(before[None, :] - np.asarray(depths, dtype=float)[:, None] * total).argmin(axis=1)
    return slots, tuple(float(before[s] / total) for s in slots)


def _interleave(sentences: Sequence[str], needles: Sequence[str], slots: Sequence[int]) -> list[str]:
    """Sentences with each needle placed before sentence ``slot`` (needles sharing a slot keep their order)."""
    pieces = []
    for boundary in range(len(sentences) + 1):
        pieces.extend(needle for needle, slot in zip(needles, slots) if slot == boundary)
        if boundary < len(sentences):
            pieces.append(sentences[boundary])
    return pieces


# ---------------------------------------------------------- seeded ingredients


@functools.cache
def _vocabulary() -> tuple[str, ...]:
    """Lower-case words of 5–10 letters used at least 5 times in the Wikipedia summaries, sorted."""
    counts = Counter(re.findall(r"\b[a-z]{5,10}\b", "\n".join(wikipedia_summaries())))
    return tuple(sorted(word for word, n in counts.items() if n >= 5))


def _distinct(n: int, draw: Callable[[], str]) -> list[str]:
    """n strings from ``draw`` (a seeded sampler), none containing another.

    Scoring is by substring, so an answer contained in another answer or
    distractor ("art" in "party") could be credited without being given.
    """
    chosen: list[str] = []
    for _ in range(100 * n + 1000):  # bounded: a too-small pool must fail, not hang
        if len(chosen) == n:
            break
        candidate = draw()
        if not any(candidate in other or other in candidate for other in chosen):
            chosen.append(candidate)
    if len(chosen) < n:
        raise ValueError(f"could not draw {n} distinct strings (got {len(chosen)}); ask for fewer or a shorter length")
    return chosen


def _words(rng: np.random.Generator, n: int) -> list[str]:
    vocabulary = _vocabulary()
    return _distinct(n, lambda: vocabulary[rng.integers(len(vocabulary))])


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    vocabulary = _vocabulary()

    def pair() -> str:
        return "-".join(vocabulary[i] for i in rng.integers(len(vocabulary), size=2))

    return _distinct(n, pair)


def _numbers(rng: np.random.Generator, n: int, digits: int) -> list[str]:
    low, high = 10 ** (digits - 1), 10**digits
    return _distinct(n, lambda: str(rng.integers(low, high)))


def _names(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list(string.ascii_uppercase))
    return _distinct(n, lambda: "".join(rng.choice(letters, size=5)))


def _list_phrase(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _check_depth(depth: float) -> float:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    return float(depth)


def _check_count(name: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"option {name} must be an int >= {minimum}, got {value!r}")
    return value


# -------------------------------------------------------------------- builders


def _niah(ctx: _Context, num_keys: int, num_values: int, num_queries: int, depths: Sequence[float] | None = None):
    """Needles "One of the special magic numbers for {key} is: {value}."; the first num_queries keys are asked."""
    keys = _keys(ctx.rng, num_keys)
    values = _numbers(ctx.rng, num_keys * num_values, digits=7)
    values_of = {key: values[i * num_values : (i + 1) * num_values] for i, key in enumerate(keys)}
    needles = [f"One of the special magic numbers for {key} is: {value}." for key in keys for value in values_of[key]]
    if depths is None:
        grid_too_small = len(needles) > len(DEPTH_GRID)
        depths = [DEPTH_GRID[i] for i in ctx.rng.choice(len(DEPTH_GRID), size=len(needles), replace=grid_too_small)]
    queried = keys[:num_queries]
    query = _list_phrase(queried)
    frame = _Frame(
        instruction="Some special magic numbers are hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the numbers afterwards.",
        question=f"What are all the special magic numbers for {query} mentioned in the provided text?",
        answer_prefix=f"The special magic numbers for {query} mentioned in the provided text are",
    )
    prompt, meta = _haystack_prompt(ctx, frame, needles, depths, keys + values)
    answers = [value for key in queried for value in values_of[key]]
    meta.update(keys=tuple(keys), query_keys=tuple(queried), depths=tuple(depths), answer_prefix=frame.answer_prefix)
    return prompt, answers, meta


def _niah_single(ctx: _Context, depth: float | None = None):
    depths = None if depth is None else [_check_depth(depth)]
    prompt, answers, meta = _niah(ctx, num_keys=1, num_values=1, num_queries=1, depths=depths)
    return prompt, answers, {**meta, "depth": meta["depths"][0]}


def _niah_multikey(ctx: _Context, num_keys: int = 4):
    return _niah(ctx, num_keys=_check_count("num_keys", num_keys, 1), num_values=1, num_queries=1)


def _niah_multivalue(ctx: _Context, num_values: int = 4):
    return _niah(ctx, num_keys=1, num_values=_check_count("num_values", num_values, 1), num_queries=1)


def _niah_multiquery(ctx: _Context, num_queries: int = 4):
    n = _check_count("num_queries", num_queries, 1)
    return _niah(ctx, num_keys=n, num_values=1, num_queries=n)


def _variable_tracking(ctx: _Context, num_chains: int = 1, num_hops: int = 4):
    """Chains "VAR B = VAR A." hidden in the haystack, in order; the first chain's variables are asked."""
    num_chains = _check_count("num_chains", num_chains, 1)
    num_hops = _check_count("num_hops", num_hops, 1)
    names = _names(ctx.rng, num_chains * (num_hops + 1))
    values = _numbers(ctx.rng, num_chains, digits=5)
    chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
    statements, depths = [], []
    for chain, value in zip(chains, values):
        statements += [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        depths += sorted(ctx.rng.uniform(size=len(chain)))
    order = np.argsort(depths, kind="stable")  # placement order keeps each chain's statements in sequence
    frame = _Frame(
        instruction="Memorize and track the chain(s) of variable assignment hidden in the following text.\n",
        question=f"Question: Find all variables that are assigned the value {values[0]} in the text above.",
        answer_prefix=f"Answer: According to the chain(s) of variable assignment in the text above, "
        f"{num_hops + 1} variables are assigned the value {values[0]}, they are: ",
    )
    prompt, meta = _haystack_prompt(
        ctx, frame, [statements[i] for i in order], [depths[i] for i in order], names + values
    )
    meta.update(chains=tuple(map(tuple, chains)), values=tuple(values), answer_prefix=frame.answer_prefix)
    return prompt, chains[0], meta


def _common_words(ctx: _Context, num_common: int = 10, common_freq: int = 30, uncommon_freq: int = 3):
    """A numbered word list; num_common words appear common_freq times, the rest uncommon_freq times."""
    num_common = _check_count("num_common", num_common, 1)
    uncommon_freq = _check_count("uncommon_freq", uncommon_freq, 1)
    common_freq = _check_count("common_freq", common_freq, uncommon_freq + 1)
    frame = _Frame(
        instruction="Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.",
        question=f"Question: What are the {num_common} most common words in the above list?",
        answer_prefix=f"Answer: The top {num_common} words that appear most often in the list are:",
    )
    # No list item is shorter than three tokens (number, ".", word), which bounds how many fit.
    most_uncommon = ctx.target // (3 * uncommon_freq)
    words = _words(ctx.rng, num_common + most_uncommon)
    common, uncommon = words[:num_common], words[num_common:]
    order_seed = int(ctx.rng.integers(2**32))

    def prompt_with(n_uncommon: int) -> str:
        items = common * common_freq + uncommon[:n_uncommon] * uncommon_freq
        shuffled = [items[i] for i in np.random.default_rng(order_seed).permutation(len(items))]
        return ctx.render(frame, " ".join(f"{i + 1}. {word}" for i, word in enumerate(shuffled)))

    if ctx.count(prompt_with(0)) > ctx.target:
        raise ValueError(
            f"{num_common} common words x {common_freq} do not fit a {ctx.target}-token prompt; "
            "lower common_freq or raise length"
        )
    # Item numbers 1..M and the words' tokens do not depend on the order, so the
    # length grows with n_uncommon: binary-search the largest count that fits.
    low, high = 0, most_uncommon
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ctx.count(prompt_with(mid)) <= ctx.target else (low, mid - 1)
    meta = {
        "common_freq": common_freq,
        "uncommon_freq": uncommon_freq,
        "uncommon_words": tuple(uncommon[:low]),
        "answer_prefix": frame.answer_prefix,
    }
    return prompt_with(low), common, meta


_BUILDERS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "niah_single": (_niah_single, ("depth",)),
    "niah_multikey": (_niah_multikey, ("num_keys",)),
    "niah_multivalue": (_niah_multivalue, ("num_values",)),
    "niah_multiquery": (_niah_multiquery, ("num_queries",)),
    "variable_tracking": (_variable_tracking, ("num_chains", "num_hops")),
    "common_words": (_common_words, ("num_common", "common_freq", "uncommon_freq")),
}
# The public task names, in suite order.
TASKS = tuple(_BUILDERS)
