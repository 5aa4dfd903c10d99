"""Are a RULER run's dense answers the model's? Re-answer them with transformers.

    python scripts/ruler_transformers_check.py RESULT_JSON [--per-task 2] [--seed 0]
                                               [--out DIR/transformers_check/RESULT.json]

RESULT_JSON is a file `jaxkv eval ruler` wrote. For the first ``--per-task``
dense records of every task and length in it, the script regenerates the same
example (``ruler.make_suite`` with the run's lengths, examples per task and
``--seed``; each example is matched by its own seed), lets transformers answer
the same token ids greedily from the same GGUF in float32 with the same answer
budget, and compares the text with the dense answer the run recorded. Exits 1
if any answer differs: then a low dense score would be ours, not the model's.
Needs transformers and torch (the test extras).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import models
from jaxkv.eval import ruler
from jaxkv.eval.ruler_runner import DENSE, answer_budget, example_key, load_records


def dense_records(records, per_task: int):
    """The first per_task dense records of every (task, length), in file order."""
    taken: dict[tuple[str, int], int] = {}
    for r in records:
        if r.method == DENSE and taken.get((r.task, r.length), 0) < per_task:
            taken[(r.task, r.length)] = taken.get((r.task, r.length), 0) + 1
            yield r


def transformers_answer(hf_model, ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """transformers' greedy continuation of ids, cut before the first EOS (as generate() returns it)."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    new = out[0, len(ids):].tolist()
    return new[:next((i for i, t in enumerate(new) if t in eos_ids), len(new))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the run's --seed")
    parser.add_argument("--out", type=Path, help="default: RESULT_JSON's folder/transformers_check/RESULT_JSON's name "
                                                 "(a subfolder: `--merge` globs of run files would take it in)")
    args = parser.parse_args(argv)
    out = args.out or args.result.parent / "transformers_check" / args.result.name

    import torch
    from transformers import AutoModelForCausalLM

    meta, records = load_records(args.result)
    path = models.default_model_path()
    config, _, tokenizer = models.load_gguf(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    suite = {example_key(e): e for e in ruler.make_suite(
        tokenizer, lengths=meta["lengths"], n_per_task=meta["n_per_task"], seed=args.seed)}
    rows = []
    for record in dense_records(records, args.per_task):
        example = suite.get(record.example)
        if example is None:
            raise SystemExit(f"{record.example} is not in the suite of --seed {args.seed}: wrong seed?")
        ids = tokenizer.encode(example.prompt)
        t0 = time.time()
        tokens = transformers_answer(hf_model, ids, answer_budget(example, meta["answer_cap_tokens"]),
                                     config.eos_token_ids)
        theirs = tokenizer.decode(tokens)
        rows.append({"task": record.task, "length": record.length, "seed": record.seed,
                     "prompt_tokens": len(ids), "references": list(example.answers),
                     "jaxkv_dense": record.answer, "transformers": theirs, "same": theirs == record.answer,
                     "score_jaxkv": record.score, "score_transformers": ruler.score(theirs, example),
                     "transformers_seconds": round(time.time() - t0, 1)})
        print(f"{record.task} {record.length} seed {record.seed}: same={rows[-1]['same']} "
              f"score {record.score:.2f} / {rows[-1]['score_transformers']:.2f}  {theirs[:60]!r}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = f"python scripts/ruler_transformers_check.py {args.result} --per-task {args.per_task} --seed {args.seed}"
    out.write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    differing = sum(not r["same"] for r in rows)
    print(f"{len(rows) - differing}/{len(rows)} dense answers identical to transformers'; wrote {out}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
