"""Tokenizer: a ``tokenizers`` backend plus the chat template and end-of-turn ids.

Built from a HF directory's ``tokenizer.json`` or from a GGUF file's metadata
(byte-level BPE, as llama.cpp's ``gpt2`` tokenizer model), and serialisable to
one JSON string so an orbax checkpoint directory is self-contained.
"""
from __future__ import annotations

import functools
import json
import pathlib

import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers, processors

from models.errors import ModelError, ModelNotFoundError
from models.files import read_json

_JSON_FORMAT = "jaxkv-tokenizer/1"
# llama.cpp token types (gguf.TokenType) that are added tokens, matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Text <-> token ids, and the chat prompt a model expects."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), bos_token: str | None = None,
                 eos_token: str | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._eos_token_ids = tuple(int(i) for i in eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generated turn."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. ``<|im_start|>``) stay whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, user_text: str, system: str | None = None) -> str:
        """The prompt for one user turn, ending with the assistant's generation prompt."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user_text})
        return self.apply_chat_messages(messages)

    def apply_chat_messages(self, messages: list[dict]) -> str:
        """The prompt for a conversation (``{"role", "content"}`` dicts), ending with the
        assistant's generation prompt."""
        if self.chat_template is None:
            return _chatml(messages)
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def to_json(self) -> str:
        return json.dumps({
            "format": _JSON_FORMAT,
            "tokenizer": json.loads(self.backend.to_str()),
            "chat_template": self.chat_template,
            "eos_token_ids": list(self.eos_token_ids),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        })

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ModelError(f"tokenizer JSON: not valid JSON ({err})") from err
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise ModelError(f"tokenizer JSON: expected format {_JSON_FORMAT!r}, found "
                             f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
        missing = [k for k in ("tokenizer", "chat_template", "eos_token_ids", "bos_token", "eos_token")
                   if k not in data]
        if missing:
            raise ModelError(f"tokenizer JSON: keys {missing} are missing")
        backend = _backend(lambda: tokenizers.Tokenizer.from_str(json.dumps(data["tokenizer"])), "tokenizer JSON")
        return cls(backend, chat_template=data["chat_template"],
                   eos_token_ids=_ids(data["eos_token_ids"], "tokenizer JSON: eos_token_ids"),
                   bos_token=data["bos_token"], eos_token=data["eos_token"])

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) in a HF directory."""
        path = pathlib.Path(path)
        if not (path / "tokenizer.json").exists():
            raise ModelNotFoundError(f"no tokenizer.json in {path}")
        backend = _backend(lambda: tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
                           str(path / "tokenizer.json"))
        settings = _read_json(path / "tokenizer_config.json")
        template = settings.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos, eos = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
        eos_ids = [backend.token_to_id(eos)] if eos is not None else []
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        eos_ids = _ids(list(dict.fromkeys(i for i in eos_ids if i is not None)), f"{path}: eos token ids")
        return cls(backend, chat_template=template, eos_token_ids=eos_ids, bos_token=bos, eos_token=eos)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """From GGUF ``tokenizer.*`` metadata (keys without the ``tokenizer.`` prefix)."""
        model = meta.get("ggml.model")
        if model != "gpt2":
            raise ModelError(f"GGUF key 'tokenizer.ggml.model': only 'gpt2' (byte-level BPE) is supported, "
                             f"found {model!r}")
        for key, default in (("ggml.tokens", None), ("ggml.merges", [])):
            value = meta.get(key, default)
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise ModelError(f"GGUF key 'tokenizer.{key}': expected a list of strings")
        tokens = [_to_byte_alphabet(t) for t in meta["ggml.tokens"]]
        merges = [tuple(m.split(" ")) for m in meta.get("ggml.merges", [])]
        for key in ("ggml.bos_token_id", "ggml.eos_token_id", "ggml.eot_token_id"):
            if meta.get(key) is not None and not (isinstance(meta[key], int) and 0 <= meta[key] < len(tokens)):
                raise ModelError(f"GGUF key 'tokenizer.{key}': expected a token id in [0, {len(tokens)}), "
                                 f"found {meta[key]!r}")
        backend = tokenizers.Tokenizer(tokenizers.models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        types = meta.get("ggml.token_type") or [0] * len(tokens)
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, kind in zip(tokens, types) if kind == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
        bos_id, eos_id = meta.get("ggml.bos_token_id"), meta.get("ggml.eos_token_id")
        if meta.get("ggml.add_bos_token") and bos_id is not None:
            bos = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        eos_ids = tuple(dict.fromkeys(i for i in (eos_id, meta.get("ggml.eot_token_id")) if i is not None))
        return cls(backend, chat_template=meta.get("chat_template"), eos_token_ids=eos_ids,
                   bos_token=tokens[bos_id] if bos_id is not None else None,
                   eos_token=tokens[eos_id] if eos_id is not None else None)


def _gguf_pre_tokenizer(pre: str):
    """The text splitting for llama.cpp's ``tokenizer.ggml.pre``: GPT-2's, as transformers uses.

    For 'smollm' llama.cpp splits digits before GPT-2's regex; transformers does
    not, and the two differ on whitespace runs before digits ("\\n\\n2" is
    one token "\\n\\n" there, two "\\n" here). We match transformers' ids.
    """
    if pre in ("smollm", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ModelError(f"GGUF key 'tokenizer.ggml.pre': pre-tokenizer {pre!r} is not supported "
                     "(supported: 'smollm', 'gpt2', 'default')")


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for offset, b in enumerate(shifted):
        mapping[b] = chr(256 + offset)
    return mapping


def _to_byte_alphabet(token: str) -> str:
    """GGUF vocabularies are written in the byte alphabet already; respell any token that is not."""
    if set(token) <= _byte_characters():
        return token
    return "".join(_byte_alphabet()[b] for b in token.encode("utf-8"))


@functools.cache
def _byte_characters() -> frozenset[str]:
    return frozenset(_byte_alphabet().values())


@functools.cache
def _compiled_template(template: str):
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:
        raise ModelError("this tokenizer's chat template needs the jinja2 package: pip install jinja2") from err

    def raise_exception(message):
        raise ModelError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _chatml(messages: list[dict]) -> str:
    """ChatML, for tokenizers that carry no template."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _read_json(path: pathlib.Path) -> dict:
    """A JSON object file's content; {} when the file is absent."""
    data = read_json(path) if path.exists() else {}
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _backend(build, source: str) -> tokenizers.Tokenizer:
    """A ``tokenizers`` backend from ``build()``, its parse error (a plain Exception) named by ``source``."""
    try:
        return build()
    except Exception as err:  # tokenizers raises Exception for any malformed definition
        raise ModelError(f"{source}: not a readable tokenizer definition ({err})") from None


def _ids(ids, what: str) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelError(f"{what}: expected a list of token ids, found {ids!r}")
    return tuple(ids)


def _token_text(token) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token
