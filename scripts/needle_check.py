"""Issue [4/10] acceptance: sparse methods find the needle wherever dense does.

    python scripts/needle_check.py [--tokens 6000] [--depths 0.1 0.5 0.9] [--methods M ...]
                                   [--out results/ruler/needle_check.json]

Builds ~6,000-token needle-in-a-haystack prompts from the packaged Wikipedia
text (needle at 10%, 50% and 90% depth, chat template already applied), runs
the real command

    jaxkv generate --prompt-file F --method M --no-dense-fallback --max-new-tokens 24

for every method `jaxkv generate --help` offers among dense, magicpig, pariskv
and hybrid, scores each answer with ``ruler.score`` and prints a table. Exits 1
if a sparse method misses a needle that dense finds.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import models
from jaxkv.eval import ruler

DEPTHS = (0.1, 0.5, 0.9)
WANTED_METHODS = ("dense", "magicpig", "pariskv", "hybrid")
MAX_NEW_TOKENS = 24  # the needle is a 7-digit number: a short answer suffices


def available_methods() -> list[str]:
    """The wanted methods that `jaxkv generate --help` lists (hybrid may not exist yet)."""
    help_text = subprocess.run(["jaxkv", "generate", "--help"], capture_output=True, text=True,
                               check=True).stdout
    return [m for m in WANTED_METHODS if m in help_text]


def run_cli(prompt_file: Path, method: str) -> tuple[str, str, float]:
    """(answer, stderr summary line, seconds) of one real `jaxkv generate` call."""
    command = ["jaxkv", "generate", "--prompt-file", str(prompt_file), "--method", method,
               "--no-dense-fallback", "--max-new-tokens", str(MAX_NEW_TOKENS)]
    t0 = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    summary = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    return done.stdout.strip(), summary, time.time() - t0


def misses(results: list[dict]) -> list[dict]:
    """Sparse results that fail a needle the dense run of the same prompt found."""
    dense_found = {r["depth"] for r in results if r["method"] == "dense" and r["score"] == 1.0}
    return [r for r in results if r["method"] != "dense" and r["depth"] in dense_found and r["score"] < 1.0]


def table(results: list[dict], methods: list[str]) -> str:
    lines = ["| depth | needle | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for depth in sorted({r["depth"] for r in results}):
        row = {r["method"]: r for r in results if r["depth"] == depth}
        cells = [f"{row[m]['score']:.0f} `{' '.join(row[m]['answer'].split())[:40]}`" if m in row else "-"
                 for m in methods]
        needle = next(iter(row.values()))["needle"]
        lines.append(f"| {depth:.1f} | {needle} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    parser.add_argument("--methods", nargs="+", help="methods to run (default: every one of "
                        f"{', '.join(WANTED_METHODS)} that `jaxkv generate` offers); dense is always run")
    parser.add_argument("--out", default="results/ruler/needle_check.json")
    args = parser.parse_args()

    _, _, tokenizer = models.load(models.default_model_path())
    methods = available_methods()
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            parser.error(f"--methods: {', '.join(unknown)} not offered; choose from {', '.join(methods)}")
        methods = ["dense"] + [m for m in methods if m in args.methods and m != "dense"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in args.depths:
            example = ruler.needle_prompt(tokenizer, args.tokens, depth, args.seed)
            prompt_file = Path(tmp) / f"needle_{depth}.txt"
            prompt_file.write_text(example.prompt, encoding="utf-8")
            for method in methods:
                answer, summary, seconds = run_cli(prompt_file, method)
                result = {"depth": depth, "achieved_depth": example.meta["depth"], "method": method,
                          "needle": example.answers[0], "answer": answer,
                          "score": ruler.score(answer, example),
                          "prompt_tokens": example.meta["prompt_tokens"], "cli_summary": summary,
                          "seconds": round(seconds, 1)}
                print(json.dumps(result), flush=True)
                results.append(result)
    print(table(results, methods))
    failed = misses(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tokens": args.tokens, "seed": args.seed, "methods": methods,
                                          "results": results, "misses": failed}, indent=2))
    for r in failed:
        print(f"MISS: {r['method']} at depth {r['depth']} answered {r['answer']!r}, needle {r['needle']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
