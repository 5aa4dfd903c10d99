"""The decoder's static configuration, read from and written to HF ``config.json``.

Every value is checked when the config is built (:mod:`models.fields`): positive
integer sizes, heads that divide, a positive finite epsilon and RoPE base, known
model and rope types. Read from a file, the error names the file and its key.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

from models import fields
from models.errors import ModelError, ModelNotFoundError
from models.files import read_json

MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# What each rope parameter must be (HF's rope validation: a scaling factor is >= 1).
_ROPE_RULES = {
    "factor": (float, fields.at_least(1)),
    "low_freq_factor": (float, fields.POSITIVE),
    "high_freq_factor": (float, fields.POSITIVE),
    "original_max_position_embeddings": (int, fields.POSITIVE),
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_FIELD_RULES = {
    "model_type": fields.OneOf(MODEL_TYPES),
    **{name: fields.POSITIVE for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                          "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")},
    # An epsilon above 1 or a base below 1 is no real model's; a base below 1 also
    # overflows the float32 frequencies into inf and the angles into NaN.
    "rms_norm_eps": fields.FRACTION,
    "rope_theta": fields.at_least(1),
    "bos_token_id": fields.NON_NEGATIVE,
    "eos_token_ids": fields.NON_NEGATIVE,
}
# ModelConfig field -> the HF config.json key it is read from.
_HF_KEYS = {
    "model_type": "model_type",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "attention_bias": "attention_bias",
    "bos_token_id": "bos_token_id",
    "eos_token_ids": "eos_token_id",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder's shapes and math depend on; hashable, so usable as a static arg.

    rope_scaling is None for plain RoPE, else a sorted tuple of (key, value)
    items of the HF rope parameters, ``rope_type`` included (``rope_theta`` not).
    attention_bias: q/k/v projections have biases; attention_out_bias: o_proj has
    one (Llama and Qwen3 tie the two to ``attention_bias``; Qwen2 has q/k/v only).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_out_bias: bool = False

    def __post_init__(self):
        try:
            fields.check(self, **_FIELD_RULES)
        except fields.FieldError as err:
            raise ModelError(str(err)) from None
        _check_relations(vars(self), label=str)
        _check_rope_scaling(self.rope_scaling)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The rope scaling as a dict, ``rope_type`` included; {"rope_type": "default"} when unscaled."""
        return dict(self.rope_scaling) if self.rope_scaling else {"rope_type": "default"}

    @classmethod
    def from_hf(cls, source: dict | str | pathlib.Path, *, where: str | None = None,
                key_names: dict[str, str] | None = None) -> ModelConfig:
        """Build from a HF ``config.json`` (a dict, the file, or the directory holding it).

        Accepts both the old rope keys (``rope_theta`` + ``rope_scaling``) and the
        new ``rope_parameters``. Errors name the file (or ``where``) and the key;
        ``key_names`` maps HF keys to the names the source used (GGUF metadata keys).
        """
        if isinstance(source, (str, os.PathLike)):
            path = _config_path(source)
            hf, where = read_json(path), str(path)
        else:
            hf = source
        if not isinstance(hf, dict):
            raise ModelError(f"{where or 'config'}: expected a JSON object, found {type(hf).__name__}")
        try:
            keys = _SourceKeys(key_names or {})
            values = _fields_from_hf(hf, keys)
            _check_relations(values, label=keys.field_label)
            return cls(**values)
        except (fields.FieldError, ModelError) as err:
            raise ModelError(f"{where}: {err}" if where else str(err)) from None

    def to_hf(self) -> dict[str, Any]:
        """A HF ``config.json`` dict (new-style ``rope_parameters``) that from_hf reads back equal."""
        hf = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, **self.rope_parameters},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.attention_bias
        return hf


_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class _SourceKeys:
    """How errors name a config key: by its name in the source (a GGUF key) or its HF name."""

    names: dict[str, str]  # HF key -> its label in the source, e.g. "GGUF key 'llama.block_count'"

    def label(self, hf_key: str) -> str:
        return self.names.get(hf_key, f"config key {hf_key!r}")

    def field_label(self, field: str) -> str:
        """The label of the key a ModelConfig field is read from."""
        return self.label(_HF_KEYS[field])


def _check_relations(values: dict[str, Any], label) -> None:
    """What the fields must satisfy together; ``label(field)`` names a field in the message."""
    heads, kv_heads, vocab = values["num_heads"], values["num_kv_heads"], values["vocab_size"]
    if heads % kv_heads:
        raise ModelError(f"{label('num_heads')} ({heads}) must be a multiple of {label('num_kv_heads')} ({kv_heads})")
    if values["head_dim"] % 2:
        raise ModelError(f"{label('head_dim')}: RoPE needs an even head_dim, found {values['head_dim']}")
    bos = values["bos_token_id"]
    for name, ids in (("bos_token_id", () if bos is None else (bos,)), ("eos_token_ids", values["eos_token_ids"])):
        outside = [i for i in ids if i >= vocab]
        if outside:
            raise ModelError(f"{label(name)}: token id {outside[0]} is outside the vocabulary [0, {vocab})")


def _config_path(source: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelNotFoundError(f"no config.json at {path}")
    return path


def _fields_from_hf(hf: dict, keys: _SourceKeys) -> dict[str, Any]:
    """ModelConfig's fields from a HF config dict, each checked as it is read (no arithmetic on bad values)."""
    def value(field, default=_REQUIRED):
        hf_key = _HF_KEYS[field]
        raw = hf.get(hf_key)
        if raw is None:
            if default is _REQUIRED:
                raise ModelError(f"{keys.label(hf_key)} is missing")
            return default
        if field == "eos_token_ids" and not isinstance(raw, (list, tuple)):
            raw = [raw]
        return fields.check_value(keys.label(hf_key), raw, _field_types()[field], _FIELD_RULES.get(field))

    model_type = value("model_type")
    _reject_unsupported_features(hf, keys)
    hidden, num_heads = value("hidden_size"), value("num_heads")
    head_dim = hf.get("head_dim")
    if head_dim is None and hidden < num_heads:
        raise ModelError(f"{keys.label('hidden_size')} ({hidden}) must be at least "
                         f"{keys.label('num_attention_heads')} ({num_heads}) when head_dim is not given")
    rope_theta, rope_scaling = _rope_from_hf(hf, keys)
    attention_bias = True if model_type == "qwen2" else value("attention_bias", False)
    return dict(
        model_type=model_type,
        vocab_size=value("vocab_size"),
        hidden_size=hidden,
        intermediate_size=value("intermediate_size"),
        num_layers=value("num_layers"),
        num_heads=num_heads,
        num_kv_heads=value("num_kv_heads", num_heads),
        head_dim=value("head_dim", hidden // num_heads),
        rms_norm_eps=value("rms_norm_eps"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=value("max_position_embeddings"),
        tie_word_embeddings=value("tie_word_embeddings", False),
        attention_bias=attention_bias,
        attention_out_bias=attention_bias and model_type != "qwen2",
        qk_norm=model_type == "qwen3",
        bos_token_id=value("bos_token_id", None),
        eos_token_ids=value("eos_token_ids", ()),
    )


def _field_types() -> dict[str, Any]:
    return fields.type_hints(ModelConfig)


def _reject_unsupported_features(hf: dict, keys: _SourceKeys) -> None:
    """Config switches this decoder does not implement: refuse rather than compute something else."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{keys.label('hidden_act')}: only 'silu' is supported, found {hf['hidden_act']!r}")
    if hf.get("mlp_bias"):
        raise ModelError(f"{keys.label('mlp_bias')}: MLP biases are not supported")
    if hf.get("use_sliding_window"):
        raise ModelError(f"{keys.label('use_sliding_window')}: sliding-window attention is not supported")
    layer_types = hf.get("layer_types") or ()
    if not isinstance(layer_types, (list, tuple)):
        raise ModelError(f"{keys.label('layer_types')}: expected a list, found {layer_types!r}")
    other_layers = set(map(str, layer_types)) - {"full_attention"}
    if other_layers:
        raise ModelError(f"{keys.label('layer_types')}: only 'full_attention' is supported, "
                         f"found {sorted(other_layers)}")


def _rope_from_hf(hf: dict, keys: _SourceKeys) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling items) from either the new or the old HF keys."""
    container = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(container) or {}
    if not isinstance(params, dict):
        raise ModelError(f"{keys.label(container)}: expected an object, found {params!r}")
    params = dict(params)
    if container == "rope_parameters":
        theta = params.pop("rope_theta", hf.get("rope_theta"))
    else:
        theta = hf.get("rope_theta", 10000.0)
    if theta is None:
        raise ModelError(f"{keys.label('rope_theta')} is missing")
    theta = fields.check_value(keys.label("rope_theta"), theta, float, _FIELD_RULES["rope_theta"])
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ModelError(f"{keys.label(container)}['rope_type']: expected one of {ROPE_TYPES}, found {rope_type!r}")
    # Keep only the keys the formula uses, so equal scalings compare equal.
    names = _ROPE_TYPE_KEYS[rope_type]
    missing = [k for k in names if params.get(k) is None]
    if missing:
        raise ModelError(f"{keys.label(container)}: rope scaling {rope_type!r}: keys {missing} are missing")
    items = [("rope_type", rope_type)] + [
        (k, fields.check_value(f"{keys.label(container)}[{k!r}]", params[k], *_ROPE_RULES[k])) for k in names]
    return theta, tuple(sorted(items))


def _check_rope_scaling(rope_scaling) -> None:
    """rope_scaling: None or (key, value) items of a known rope type, every value within its rule."""
    if rope_scaling is None:
        return
    params = dict(rope_scaling)
    rope_type = params.get("rope_type")
    if rope_type not in ROPE_TYPES[1:]:
        raise ModelError(f"rope_scaling['rope_type']: expected one of {ROPE_TYPES[1:]}, found {rope_type!r}")
    missing = [k for k in _ROPE_TYPE_KEYS[rope_type] if k not in params]
    if missing:
        raise ModelError(f"rope_scaling {rope_type!r}: keys {missing} are missing")
    try:
        for key in _ROPE_TYPE_KEYS[rope_type]:
            fields.check_value(f"rope_scaling[{key!r}]", params[key], *_ROPE_RULES[key])
    except fields.FieldError as err:
        raise ModelError(str(err)) from None
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ModelError(f"rope_scaling: llama3 needs high_freq_factor > low_freq_factor, found "
                         f"{params['high_freq_factor']} and {params['low_freq_factor']}")
