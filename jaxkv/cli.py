"""The `jaxkv` command: generate, convert, eval, bench.

User errors (a missing model, a bad flag value, a prompt that does not fit)
print one line `jaxkv: error: …` and exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import typing
from pathlib import Path

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, KeyError)


class UserError(Exception):
    """A problem with what the user asked for, reported as one line."""


def _parse_value(text: str, annotation):
    """Turn `text` into the type a config field declares (int, float, bool, tuple of ints)."""
    kinds = typing.get_args(annotation) or (annotation,)
    if type(None) in kinds and text.lower() == "none":
        return None
    for kind in kinds:
        kind = typing.get_origin(kind) or kind
        if kind is bool:
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
        elif kind is tuple:
            return tuple(int(x) for x in text.split(",") if x.strip())
        elif kind in (int, float, str):
            try:
                return kind(text)
            except ValueError:
                continue
    raise UserError(f"cannot read {text!r} as {annotation}")


def config_with_overrides(cls, items: list[str]):
    """Build config class `cls` from `key=value` strings (unknown keys are errors)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"--set expects key=value, got {item!r}")
        if name not in fields:
            raise UserError(f"{cls.__name__} has no field {name!r}; fields: {', '.join(fields)}")
        values[name] = _parse_value(text, hints[name])
    return cls(**values)


def _load_model(path: str | None, keep_quantized: bool = False):
    import models

    target = Path(path) if path else models.default_model_path()
    return models.load(target, keep_quantized=keep_quantized)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def _method_configs(args, method: str, overrides: list[str]):
    """(method config, cache config) of `method` from the flags; `overrides` the --set items it takes."""
    from jaxkv import cache as kvcache
    from jaxkv.attention.dense import DenseConfig

    if method == "dense":
        return (config_with_overrides(DenseConfig, overrides) if overrides else None), None
    return config_with_overrides(kvcache.method_config_class(method), overrides), kvcache.CacheConfig(
        sink=args.sink, local=args.local, buffer=args.buffer,
        dense_threshold=0 if args.no_dense_fallback else None, offload=not args.on_device)


def _compare_with_dense(args, config, params, tokenizer, ids: list[int]) -> int:
    """--compare: dense (its defaults) and args.compare (with --set and the region flags) decode
    from one prefill; print each answer, its decode rate and the fraction of keys it read. Each
    method is called twice with the same arguments: the first call compiles, the second is the
    one reported (a steady decode rate)."""
    import models
    from jaxkv.generate import generate, prefill_prompts

    if args.method != "dense":
        raise UserError(f"--compare runs dense beside {args.compare}: drop --method {args.method}")
    params = models.unstack_layers(params, config.num_layers)  # split once for every call below
    prefilled = prefill_prompts(params, config, [ids], capacity=len(ids) + args.max_new_tokens)
    for method, overrides in (("dense", []), (args.compare, args.set)):
        method_config, cache_config = _method_configs(args, method, overrides)
        call = functools.partial(
            generate, params, config, None, prefilled=prefilled, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, method=method,
            method_config=method_config, cache_config=cache_config, allow_beyond_context=args.allow_beyond_context,
            eos_ids=() if args.ignore_eos else None)
        first, result = call(), call()
        read = result.keys_read_fraction[0] if result.keys_read_fraction else 1.0
        label = ", ".join([method, *overrides])
        print(f"[{label}] {tokenizer.decode(result.tokens[0]).strip()}")
        print(f"[{label}] prompt {len(ids)} tokens, prefill {len(ids) / prefilled.seconds:.1f} tok/s "
              f"({prefilled.seconds:.2f} s, one prefill for both); generated {len(result.tokens[0])} tokens, "
              f"decode {result.decode_tokens_per_second:.1f} tok/s ({result.decode_seconds:.2f} s; the first "
              f"call, compiling, {first.decode_seconds:.2f} s); read {read:.1%} of the keys", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from jaxkv.generate import generate

    text = _read_prompt(args)
    config, params, tokenizer = _load_model(args.model, args.keep_quantized)
    prompt = tokenizer.apply_chat_template(text) if args.chat else text
    ids = tokenizer.encode(prompt)
    if args.compare:
        return _compare_with_dense(args, config, params, tokenizer, ids)
    method_config, cache_config = _method_configs(args, args.method, args.set)
    result = generate(
        params, config, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, method=args.method,
        method_config=method_config, cache_config=cache_config,
        allow_beyond_context=args.allow_beyond_context,
        eos_ids=() if args.ignore_eos else None)
    print(tokenizer.decode(result.tokens[0]))
    print(f"[{args.method}] prompt {len(ids)} tokens, prefill {result.prefill_tokens_per_second:.1f} tok/s "
          f"({result.prefill_seconds:.2f} s); generated {len(result.tokens[0])} tokens, decode "
          f"{result.decode_tokens_per_second:.1f} tok/s ({result.decode_seconds:.2f} s, compile included)",
          file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    import models

    config, params, tokenizer = models.load(Path(args.src))
    models.save(Path(args.dst), config, params, tokenizer)
    print(f"wrote {args.dst} ({config.model_type}, {config.num_layers} layers)")
    return 0


def _study(module: str, args) -> int:
    import importlib

    return importlib.import_module(f"jaxkv.eval.{module}").main(args)


def cmd_bench(args) -> int:
    """Run benchmarks/bench_attention.py (a script of the source tree, not an installed module)."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
    if not script.is_file():
        raise UserError(f"{script} not found: `jaxkv bench` runs from a source checkout")
    spec = importlib.util.spec_from_file_location("bench_attention", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file holding the prompt")
    gen.add_argument("--model", help="GGUF file, Hugging Face directory or jaxkv checkpoint "
                                     "(default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--keep-quantized", action="store_true",
                     help="keep a GGUF model's Q4_1 / Q8_0 weight matrices in their blocks (decode reads "
                          "~1/5.6 of the float32 bytes; same tokens up to float32 rounding)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--method", default="dense",
                     choices=["dense", "magicpig", "pariskv", "topk", "pqcache", "hybrid"])
    gen.add_argument("--compare", choices=["magicpig", "pariskv", "topk", "pqcache", "hybrid"], metavar="METHOD",
                     help="prefill once, then decode with dense (its defaults) and with METHOD (--set and the "
                          "region flags apply to it); print both answers, their decode rates (compile apart) "
                          "and the fraction of keys each read")
    gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a method parameter, e.g. --set top_k=2048 (repeatable)")
    gen.add_argument("--sink", type=int, help="sink tokens (default: the method's)")
    gen.add_argument("--local", type=int, help="local window tokens (default: the method's)")
    gen.add_argument("--buffer", type=int, help="update buffer tokens (default: the method's)")
    gen.add_argument("--no-dense-fallback", action="store_true",
                     help="use the sparse method even for short contexts")
    gen.add_argument("--on-device", action="store_true",
                     help="keep the retrieval region in device memory instead of pinned host memory")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    gen.add_argument("--allow-beyond-context", action="store_true",
                     help="allow positions past the model's max_position_embeddings")
    gen.set_defaults(run=cmd_generate)

    conv = sub.add_parser("convert", help="convert a GGUF file or HF directory to a jaxkv checkpoint")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.set_defaults(run=cmd_convert)

    # Every flag (--help included) goes to the script's own parser.
    bench = sub.add_parser("bench", add_help=False,
                           help="attention step time per method and context length "
                                "(benchmarks/bench_attention.py; --quick for a smoke run)")
    bench.set_defaults(run=cmd_bench, passthrough=True)

    ev = sub.add_parser("eval", help="studies on the embedded model (tables, JSON, plots)")
    studies = ev.add_subparsers(dest="study", required=True)
    err = studies.add_parser("attention-error", help="attention-output error vs keys read (oracles, MagicPIG)")
    err.add_argument("--tokens", type=int, default=8000, help="context length")
    err.add_argument("--queries", type=int, default=64, help="last positions whose attention is estimated")
    err.add_argument("--out", default="results/attention_error")
    err.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it")
    err.add_argument("--layers", help="comma-separated layers (default: all)")
    err.add_argument("--budgets", help="comma-separated oracle budgets, fractions of the context "
                                       "(default: 0.01,0.02,0.04,0.08,0.16)")
    err.add_argument("--magicpig", help="comma-separated MagicPIG settings KxL, e.g. 10x150 "
                                        "(default: 11x300,10x170,10x150,9x120,8x100,7x64)")
    err.set_defaults(run=lambda a: _study("attention_error", a))
    rul = studies.add_parser("ruler", help="RULER-style accuracy and keys read: dense vs sparse methods")
    rul.add_argument("--quick", action="store_true", help="CI mode: one example per task at 2048 tokens")
    rul.add_argument("--lengths", default="2048,4096,8192", help="comma-separated context lengths")
    rul.add_argument("--n", type=int, default=20, help="examples per task and length")
    rul.add_argument("--batch-size", type=int, default=4, help="examples of one length per generate call")
    rul.add_argument("--cap", type=int, default=48, help="answer tokens at most (below RULER's per-task budget)")
    rul.add_argument("--top-k", type=int, default=512, help="keys ParisKV and the TopK oracle retrieve")
    rul.add_argument("--methods", help="comma-separated method labels (default: all)")
    rul.add_argument("--tasks", help="comma-separated task names (default: all)")
    rul.add_argument("--resume", action="store_true",
                     help="keep the examples the output JSON already holds (a killed run's) and answer the rest")
    rul.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier result files instead of running")
    rul.add_argument("--out", default="results/ruler")
    rul.set_defaults(run=lambda a: _study("ruler_runner", a))
    hyb = studies.add_parser("hybrid", help="hybrid (ParisKV head + estimated tail) vs ParisKV, MagicPIG and the oracle")
    hyb.add_argument("--tokens", type=int, default=8000, help="context length")
    hyb.add_argument("--queries", type=int, default=64, help="last positions whose attention is estimated")
    hyb.add_argument("--sweep-layers", default="1,8,15,22,29",
                     help="comma-separated layers the settings sweep runs on (the final table uses every layer)")
    hyb.add_argument("--layers", default="all", help="layers of the final table: 'all' or a comma-separated list")
    hyb.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it")
    hyb.add_argument("--out", default="results/hybrid")
    hyb.set_defaults(run=lambda a: _study("hybrid_study", a))
    rec = studies.add_parser("recall", help="Recall@k of ParisKV (coarse, end to end), PQCache, MagicPIG; output error")
    rec.add_argument("--tokens", type=int, default=8000, help="context length")
    rec.add_argument("--queries", type=int, default=64, help="last positions whose queries are scored")
    rec.add_argument("--top-k", type=int, default=100, help="keys retrieved and the recall depth k")
    rec.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it "
                                             "(a longer capture, e.g. the drift study's, serves too)")
    rec.add_argument("--layers", help="comma-separated layers (default: all)")
    rec.add_argument("--out", default="results/recall")
    rec.set_defaults(run=lambda a: _study("recall", a))
    dri = studies.add_parser("drift", help="Recall@k vs decode step as new keys join the pool (no retraining)")
    dri.add_argument("--tokens", type=int, default=8192, help="text length (prefill + decode steps)")
    dri.add_argument("--prefill", type=int, default=4000, help="tokens the indexes are built on")
    dri.add_argument("--step", type=int, default=250, help="decode steps between checkpoints (= insertion block)")
    dri.add_argument("--queries-per-step", type=int, default=8, help="positions scored at each checkpoint")
    dri.add_argument("--top-k", type=int, default=100, help="keys retrieved and the recall depth k")
    dri.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it")
    dri.add_argument("--layers", help="comma-separated layers (default: all)")
    dri.add_argument("--out", default="results/drift")
    dri.set_defaults(run=lambda a: _study("drift", a))
    for p in (err, rul, hyb, rec, dri):
        p.add_argument("--model", help="model path (default: the embedded SmolLM2)")
        p.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args)
    except (UserError, *USER_ERRORS) as e:
        if os.environ.get("JAXKV_DEBUG"):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"jaxkv: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
