"""Model families. Each family module provides `init_params`, `init_cache` and `run` with the same signature:

  run(params, cfg, tokens [T], cache=None, *, start=None, length=None, slot=None, rows=None)
      -> (final-normed hidden [T, H], cache)

cache None: full causal forward; start None: prefill from position 0 (length = true prompt length);
start given: one row-tile step at positions start..start+T-1 (rows = valid rows, slot = committed slot).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from jspec.config import DENSE_FAMILIES, HYBRID_FAMILIES, ModelConfig, UnsupportedModelError


def family_module(cfg: ModelConfig) -> ModuleType:
    if cfg.family in DENSE_FAMILIES:
        return importlib.import_module("jspec.models.dense")
    if cfg.family in HYBRID_FAMILIES:
        return importlib.import_module("jspec.models.hybrid")
    raise UnsupportedModelError(f"unknown model family {cfg.family!r}")
