"""The decoder's static configuration, read from and written to HF ``config.json``."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from models.errors import ModelError, ModelNotFoundError

MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
        if self.model_type not in MODEL_TYPES:
            raise ModelError(f"model_type: expected one of {MODEL_TYPES}, found {self.model_type!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{name}: expected a positive int, found {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelError(f"head_dim: RoPE needs an even head_dim, found {self.head_dim}")
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
    def from_hf(cls, source: dict | str | pathlib.Path) -> ModelConfig:
        """Build from a HF ``config.json`` (a dict, the file, or the directory holding it).

        Accepts both the old rope keys (``rope_theta`` + ``rope_scaling``) and the
        new ``rope_parameters``.
        """
        hf = source if isinstance(source, dict) else _read_config_json(source)
        model_type = _require(hf, "model_type")
        if model_type not in MODEL_TYPES:
            raise ModelError(f"model_type: expected one of {MODEL_TYPES}, found {model_type!r}")
        _reject_unsupported_features(hf)
        num_heads = _require(hf, "num_attention_heads")
        hidden = _require(hf, "hidden_size")
        rope_theta, rope_scaling = _rope_from_hf(hf)
        attention_bias = True if model_type == "qwen2" else bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require(hf, "intermediate_size"),
            num_layers=_require(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(_require(hf, "rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_require(hf, "max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            attention_out_bias=attention_bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
        )

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


def _read_config_json(path: str | pathlib.Path) -> dict:
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelNotFoundError(f"no config.json at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelError(f"{path}: not valid JSON ({err})") from err


def _require(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise ModelError(f"config key {key!r} is missing")
    return hf[key]


def _as_id_tuple(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))


def _reject_unsupported_features(hf: dict) -> None:
    """Config switches this decoder does not implement: refuse rather than compute something else."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelError(f"config key 'hidden_act': only 'silu' is supported, found {hf['hidden_act']!r}")
    if hf.get("mlp_bias"):
        raise ModelError("config key 'mlp_bias': MLP biases are not supported")
    if hf.get("use_sliding_window"):
        raise ModelError("config key 'use_sliding_window': sliding-window attention is not supported")
    other_layers = set(hf.get("layer_types") or ()) - {"full_attention"}
    if other_layers:
        raise ModelError(f"config key 'layer_types': only 'full_attention' is supported, found {sorted(other_layers)}")


def _rope_from_hf(hf: dict) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling items) from either the new or the old HF keys."""
    if hf.get("rope_parameters") is not None:
        params = dict(hf["rope_parameters"])
        theta = params.pop("rope_theta", hf.get("rope_theta"))
    else:
        params = dict(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", 10000.0)
    if theta is None:
        raise ModelError("config key 'rope_theta' is missing")
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ModelError(f"config key 'rope_type': expected one of {ROPE_TYPES}, found {rope_type!r}")
    # Keep only the keys the formula uses, so equal scalings compare equal.
    keys = _ROPE_TYPE_KEYS[rope_type]
    missing = [k for k in keys if k not in params]
    if missing:
        raise ModelError(f"rope scaling {rope_type!r}: config keys {missing} are missing")
    items = [("rope_type", rope_type)] + [(k, _number(params[k])) for k in keys]
    return float(theta), tuple(sorted(items))


def _number(value):
    return int(value) if isinstance(value, int) else float(value)


def _check_rope_scaling(rope_scaling) -> None:
    if rope_scaling is None:
        return
    try:
        hash(rope_scaling)
        params = dict(rope_scaling)
    except (TypeError, ValueError) as err:
        raise ModelError(
            f"rope_scaling: expected a hashable tuple of (key, value) items, found {rope_scaling!r}") from err
    rope_type = params.get("rope_type")
    if rope_type not in ROPE_TYPES[1:]:
        raise ModelError(f"rope_scaling['rope_type']: expected one of {ROPE_TYPES[1:]}, found {rope_type!r}")
    missing = [k for k in _ROPE_TYPE_KEYS[rope_type] if k not in params]
    if missing:
        raise ModelError(f"rope_scaling {rope_type!r}: keys {missing} are missing")
