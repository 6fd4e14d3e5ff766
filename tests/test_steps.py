"""Step-level exactness (DESIGN 2.1): verify_step row i == decode_step at position p + i, bit for bit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.state import init_state, physical_length
from pallas_kernels import ROW_TILE, quantize
from tests.tiny import bits, tiny_config, tiny_params

MAX_LEN = 64


def _quantize_linears(params: dict) -> dict:
    layers = [
        {name: quantize(w) if name in ("qkv", "o", "gate_up", "down") else w for name, w in layer.items()}
        for layer in params["layers"]
    ]
    return {**params, "layers": layers}


@functools.cache
def _setup(family: str, dtype: str, int4: bool = False):
    cfg = tiny_config(family)
    params = tiny_params(cfg, jnp.dtype(dtype))
    if int4:
        params = _quantize_linears(params)
    prompt = np.asarray([5, 17, 3, 42, 8, 8, 9, 1, 77, 30, 2, 11, 4], np.int32)
    padded = np.zeros((16,), np.int32)
    padded[: prompt.size] = prompt
    state = init_state(cfg, MAX_LEN, jnp.dtype(dtype))
    state, _, _ = jax.jit(jspec.prefill, static_argnums=1)(params, cfg, state, padded, prompt.size)

    @jax.jit
    def decode(p, s, next_token):
        s, logits = jspec.decode_step(p, cfg, s)
        return jspec.commit(s, jnp.int32(0), next_token), logits

    verify = jax.jit(lambda p, s, d: jspec.verify_step(p, cfg, s, d))
    return cfg, params, state, decode, verify


def _check_rows(family: str, dtype: str, ks, int4: bool = False):
    cfg, params, state, decode, verify = _setup(family, dtype, int4)
    rng = np.random.default_rng(0)
    draft_all = rng.integers(0, cfg.vocab_size, size=ROW_TILE).astype(np.int32)
    # Decode path: feed the draft tokens one by one (forced commits), collecting each position's logits.
    decode_logits = []
    s = state
    for i in range(ROW_TILE):
        s, logits = decode(params, s, draft_all[i])
        decode_logits.append(np.asarray(logits))
    for k in ks:
        _, logits = verify(params, state, draft_all[:k])
        logits = np.asarray(logits)
        assert logits.shape == (k + 1, cfg.vocab_size)
        for i in range(k + 1):
            assert np.array_equal(bits(logits[i]), bits(decode_logits[i])), f"{family} {dtype} k={k} row {i}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_rows_equal_decode_every_k_qwen2(dtype):
    _check_rows("qwen2", dtype, range(1, ROW_TILE))


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("glm4", "bfloat16"), ("glm4", "float32")])
def test_verify_rows_equal_decode_other_families(family, dtype):
    _check_rows(family, dtype, (1, 4, 15))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_rows_equal_decode_int4(dtype):
    _check_rows("qwen2", dtype, (1, 7, 15), int4=True)


def test_verify_rejects_k_beyond_row_tile():
    cfg, params, state, _, _ = _setup("qwen2", "float32")
    with pytest.raises(ValueError, match="row tile"):
        jspec.verify_step(params, cfg, state, jnp.zeros((ROW_TILE,), jnp.int32))
    with pytest.raises(ValueError, match="row tile"):
        jspec.verify_step(params, cfg, state, jnp.zeros((0,), jnp.int32))


def test_commit_moves_position_and_sets_pending():
    cfg, params, state, _, verify = _setup("qwen2", "float32")
    s, _ = verify(params, state, jnp.asarray([1, 2, 3], jnp.int32))
    p = int(state.position)
    s = jspec.commit(s, jnp.int32(2), jnp.int32(55))
    assert int(s.position) == p + 3 and int(s.slot) == 2
    assert list(np.asarray(s.tokens[p + 1 : p + 4])) == [1, 2, 55]


def test_physical_cache_has_row_tile_slack():
    for max_len in (1, 16, 255, 256, 1000):
        assert physical_length(max_len) >= max_len + ROW_TILE
        assert physical_length(max_len) % 256 == 0
