"""Native int4 weight layout: blocks of 32 along K, bf16 scales, symmetric or asymmetric.

An `Int4Weight` stands for a dense matrix W[K, N] (used as x[M, K] @ W). Physically:
  packed  uint8 [N, K // 2]   output channel n, byte j holds k = 2j (low nibble) and k = 2j + 1 (high nibble)
  scales  bf16  [N, K // 32]  one scale per block of 32 consecutive k
  zeros   uint8 [N, K // 32]  per-block zero point 0..15 (asymmetric), or None: symmetric, zero point 8

Dequantization (the one formula every path uses):
  W[k, n] = (q[n, k] - z[n, k // 32]) * float32(s[n, k // 32])
computed in float32, where it is exact (a 5-bit integer times an 8-bit-mantissa scale), then cast once to the
compute dtype (float32: no rounding; bfloat16: one round-to-nearest-even).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """int4 matrix W[K, N] in the native layout (see module docstring)."""

    packed: jax.Array  # uint8 [N, K // 2]
    scales: jax.Array  # bfloat16 [N, K // BLOCK]
    zeros: jax.Array | None = None  # uint8 [N, K // BLOCK] or None (symmetric: 8)

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (K, N)."""
        n, half_k = self.packed.shape
        return (2 * half_k, n)

    @property
    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else self.zeros.size
        return self.packed.size + 2 * self.scales.size + zeros


def pack(q: np.ndarray | jax.Array, scales, zeros=None) -> Int4Weight:
    """Build an Int4Weight from integer codes q [N, K] in 0..15, scales [N, K/32] and optional zeros [N, K/32]."""
    xp = np if isinstance(q, np.ndarray) else jnp
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"int4 needs K divisible by {BLOCK}, got K={k}")
    if scales.shape != (n, k // BLOCK):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match {(n, k // BLOCK)} for q {(n, k)}")
    q = q.astype(xp.uint8)
    packed = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)
    z = None if zeros is None else jnp.asarray(zeros, jnp.uint8)
    return Int4Weight(jnp.asarray(packed, jnp.uint8), jnp.asarray(scales, jnp.bfloat16), z)


def unpack_codes(w: Int4Weight) -> jax.Array:
    """Integer codes q [N, K] (uint8, 0..15)."""
    low = w.packed & 0xF
    high = w.packed >> 4
    n, half = w.packed.shape
    return jnp.stack([low, high], axis=-1).reshape(n, 2 * half)


def _dequantize_blocks(codes: jax.Array, w: Int4Weight, dtype) -> jax.Array:
    """The module's formula on codes uint8 [N, K // BLOCK, c] (c codes of each block) -> [N, K // BLOCK, c]."""
    z = 8.0 if w.zeros is None else w.zeros.astype(jnp.float32)[..., None]
    s = w.scales.astype(jnp.float32)[..., None]
    return ((codes.astype(jnp.float32) - z) * s).astype(dtype)


def dequantize(w: Int4Weight, dtype=jnp.float32) -> jax.Array:
    """Dense W [K, N] in `dtype` by the module's formula."""
    q = unpack_codes(w)
    n, k = q.shape
    return _dequantize_blocks(q.reshape(n, k // BLOCK, BLOCK), w, dtype).reshape(n, k).T


def dequantize_halves(w: Int4Weight, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(W[0::2].T, W[1::2].T), each [N, K // 2] in `dtype` (the packed layout): the low and the high nibbles
    dequantized by the module's formula, not interleaved (the row-tile reference product dots them separately)."""
    n, half = w.packed.shape
    blocks = w.packed.reshape(n, half // (BLOCK // 2), BLOCK // 2)  # the BLOCK // 2 bytes of each block
    even = _dequantize_blocks(blocks & 0xF, w, dtype).reshape(n, half)
    odd = _dequantize_blocks(blocks >> 4, w, dtype).reshape(n, half)
    return even, odd


def quantize(w, *, symmetric: bool = True) -> Int4Weight:
    """Round-to-nearest int4 quantization of a dense W [K, N] (any float dtype), blocks of 32 along K.

    Symmetric: s = max|w| / 7 per block (bf16-rounded), q = clip(round(w / s) + 8, 0, 15).
    Asymmetric: s = (max - min) / 15, z = clip(round(-min / s), 0, 15), q = clip(round(w / s) + z, 0, 15).
    The scale is rounded to bf16 before the codes are computed, so codes are chosen for the stored scale.
    """
    w = jnp.asarray(w, jnp.float32).T  # [N, K]
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"int4 needs K divisible by {BLOCK}, got K={k}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    if symmetric:
        scale = jnp.max(jnp.abs(blocks), axis=-1) / 7.0
        scale = jnp.where(scale == 0, 1.0, scale).astype(jnp.bfloat16)
        s = scale.astype(jnp.float32)[..., None]
        q = jnp.clip(jnp.round(blocks / s) + 8, 0, 15)
        zeros = None
    else:
        lo = jnp.minimum(jnp.min(blocks, axis=-1), 0.0)
        hi = jnp.maximum(jnp.max(blocks, axis=-1), 0.0)
        scale = (hi - lo) / 15.0
        scale = jnp.where(scale == 0, 1.0, scale).astype(jnp.bfloat16)
        s = scale.astype(jnp.float32)
        zeros = jnp.clip(jnp.round(-lo / s), 0, 15)
        q = jnp.clip(jnp.round(blocks / s[..., None]) + zeros[..., None], 0, 15)
        zeros = zeros.astype(jnp.uint8)
    return pack(q.reshape(n, k).astype(jnp.uint8), scale, zeros)
