"""Serving throughput and latency of `jaxkv serve`: dense vs sparse methods, by concurrency.

    python benchmarks/bench_serve.py                      # 2k and 8k prompts, concurrency 1/4/16
    python benchmarks/bench_serve.py --quick              # a smoke run: 512-token prompts, 1 and 2

Starts `jaxkv serve` (the embedded SmolLM2) on 127.0.0.1 and, for every method,
prompt length and concurrency c, sends c streaming completions at once (distinct
prompts cut from Python's own documentation, 64 greedy tokens each, the method
chosen per request by the server's ``jaxkv`` field). Before each measured wave a
warm-up wave of the same batch shape compiles the programs and is cancelled.
Reported per wave: generated tokens per second (all requests' completion tokens /
the wave's wall time, prefill included), decode tokens per second (the tokens after
each request's first / the time from the last first token to the last token: the
batch's decode steps), p50/p95 request latency, p50 time to first token. Writes
JSON after every wave (with the load averages before and after), a markdown
table, and a plot of decode throughput against concurrency.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import pydoc_data.topics
import socket
import subprocess
import sys
import time

import models

METHODS = ("dense", "pariskv", "magicpig", "hybrid")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def prompts(tokenizer, length: int, count: int) -> list[str]:
    """`count` distinct texts of about `length` tokens, windows of Python's documentation."""
    ids = tokenizer.encode("\n\n".join(pydoc_data.topics.topics.values()))
    stride = max(1, (len(ids) - length) // max(count, 1))
    return [tokenizer.decode(ids[i * stride: i * stride + length]) for i in range(count)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "jaxkv.cli", "serve", "--port", str(port), "--max-batch", str(max(args.concurrency)),
               "--max-context", str(args.max_context), "--max-queue", str(4 * max(args.concurrency)),
               "--chunk-steps", str(args.chunk_steps), "--model-name", "bench"]
    log = open(pathlib.Path(args.out) / "server.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import urllib.request
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: see {log.name}")
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise TimeoutError("the server did not start")


def one_request(client, prompt: str, method: str, max_tokens: int, cancel_after: int | None = None) -> dict:
    """A streaming completion: its latency, time to first token and completion tokens
    (or nothing, when cancelled after `cancel_after` pieces of text)."""
    t0 = time.perf_counter()
    first = None
    stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"jaxkv": {"method": method}})
    usage, pieces = None, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0 if first is None else first
            pieces += 1
            if pieces == cancel_after:
                stream.close()
                return {}
        if chunk.usage is not None:
            usage = chunk.usage
    return {"start": t0, "latency": time.perf_counter() - t0, "ttft": first,
            "completion_tokens": usage.completion_tokens, "prompt_tokens": usage.prompt_tokens}


def wave(client, texts: list[str], method: str, max_tokens: int, **kwargs) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(lambda text: one_request(client, text, method, max_tokens, **kwargs), texts))
    return results, time.perf_counter() - t0


def percentile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def measure(client, tokenizer, method: str, length: int, concurrency: int, args) -> dict:
    # Warm-up: prompts of at least one full prefill chunk whose prompt + max_tokens fall in the
    # measured requests' cache bucket compile the same programs; cancelled after their second
    # piece of text (the first comes with the prefill, the second from a decode chunk).
    warm_length = min(600, length)
    wave(client, prompts(tokenizer, warm_length, concurrency), method, length + args.max_tokens - warm_length,
         cancel_after=2)
    results, seconds = wave(client, prompts(tokenizer, length, concurrency), method, args.max_tokens)
    generated = sum(r["completion_tokens"] for r in results)
    latencies = [r["latency"] for r in results]
    # Decoding proper: every row's first token comes with its batch's prefill; the rest from the steps.
    decoding = max(r["start"] + r["latency"] for r in results) - max(r["start"] + r["ttft"] for r in results)
    return {"method": method, "prompt_tokens": length, "concurrency": concurrency, "wall_s": round(seconds, 3),
            "generated_tokens": generated, "throughput_tok_s": round(generated / seconds, 3),
            "decode_tok_s": round((generated - len(results)) / max(decoding, 1e-9), 3),
            "latency_p50_s": round(percentile(latencies, 50), 3), "latency_p95_s": round(percentile(latencies, 95), 3),
            "ttft_p50_s": round(percentile([r["ttft"] for r in results if r["ttft"] is not None], 50), 3),
            "prompt_tokens_seen": sorted({r["prompt_tokens"] for r in results})}


def table(rows: list[dict]) -> str:
    lines = ["| method | prompt tokens | concurrency | generated tok/s | decode tok/s | p50 latency s | "
             "p95 latency s | p50 TTFT s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r['concurrency']} | failed: {r['error'][:60]} "
                         "| | | | |")
            continue
        lines.append(f"| {r['method']} | {r['prompt_tokens']} | {r['concurrency']} | {r['throughput_tok_s']:.2f} | "
                     f"{r['decode_tok_s']:.1f} | {r['latency_p50_s']:.1f} | {r['latency_p95_s']:.1f} | "
                     f"{r['ttft_p50_s']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = [(r["concurrency"], r["decode_tok_s"]) for r in rows
                      if r["method"] == method and r["prompt_tokens"] == length and "error" not in r]
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
        ax.set(title=f"{length}-token prompts", xlabel="concurrent requests", ylabel="decode tokens / s",
               xscale="log", xticks=sorted({r["concurrency"] for r in rows}))
        ax.set_xticklabels(sorted({r["concurrency"] for r in rows}))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def command_line(argv: list[str]) -> str:
    """The command that reproduces a run: its flags without --out (where files go changes no number)."""
    words = []
    for i, word in enumerate(argv):
        if not (word == "--out" or word.startswith("--out=") or (i and argv[i - 1] == "--out")):
            words.append(word)
    return " ".join(["python benchmarks/bench_serve.py", *words])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512-token prompts, concurrency 1 and 2, 16 tokens")
    parser.add_argument("--lengths", default="2048,8000", help="prompt tokens, comma-separated")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--chunk-steps", type=int, default=8)
    parser.add_argument("--out", default="results/bench_serve")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.concurrency, args.max_tokens, args.max_context = "512", "1,2", 16, 2048
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    methods = args.methods.split(",")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import openai

    tokenizer = models.load(models.default_model_path())[2]
    report = {"command": command_line(argv if argv is not None else sys.argv[1:]),
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32 weights)", "max_tokens": args.max_tokens,
              "cpus": os.cpu_count(), "load_average_before": load_average(), "rows": []}
    proc, url = start_server(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        for length in args.lengths:
            for method in methods:
                for concurrency in args.concurrency:
                    try:
                        row = measure(client, tokenizer, method, length, concurrency, args)
                    except openai.APIError as err:  # e.g. out of memory: recorded, the run goes on
                        row = {"method": method, "prompt_tokens": length, "concurrency": concurrency,
                               "error": f"{type(err).__name__}: {err}"}
                    row["load_average_after"] = load_average()
                    report["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    (out / "bench_serve.json").write_text(json.dumps(report, indent=1))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    report["load_average_after"] = load_average()
    (out / "bench_serve.json").write_text(json.dumps(report, indent=1))
    (out / "bench_serve.md").write_text(table(report["rows"]) + "\n")
    plot(report["rows"], out / "bench_serve.png")
    print(table(report["rows"]))
    print(f"load average before {report['load_average_before']}, after {report['load_average_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
