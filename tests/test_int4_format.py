"""Native int4 format: pack/unpack round trip, physical nibble order, the dequantization formula, quantize bounds."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4 import BLOCK, Int4Weight, dequantize, dequantize_halves, pack, quantize, unpack_codes


def _codes(rng, n, k):
    return rng.integers(0, 16, (n, k), dtype=np.uint8)


def _numpy_dequant(q, s, z, dtype):
    """The module docstring's formula, written in numpy: W[k, n] = (q[n, k] - z) * f32(s), cast once to dtype."""
    s32 = np.repeat(np.asarray(jnp.asarray(s, jnp.float32)), BLOCK, axis=1)
    z32 = 8.0 if z is None else np.repeat(np.asarray(z, np.float32), BLOCK, axis=1)
    w = (q.astype(np.float32) - z32) * s32
    return np.asarray(jnp.asarray(w.T).astype(dtype))


def test_pack_unpack_round_trip_and_nibble_order():
    rng = np.random.default_rng(0)
    q = _codes(rng, 48, 96)
    s = np.ones((48, 3), np.float32)
    w = pack(q, s)
    assert w.packed.dtype == jnp.uint8 and w.packed.shape == (48, 48)
    np.testing.assert_array_equal(np.asarray(unpack_codes(w)), q)
    # byte j of row n holds k = 2j in the low nibble and k = 2j + 1 in the high nibble
    np.testing.assert_array_equal(np.asarray(w.packed), q[:, 0::2] | (q[:, 1::2] << 4))
    assert w.shape == (96, 48)
    assert w.nbytes == 48 * 48 + 2 * 48 * 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_matches_formula_bitwise(dtype, symmetric):
    rng = np.random.default_rng(1)
    n, k = 40, 128
    q = _codes(rng, n, k)
    s = jnp.asarray(rng.uniform(-0.05, 0.05, (n, k // BLOCK)), jnp.bfloat16)
    z = None if symmetric else rng.integers(0, 16, (n, k // BLOCK), dtype=np.uint8)
    got = np.asarray(dequantize(pack(q, s, z), dtype))
    want = _numpy_dequant(q, s, z, dtype)
    assert got.dtype == want.dtype and got.shape == (k, n)
    bits = np.uint32 if dtype == jnp.float32 else np.uint16
    assert np.array_equal(got.view(bits), want.view(bits))
    even, odd = (np.asarray(h) for h in dequantize_halves(pack(q, s, z), dtype))  # [N, K / 2] each
    assert even.shape == odd.shape == (n, k // 2)
    assert np.array_equal(even.view(bits), want[0::2].T.view(bits))
    assert np.array_equal(odd.view(bits), want[1::2].T.view(bits))


def test_quantize_symmetric_error_bound():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    qw = quantize(w, symmetric=True)
    assert qw.zeros is None
    s = np.repeat(np.asarray(qw.scales, np.float32), BLOCK, axis=1).T  # [K, N]
    blocks = np.abs(w.T.reshape(64, 8, BLOCK)).max(-1)  # [N, K/32]
    np.testing.assert_allclose(np.asarray(qw.scales, np.float32), blocks / 7, rtol=2**-8)
    err = np.abs(np.asarray(dequantize(qw)) - w)
    assert np.all(err <= 0.5 * s * (1 + 1e-6))


def test_quantize_asymmetric_error_bound_and_zero_points():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((128, 32)) + 0.7).astype(np.float32)
    qw = quantize(w, symmetric=False)
    z = np.asarray(qw.zeros)
    assert z.dtype == np.uint8 and z.shape == (32, 4) and z.max() <= 15
    s = np.repeat(np.asarray(qw.scales, np.float32), BLOCK, axis=1).T
    err = np.abs(np.asarray(dequantize(qw)) - w)
    assert np.all(err <= s * (1 + 1e-6))  # rounding (s/2) plus at most s/2 from the rounded zero point


def test_quantize_exact_grid_and_zero_block():
    rng = np.random.default_rng(4)
    s = 0.25
    q = rng.integers(-7, 8, (64, 16)).astype(np.float32)
    q[:, 0] = 7.0  # every block reaches max|w| = 7 s, so the scale is exactly s
    w = q * s
    w[:32, 1] = 0.0  # an all-zero block: scale 1, codes 8, dequantizes to exact zeros
    qw = quantize(w, symmetric=True)
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), w)
    assert float(np.asarray(qw.scales, np.float32)[1, 0]) == 1.0


def test_quantize_accepts_bfloat16_and_rejects_bad_shapes():
    w = jnp.ones((64, 16), jnp.bfloat16)
    assert quantize(w).shape == (64, 16)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(np.ones((48, 16), np.float32))
    with pytest.raises(ValueError, match="divisible by 32"):
        pack(np.zeros((4, 40), np.uint8), np.ones((4, 1), np.float32))
    with pytest.raises(ValueError, match="scales shape"):
        pack(np.zeros((4, 64), np.uint8), np.ones((4, 3), np.float32))


def test_int4_weight_is_a_pytree():
    import jax

    w = quantize(np.ones((32, 8), np.float32), symmetric=False)
    leaves = jax.tree_util.tree_leaves(w)
    assert len(leaves) == 3
    assert isinstance(jax.tree_util.tree_map(lambda a: a, w), Int4Weight)
