"""ModelConfig: the static, hashable description of a model, read from a HuggingFace config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

DENSE_FAMILIES = ("qwen2", "llama", "glm4")
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5")
SUPPORTED_FAMILIES = DENSE_FAMILIES + HYBRID_FAMILIES
TP_AXIS = "tp"  # the device mesh axis a tensor-parallel model's shards run over (jspec.tensor_parallel)

# HF model_type -> jspec family.
_MODEL_TYPES = {
    "qwen2": "qwen2",
    "llama": "llama",
    "glm4": "glm4",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
}


# HF model types whose every layer is a sparse MoE block (refused with the MoE error, not "unknown model_type").
_MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not (yet) supported."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: theta, the rotated fraction of head_dim, pair layout and llama3 scaling."""

    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    # False: rotate halves (x[:d/2], x[d/2:]) as Llama/Qwen; True: rotate adjacent pairs (x[0::2], x[1::2]) as GLM-4.
    interleaved: bool = False
    scaling_type: str | None = None  # None or "llama3"
    scaling_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model description (hashable: usable as a `jax.jit` static argument).

    Dense families: qwen2 (qkv bias), llama, glm4 (partial interleaved rotary, fused gate_up, post norms).
    Hybrid families (qwen3_next, qwen3_5) use the `linear_*` fields and `layer_types`.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on o_proj (llama with attention_bias=True)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    post_norms: bool = False  # glm4: post_self_attn_layernorm and post_mlp_layernorm
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid (Gated DeltaNet) models.
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "linear_attention"
    attn_output_gate: bool = False  # q_proj doubled: second half gates the attention output
    norm_plus_one: bool = False  # RMSNorm weight applied as (1 + w)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Multi-token-prediction head(s) shipped with the checkpoint: 0 when absent.
    num_mtp_layers: int = 0
    mtp_layout: str | None = None  # "qwen3_next" or "deepseek"
    # n > 1: this config is one of n tensor-parallel shards (jspec.tensor_parallel.shard_config): its heads, KV heads,
    # linear heads and intermediate size are the shard's; vocab_size stays the model's (embed / lm_head hold V / n).
    tensor_parallel: int = 1

    @property
    def is_hybrid(self) -> bool:
        return self.family in HYBRID_FAMILIES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that keep a KV cache."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        for key in ("eos_token_ids", "layer_types"):
            d[key] = tuple(d[key])
        return cls(**d)

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike) -> ModelConfig:
        """Build from a HuggingFace config: a dict, a config.json path or a checkpoint directory (`read_hf_config`)."""
        if not isinstance(config, dict):
            config = read_hf_config(config)
        if "text_config" in config and config.get("model_type") == "qwen3_5":
            config = {**config["text_config"], "model_type": "qwen3_5_text"}
        model_type = config.get("model_type")
        if model_type in _MOE_MODEL_TYPES:
            raise UnsupportedModelError(
                f"MoE is not supported yet: layer 0 is a sparse MoE block (model_type {model_type!r} has MoE "
                f"layers throughout); only dense configs load"
            )
        family = _MODEL_TYPES.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"unknown model_type {model_type!r}; supported: {', '.join(sorted(_MODEL_TYPES))}"
            )
        _refuse_moe(config, family)
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [key for key in required if key not in config]
        if missing:
            raise ValueError(f"HuggingFace config ({model_type}) lacks {', '.join(missing)}")
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        common = dict(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(config, family),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            eos_token_ids=eos_ids,
        )
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        if family == "qwen2":
            extra = dict(attention_bias=True)
        elif family == "llama":
            bias = bool(config.get("attention_bias", False))
            extra = dict(attention_bias=bias, o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))
        elif family == "glm4":
            extra = dict(attention_bias=bool(config.get("attention_bias", True)), post_norms=True)
        else:
            num_mtp = config.get("num_nextn_predict_layers") or config.get("mtp_num_hidden_layers") or 0
            bias = bool(config.get("attention_bias", False))
            extra = dict(
                attention_bias=bias,
                o_bias=bias,
                layer_types=tuple(config.get("layer_types") or _default_layer_types(config)),
                attn_output_gate=True,
                norm_plus_one=True,
                linear_num_key_heads=config["linear_num_key_heads"],
                linear_num_value_heads=config["linear_num_value_heads"],
                linear_key_head_dim=config["linear_key_head_dim"],
                linear_value_head_dim=config["linear_value_head_dim"],
                linear_conv_kernel_dim=config["linear_conv_kernel_dim"],
                num_mtp_layers=int(num_mtp),
                mtp_layout="qwen3_next" if num_mtp else None,
            )
        if family in DENSE_FAMILIES and config.get("num_nextn_predict_layers"):
            extra.update(num_mtp_layers=int(config["num_nextn_predict_layers"]), mtp_layout="deepseek")
        return cls(**common, **extra)


def _default_layer_types(config: dict[str, Any]) -> list[str]:
    interval = config.get("full_attention_interval", 4)
    n = config["num_hidden_layers"]
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _refuse_moe(config: dict[str, Any], family: str) -> None:
    if family != "qwen3_next":
        return
    num_experts = config.get("num_experts", 512) or 0  # transformers' Qwen3NextConfig default is 512 (MoE)
    if num_experts == 0:
        return
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1) or 1
    for i in range(config["num_hidden_layers"]):
        if i not in mlp_only and (i + 1) % step == 0:
            raise UnsupportedModelError(
                f"MoE is not supported yet: layer {i} is a sparse MoE block "
                f"(num_experts={num_experts}); only dense configs (num_experts=0 or every layer "
                f"in mlp_only_layers) load"
            )


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """A HuggingFace config.json as a dict; path: the file or the checkpoint directory holding it. Raises
    FileNotFoundError (unreadable) or ValueError (not JSON), each naming the file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise FileNotFoundError(f"cannot read HuggingFace config {path!r}: {e}") from e
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"cannot read HuggingFace config {path!r}: not JSON ({e})") from e


def _rope_from_hf(config: dict[str, Any], family: str) -> RopeConfig:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    default_partial = {"glm4": 0.5, "qwen3_next": 0.25, "qwen3_5": 0.25}.get(family, 1.0)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", default_partial))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, llama3)")
    rope = RopeConfig(theta=float(theta), partial_rotary_factor=float(partial), interleaved=family == "glm4")
    if rope_type == "llama3":
        rope = dataclasses.replace(
            rope,
            scaling_type="llama3",
            scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
            ),
        )
    return rope
