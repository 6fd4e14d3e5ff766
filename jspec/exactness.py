"""Step-level exactness check, usable on any model and backend: verify_step row i must equal, bit for bit,
the decode_step logits at position p + i (docs/design.md, rule 1). The tests and the GPU exactness run call
this."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.state import init_state
from jspec.steps import PREFILL_CHUNK, commit, decode_step, prefill, verify_step
from pallas_kernels import ROW_TILE


def bits(a) -> np.ndarray:
    """Raw bits of a float array (uint32 for 4-byte floats, uint16 for 2-byte) for bitwise comparison."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@functools.partial(jax.jit, static_argnums=1)
def _decode_forced(params, cfg: ModelConfig, state, next_token):
    state, logits = decode_step(params, cfg, state)
    return commit(state, jnp.int32(0), next_token), logits


@functools.partial(jax.jit, static_argnums=1)
def _verify(params, cfg: ModelConfig, state, draft):
    return verify_step(params, cfg, state, draft)


def verify_rows_match_decode(
    params: dict, cfg: ModelConfig, prompt, ks=range(1, ROW_TILE), *, max_len: int = 256, dtype=None, seed: int = 0
) -> dict[int, list[int]]:
    """Prefill `prompt`, then for each k compare verify_step(k) rows with decode_step run position by position
    over the same tokens (a random draft, committed by force on the decode side).

    Returns {k: [rows whose logits differ in any bit]} (all lists empty = exact).
    """
    dtype = jnp.dtype(dtype or params["embed"].dtype)
    prompt = np.asarray(prompt, np.int32)
    state = init_state(cfg, max_len, dtype)
    chunk = min(PREFILL_CHUNK, -(-prompt.size // 16) * 16)  # the prompt in one chunk shape (one compile)
    state, _ = jax.jit(prefill, static_argnums=(1, 5))(params, cfg, state, prompt, prompt.size, chunk)
    draft = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=ROW_TILE).astype(np.int32)
    step = functools.partial(_decode_forced, params, cfg)
    decode_logits = forced_decode_logits(step, state, draft[: max(ks) + 1])
    return {k: mismatched_rows(_verify(params, cfg, state, draft[:k])[1], decode_logits) for k in ks}


def forced_decode_logits(step, state, tokens) -> list[np.ndarray]:
    """Run step(state, next_token) -> (state, logits [V]) once per token, committing `tokens[i]` after decode i
    (a forced draft, not the argmax); returns the len(tokens) logits rows, positions p .. p + len(tokens) - 1."""
    rows = []
    for token in tokens:
        state, logits = step(state, token)
        rows.append(np.asarray(logits))
    return rows


def mismatched_rows(verify_logits, decode_logits: list[np.ndarray]) -> list[int]:
    """Rows i of verify_logits [k + 1, V] that differ in any bit from decode_logits[i]."""
    verify_bits = bits(verify_logits)
    return [i for i in range(verify_bits.shape[0]) if not np.array_equal(verify_bits[i], bits(decode_logits[i]))]
