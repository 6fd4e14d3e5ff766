"""Step-level exactness (docs/design.md, rule 1): verify_step row i == decode_step at position p + i, bit for bit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.exactness import verify_rows_match_decode
from jspec.models import quantize_linears
from jspec.state import init_state, physical_length
from pallas_kernels import ROW_TILE
from tests.tiny import tiny_config, tiny_params

MAX_LEN = 64


@functools.cache
def _model(family: str, dtype: str, int4: bool = False):
    cfg = tiny_config(family)
    params = tiny_params(cfg, jnp.dtype(dtype))
    return cfg, quantize_linears(params, lm_head=False) if int4 else params


PROMPT = [5, 17, 3, 42, 8, 8, 9, 1, 77, 30, 2, 11, 4]


def _check_rows(family: str, dtype: str, ks, int4: bool = False):
    cfg, params = _model(family, dtype, int4)
    mismatches = verify_rows_match_decode(params, cfg, PROMPT, ks, max_len=MAX_LEN)
    assert mismatches == {k: [] for k in ks}, f"{family} {dtype} int4={int4}: rows differing from decode"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_rows_equal_decode_every_k_qwen2(dtype):
    _check_rows("qwen2", dtype, range(1, ROW_TILE))


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("glm4", "bfloat16"), ("glm4", "float32")])
def test_verify_rows_equal_decode_other_families(family, dtype):
    _check_rows(family, dtype, (1, 4, 15))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_rows_equal_decode_int4(dtype):
    _check_rows("qwen2", dtype, (1, 7, 15), int4=True)


@pytest.mark.parametrize("family", ["qwen2", "glm4"])
def test_a_step_writes_each_layer_cache_with_one_update(family):
    """Keys and values share one array per layer, so decode and verify each write a layer's new rows with one
    dynamic_update_slice of that array (XLA then runs one cache-write fusion per layer, not one per K and V)."""
    cfg, params = _model(family, "float32")
    state = init_state(cfg, MAX_LEN, jnp.float32)
    cache_shape = state.cache[0].shape
    assert cache_shape == (physical_length(MAX_LEN), cfg.num_kv_heads, 2, cfg.head_dim)
    draft = jnp.arange(3, dtype=jnp.int32)
    for step in (lambda s: jspec.decode_step(params, cfg, s), lambda s: jspec.verify_step(params, cfg, s, draft)):
        eqns = jax.make_jaxpr(step)(state).eqns
        writes = [
            e for e in eqns if e.primitive.name == "dynamic_update_slice" and e.outvars[0].aval.shape == cache_shape
        ]
        assert len(writes) == cfg.num_layers


def _prefilled(cfg, params):
    padded = jnp.zeros((16,), jnp.int32).at[: len(PROMPT)].set(jnp.asarray(PROMPT))
    state, _ = jspec.prefill(params, cfg, init_state(cfg, MAX_LEN, jnp.float32), padded, len(PROMPT))
    return state


def test_verify_rejects_k_beyond_row_tile():
    cfg, params = _model("qwen2", "float32")
    state = _prefilled(cfg, params)
    with pytest.raises(ValueError, match="row tile"):
        jspec.verify_step(params, cfg, state, jnp.zeros((ROW_TILE,), jnp.int32))
    with pytest.raises(ValueError, match="row tile"):
        jspec.verify_step(params, cfg, state, jnp.zeros((0,), jnp.int32))


def test_commit_moves_position_and_sets_pending():
    cfg, params = _model("qwen2", "float32")
    state = _prefilled(cfg, params)
    s, _ = jspec.verify_step(params, cfg, state, jnp.asarray([1, 2, 3], jnp.int32))
    p = int(state.position)
    s = jspec.commit(s, jnp.int32(2), jnp.int32(55))
    assert int(s.position) == p + 3 and int(s.slot) == 2
    assert list(np.asarray(s.tokens[p + 1 : p + 4])) == [1, 2, 55]


def test_physical_cache_has_row_tile_slack():
    for max_len in (1, 16, 255, 256, 1000):
        assert physical_length(max_len) >= max_len + ROW_TILE
        assert physical_length(max_len) % 256 == 0
