"""RMSNorm, and the residual add of a row-tile product fused with the RMSNorm after it.

A pre-norm decoder layer adds each sub-block's output projection to the residual stream and normalizes the sum for
the next sub-block: x <- x + h @ W, normed = rms_norm(x). On the row-tile path XLA runs that as two launches after
the product (the split-K partials summed into the add, then its Triton normalization fusion), each a few
microseconds of launch-bound work on [16, H]. `add_rms_norm` does both in one kernel that reads the product's
float32 partials itself: it sums them in the order `int4_matmul._combine` does, casts to the activation dtype,
adds the residual row, and normalizes with the formula of `rms_norm`, writing the new residual stream and its
normed rows. One program per row: it loads the row's partials block by block (all loads independent), keeps the
new residual row in registers, sums its squares in a fixed order and writes both rows, so row r's bits depend on
row r's inputs only (docs/design.md, rule 1), whatever the row count. (A program per (row, block of columns),
each summing the whole row's squares again, took 4.7 us a call at the Qwen3.5 shape, where XLA's two take ~1.7
and ~1.6.) The float32 sum of squares runs in another order than XLA's reduction, so the fused rows are not the
bits of the unfused composition: `matmul.linear_add_norm` picks one or the other from the weight type and the
backend alone, never from the row count.

Triton-lowered: it runs on the GPU and, unchanged, in interpret mode on the CPU (tests/test_residual_norm.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.int4_matmul import _combine

MAX_BLOCK = 1024  # columns per load (a power of two, as Triton's blocks must be)
NUM_WARPS = 8


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, plus_one: bool = False) -> jax.Array:
    """x [..., H] -> same shape/dtype. Statistics in float32 (as HuggingFace).

    plus_one=False: weight * normalize(x).astype(x.dtype)         (Llama / Qwen2 / GLM-4)
    plus_one=True:  (normalize(x) * (1 + weight)).astype(x.dtype)  (Qwen3-Next / Qwen3.5), in float32
    """
    xf = x.astype(jnp.float32)
    return scale_normed(xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps), weight, x.dtype, plus_one)


def scale_normed(normed: jax.Array, weight: jax.Array, dtype, plus_one: bool) -> jax.Array:
    """The normalized float32 rows times the norm weight, in `rms_norm`'s two conventions -> dtype."""
    if plus_one:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    return weight * normed.astype(dtype)


def column_block(h: int) -> int:
    """Columns per load for a hidden size h: the largest power of two dividing h, at most MAX_BLOCK."""
    return min(h & -h, MAX_BLOCK)


def add_rms_norm(
    x: jax.Array,
    parts: jax.Array,
    live: np.ndarray,
    weight: jax.Array,
    *,
    eps: float,
    plus_one: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """x [R, H] (the residual stream) + the product whose float32 split-K partials are parts [S, R, N >= H]
    (`live` [S, N] static bool: which partials exist, as `_combine` takes it), then RMSNorm with weight [H] ->
    (x + product, rms_norm(x + product)), both [R, H] in x.dtype; the product's columns past H are not read."""
    r, h = x.shape
    s, rows, n = parts.shape
    if rows != r or n < h or live.shape != (s, n) or weight.shape != (h,):
        raise ValueError(f"add_rms_norm: x {x.shape}, parts {parts.shape}, live {live.shape}, weight {weight.shape}")
    block = column_block(h)
    kernel = functools.partial(_kernel, live=live[:, :h], block=block, eps=eps, plus_one=plus_one)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    whole = [pl.BlockSpec(a.shape, lambda i, nd=a.ndim: (0,) * nd) for a in (x, parts, live[:, :h], weight)]
    out = pl.BlockSpec(x.shape, lambda i: (0, 0))
    return pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=whole,
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="jspec_add_rms_norm",
    )(x, parts, jnp.asarray(live[:, :h], jnp.int8), weight)


def _kernel(x_ref, parts_ref, live_ref, w_ref, x_out, normed_out, *, live, block, eps, plus_one):
    """Program r: row r's new residual stream block by block, its squares summed over all H columns (one float32
    vector, then one reduction), then both output rows."""
    r, h = pl.program_id(0), x_ref.shape[1]
    rows = []
    for at in range(0, h, block):
        cols = pl.ds(at, block)
        parts = [parts_ref[s, r, cols] for s in range(live.shape[0])]
        y = _combine(parts, live, mask=lambda s, cols=cols: live_ref[s, cols] != 0)
        rows.append(x_ref[r, cols] + y.astype(x_ref.dtype))
    squares = jnp.zeros((block,), jnp.float32)
    for row in rows:
        squares = squares + jnp.square(row.astype(jnp.float32))
    rstd = jax.lax.rsqrt(jnp.sum(squares) / h + eps)
    for at, row in zip(range(0, h, block), rows, strict=True):
        cols = pl.ds(at, block)
        x_out[r, cols] = row
        normed_out[r, cols] = scale_normed(row.astype(jnp.float32) * rstd, w_ref[cols], row.dtype, plus_one)
