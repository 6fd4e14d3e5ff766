"""HuggingFace import for the hybrid Gated-DeltaNet families (qwen3_next dense configs, qwen3_5 text) into the
params layout of jspec/models/hybrid.py. Registered in checkpoints.hf.FAMILY_LOADERS on import.

Full-attention layers: q_proj (query and output gate interleaved per head, kept as is) / k_proj / v_proj fuse into
`qkv`; q_norm / k_norm are (1 + w) weights, loaded raw. Gated DeltaNet layers: qwen3_5's separate in_proj_qkv /
in_proj_z / in_proj_b / in_proj_a fuse into `in_proj` = [q | k | v | z | b | a]; qwen3_next's grouped
in_proj_qkvz (per key head: q, k, then its value heads' v and z) and in_proj_ba (per key head: its b, then its a)
are fused and their output columns permuted into the same layout (for an int4 weight: its output channels, an
exact reordering). conv1d.weight [C, 1, W] -> conv [W, C]; A_log and dt_bias stay float32 (the recurrence runs in
float32 whatever the dtype); the gated norm weight is plain w. MLPs fuse gate/up. Linears follow `quantize`
(int4 or a checkpoint's quantization_config) as for the dense families.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.hf import FAMILY_LOADERS, Checkpoint, Linears, outer_params
from jspec.config import ModelConfig
from jspec.models.hybrid import FULL
from pallas_kernels.int4 import Int4Weight


def load_hybrid(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, quantize_lm_head: bool) -> dict:
    """qwen3_next / qwen3_5 tensors -> the params of jspec/models/hybrid.py."""
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        read = attention_layer_params if kind == FULL else linear_attention_layer_params
        layers.append(linears.place(read(ckpt, cfg, linears, f"model.layers.{i}")))
    return dict(outer_params(ckpt, cfg, linears, quantize_lm_head), layers=layers)


def _norms_and_mlp(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, prefix: str) -> dict:
    h, inter, mlp = cfg.hidden_size, cfg.intermediate_size, f"{prefix}.mlp"
    return dict(
        input_norm=ckpt.get(f"{prefix}.input_layernorm.weight", (h,)).astype(linears.dtype),
        post_attn_norm=ckpt.get(f"{prefix}.post_attention_layernorm.weight", (h,)).astype(linears.dtype),
        gate_up=linears.weight([f"{mlp}.gate_proj", f"{mlp}.up_proj"], h, [inter, inter]),
        down=linears.weight([f"{mlp}.down_proj"], inter, [h]),
    )


def attention_layer_params(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, prefix: str) -> dict:
    """One gated-attention decoder layer `prefix` (e.g. "model.layers.3", or an MTP head's "mtp.layers.0") ->
    the params `jspec.models.hybrid.attention_layer` takes."""
    h, d, attn = cfg.hidden_size, cfg.head_dim, f"{prefix}.self_attn"
    qkv = [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
    qkv_n = [2 * cfg.q_size, cfg.kv_size, cfg.kv_size]
    p = _norms_and_mlp(ckpt, cfg, linears, prefix)
    p.update(
        qkv=linears.weight(qkv, h, qkv_n),
        q_norm=ckpt.get(f"{attn}.q_norm.weight", (d,)).astype(linears.dtype),
        k_norm=ckpt.get(f"{attn}.k_norm.weight", (d,)).astype(linears.dtype),
        o=linears.weight([f"{attn}.o_proj"], cfg.q_size, [h]),
    )
    if cfg.attention_bias:
        p["qkv_bias"] = linears.bias(qkv, qkv_n)
    if cfg.o_bias:
        p["o_bias"] = linears.bias([f"{attn}.o_proj"], [h])
    return p


def linear_attention_layer_params(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, prefix: str) -> dict:
    """One Gated DeltaNet decoder layer `prefix` -> the params `jspec.models.hybrid.linear_attention_layer` takes."""
    h, nv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = nv * dv
    conv_dim = 2 * key_dim + value_dim
    la = f"{prefix}.linear_attn"
    if cfg.family == "qwen3_next":
        fused = linears.weight([f"{la}.in_proj_qkvz", f"{la}.in_proj_ba"], h, [conv_dim + value_dim, 2 * nv])
        in_proj = _take_columns(fused, qwen3_next_in_proj_order(cfg))
    else:
        names = [f"{la}.in_proj_qkv", f"{la}.in_proj_z", f"{la}.in_proj_b", f"{la}.in_proj_a"]
        in_proj = linears.weight(names, h, [conv_dim, value_dim, nv, nv])
    width = cfg.linear_conv_kernel_dim
    conv = ckpt.get(f"{la}.conv1d.weight", (conv_dim, 1, width))[:, 0, :].T
    p = _norms_and_mlp(ckpt, cfg, linears, prefix)
    p.update(
        in_proj=in_proj,
        conv=conv.astype(linears.dtype),
        A_log=ckpt.get(f"{la}.A_log", (nv,)).astype(jnp.float32),
        dt_bias=ckpt.get(f"{la}.dt_bias", (nv,)).astype(jnp.float32),
        gdn_norm=ckpt.get(f"{la}.norm.weight", (dv,)).astype(linears.dtype),
        out=linears.weight([f"{la}.out_proj"], value_dim, [h]),
    )
    return p


def qwen3_next_in_proj_order(cfg: ModelConfig) -> np.ndarray:
    """Column order taking qwen3_next's fused [in_proj_qkvz | in_proj_ba] outputs to [q | k | v | z | b | a].

    in_proj_qkvz, per key head g: q_g [dk], k_g [dk], v_g [r dv], z_g [r dv] (r = nv / nk value heads per key head);
    in_proj_ba, per key head g: b_g [r], a_g [r].
    """
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    group = 2 * dk + 2 * r * dv
    starts = np.arange(nk)[:, None] * group
    q = starts + np.arange(dk)
    k = starts + dk + np.arange(dk)
    v = starts + 2 * dk + np.arange(r * dv)
    z = starts + 2 * dk + r * dv + np.arange(r * dv)
    ba = nk * group + np.arange(nk)[:, None] * 2 * r
    b = ba + np.arange(r)
    a = ba + r + np.arange(r)
    return np.concatenate([x.reshape(-1) for x in (q, k, v, z, b, a)])


def _take_columns(w: jax.Array | Int4Weight, order: np.ndarray) -> jax.Array | Int4Weight:
    """W [K, N] with its N columns (output channels) reordered; exact for dense and int4 weights."""
    if isinstance(w, Int4Weight):
        zeros = None if w.zeros is None else w.zeros[order]
        return Int4Weight(w.packed[order], w.scales[order], zeros)
    return w[:, order]


FAMILY_LOADERS.update(qwen3_next=load_hybrid, qwen3_5=load_hybrid)
