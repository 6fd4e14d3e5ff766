"""HuggingFace import of multi-token-prediction heads into params["mtp"] (layout: jspec/models/mtp.py).

transformers' model classes drop these tensors, so `load_hf` reads them here from the same checkpoint. Layouts:
  "qwen3_next" (Qwen3-Next, Qwen3.5): mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc [H, 2H],
      mtp.layers.{i}.* (a full-attention decoder layer of the family), mtp.norm. fc and the three norms are one set
      shared by every MTP layer (as vLLM's qwen3_next_mtp / qwen3_5_mtp apply them).
  "deepseek" (DeepSeek-V3 style, on dense families): model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj,
      shared_head.norm} plus the decoder layer's own tensors under the same prefix. A per-layer embed_tokens /
      shared_head.head copy is accepted only if it equals the main model's embedding / lm_head (they are shared).
The layer count comes from the config (num_nextn_predict_layers / mtp_num_hidden_layers); a checkpoint whose config
lacks it but which carries the tensors (Qwen3-Next's config.json has no count) gets it from the tensor names. A
config that declares MTP layers whose tensors were all stripped loads without MTP, with a warning. quantize="int4"
(or a checkpoint's quantization_config) applies to fc and the decoder layer's linears as to the main model. On a mesh
the MTP layers are placed together, after they are read (`Linears.place`).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from checkpoints.hf import Checkpoint, CheckpointError, Linears, dense_layer_params
from jspec.config import ModelConfig


def load_mtp(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, params: dict) -> tuple[ModelConfig, dict]:
    """Read the MTP head(s) of `ckpt` -> (cfg with num_mtp_layers / mtp_layout set, params with "mtp" if any)."""
    layout = "qwen3_next" if cfg.is_hybrid else "deepseek"
    found = _count_layers(ckpt, cfg, layout)
    if cfg.num_mtp_layers and not found:
        warnings.warn(
            f"config declares {cfg.num_mtp_layers} MTP layer(s) but {ckpt.dir} has no MTP tensors; loading without "
            "MTP (MTPDrafter will not be available)",
            stacklevel=3,
        )
    num_layers = (cfg.num_mtp_layers or found) if found else 0
    cfg = dataclasses.replace(cfg, num_mtp_layers=num_layers, mtp_layout=layout if num_layers else None)
    if not num_layers:
        return cfg, params
    load = _qwen3_next_layers if layout == "qwen3_next" else _deepseek_layers
    return cfg, {**params, "mtp": linears.place(load(ckpt, cfg, linears))}


def _count_layers(ckpt: Checkpoint, cfg: ModelConfig, layout: str) -> int:
    """Number of consecutive MTP decoder layers present in the checkpoint (0: none)."""
    if layout == "qwen3_next":

        def prefix(i):
            return f"mtp.layers.{i}"
    else:

        def prefix(i):
            return f"model.layers.{cfg.num_layers + i}"

    n = 0
    while ckpt.has(f"{prefix(n)}.input_layernorm.weight"):
        n += 1
    return n


def _vec(ckpt: Checkpoint, name: str, linears: Linears, size: int):
    return ckpt.get(name, (size,)).astype(linears.dtype)


def _qwen3_next_layers(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears) -> list[dict]:
    from checkpoints.hf_hybrid import attention_layer_params

    h = cfg.hidden_size
    _check_shared_copy(ckpt, "mtp.embed_tokens.weight", "model.embed_tokens.weight")
    shared = dict(
        embed_norm=_vec(ckpt, "mtp.pre_fc_norm_embedding.weight", linears, h),
        hidden_norm=_vec(ckpt, "mtp.pre_fc_norm_hidden.weight", linears, h),
        fc=linears.weight(["mtp.fc"], 2 * h, [h]),
        final_norm=_vec(ckpt, "mtp.norm.weight", linears, h),
    )  # one set for every MTP layer
    return [
        dict(shared, layer=attention_layer_params(ckpt, cfg, linears, f"mtp.layers.{i}"))
        for i in range(cfg.num_mtp_layers)
    ]


def _deepseek_layers(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears) -> list[dict]:
    h = cfg.hidden_size
    layers = []
    for i in range(cfg.num_mtp_layers):
        pre = f"model.layers.{cfg.num_layers + i}"
        layers.append(
            dict(
                embed_norm=_vec(ckpt, f"{pre}.enorm.weight", linears, h),
                hidden_norm=_vec(ckpt, f"{pre}.hnorm.weight", linears, h),
                fc=linears.weight([f"{pre}.eh_proj"], 2 * h, [h]),
                layer=dense_layer_params(ckpt, cfg, linears, pre),
                final_norm=_vec(ckpt, f"{pre}.shared_head.norm.weight", linears, h),
            )
        )
        main_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        _check_shared_copy(ckpt, f"{pre}.embed_tokens.weight", "model.embed_tokens.weight")
        _check_shared_copy(ckpt, f"{pre}.shared_head.head.weight", main_head)
    return layers


def _check_shared_copy(ckpt: Checkpoint, name: str, main: str) -> None:
    """An MTP layer's copy of a shared tensor must equal the main model's (jspec keeps one)."""
    if not ckpt.has(name):
        return
    if not ckpt.has(main) or not np.array_equal(ckpt.get_numpy(name), ckpt.get_numpy(main)):
        raise CheckpointError(
            f"{name} differs from the main model's {main}: MTP layers with their own embedding or output head "
            "are not supported (jspec shares the main model's)"
        )
