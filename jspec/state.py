"""DecodeState: the immutable pytree every step function takes and returns (donated, fixed shapes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models import family_module
from pallas_kernels import ROW_TILE

CACHE_MULTIPLE = 256  # physical cache length is a multiple of this (attention kernel blocks tile it exactly)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """State of one generation.

    cache     family cache pytree: per attention layer kv [S, Hkv, 2, D] (keys, values); recurrent families add
              their states.
              S = physical_length(max_len): max_len plus ROW_TILE slack, so a full row tile written at any
              position < max_len never clamps.
    tokens    int32 [max_len + ROW_TILE]: prompt + generated tokens; tokens[position] is the pending token
              (generated, not yet in the cache); entries past it are stale.
    position  int32 []: number of positions in the cache.
    hidden    [ROW_TILE, H] final-normed hidden rows of the last step (row i = position of that step + i).
    slot      int32 []: row of `hidden` (and of per-row recurrent candidates) holding the last committed position.
    drafter   the drafter's own state (an MTP head's KV cache), None for stateless drafters.
    """

    cache: Any
    tokens: jax.Array
    position: jax.Array
    hidden: jax.Array
    slot: jax.Array
    drafter: Any = None

    @property
    def max_len(self) -> int:
        return self.tokens.shape[0] - ROW_TILE


def physical_length(max_len: int) -> int:
    """Cache rows for a logical max_len: room for a full row tile at position max_len - 1, rounded up."""
    need = max_len + ROW_TILE
    return -(-need // CACHE_MULTIPLE) * CACHE_MULTIPLE


def init_state(cfg: ModelConfig, max_len: int, dtype) -> DecodeState:
    """Empty state for up to max_len positions, activations/cache in `dtype`."""
    cache = family_module(cfg).init_cache(cfg, physical_length(max_len), dtype)
    return DecodeState(
        cache=cache,
        tokens=jnp.zeros((max_len + ROW_TILE,), jnp.int32),
        position=jnp.zeros((), jnp.int32),
        hidden=jnp.zeros((ROW_TILE, cfg.hidden_size), dtype),
        slot=jnp.zeros((), jnp.int32),
    )
