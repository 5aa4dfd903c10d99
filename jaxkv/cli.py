"""The `jaxkv` command: generate, serve, convert, eval, bench.

Every failure prints one line `jaxkv: error: …` on stderr, without a traceback
(`--debug` or JAXKV_DEBUG=1 shows it): exit status 2 for a usage error (a flag or
its value, a path that does not exist; checked before any model is loaded), 1 for
a runtime error (an invalid or damaged file, a request that cannot fit). Ctrl-C
prints `jaxkv: interrupted` and exits 130; SIGTERM `jaxkv: terminated`, 143.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import os
import signal
import sys
import threading
import types
import typing
import warnings
from pathlib import Path

from jaxkv.plots import PlotsUnavailable
from models import fields

EXIT_RUNTIME, EXIT_USAGE = 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM
# Flags that size the four-region cache: a sparse method's, meaningless with --method dense.
REGION_FLAGS = ("sink", "local", "buffer", "no_dense_fallback", "on_device")
DTYPE_CHOICES = ("float32", "bfloat16")
DTYPE_HELP = ("weights, activations and KV cache in this dtype "
              "(default: the checkpoint's own; float32 for GGUF)")


class UsageError(Exception):
    """The command line cannot be carried out as given (exit status 2)."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that writers clean up (like KeyboardInterrupt)."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one `jaxkv: error:` line (no usage block); subparsers inherit it."""

    def error(self, message):
        command = self.prog.removeprefix("jaxkv").strip()  # "generate", "eval recall"; "" at the top
        self.exit(EXIT_USAGE, f"jaxkv: error: {command + ': ' if command else ''}{message} (see --help)\n")


def _flag_type(annotation, rule=None, *, check=None):
    """An argparse ``type`` that reads a flag's text as ``annotation`` within ``rule`` (models.fields)."""
    def parse(text: str):
        try:
            value = fields.check_value("value", _parse_value(text, annotation), annotation, rule)
        except (UsageError, fields.FieldTypeError):
            raise argparse.ArgumentTypeError(f"must be {fields.describe(annotation, rule)}, got {text!r}") from None
        except fields.FieldError as err:
            raise argparse.ArgumentTypeError(f"must be {err.expected}, got {text!r}") from None
        try:
            if check is not None:
                check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value
    return parse


def _check_temperature(value: float) -> None:
    from jaxkv.sampling import SamplingConfig

    SamplingConfig(temperature=value)


POSITIVE_INT = _flag_type(int, fields.at_least(1))
NON_NEGATIVE_INT = _flag_type(int, fields.NON_NEGATIVE)
SEED = _flag_type(int, fields.SEED)
TEMPERATURE = _flag_type(float, fields.NON_NEGATIVE, check=_check_temperature)
FRACTION = _flag_type(float, fields.FRACTION)


def _parse_value(text: str, annotation):
    """``text`` read as the type a config field declares: int, float, bool, str, a tuple of ints, unions."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = typing.get_args(annotation) if union else (annotation,)
    if type(None) in kinds and text.strip().lower() == "none":
        return None
    for kind in kinds:
        value = _parse_one(text.strip(), kind)
        if value is not _UNREAD:
            return value
    raise UsageError(f"cannot read {text!r} as {fields.describe(annotation)}")


_UNREAD = object()


def _parse_one(text: str, kind):
    """``text`` as one (non-union) type, or _UNREAD."""
    if kind is bool:
        return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(
            text.lower(), _UNREAD)
    if kind is tuple or typing.get_origin(kind) is tuple:
        items = [x.strip() for x in text.strip("()[]").split(",") if x.strip()]
        try:
            return tuple(int(x) for x in items)
        except ValueError:
            return _UNREAD
    if kind in (int, float, str) or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        try:
            return kind(text)
        except ValueError:
            return _UNREAD
    return _UNREAD


def config_with_overrides(cls, items: list[str], base=None, prefix: str = ""):
    """Build config class `cls` (or replace fields of `base`, an instance) from `key=value`
    strings; `field.key=value` sets a field of a nested config (`prefix`: the keys' path to
    `cls`, for messages). Unknown keys and bad values are usage errors."""
    names = [f.name for f in dataclasses.fields(cls)]
    hints = fields.type_hints(cls)
    values, nested = {}, {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep:
            raise UsageError(f"--set expects key=value, got {item!r}")
        name, dot, inner = name.partition(".")
        if name not in names:
            raise UsageError(f"{cls.__name__} has no field {name!r}; fields: {', '.join(names)}")
        if dot:
            nested.setdefault(name, []).append(f"{inner}={text}")
            continue
        try:
            values[name] = _parse_value(text, hints[name])
        except UsageError as err:
            raise UsageError(f"--set {prefix}{name}: {err}") from None
    for name, inner_items in nested.items():
        inner_base = values.get(name, getattr(base if base is not None else cls(), name))
        if not dataclasses.is_dataclass(inner_base):
            raise UsageError(f"{cls.__name__}.{name} is not a nested config: no '{name}.' keys")
        values[name] = config_with_overrides(type(inner_base), inner_items, inner_base, f"{prefix}{name}.")
    try:
        return cls(**values) if base is None else dataclasses.replace(base, **values)
    except ValueError as err:  # the config's own check, naming Class.field
        raise UsageError(f"--set: {err}") from None


def _model_source(path: str | None, flag: str = "--model"):
    """The model that ``flag`` names, weights not read yet (None: the embedded SmolLM2).

    A path that names nothing is a usage error; a model that cannot be read, a runtime one.
    """
    import models

    if path is None:
        return models.open_model(models.default_model_path())
    _check_model_path(path, flag)
    return models.open_model(Path(path))


def _check_model_path(path: str, flag: str = "--model") -> None:
    if not path.strip():
        raise UsageError(f"{flag} is empty: give a model path" + (
            ", or leave --model out for the embedded SmolLM2" if flag == "--model" else ""))
    if not Path(path).exists():
        raise UsageError(f"no model at {path}")


def _read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"prompt file {args.prompt_file} is not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
        except OSError as e:
            raise UsageError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def _method_settings(args, method: str | None = None, overrides: list[str] | None = None):
    """(method config, cache config) of `method` (default: --method) from the flags, with the
    --set items `overrides` (default: --set); usage errors name the flag."""
    from jaxkv import cache as kvcache
    from jaxkv.attention import registry
    from jaxkv.attention.dense import DenseConfig

    method = args.method if method is None else method
    overrides = args.set if overrides is None else overrides
    if method == "dense":
        given = [f"--{name.replace('_', '-')}" for name in REGION_FLAGS if getattr(args, name) not in (None, False)]
        if given and not getattr(args, "compare", None):
            raise UsageError(f"{', '.join(given)}: the cache-region flags apply to the sparse methods, "
                             "not to --method dense")
        return (config_with_overrides(DenseConfig, overrides) if overrides else None), None
    method_config = config_with_overrides(registry.get(method).config_class, overrides)
    try:
        cache_config = kvcache.CacheConfig(
            sink=args.sink, local=args.local, buffer=args.buffer,
            dense_threshold=0 if args.no_dense_fallback else None, offload=not args.on_device)
    except fields.FieldError as err:
        raise UsageError(f"--{err.field.replace('_', '-')} must be {err.expected}, got {err.value!r}") from None
    return method_config, cache_config


def _check_sampling_flags(args) -> None:
    unused = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if args.temperature == 0 and unused:
        raise UsageError(f"{', '.join(unused)}: sampling filters need --temperature > 0 (0 is greedy decoding)")


def _check_context(args, prompt_tokens: int, config) -> None:
    """The prompt plus --max-new-tokens must fit the model's positions (unless --allow-beyond-context)."""
    total = prompt_tokens + args.max_new_tokens
    if total > config.max_position_embeddings and not args.allow_beyond_context:
        raise UsageError(
            f"the prompt ({prompt_tokens} tokens) + --max-new-tokens {args.max_new_tokens} = {total} positions "
            f"exceed the model's context of {config.max_position_embeddings} (max_position_embeddings); "
            "lower --max-new-tokens or pass --allow-beyond-context")


def _require_tokenizer(source):
    import models

    if source.tokenizer is None:
        raise models.ModelError(f"the model at {source.path} has no tokenizer (a Hugging Face directory without "
                           "tokenizer.json, or a checkpoint saved without one); a text prompt needs one")
    return source.tokenizer


def _compare_with_dense(args, config, params, tokenizer, ids: list[int]) -> int:
    """--compare: dense (its defaults) and args.compare (with --set and the region flags) decode
    from one prefill; print each answer, its decode rate (compile apart) and the fraction of
    keys it read."""
    import models
    from jaxkv.generate import capacity_for, generate, prefill_prompts

    params = models.unstack_layers(params, config.num_layers)  # split once for both calls
    prefilled = prefill_prompts(params, config, [ids], capacity=capacity_for(len(ids), args.max_new_tokens))
    for method, overrides in (("dense", []), (args.compare, args.set)):
        method_config, cache_config = _method_settings(args, method, overrides)
        result = generate(
            params, config, None, prefilled=prefilled, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, method=method,
            method_config=method_config, cache_config=cache_config, allow_beyond_context=args.allow_beyond_context,
            eos_ids=() if args.ignore_eos else None)
        read = result.keys_read_fraction[0] if result.keys_read_fraction else 1.0
        label = ", ".join([method, *overrides])
        print(f"[{label}] {tokenizer.decode(result.tokens[0]).strip()}")
        print(f"[{label}] prompt {len(ids)} tokens, prefill {len(ids) / prefilled.seconds:.1f} tok/s "
              f"({prefilled.seconds:.2f} s, one prefill for both); generated {len(result.tokens[0])} tokens; "
              f"compile {result.compile_seconds:.2f} s; decode {result.decode_tokens_per_second:.1f} tok/s "
              f"({result.decode_seconds:.2f} s); read {read:.1%} of the keys", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    import jax.numpy as jnp

    from jaxkv import cache as kvcache
    from jaxkv import memory
    from jaxkv.generate import generate

    _check_sampling_flags(args)
    if args.compare and args.method != "dense":
        raise UsageError(f"--compare runs dense beside {args.compare}: drop --method {args.method}")
    method = args.compare or args.method  # the sparse one of a comparison: the larger cache
    method_config, cache_config = _method_settings(args, method)
    text = _read_prompt(args)
    source = _model_source(args.model)
    if args.keep_quantized and source.kind != "gguf":
        raise UsageError(f"--keep-quantized applies to GGUF models; {source.path} is a {source.kind} model")
    tokenizer = _require_tokenizer(source)
    prompt = tokenizer.apply_chat_template(text) if args.chat else text
    ids = tokenizer.encode(prompt)
    _check_context(args, len(ids), source.config)
    # Before the weights load: a request whose caches cannot fit is refused at once.
    backend = kvcache.make_backend(source.config, method, method_config, cache_config,
                                   len(ids), args.max_new_tokens)
    memory.check_fits(memory.request_need(backend, source.config, batch=1, dtype=jnp.dtype(args.dtype or "float32"),
                                          max_new_tokens=args.max_new_tokens))
    config, params, tokenizer = source.load(args.dtype, keep_quantized=args.keep_quantized)
    if args.compare:
        return _compare_with_dense(args, config, params, tokenizer, ids)
    result = generate(
        params, config, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, method=args.method,
        method_config=method_config, cache_config=cache_config,
        allow_beyond_context=args.allow_beyond_context,
        eos_ids=() if args.ignore_eos else None)
    print(tokenizer.decode(result.tokens[0]))
    print(f"[{args.method}] prompt {len(ids)} tokens, generated {len(result.tokens[0])} tokens; "
          f"compile {result.compile_seconds:.2f} s; prefill {result.prefill_tokens_per_second:.1f} tok/s "
          f"({result.prefill_seconds:.2f} s); decode {result.decode_tokens_per_second:.1f} tok/s "
          f"({result.decode_seconds:.2f} s)", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from jaxkv import serve

    method_config, cache_config = _method_settings(args)
    source = _model_source(args.model)
    if args.keep_quantized and source.kind != "gguf":
        raise UsageError(f"--keep-quantized applies to GGUF models; {source.path} is a {source.kind} model")
    tokenizer = _require_tokenizer(source)
    config = source.config
    max_context = args.max_context or config.max_position_embeddings
    if not 1 < max_context <= config.max_position_embeddings and not args.allow_beyond_context:
        raise UsageError(f"--max-context {max_context} must be in [2, max_position_embeddings = "
                        f"{config.max_position_embeddings}] (or pass --allow-beyond-context)")
    config, params, tokenizer = source.load(keep_quantized=args.keep_quantized)
    name = args.model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    engine = serve.Engine(params, config, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
                          chunk_steps=args.chunk_steps)
    limits = serve.ServeLimits(name, max_context, args.default_max_tokens,
                               serve.Method(args.method, method_config, cache_config))
    serve.run(engine, limits, host=args.host, port=args.port, shutdown_grace=args.shutdown_grace)
    return 0


def cmd_convert(args) -> int:
    import models

    source = _model_source(args.src, "SRC")
    if not args.dst.strip():
        raise UsageError("DST is empty: give the checkpoint directory to write")
    if Path(args.dst).exists():
        raise UsageError(f"{args.dst} already exists; choose a new path or remove it")
    config, params, tokenizer = source.load(args.dtype)
    models.save(Path(args.dst), config, params, tokenizer)
    print(f"wrote {args.dst} ({config.model_type}, {config.num_layers} layers)")
    return 0


def _study(module: str, args) -> int:
    """Run study ``module``: its check_args(args) first (a ValueError there is a usage error), then main(args)."""
    import importlib

    study = importlib.import_module(f"jaxkv.eval.{module}")
    try:
        study.check_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.model is not None:
        _check_model_path(args.model)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a file; give a directory for the study's outputs")
    return study.main(args)


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
    parser = _Parser(prog="jaxkv", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
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
    gen.add_argument("--max-new-tokens", type=POSITIVE_INT, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--method", default="dense",
                     choices=["dense", "magicpig", "pariskv", "topk", "pqcache", "hybrid"])
    gen.add_argument("--compare", choices=["magicpig", "pariskv", "topk", "pqcache", "hybrid"], metavar="METHOD",
                     help="prefill once, then decode with dense (its defaults) and with METHOD (--set and the "
                          "region flags apply to it); print both answers, their decode rates (compile apart) "
                          "and the fraction of keys each read")
    gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a method parameter, e.g. --set top_k=2048 (repeatable)")
    gen.add_argument("--sink", type=NON_NEGATIVE_INT, help="sink tokens (default: the method's)")
    gen.add_argument("--local", type=NON_NEGATIVE_INT, help="local window tokens (default: the method's)")
    gen.add_argument("--buffer", type=POSITIVE_INT, help="update buffer tokens (default: the method's)")
    gen.add_argument("--no-dense-fallback", action="store_true",
                     help="use the sparse method even for short contexts")
    gen.add_argument("--on-device", action="store_true",
                     help="keep the retrieval region in device memory instead of pinned host memory")
    gen.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    gen.add_argument("--top-k", type=POSITIVE_INT)
    gen.add_argument("--top-p", type=FRACTION)
    gen.add_argument("--seed", type=SEED, default=0)
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
    err.add_argument("--tokens", type=POSITIVE_INT, default=8000, help="context length")
    err.add_argument("--queries", type=POSITIVE_INT, default=64, help="last positions whose attention is estimated")
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
    rul.add_argument("--n", type=POSITIVE_INT, default=20, help="examples per task and length")
    rul.add_argument("--batch-size", type=POSITIVE_INT, default=4, help="examples of one length per generate call")
    rul.add_argument("--cap", type=POSITIVE_INT, default=48, help="answer tokens at most (below RULER's per-task budget)")
    rul.add_argument("--top-k", type=POSITIVE_INT, default=512, help="keys ParisKV and the TopK oracle retrieve")
    rul.add_argument("--methods", help="comma-separated method labels (default: all)")
    rul.add_argument("--tasks", help="comma-separated task names (default: all)")
    rul.add_argument("--resume", action="store_true",
                     help="keep the examples the output JSON already holds (a killed run's) and answer the rest")
    rul.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier result files instead of running")
    rul.add_argument("--out", default="results/ruler")
    rul.set_defaults(run=lambda a: _study("ruler_runner", a))
    hyb = studies.add_parser("hybrid", help="hybrid (ParisKV head + estimated tail) vs ParisKV, MagicPIG and the oracle")
    hyb.add_argument("--tokens", type=POSITIVE_INT, default=8000, help="context length")
    hyb.add_argument("--queries", type=POSITIVE_INT, default=64, help="last positions whose attention is estimated")
    hyb.add_argument("--sweep-layers", default="1,8,15,22,29",
                     help="comma-separated layers the settings sweep runs on (the final table uses every layer)")
    hyb.add_argument("--layers", default="all", help="layers of the final table: 'all' or a comma-separated list")
    hyb.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it")
    hyb.add_argument("--out", default="results/hybrid")
    hyb.set_defaults(run=lambda a: _study("hybrid_study", a))
    rec = studies.add_parser("recall", help="Recall@k of ParisKV (coarse, end to end), PQCache, MagicPIG; output error")
    rec.add_argument("--tokens", type=POSITIVE_INT, default=8000, help="context length")
    rec.add_argument("--queries", type=POSITIVE_INT, default=64, help="last positions whose queries are scored")
    rec.add_argument("--top-k", type=POSITIVE_INT, default=100, help="keys retrieved and the recall depth k")
    rec.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it "
                                             "(a longer capture, e.g. the drift study's, serves too)")
    rec.add_argument("--layers", help="comma-separated layers (default: all)")
    rec.add_argument("--out", default="results/recall")
    rec.set_defaults(run=lambda a: _study("recall", a))
    dri = studies.add_parser("drift", help="Recall@k vs decode step as new keys join the pool (no retraining)")
    dri.add_argument("--tokens", type=POSITIVE_INT, default=8192, help="text length (prefill + decode steps)")
    dri.add_argument("--prefill", type=POSITIVE_INT, default=4000, help="tokens the indexes are built on")
    dri.add_argument("--step", type=POSITIVE_INT, default=250, help="decode steps between checkpoints (= insertion block)")
    dri.add_argument("--queries-per-step", type=POSITIVE_INT, default=8, help="positions scored at each checkpoint")
    dri.add_argument("--top-k", type=POSITIVE_INT, default=100, help="keys retrieved and the recall depth k")
    dri.add_argument("--capture-cache", help="npz file: reuse captured tensors if it exists, else write it")
    dri.add_argument("--layers", help="comma-separated layers (default: all)")
    dri.add_argument("--out", default="results/drift")
    dri.set_defaults(run=lambda a: _study("drift", a))
    for p in (err, rul, hyb, rec, dri):
        p.add_argument("--model", help="model path (default: the embedded SmolLM2)")
        p.add_argument("--seed", type=SEED, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if "--debug" in extra:  # accepted after the subcommand too
        extra.remove("--debug")
        args.debug = True
    if getattr(args, "passthrough", False):
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    debug = args.debug or bool(os.environ.get("JAXKV_DEBUG"))
    with warnings.catch_warnings(), _interrupts_raise():
        warnings.showwarning = _show_warning
        try:
            _enable_compile_cache(args)
            return args.run(args)
        except UsageError as e:
            return _fail(e, EXIT_USAGE, debug)
        except KeyboardInterrupt:
            return _stop("interrupted", EXIT_INTERRUPTED, debug)
        except Terminated:
            return _stop("terminated", EXIT_TERMINATED, debug)
        except Exception as e:  # a runtime error: one line unless --debug
            return _fail(e, EXIT_RUNTIME, debug)


def _fail(error: Exception, status: int, debug: bool) -> int:
    if debug:
        raise error
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    # Not one of ours: say what it was.
    if not isinstance(error, (UsageError, ValueError, OSError, KeyError, PlotsUnavailable)):
        message = f"{type(error).__name__}: {message} (run with --debug for the traceback)"
    _print_line(f"jaxkv: error: {message}")
    return status


def _stop(what: str, status: int, debug: bool) -> int:
    if debug:
        raise
    _print_line(f"jaxkv: {what}")
    return status


def _print_line(line: str) -> None:
    # "\r\033[K": a progress bar may have left a partial line on a terminal.
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    print(prefix + line, file=sys.stderr, flush=True)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    _print_line(f"jaxkv: warning: {message}")


@contextlib.contextmanager
def _interrupts_raise():
    """While the command runs, SIGTERM raises Terminated (as SIGINT raises KeyboardInterrupt), so
    writers clean up; an interrupt that lands in a callback which cannot raise (a gc callback,
    ``__del__``: Python prints "Exception ignored" and goes on) is delivered again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    previous_hook = sys.unraisablehook

    def redeliver(unraisable):
        signum = {KeyboardInterrupt: signal.SIGINT, Terminated: signal.SIGTERM}.get(unraisable.exc_type)
        if signum is None:
            previous_hook(unraisable)
            return
        # Sent from another thread a moment later, so the handler runs outside this callback.
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()

    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous_handler)


def _raise_terminated(signum, frame):
    raise Terminated


def console_main() -> None:
    """The `jaxkv` command: `main()`, then exit with its status."""
    status = main()
    if status in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        # Stopping already: a second Ctrl-C during interpreter exit would otherwise kill the
        # process by SIGINT (status -2) instead of letting it exit 130.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    console_main()
