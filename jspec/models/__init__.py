"""Model families. Each family module provides `init_params`, `init_cache` and `run` with the same signature:

  run(params, cfg, tokens [T], cache=None, *, start=None, length=None, slot=None, rows=None)
      -> (final-normed hidden [T, H], cache)

cache None: full causal forward; start None: prefill from position 0 (length = true prompt length);
start given: one row-tile step at positions start..start+T-1 (rows = valid rows, slot = committed slot).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import jax

from jspec.config import DENSE_FAMILIES, HYBRID_FAMILIES, ModelConfig, UnsupportedModelError
from pallas_kernels import quantize

# The param names of every matrix `linear` multiplies by, in all families (dense, hybrid, MTP fc) and lm_head.
LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down", "in_proj", "out", "fc", "lm_head")


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
