"""The `jaxkv` command: generate, serve, convert, eval, bench.

User errors (a missing model, a bad flag value, a prompt that does not fit)
print one line `jaxkv: error: …` and exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import typing
from pathlib import Path

from jaxkv.plots import PlotsUnavailable

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, KeyError, PlotsUnavailable)


DTYPE_CHOICES = ("float32", "bfloat16")
DTYPE_HELP = ("weights, activations and KV cache in this dtype "
              "(default: the checkpoint's own; float32 for GGUF)")


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
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            try:
                return kind(text)
            except ValueError:
                raise UserError(f"{text!r} is not one of {', '.join(str(k.value) for k in kind)}") from None
        elif kind in (int, float, str):
            try:
                return kind(text)
            except ValueError:
                continue
    raise UserError(f"cannot read {text!r} as {annotation}")


def config_with_overrides(cls, items: list[str], base=None):
    """Build config class `cls` (or replace fields of `base`, an instance) from `key=value`
    strings; `field.key=value` sets a field of a nested config (unknown keys are errors)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values, nested = {}, {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"--set expects key=value, got {item!r}")
        name, dot, inner = name.partition(".")
        if name not in fields:
            raise UserError(f"{cls.__name__} has no field {name!r}; fields: {', '.join(fields)}")
        if dot:
            nested.setdefault(name, []).append(f"{inner}={text}")
        else:
            values[name] = _parse_value(text, hints[name])
    for name, inner_items in nested.items():
        inner_base = values.get(name, getattr(base if base is not None else cls(), name))
        if not dataclasses.is_dataclass(inner_base):
            raise UserError(f"{cls.__name__}.{name} is not a nested config: no '{name}.' keys")
        values[name] = config_with_overrides(type(inner_base), inner_items, inner_base)
    return cls(**values) if base is None else dataclasses.replace(base, **values)


def _load_model(path: str | None, keep_quantized: bool = False, dtype: str | None = None):
    import models

    target = Path(path) if path else models.default_model_path()
    return models.load(target, dtype, keep_quantized=keep_quantized)


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


def _method_settings(args):
    """(method config, cache config) from --method, --set and the region flags."""
    from jaxkv import cache as kvcache
    from jaxkv.attention import registry
    from jaxkv.attention.dense import DenseConfig

    if args.method == "dense":
        return (config_with_overrides(DenseConfig, args.set) if args.set else None), None
    return (config_with_overrides(registry.get(args.method).config_class, args.set),
            kvcache.CacheConfig(sink=args.sink, local=args.local, buffer=args.buffer,
                                dense_threshold=0 if args.no_dense_fallback else None, offload=not args.on_device))


def cmd_generate(args) -> int:
    from jaxkv.generate import generate

    text = _read_prompt(args)
    config, params, tokenizer = _load_model(args.model, args.keep_quantized, args.dtype)
    prompt = tokenizer.apply_chat_template(text) if args.chat else text
    ids = tokenizer.encode(prompt)
    method_config, cache_config = _method_settings(args)
    result = generate(
        params, config, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, method=args.method,
        method_config=method_config, cache_config=cache_config,
        allow_beyond_context=args.allow_beyond_context,
        eos_ids=() if args.ignore_eos else None)
    print(tokenizer.decode(result.tokens[0]))
    print(f"[{args.method}] prompt {len(ids)} tokens, generated {len(result.tokens[0])}; "
          f"compile {result.compile_seconds:.2f} s; prefill {result.prefill_tokens_per_second:.1f} tok/s "
          f"({result.prefill_seconds:.2f} s); decode {result.decode_tokens_per_second:.1f} tok/s "
          f"({result.decode_seconds:.2f} s)", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from jaxkv import serve

    method_config, cache_config = _method_settings(args)
    config, params, tokenizer = _load_model(args.model, args.keep_quantized)
    max_context = args.max_context or config.max_position_embeddings
    if not 1 < max_context <= config.max_position_embeddings and not args.allow_beyond_context:
        raise UserError(f"--max-context {max_context} must be in [2, max_position_embeddings = "
                        f"{config.max_position_embeddings}] (or pass --allow-beyond-context)")
    name = args.model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    engine = serve.Engine(params, config, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
                          chunk_steps=args.chunk_steps)
    limits = serve.ServeLimits(name, max_context, args.default_max_tokens,
                               serve.Method(args.method, method_config, cache_config))
    serve.run(engine, limits, host=args.host, port=args.port, shutdown_grace=args.shutdown_grace)
    return 0


def cmd_convert(args) -> int:
    import models

    config, params, tokenizer = models.load(Path(args.src), args.dtype)
    models.save(Path(args.dst), config, params, tokenizer)
    print(f"wrote {args.dst} ({config.model_type}, {config.num_layers} layers)")
    return 0


def _study(module: str, args) -> int:
    import importlib

    return importlib.import_module(f"jaxkv.eval.{module}").main(args)


def cmd_bench(args) -> int:
    """Run :mod:`jaxkv.bench.attention` with the flags after ``bench``."""
    from jaxkv.bench import attention

    return attention.main(args.bench_args)


def _add_compile_cache_flags(parser: argparse.ArgumentParser) -> None:
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR",
                       help="JAX's persistent compilation cache (default: $JAXKV_COMPILATION_CACHE, "
                            "else ~/.cache/jaxkv/jax; 'off' in the variable disables it)")
    cache.add_argument("--no-compile-cache", action="store_true", help="compile without the persistent cache")


def _enable_compile_cache(args) -> None:
    from jaxkv import compilation

    compilation.enable_persistent_cache(compilation.cache_dir_setting(args.compile_cache, args.no_compile_cache))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description=__doc__.splitlines()[0])
    parser.set_defaults(compile_cache=None, no_compile_cache=False)
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
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--method", default="dense",
                     choices=["dense", "magicpig", "pariskv", "topk", "pqcache", "hybrid"])
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
    _add_compile_cache_flags(gen)
    gen.set_defaults(run=cmd_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with batched decoding (docs/serving.md)")
    srv.add_argument("--model", help="model path (default: the embedded SmolLM2-135M-Instruct)")
    srv.add_argument("--model-name", help="the model id clients name (default: the file's stem)")
    srv.add_argument("--keep-quantized", action="store_true", help="keep a GGUF model's weights in their blocks")
    srv.add_argument("--method", default="dense", choices=["dense", "magicpig", "pariskv", "topk", "pqcache", "hybrid"],
                     help="attention of requests that do not choose one (the 'jaxkv' request field)")
    srv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a method parameter")
    srv.add_argument("--sink", type=int)
    srv.add_argument("--local", type=int)
    srv.add_argument("--buffer", type=int)
    srv.add_argument("--no-dense-fallback", action="store_true")
    srv.add_argument("--on-device", action="store_true")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch", type=int, default=8, help="most requests decoded together")
    srv.add_argument("--max-context", type=int, help="most prompt + max_tokens tokens (default: the model's window)")
    srv.add_argument("--max-queue", type=int, default=64, help="most waiting requests; more get HTTP 503")
    srv.add_argument("--chunk-steps", type=int, default=8, help="decode steps between two deliveries of text")
    srv.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request without one")
    srv.add_argument("--shutdown-grace", type=float, default=10.0,
                     help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    srv.add_argument("--allow-beyond-context", action="store_true",
                     help="allow --max-context past the model's max_position_embeddings")
    _add_compile_cache_flags(srv)
    srv.set_defaults(run=cmd_serve)

    conv = sub.add_parser("convert", help="convert a GGUF file or HF directory to a jaxkv checkpoint")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--dtype", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    conv.set_defaults(run=cmd_convert)

    # Every flag (--help included) goes to the script's own parser.
    bench = sub.add_parser("bench", add_help=False,
                           help="attention step time per method and context length "
                                "(jaxkv.bench.attention; --quick for a smoke run)")
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
        _enable_compile_cache(args)
        return args.run(args)
    except (UserError, *USER_ERRORS) as e:
        if os.environ.get("JAXKV_DEBUG"):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"jaxkv: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
