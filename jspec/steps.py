"""Pure step functions over DecodeState: prefill, decode_step (M=1), verify_step (M=k+1), commit.

Both decode_step and verify_step run the model on one full row tile (ROW_TILE rows, padded tokens) at the
current position, so every op sees the same shapes in both and row r depends only on row r (DESIGN 2.1):
verify row i equals, bit for bit, the decode step at position + i. The logits are cut to the valid rows
only after an optimization barrier (DESIGN 2, rule 7).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models import family_module
from jspec.models.layers import logits as logits_from_hidden
from jspec.state import DecodeState
from pallas_kernels import ROW_TILE


def prefill(params: dict, cfg: ModelConfig, state: DecodeState, prompt: jax.Array, length: jax.Array):
    """Run the prompt from position 0 and set the first generated token pending.

    prompt: int32 [T_bucket] (the prompt, padded), length: int32 [] true prompt length (1..T_bucket).
    Returns (state, logits float32 [V] at position length-1, hidden [T_bucket, H] of every prompt row).
    """
    hidden, cache = family_module(cfg).run(params, cfg, prompt, state.cache, length=length)
    last = jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1)
    logits = logits_from_hidden(params, cfg, last)[0]
    tokens = jax.lax.dynamic_update_slice(state.tokens, prompt, (0,))
    tokens = tokens.at[length].set(jnp.argmax(logits).astype(jnp.int32))
    hidden_rows = jnp.zeros_like(state.hidden).at[0].set(last[0])
    state = dataclasses.replace(
        state, cache=cache, tokens=tokens, position=length, hidden=hidden_rows, slot=jnp.zeros((), jnp.int32)
    )
    return state, logits, hidden


def _tile_step(params: dict, cfg: ModelConfig, state: DecodeState, row_tokens: jax.Array, rows: int):
    """Run one row tile at state.position. row_tokens int32 [ROW_TILE]; rows = valid rows (static)."""
    hidden, cache = family_module(cfg).run(
        params, cfg, row_tokens, state.cache, start=state.position, slot=state.slot, rows=rows
    )
    logits = jax.lax.optimization_barrier(logits_from_hidden(params, cfg, hidden))
    return dataclasses.replace(state, cache=cache, hidden=hidden), logits


def decode_step(params: dict, cfg: ModelConfig, state: DecodeState):
    """Process the pending token at state.position. Returns (state, float32 logits [V]).

    Writes the KV row at state.position; the position advances only in `commit`.
    """
    pending = state.tokens[state.position]
    row_tokens = jnp.zeros((ROW_TILE,), jnp.int32).at[0].set(pending)
    state, logits = _tile_step(params, cfg, state, row_tokens, rows=1)
    return state, logits[0]


def verify_step(params: dict, cfg: ModelConfig, state: DecodeState, draft: jax.Array):
    """Process the pending token and a draft int32 [k] (k + 1 <= ROW_TILE) in one forward.

    Writes KV rows state.position .. state.position + k and the draft into the token history (entries past the
    accepted ones are overwritten later). Returns (state, float32 logits [k + 1, V]); row i equals
    decode_step's logits at position state.position + i bit for bit.
    """
    k = draft.shape[0]
    if not 1 <= k <= ROW_TILE - 1:
        raise ValueError(f"draft length k={k} must be in 1..{ROW_TILE - 1} (k + 1 rows within the row tile)")
    pending = state.tokens[state.position]
    row_tokens = jnp.zeros((ROW_TILE,), jnp.int32).at[0].set(pending).at[1 : k + 1].set(draft.astype(jnp.int32))
    state, logits = _tile_step(params, cfg, state, row_tokens, rows=k + 1)
    tokens = jax.lax.dynamic_update_slice(state.tokens, draft.astype(jnp.int32), (state.position + 1,))
    return dataclasses.replace(state, tokens=tokens), logits[: k + 1]


def commit(state: DecodeState, n_accepted: jax.Array, next_token: jax.Array) -> DecodeState:
    """Keep the pending token and n_accepted draft tokens (rows 0..n_accepted of the last step), and set
    next_token pending. Moves the position and the slot; no cache data is copied (rejected rows are simply
    overwritten later; recurrent families select their post-state by `slot`)."""
    position = state.position + n_accepted + 1
    tokens = state.tokens.at[position].set(next_token.astype(jnp.int32))
    return dataclasses.replace(state, position=position, tokens=tokens, slot=jnp.asarray(n_accepted, jnp.int32))
