"""`linear`: y = x @ W (+ bias) for dense or int4 W, with the row-tile rule on the decode/verify path.

Rows M <= ROW_TILE (decode and verify) go through the row-tile path: the rows are padded to ROW_TILE and the
product runs on that fixed tile, so row r of the result is bit-identical for every M. Larger M (prefill, the
full forward) goes through a plain dequantize-then-dot; both greedy and speculative decoding start from the
same prefill, so it never needs to agree with the row-tile path bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import backend as _backend
from pallas_kernels.int4 import Int4Weight, dequantize

Weight = jax.Array | Int4Weight


def linear(x: jax.Array, w: Weight, bias: jax.Array | None = None, *, out_dtype=None) -> jax.Array:
    """x [M, K] (float32 | bfloat16) @ W [K, N] (+ bias [N]) -> [M, N] in out_dtype (default x.dtype).

    Accumulates in float32; the bias is added in float32 before the single cast to out_dtype.
    """
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"linear: x has K={k} but the weight is {tuple(w.shape)} ([K, N])")
    if m <= _backend.ROW_TILE:
        y = rows_matmul(x, w)
    else:
        w_dense = dequantize(w, x.dtype) if isinstance(w, Int4Weight) else w
        y = jnp.dot(x, w_dense, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def rows_matmul(x: jax.Array, w: Weight) -> jax.Array:
    """Row-tile product: x [M <= ROW_TILE, K] @ W [K, N] -> float32 [M, N], row r independent of M."""
    name = _backend.get_backend()
    if name == "reference":
        return reference_rows_matmul(x, w)
    from pallas_kernels import int4_matmul

    return int4_matmul.rows_matmul(x, w, interpret=name == "interpret")


def reference_rows_matmul(x: jax.Array, w: Weight) -> jax.Array:
    """jnp reference of the row-tile product: pad to ROW_TILE rows, one fixed-shape dot, then slice.

    The optimization barrier keeps XLA from sinking the final slice into the dot (DESIGN 2, rule 7).
    """
    m = x.shape[0]
    tile = _backend.ROW_TILE
    if m > tile:
        raise ValueError(f"rows_matmul takes at most {tile} rows, got {m}")
    xp = jnp.pad(x, ((0, tile - m), (0, 0)))
    w_dense = dequantize(w, x.dtype) if isinstance(w, Int4Weight) else w.astype(x.dtype)
    y = jnp.dot(xp, w_dense, preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(y)[:m]
