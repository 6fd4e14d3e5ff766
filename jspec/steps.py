"""Pure step functions over DecodeState: prefill (in chunks of one shape), decode_step (M=1), verify_step (M=k+1),
commit.

Both decode_step and verify_step run the model on one full row tile (ROW_TILE rows, padded tokens) at the
current position, so every op sees the same shapes in both and row r depends only on row r (docs/design.md, rule 1):
verify row i equals, bit for bit, the decode step at position + i. The logits are cut to the valid rows
only after an optimization barrier (docs/design.md, rule 7).
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

# The largest prefill chunk (positions). Every chunk dequantizes all the int4 weights once more, ~9 ms a chunk at the
# Llama-3-8B shape on the H200, so long chunks pay: an 8192-token prompt took 430 / 352 / 316 ms in chunks of
# 512 / 1024 / 2048 (benchmarks/results/bench_prefill_h200.json, chunk_sweep). Shorter prompts and a
# prompt's tail run in the smaller shapes of `chunk_sizes`, so a short prompt pays no 2048-row chunk.
PREFILL_CHUNK = 2048
CHUNK_SHAPES = 5  # at most: chunk, chunk / 2, ..., chunk / 16
SMALLEST_CHUNK = 128  # a chunk of 128 rows costs about what a shorter one does (the weights' read, not the rows)


def chunk_sizes(chunk: int) -> tuple[int, ...]:
    """The chunk shapes of a prefill whose largest chunk is `chunk`, largest first: chunk and its halves, at most
    CHUNK_SHAPES of them, none below SMALLEST_CHUNK (2048: 2048, 1024, 512, 256, 128; a chunk of 128 or less: itself
    alone). A prompt's tail pads to at most twice its length (or 128). One executable per shape the host loop uses;
    all of them in the on-device one."""
    sizes = [chunk]
    while len(sizes) < CHUNK_SHAPES and sizes[-1] // 2 >= SMALLEST_CHUNK:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def tail_size(sizes: tuple[int, ...], remaining: int) -> int:
    """The smallest chunk shape that holds `remaining` (1 .. sizes[0]) positions."""
    return min(s for s in sizes if s >= remaining)


def check_dtype(params: dict, state: DecodeState) -> None:
    """Raise ValueError unless the state (activations, caches) is in the params' dtype: a model computes in its
    embedding's dtype (dtypes are static: this raises while tracing, inside jit too)."""
    want, got = jnp.dtype(params["embed"].dtype), jnp.dtype(state.hidden.dtype)
    if got != want:
        raise ValueError(
            f"the state is {got.name} but the params compute in {want.name} (their embedding's dtype): build it with "
            f"init_state(cfg, max_len, {want.name!r}), or cast the params (jspec.models.with_activation_dtype)"
        )


def prefill_chunk(params: dict, cfg: ModelConfig, state: DecodeState, start, n_valid, size: int):
    """Run the prompt chunk at positions start..start+size-1 (its tokens read from state.tokens, the first n_valid
    real, 1 <= n_valid <= size): write its KV rows, attend the cache causally (flash path), carry the recurrent
    state. Keeps the final-normed hidden row of the last real token in state.hidden[0] (for `finish_prefill`).

    start, n_valid: int32 []; size: the chunk length (static). Returns (state, hidden [size, H]).
    Memory: the chunk's activations (size x max(H, 2I) in the activation dtype) and one [Hq, size, 256] float32
    block of attention scores (jnp path; a [block_q, block_k] tile per program in the kernel), never the prompt's.
    """
    check_dtype(params, state)
    index = start + jnp.arange(size, dtype=jnp.int32)
    tokens = jnp.take(state.tokens, index, mode="fill", fill_value=0)  # past the buffer: padding, never clamped
    hidden, cache = family_module(cfg).prefill_chunk(params, cfg, tokens, state.cache, start, n_valid)
    last = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False)
    return dataclasses.replace(state, cache=cache, hidden=state.hidden.at[0].set(last)), hidden


def finish_prefill(params: dict, cfg: ModelConfig, state: DecodeState, length):
    """After the chunks of a prompt of `length` tokens (int32 []): set the first generated token pending.
    Returns (state, float32 logits [V] at position length - 1)."""
    logits = logits_from_hidden(params, cfg, state.hidden[:1])[0]
    tokens = state.tokens.at[length].set(jnp.argmax(logits).astype(jnp.int32))
    hidden = jnp.zeros_like(state.hidden).at[0].set(state.hidden[0])
    state = dataclasses.replace(state, tokens=tokens, position=length, hidden=hidden, slot=jnp.zeros((), jnp.int32))
    return state, logits


def write_prompt(state: DecodeState, prompt: jax.Array) -> DecodeState:
    """state with prompt int32 [P] (padded, P <= max_len) as its first token history entries."""
    if prompt.shape[0] > state.max_len:
        raise ValueError(f"prompt array of {prompt.shape[0]} tokens is longer than the cache's max_len {state.max_len}")
    return dataclasses.replace(state, tokens=jax.lax.dynamic_update_slice(state.tokens, prompt.astype(jnp.int32), (0,)))


def prefill(params: dict, cfg: ModelConfig, state: DecodeState, prompt: jax.Array, length, chunk: int = PREFILL_CHUNK):
    """Run a whole prompt in chunks (`prefill_chunk`): length // chunk chunks of `chunk` positions (a
    `lax.while_loop`), the rest as one chunk of the smallest of `chunk_sizes(chunk)` that holds it; then set the
    first generated token pending. prompt int32 [P] padded (P <= max_len), length int32 [] the true prompt length
    (1..P). Returns (state, float32 logits [V] at position length - 1)."""
    state = write_prompt(state, prompt)
    state, _ = run_chunks(params, cfg, state, jnp.zeros((), jnp.int32), length, chunk, lambda st, *_: st)
    return finish_prefill(params, cfg, state, length)


def run_chunks(params: dict, cfg: ModelConfig, carry, start, length, chunk: int, after, state_of=None, put=None):
    """The chunk loop of a prefill on device: from position `start` to `length` (int32 []), full chunks of `chunk`
    positions, then the rest in the smallest shape of `chunk_sizes(chunk)` that holds it (a `lax.switch`).

    carry: a DecodeState, or (with state_of / put) a pytree holding one; after(carry, hidden, start, n_valid) ->
    carry runs after every chunk (the drafter's prefill). Returns (carry, end position)."""
    state_of = state_of or (lambda c: c)
    put = put or (lambda c, st: st)
    sizes = chunk_sizes(chunk)

    def step(size):
        def run(cs):
            c, start = cs
            n_valid = jnp.minimum(length - start, size)
            st, hidden = prefill_chunk(params, cfg, state_of(c), start, n_valid, size)
            return after(put(c, st), hidden, start, n_valid), start + n_valid

        return run

    def tail(size):  # the rest, if any, as one chunk of `size`
        return lambda cs: jax.lax.cond(cs[1] < length, step(size), lambda c: c, cs)

    carry, start = jax.lax.while_loop(
        lambda cs: length - cs[1] >= chunk, step(chunk), (carry, jnp.asarray(start, jnp.int32))
    )
    index = jnp.sum(jnp.asarray(sizes) >= length - start) - 1  # sizes descend: the last that holds the rest
    branches = [tail(size) for size in sizes]
    return jax.lax.switch(jnp.clip(index, 0, len(sizes) - 1), branches, (carry, start))


def _tile_step(params: dict, cfg: ModelConfig, state: DecodeState, row_tokens: jax.Array, rows: int, one_split=False):
    """Run one row tile at state.position. row_tokens int32 [T] (T = ROW_TILE, or a batch slot's rows);
    rows = valid rows (static); one_split (static): the attention's partition (`jspec.models.layers.Run`). The
    tile's hidden rows go to state.hidden[:T]."""
    check_dtype(params, state)
    family = family_module(cfg)
    hidden, cache = family.step(params, cfg, row_tokens, state.cache, state.position, state.slot, rows, one_split)
    logits = jax.lax.optimization_barrier(logits_from_hidden(params, cfg, hidden))
    kept = hidden if hidden.shape[0] == state.hidden.shape[0] else state.hidden.at[: hidden.shape[0]].set(hidden)
    return dataclasses.replace(state, cache=cache, hidden=kept), logits


def decode_tile(params: dict, cfg: ModelConfig, state: DecodeState, tile_rows: int = ROW_TILE, one_split=False):
    """`decode_step` with the whole row tile: (state, float32 logits [tile_rows, V], the tile's input tokens int32
    [tile_rows]); row 0 is the decode's, the others are padding. tile_rows: ROW_TILE, or the rows of one slot of a
    batch (`jspec.batch`); one_split: the attention's partition (`jspec.batch.one_split`)."""
    pending = state.tokens[state.position]
    row_tokens = jnp.zeros((tile_rows,), jnp.int32).at[0].set(pending)
    state, logits = _tile_step(params, cfg, state, row_tokens, rows=1, one_split=one_split)
    return state, logits, row_tokens


def decode_step(params: dict, cfg: ModelConfig, state: DecodeState):
    """Process the pending token at state.position. Returns (state, float32 logits [V]).

    Writes the KV row at state.position; the position advances only in `commit`.
    """
    state, logits, _ = decode_tile(params, cfg, state)
    return state, logits[0]


def verify_tile(
    params: dict, cfg: ModelConfig, state: DecodeState, draft: jax.Array, tile_rows: int = ROW_TILE, one_split=False
):
    """`verify_step` with the whole row tile: (state, float32 logits [tile_rows, V], input tokens int32
    [tile_rows]: the pending token, the draft, padding). tile_rows (k + 1 <= tile_rows) and one_split: as
    `decode_tile`."""
    k = draft.shape[0]
    if not 1 <= k <= tile_rows - 1:
        raise ValueError(f"draft length k={k} must be in 1..{tile_rows - 1} (k + 1 rows within the row tile)")
    pending = state.tokens[state.position]
    row_tokens = jnp.zeros((tile_rows,), jnp.int32).at[0].set(pending).at[1 : k + 1].set(draft.astype(jnp.int32))
    state, logits = _tile_step(params, cfg, state, row_tokens, rows=k + 1, one_split=one_split)
    tokens = jax.lax.dynamic_update_slice(state.tokens, draft.astype(jnp.int32), (state.position + 1,))
    return dataclasses.replace(state, tokens=tokens), logits, row_tokens


def verify_step(params: dict, cfg: ModelConfig, state: DecodeState, draft: jax.Array):
    """Process the pending token and a draft int32 [k] (k + 1 <= ROW_TILE) in one forward.

    Writes KV rows state.position .. state.position + k and the draft into the token history (entries past the
    accepted ones are overwritten later). Returns (state, float32 logits [k + 1, V]); row i equals
    decode_step's logits at position state.position + i bit for bit.
    """
    state, logits, _ = verify_tile(params, cfg, state, draft)
    return state, logits[: draft.shape[0] + 1]


def commit(state: DecodeState, n_accepted: jax.Array, next_token: jax.Array) -> DecodeState:
    """Keep the pending token and n_accepted draft tokens (rows 0..n_accepted of the last step), and set
    next_token pending. Moves the position and the slot; no cache data is copied (rejected rows are simply
    overwritten later; recurrent families select their post-state by `slot`)."""
    position = state.position + n_accepted + 1
    tokens = state.tokens.at[position].set(next_token.astype(jnp.int32))
    return dataclasses.replace(state, position=position, tokens=tokens, slot=jnp.asarray(n_accepted, jnp.int32))
