"""The fused residual add + RMSNorm kernel (pallas_kernels.residual_norm), in interpret mode on the CPU and compiled
on the GPU: the residual stream bit for bit as the unfused composition, the norm within two bf16 roundings of it
(its sum of squares runs in another order than XLA's), every row independent of the others and of the row count,
dead split-K partials never read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ROW_TILE, linear, linear_add_norm, quantize, rms_norm, use_backend
from pallas_kernels.int4_matmul import _combine
from pallas_kernels.prepare import prepare_ws
from pallas_kernels.residual_norm import add_rms_norm

GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not GPU, reason="the compiled kernel needs a GPU")


def _inputs(rows: int, h: int, slots: int, seed: int = 0):
    """x bf16 [rows, H], partials float32 [slots, rows, H + 32] (32 padded columns), live [slots, H + 32] with a
    dead slot per column block past the first, holding NaN, and a norm weight bf16 [H]."""
    rng = np.random.default_rng(seed)
    n = h + 32
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    parts = rng.standard_normal((slots, rows, n)).astype(np.float32)
    live = np.ones((slots, n), bool)
    live[slots - 1, n // 2 :] = False  # the last slot exists for the first half of the columns only
    parts[~np.broadcast_to(live[:, None, :], parts.shape)] = np.nan  # what the kernel never writes
    weight = jnp.asarray(rng.standard_normal(h) * 0.1, jnp.bfloat16)
    return x, jnp.asarray(parts), live, weight


def _composition(x, parts, live, weight, plus_one):
    h = x.shape[1]
    x = x + _combine(parts, live)[:, :h].astype(x.dtype)
    return x, rms_norm(x, weight, 1e-6, plus_one=plus_one)


def _u16(a):
    return np.asarray(a).view(np.uint16)


def _near(got, want):
    """Within two bf16 roundings (a normalized value's, then its product with the weight): a numerics check against
    the composition, which sums its squares in another order; exactness is the row tests' bitwise business."""
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-6, atol=0)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=needs_gpu)])
@pytest.mark.parametrize("h,plus_one", [(64, False), (96, True), (1536, False)])
def test_matches_the_composition(interpret, h, plus_one):
    x, parts, live, weight = _inputs(ROW_TILE, h, 3)
    got_x, got_normed = add_rms_norm(x, parts, live, weight, eps=1e-6, plus_one=plus_one, interpret=interpret)
    want_x, want_normed = _composition(x, parts, live, weight, plus_one)
    assert np.array_equal(_u16(got_x), _u16(want_x))  # the same sum, cast and add
    assert np.isfinite(np.asarray(got_normed, np.float32)).all()  # the dead (NaN) partials were never read
    _near(got_normed, want_normed)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=needs_gpu)])
def test_rows_do_not_depend_on_the_other_rows_or_the_row_count(interpret):
    x, parts, live, weight = _inputs(2 * ROW_TILE, 96, 2)
    run = lambda x, p: add_rms_norm(x, p, live, weight, eps=1e-6, plus_one=True, interpret=interpret)  # noqa: E731
    full = run(x, parts)
    half = run(x[:ROW_TILE], parts[:, :ROW_TILE])
    changed = run(x.at[1:].set(-x[1:]), parts.at[:, 1:].multiply(3.0))  # every row but row 0 changed
    for a, b, c in zip(full, half, changed, strict=True):
        assert np.array_equal(_u16(a[:ROW_TILE]), _u16(b))
        assert np.array_equal(_u16(a[0]), _u16(c[0]))


def test_rejects_mismatched_shapes():
    x, parts, live, weight = _inputs(ROW_TILE, 64, 2)
    with pytest.raises(ValueError, match="add_rms_norm: x"):
        add_rms_norm(x, parts[:, :8], live, weight, eps=1e-6, plus_one=False, interpret=True)
    with pytest.raises(ValueError, match="add_rms_norm: x"):
        add_rms_norm(x, parts, live, weight[:32], eps=1e-6, plus_one=False, interpret=True)


def test_linear_add_norm_off_the_fused_path_is_the_composition():
    """The reference backend (and any weight but Int4Codes) runs `linear` then `rms_norm`, bit for bit."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    w, weight = quantize(jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.float32)), jnp.ones(64, jnp.bfloat16)
    with use_backend("reference"):
        got = linear_add_norm(x, h, w, None, weight, eps=1e-5, plus_one=False)
        want_x = x + linear(h, w)
        want = (want_x, rms_norm(want_x, weight, 1e-5))
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(_u16(a), _u16(b))


@needs_gpu
def test_fused_linear_add_norm_is_row_exact_and_batch_independent():
    """On Int4Codes (the GPU default), decode's 1 row, verify's 8 and a batch of sequences (vmap: their rows in
    shared tiles) give row 0 the same bits; the residual stream is the composition's bits, the norm near them."""
    rng = np.random.default_rng(4)
    k, n = 512, 384
    w = prepare_ws(quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32)))
    weight = jnp.asarray(rng.standard_normal(n) * 0.1, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((ROW_TILE, n)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((ROW_TILE, k)), jnp.bfloat16)
    fused = jax.jit(lambda x, h: linear_add_norm(x, h, w, None, weight, eps=1e-6, plus_one=True))
    tile = fused(x, h)
    for m in (1, 8):
        rows = fused(x[:m], h[:m])
        for a, b in zip(tile, rows, strict=True):
            assert np.array_equal(_u16(a[:m]), _u16(b))
    batch = jax.jit(jax.vmap(fused))(jnp.stack([x, -x, x]), jnp.stack([h, h * 2, h]))
    for a, b in zip(tile, batch, strict=True):
        assert np.array_equal(_u16(a), _u16(b[0])) and np.array_equal(_u16(a), _u16(b[2]))
    want_x = x + linear(h, w)
    assert np.array_equal(_u16(tile[0]), _u16(want_x))
    _near(tile[1], rms_norm(want_x, weight, 1e-6, plus_one=True))
