"""Step-level exactness check, usable on any model and backend: verify_step row i must equal, bit for bit,
the decode_step logits at position p + i (docs/design.md, rule 1). The tests and the GPU exactness run call
this."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec import tensor_parallel
from jspec.config import ModelConfig
from jspec.state import init_state
from jspec.steps import PREFILL_CHUNK, commit, decode_step, prefill, verify_step
from jspec.tensor_parallel import REPLICATED, SHARDED, STATE_SPECS
from pallas_kernels import ROW_TILE


def bits(a) -> np.ndarray:
    """Raw bits of a float array (uint32 for 4-byte floats, uint16 for 2-byte) for bitwise comparison."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _on(mesh, fn, in_specs: tuple):
    """fn(params, ...) -> (state, logits) itself, or on a mesh run by every device on its shard."""
    return fn if mesh is None else tensor_parallel.on_mesh(fn, mesh, in_specs, (STATE_SPECS, REPLICATED))


@functools.partial(jax.jit, static_argnums=(1, 3, 4, 5, 6))
def _prefilled(params, cfg: ModelConfig, prompt, max_len: int, dtype, chunk: int, mesh):
    def run(p, tokens):
        return prefill(p, cfg, init_state(cfg, max_len, dtype), tokens, tokens.shape[0], chunk)

    return _on(mesh, run, (SHARDED, REPLICATED))(params, prompt)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _decode_forced(params, cfg: ModelConfig, state, next_token, mesh):
    def run(p, st, token):
        st, logits = decode_step(p, cfg, st)
        return commit(st, jnp.int32(0), token), logits

    return _on(mesh, run, (SHARDED, STATE_SPECS, REPLICATED))(params, state, next_token)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _verify(params, cfg: ModelConfig, state, draft, mesh):
    run = _on(mesh, lambda p, st, d: verify_step(p, cfg, st, d), (SHARDED, STATE_SPECS, REPLICATED))
    return run(params, state, draft)


def verify_rows_match_decode(
    params: dict,
    cfg: ModelConfig,
    prompt,
    ks=range(1, ROW_TILE),
    *,
    max_len: int = 256,
    dtype=None,
    seed: int = 0,
    mesh=None,
) -> dict[int, list[int]]:
    """Prefill `prompt`, then for each k compare verify_step(k) rows with decode_step run position by position
    over the same tokens (a random draft, committed by force on the decode side). mesh: None, or a tensor-parallel
    mesh (`jspec.tensor_parallel`; params unsharded or stacked on it): every step then runs on the mesh.

    Returns {k: [rows whose logits differ in any bit]} (all lists empty = exact).
    """
    dtype = jnp.dtype(dtype or params["embed"].dtype)
    if mesh is not None:
        if not tensor_parallel.is_stacked(params, mesh):
            params = tensor_parallel.shard_params(params, cfg, mesh)
        cfg = tensor_parallel.shard_config(cfg, tensor_parallel.mesh_size(mesh))
    prompt = np.asarray(prompt, np.int32)
    chunk = min(PREFILL_CHUNK, -(-prompt.size // 16) * 16)  # the prompt in one chunk shape (one compile)
    state, _ = _prefilled(params, cfg, prompt, max_len, dtype, chunk, mesh)
    draft = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=ROW_TILE).astype(np.int32)
    step = lambda st, token: _decode_forced(params, cfg, st, token, mesh)  # noqa: E731
    decode_logits = forced_decode_logits(step, state, draft[: max(ks) + 1])
    return {k: mismatched_rows(_verify(params, cfg, state, draft[:k], mesh)[1], decode_logits) for k in ks}


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
