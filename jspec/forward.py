"""`forward`: the full causal forward of a model (no cache), float32 logits for every position."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models import family_module
from jspec.models.layers import logits


@functools.partial(jax.jit, static_argnums=1)
def _forward(params: dict, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    hidden = family_module(cfg).forward(params, cfg, token_ids)
    return logits(params, cfg, hidden)


def forward(params: dict, cfg: ModelConfig, token_ids) -> jax.Array:
    """token_ids [T] int -> float32 logits [T, vocab] of the full causal forward (no cache, no padding)."""
    token_ids = jnp.asarray(token_ids, jnp.int32)
    if token_ids.ndim != 1 or token_ids.shape[0] == 0:
        raise ValueError(f"forward takes a non-empty 1-D token array, got shape {token_ids.shape}")
    check_token_ids(token_ids, cfg)
    return _forward(params, cfg, token_ids)


def check_token_ids(token_ids, cfg: ModelConfig) -> None:
    """Raise if any token id is outside [0, vocab_size) (a gather would silently clamp it)."""
    lo, hi = int(jnp.min(token_ids)), int(jnp.max(token_ids))
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} out of range for vocab_size {cfg.vocab_size}")
