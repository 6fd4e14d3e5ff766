"""Model families. Each family module (dense, hybrid) provides the same entry points:

init_params(cfg, key, dtype, scale) -> params;  init_cache(cfg, length, dtype) -> cache pytree
forward(params, cfg, tokens [T]) -> final-normed hidden [T, H]              full causal, no cache
prefill_chunk(params, cfg, tokens [C], cache, start, n_valid) -> (hidden [C, H], cache)
    one prompt chunk at positions start..start+C-1, the first n_valid rows real (flash attention)
step(params, cfg, tokens [ROW_TILE], cache, start, slot, rows) -> (hidden [ROW_TILE, H], cache)
    one row tile at start, `rows` valid (static), recurrent layers from candidate `slot` (row-exact kernels)
attention_layer(p, cfg, x, positions, cache, run) -> (x, cache)             one attention decoder layer (MTP)
"""

from __future__ import annotations

import importlib
from types import ModuleType

import jax
import jax.numpy as jnp

from jspec.config import DENSE_FAMILIES, HYBRID_FAMILIES, ModelConfig, UnsupportedModelError
from pallas_kernels import Int4Codes, Int4Halves, Int4Weight, quantize

# The param names of every matrix `linear` multiplies by, in all families (dense, hybrid, MTP fc) and lm_head.
LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down", "in_proj", "out", "fc", "lm_head")


# Params left in their stored dtype whatever the activations': the Gated DeltaNet decay's A_log and dt_bias (float32 in
# an imported checkpoint, as checkpoints/hf_hybrid.py loads them: the recurrence runs in float32, as in transformers).
FLOAT32_PARAMS = ("A_log", "dt_bias")


def with_activation_dtype(params, dtype):
    """params computing in `dtype` ("float32" or "bfloat16"): a model's activations take its embedding's dtype, so
    every floating array (embedding, norms, biases, dense weights) is cast to it, except FLOAT32_PARAMS (left as
    stored) and the int4 weights (their bf16 scales are the format's). Arrays already in dtype are kept, not copied."""
    dtype = jnp.dtype(dtype)
    quantized = (Int4Weight, Int4Halves, Int4Codes)

    def cast(path, leaf):
        if isinstance(leaf, quantized) or getattr(path[-1], "key", None) in FLOAT32_PARAMS:
            return leaf
        floating = jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != dtype
        return leaf.astype(dtype) if floating else leaf

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=lambda x: isinstance(x, quantized))


def family_module(cfg: ModelConfig) -> ModuleType:
    if cfg.family in DENSE_FAMILIES:
        return importlib.import_module("jspec.models.dense")
    if cfg.family in HYBRID_FAMILIES:
        return importlib.import_module("jspec.models.hybrid")
    raise UnsupportedModelError(f"unknown model family {cfg.family!r}")


def quantize_linears(params, *, lm_head: bool = True):
    """Every dense linear weight of a params pytree (found by its name in LINEAR_WEIGHTS) -> symmetric int4 by
    `pallas_kernels.quantize`; lm_head too unless lm_head=False. Everything else is returned unchanged."""
    names = set(LINEAR_WEIGHTS) - (set() if lm_head else {"lm_head"})

    def convert(path, leaf):
        return quantize(leaf) if getattr(path[-1], "key", None) in names else leaf

    return jax.tree_util.tree_map_with_path(convert, params)
