"""RULER-style accuracy of dense vs sparse decoding on the embedded model.

    jaxkv eval ruler [--quick] [--lengths 2048,4096,8192] [--n 20] [--tasks T,...] [--methods M,...]
                     [--out results/ruler]
    jaxkv eval ruler ... --resume      # keep what a killed run wrote, answer the rest
    jaxkv eval ruler --merge results/ruler/a.json results/ruler/b.json [--out DIR]

Every task of :mod:`jaxkv.eval.ruler` at every length is answered by dense
attention, MagicPIG (official K10L150 and a cheaper K10L75), ParisKV (official
retrieval settings) and the TopK oracle, all with the same exact regions (sink,
local, update buffer) and the dense fallback disabled, so the sparse methods
are exercised at 2k too. Examples of one length are batched (right-padded) and
prefilled once; every method then decodes from that shared prefill, since only
the index differs. Decoding is greedy; each example's answer is cut at
``min(cap, example.max_new_tokens)`` tokens (greedy tokens do not depend on
later ones, so one decode of the batch's longest budget serves all rows).

Reported per task, length and method: accuracy (RULER string match, %) and the
fraction of keys read (distinct keys per decode step and KV head / context,
dense layers counted as reading everything), plus index bytes per key next to
the K/V bytes per key. Writes JSON after every batch (a killed run keeps what
finished) and a markdown table.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxkv import cache as kvcache
from jaxkv.attention import hybrid, magicpig, pariskv, topk
from jaxkv.eval import ruler
from models import fields, files

DENSE = "dense"
QUICK_LENGTHS = (2048,)
QUICK_N_PER_TASK = 1
# Answers are short (7-digit numbers, five variable names, ten words); RULER's
# 128-token budget for niah mostly buys silence. 48 tokens hold the longest
# expected answer (ten numbered words) with room to spare.
DEFAULT_ANSWER_CAP = 48


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One column of the table: a generate() method and its configuration."""

    label: str
    method: str
    method_config: Any = None
    cache_config: kvcache.CacheConfig | None = None


def default_methods(top_k: int = 512, sink: int = 4, local: int = 64, buffer: int = 64) -> tuple[MethodSpec, ...]:
    """Dense, MagicPIG K10L150 and K10L75, ParisKV, the hybrid and the TopK oracle over the same exact regions.

    top_k=512 with sink 4, local 64, buffer 64 reads (4 + 64..128 + 512)/8192 ≈ 8% of
    an 8k context for ParisKV, the hybrid (its regression tail reads no K/V row) and
    TopK; MagicPIG reads what its hash tables give, plus its official dense layers
    0 and 16 (2 of SmolLM2's 30 layers).
    """
    regions = kvcache.CacheConfig(sink=sink, local=local, buffer=buffer, dense_threshold=0)
    return (
        MethodSpec(DENSE, DENSE),
        MethodSpec("magicpig_K10L150", "magicpig", magicpig.MagicPIGConfig(K=10, L=150, sink=sink, local=local),
                   regions),
        MethodSpec("magicpig_K10L75", "magicpig", magicpig.MagicPIGConfig(K=10, L=75, sink=sink, local=local),
                   regions),
        MethodSpec("pariskv", "pariskv", pariskv.ParisKVConfig(top_k=top_k, sink=sink, local=local, buffer=buffer),
                   regions),
        MethodSpec("hybrid", "hybrid", hybrid.HybridConfig(pariskv=pariskv.ParisKVConfig(top_k=top_k), sink=sink,
                                                           local=local, buffer=buffer),
                   regions),
        MethodSpec("topk", "topk", topk.TopKConfig(top_k=top_k, sink=sink, local=local, buffer=buffer), regions),
    )


def index_bytes_per_key(spec: MethodSpec, head_dim: int) -> int:
    """Index metadata per key and KV head (the TopK oracle keeps none: it scores the full keys)."""
    if spec.method == "magicpig":
        return magicpig.index_bytes_per_key(spec.method_config)
    if spec.method == "pariskv":
        return pariskv.index_bytes_per_key(spec.method_config, head_dim)
    if spec.method == "hybrid":
        return hybrid.index_bytes_per_key(spec.method_config, head_dim)
    return 0


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    keys_read_fraction: float | None  # None: no sparse decode step ran


@dataclasses.dataclass(frozen=True)
class Record:
    """One example answered by one method."""

    task: str
    length: int
    seed: int
    method: str
    score: float
    keys_read_fraction: float | None
    answer: str
    references: tuple[str, ...]
    prompt_tokens: int

    @property
    def example(self) -> tuple[str, int, int]:
        """(task, length, seed): which generated example this answers, as example_key names it."""
        return self.task, self.length, self.seed


def example_key(example: ruler.Example) -> tuple[str, int, int]:
    """(task, length, seed): an example's identity across runs (the suite regenerates it from these)."""
    return example.task, example.length, int(example.meta["seed"])


# (examples of one length, methods) -> per method label, one Answer per example.
Answerer = Callable[[Sequence[ruler.Example], Sequence[MethodSpec]], dict[str, list[Answer]]]


def answer_budget(example: ruler.Example, cap: int) -> int:
    return min(cap, example.max_new_tokens)


def model_answerer(params, config, tokenizer, *, cap: int = DEFAULT_ANSWER_CAP, generate_fn=None,
                   prefill_fn=None, log: Callable[[str], None] = lambda line: None) -> Answerer:
    """An Answerer running the model: one prefill per batch, one greedy decode per method.

    generate_fn / prefill_fn default to jaxkv.generate / jaxkv.prefill_prompts
    (injectable for tests); log receives one line per prefill and per method.
    """
    if generate_fn is None or prefill_fn is None:
        from jaxkv.generate import generate, prefill_prompts

        generate_fn = generate_fn or generate
        prefill_fn = prefill_fn or prefill_prompts

    def answer(examples, methods):
        ids = [tokenizer.encode(e.prompt) for e in examples]
        budgets = [answer_budget(e, cap) for e in examples]
        max_new = max(budgets)
        t0 = time.time()
        # An example's nominal length bounds its prompt + answer, so every batch of one
        # length gets one cache size and reuses the methods' compiled decode loops.
        capacity = max(max(map(len, ids)) + max_new, max(e.length for e in examples))
        prefilled = prefill_fn(params, config, ids, capacity=capacity)
        log(f"prefill {sum(map(len, ids))} tokens: {time.time() - t0:.0f} s")
        answers = {}
        for spec in methods:
            t0 = time.time()
            sparse = spec.method != DENSE
            result = generate_fn(params, config, None, max_new_tokens=max_new, method=spec.method,
                                 method_config=spec.method_config if sparse else None,
                                 cache_config=spec.cache_config if sparse else None, prefilled=prefilled)
            fractions = ([1.0] * len(examples) if not sparse
                         else result.keys_read_fraction or [None] * len(examples))
            answers[spec.label] = [Answer(tokenizer.decode(tokens[:budget]), fraction)
                                   for tokens, budget, fraction in zip(result.tokens, budgets, fractions)]
            log(f"{spec.label}: {time.time() - t0:.0f} s (compile included)")
        return answers

    return answer


def batches(examples: Sequence[ruler.Example], batch_size: int) -> list[list[ruler.Example]]:
    """Consecutive runs of at most batch_size examples sharing a length (order kept)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out: list[list[ruler.Example]] = []
    for example in examples:
        if out and out[-1][0].length == example.length and len(out[-1]) < batch_size:
            out[-1].append(example)
        else:
            out.append([example])
    return out


def score_batch(examples: Sequence[ruler.Example], answers: dict[str, list[Answer]],
                methods: Sequence[MethodSpec]) -> list[Record]:
    records = []
    for spec in methods:
        got = answers.get(spec.label)
        if got is None or len(got) != len(examples):
            raise ValueError(f"answerer returned {None if got is None else len(got)} answers for method "
                             f"{spec.label!r}; expected {len(examples)}")
        for example, answer in zip(examples, got):
            task, length, seed = example_key(example)
            records.append(Record(
                task=task, length=length, seed=seed, method=spec.label,
                score=ruler.score(answer.text, example), keys_read_fraction=answer.keys_read_fraction,
                answer=answer.text, references=example.answers, prompt_tokens=int(example.meta["prompt_tokens"])))
    return records


def evaluate(examples: Sequence[ruler.Example], methods: Sequence[MethodSpec], answerer: Answerer, *,
             batch_size: int, on_batch: Callable[[list[Record]], None] | None = None) -> list[Record]:
    """Answer and score every example with every method; on_batch sees the records so far after each batch."""
    labels = [spec.label for spec in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"method labels must be unique, got {labels}")
    records: list[Record] = []
    for batch in batches(examples, batch_size):
        records += score_batch(batch, answerer(batch, methods), methods)
        if on_batch is not None:
            on_batch(records)
    return records


# ------------------------------------------------------------------ summaries


@dataclasses.dataclass(frozen=True)
class Cell:
    """Aggregate of one (task, length, method): accuracy in %, examples, mean fraction of keys read."""

    task: str
    length: int
    method: str
    accuracy: float
    n: int
    keys_read_fraction: float | None


def _mean_or_none(values) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def summarize(records: Sequence[Record]) -> list[Cell]:
    """One Cell per (task, length, method), plus task "average" = mean of the task accuracies per length."""
    groups: dict[tuple[str, int, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.task, r.length, r.method), []).append(r)
    cells = [Cell(task, length, method, 100.0 * float(np.mean([r.score for r in rs])), len(rs),
                  _mean_or_none(r.keys_read_fraction for r in rs))
             for (task, length, method), rs in groups.items()]
    per_length: dict[tuple[int, str], list[Cell]] = {}
    for c in cells:
        per_length.setdefault((c.length, c.method), []).append(c)
    averages = [Cell("average", length, method, float(np.mean([c.accuracy for c in cs])), sum(c.n for c in cs),
                     _mean_or_none(c.keys_read_fraction for c in cs))
                for (length, method), cs in per_length.items()]
    return cells + averages


def relative_to_dense(cells: Sequence[Cell]) -> dict[str, dict[int, float | None]]:
    """Per method and length: its average accuracy / dense's (None where dense scored 0 or is absent)."""
    averages = {(c.method, c.length): c.accuracy for c in cells if c.task == "average"}
    out: dict[str, dict[int, float | None]] = {}
    for (method, length), accuracy in averages.items():
        dense = averages.get((DENSE, length))
        out.setdefault(method, {})[length] = accuracy / dense if dense else None
    return out


def markdown(cells: Sequence[Cell], methods: Sequence[str]) -> str:
    """Rows task × length; cells "accuracy % (keys read %)"; last rows: averages and the ratio to dense."""
    by_key = {(c.task, c.length, c.method): c for c in cells}
    tasks = [t for t in ruler.TASKS if any(c.task == t for c in cells)] + ["average"]
    lengths = sorted({c.length for c in cells})
    lines = ["| task | length | n | " + " | ".join(methods) + " |", "|---|---|---|" + "---|" * len(methods)]
    for task in tasks:
        for length in lengths:
            row = [by_key.get((task, length, m)) for m in methods]
            if not any(row):
                continue
            n = next(c.n for c in row if c)
            lines.append(f"| {'**average**' if task == 'average' else task} | {length} | {n} | "
                         + " | ".join(_cell_text(c) for c in row) + " |")
    ratios = relative_to_dense(cells)
    for length in lengths:
        lines.append(f"| avg / dense | {length} | | " + " | ".join(
            _ratio_text(ratios.get(m, {}).get(length)) for m in methods) + " |")
    return "\n".join(lines)


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    keys = "" if cell.keys_read_fraction is None else f" ({100 * cell.keys_read_fraction:.1f}%)"
    return f"{cell.accuracy:.1f}{keys}"


def _ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.0f}%"


# ------------------------------------------------------------------------ I/O


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **{f.name: _jsonable(getattr(value, f.name))
                                                 for f in dataclasses.fields(value)}}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def settings(methods: Sequence[MethodSpec], head_dim: int, kv_bytes_per_key: int, cap: int) -> dict:
    return {
        "answer_cap_tokens": cap,
        "kv_bytes_per_key_per_kv_head": kv_bytes_per_key,
        "methods": [{**_jsonable(spec), "index_bytes_per_key_per_kv_head": index_bytes_per_key(spec, head_dim)}
                    for spec in methods],
    }


def write_json(path: Path, records: Sequence[Record], meta: dict) -> None:
    """Write {meta, records, summary} atomically (a crash leaves the previous file intact)."""
    payload = {**meta, "records": [dataclasses.asdict(r) for r in records],
               "summary": [dataclasses.asdict(c) for c in summarize(records)]}
    files.write_text(path, json.dumps(payload, indent=1))


def load_records(path: Path) -> tuple[dict, list[Record]]:
    """(meta, records) of a JSON file written by write_json, every record's fields checked.

    Raises:
        ValueError: naming the file (and the record) when it is not such a file.
    """
    payload = files.read_json(path)
    if not isinstance(payload, dict) or not isinstance(payload.get("records"), list):
        raise ValueError(f"{path} has no 'records' list: not a ruler runner result")
    records = [_record(path, i, r) for i, r in enumerate(payload["records"])]
    meta = {k: v for k, v in payload.items() if k not in ("records", "summary")}
    return meta, records


def _record(path: Path, i: int, data) -> Record:
    names = [f.name for f in dataclasses.fields(Record)]
    if not isinstance(data, dict) or sorted(data) != sorted(names):
        raise ValueError(f"{path}: record {i} is not a ruler record (expected the keys {names})")
    try:
        record = Record(**data)
        fields.check(record, length=fields.at_least(1), score=fields.in_range(0, 1))
    except ValueError as err:
        raise ValueError(f"{path}: record {i}: {err}") from None
    return record


def merge_records(parts: Sequence[Sequence[Record]], names: Sequence[str]) -> list[Record]:
    """The records of every part, refusing an example a method answered in two parts (it would count twice)."""
    seen: dict[tuple, str] = {}
    for records, name in zip(parts, names):
        for r in records:
            key = (*r.example, r.method)
            if key in seen:
                raise ValueError(f"{name} and {seen[key]} both hold {r.method}'s answer to {r.task} "
                                 f"at {r.length} (seed {r.seed})")
            seen[key] = name
    return [r for records in parts for r in records]


def method_order(records: Sequence[Record]) -> list[str]:
    """Method labels in order of first appearance (dense first, as the runner writes them)."""
    return list(dict.fromkeys(r.method for r in records))


# ------------------------------------------------------------------------ CLI


def _comma_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated flag value."""
    return [x.strip() for x in text.split(",") if x.strip()]


def _parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in _comma_list(text))
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated ints, got {text!r}") from None
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"--lengths must be positive ints, got {text!r}")
    return lengths


def _select(methods: Sequence[MethodSpec], wanted: str | None) -> tuple[MethodSpec, ...]:
    if not wanted:
        return tuple(methods)
    labels = _comma_list(wanted)
    known = {m.label: m for m in methods}
    unknown = [x for x in labels if x not in known]
    if unknown:
        raise ValueError(f"--methods: unknown label(s) {unknown}; known: {', '.join(known)}")
    return tuple(known[x] for x in labels)


def _parse_tasks(text: str | None) -> tuple[str, ...]:
    if not text:
        return ruler.TASKS
    tasks = tuple(_comma_list(text))
    unknown = [x for x in tasks if x not in ruler.TASKS]
    if unknown or not tasks:
        raise ValueError(f"--tasks: unknown task(s) {unknown or text!r}; known: {', '.join(ruler.TASKS)}")
    return tasks


def _command_line(args) -> str:
    if args.merge:
        return f"jaxkv eval ruler --merge {' '.join(args.merge)} --out {args.out}"
    size = "--quick" if args.quick else f"--lengths {args.lengths} --n {args.n}"
    parts = [f"jaxkv eval ruler {size} --batch-size {args.batch_size}",
             f"--cap {args.cap} --top-k {args.top_k} --seed {args.seed}"]
    if args.methods:
        parts.append(f"--methods {args.methods}")
    if args.tasks:
        parts.append(f"--tasks {args.tasks}")
    if args.resume:
        parts.append("--resume")
    return " ".join(parts)


def output_stem(quick: bool, lengths: Sequence[int], tasks: str | None, methods: str | None) -> str:
    """The result files' name: a run of a subset of tasks or methods names them, so parts of one length don't collide."""
    if quick:
        return "quick"
    parts = ["ruler", *map(str, lengths)]
    for subset in (tasks, methods):
        if subset:
            parts.append("-".join(_comma_list(subset)))
    return "_".join(parts)


def _write_outputs(out: Path, stem: str, records: Sequence[Record], meta: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", records, meta)
    table = markdown(summarize(records), method_order(records))
    files.write_text(out / f"{stem}.md", f"Command: `{meta['command']}`\n\n{table}\n")
    return table


def resume(path: Path, meta: dict, methods: Sequence[MethodSpec],
           examples: Sequence[ruler.Example]) -> tuple[list[Record], list[ruler.Example]]:
    """(records kept from a killed run's JSON, examples still to answer).

    Kept: every record of an example all of ``methods`` answered. The file must
    have been written with the same methods and answer cap; ``meta`` notes the
    seconds it had taken.
    """
    old_meta, old_records = load_records(path)
    same = {k: json.loads(json.dumps(meta[k])) for k in ("methods", "answer_cap_tokens")}
    if any(old_meta.get(k) != v for k, v in same.items()):
        raise ValueError(f"--resume: {path} was written with other methods or answer cap; "
                         "resume with the same flags or choose another --out")
    labels = {spec.label for spec in methods}
    answered: dict[tuple[str, int, int], set[str]] = {}
    for r in old_records:
        answered.setdefault(r.example, set()).add(r.method)
    done = {key for key, got in answered.items() if labels <= got}
    meta["resumed_after_seconds"] = old_meta.get("seconds")
    return ([r for r in old_records if r.example in done],
            [e for e in examples if example_key(e) not in done])


def check_args(args) -> None:
    """The flags checked before any model is loaded (ValueError naming the flag)."""
    if args.merge:
        missing = [p for p in args.merge if not Path(p).is_file()]
        if missing:
            raise ValueError(f"--merge: no file {missing[0]}")
        return
    if not args.quick:
        _parse_lengths(args.lengths)
    _parse_tasks(args.tasks)
    _select(default_methods(top_k=args.top_k), args.methods)


def main(args) -> int:
    out = Path(args.out)
    if args.merge:
        metas, parts = zip(*(load_records(Path(p)) for p in args.merge))
        meta = {"command": _command_line(args), "merged_from": list(args.merge), "parts": list(metas)}
        print(_write_outputs(out, "merged", merge_records(parts, args.merge), meta))
        return 0

    import models

    lengths = QUICK_LENGTHS if args.quick else _parse_lengths(args.lengths)
    tasks = _parse_tasks(args.tasks)
    n_per_task = QUICK_N_PER_TASK if args.quick else args.n
    t0 = time.time()
    config, params, tokenizer = models.load(Path(args.model) if args.model else models.default_model_path())
    methods = _select(default_methods(top_k=args.top_k), args.methods)
    # Filtered after generation, so an example is the same with or without --tasks.
    examples = [e for e in ruler.make_suite(tokenizer, lengths=lengths, n_per_task=n_per_task, seed=args.seed)
                if e.task in tasks]
    kv_bytes = 2 * config.head_dim * np.dtype(np.float32).itemsize  # params load as float32
    stem = output_stem(args.quick, lengths, args.tasks, args.methods)
    meta = {"command": _command_line(args), "model": str(args.model or "SmolLM2-135M-Instruct (embedded GGUF)"),
            "lengths": list(lengths), "n_per_task": n_per_task,
            **settings(methods, config.head_dim, kv_bytes, args.cap)}
    kept: list[Record] = []
    if args.resume and (out / f"{stem}.json").exists():
        kept, examples = resume(out / f"{stem}.json", meta, methods, examples)
    print(f"{len(examples)} examples x {len(methods)} methods ({len(kept) // len(methods)} kept from a previous run); "
          f"model and suite ready in {time.time() - t0:.0f} s", flush=True)

    def progress(records):
        meta["seconds"] = round(time.time() - t0, 1)
        _write_outputs(out, stem, kept + records, meta)
        print(f"[{meta['seconds']:.0f} s] {len(records) // len(methods)}/{len(examples)} examples done", flush=True)

    answerer = model_answerer(params, config, tokenizer, cap=args.cap, log=lambda line: print(line, flush=True))
    records = kept + evaluate(examples, methods, answerer, batch_size=args.batch_size, on_batch=progress)
    print(_write_outputs(out, stem, records, meta))
    print(f"wrote {out}/{stem}.json and {stem}.md in {time.time() - t0:.0f} s")
    return 0

