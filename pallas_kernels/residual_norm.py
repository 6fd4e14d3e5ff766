"""RMSNorm, and the residual add of a row-tile product fused with the RMSNorm after it.

A pre-norm decoder layer adds each sub-block's output projection to the residual stream and normalizes the sum for
the next sub-block: x <- x + h @ W, normed = rms_norm(x). On the row-tile path XLA runs that as two launches after
the product (the split-K partials summed into the add, then its Triton normalization fusion), each a few
microseconds of launch-bound work on [16, H]. `add_rms_norm` does both in one kernel that reads the product's
float32 partials itself: it sums them in the order `int4_matmul._combine` does, casts to the activation dtype,
adds the residual row, and normalizes with the formula of `rms_norm`, writing the new residual stream and its
normed rows. One program per (row, block of columns): each program sums its row's squares over every column in a
fixed order (the same in every program of the row) and writes its own block, so row r's bits depend on row r's
inputs only (docs/design.md, rule 1), whatever the row count. The float32 sum of squares runs in another order than
XLA's reduction, so the fused rows are not the bits of the unfused composition: `matmul.linear_add_norm` picks one
or the other from the weight type and the backend alone, never from the row count.

Triton-lowered: it runs on the GPU and, unchanged, in interpret mode on the CPU (tests/test_residual_norm.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.int4_matmul import _combine

MAX_BLOCK = 512  # columns per program (a power of two, as Triton's blocks must be)
NUM_WARPS = 4


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
    """Columns per program for a hidden size h: the largest power of two dividing h, at most MAX_BLOCK."""
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
    whole = [pl.BlockSpec(a.shape, lambda i, j, nd=a.ndim: (0,) * nd) for a in (x, parts, live[:, :h], weight)]
    out = pl.BlockSpec((None, block), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel,
        grid=(r, h // block),
        in_specs=whole,
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="jspec_add_rms_norm",
    )(x, parts, jnp.asarray(live[:, :h], jnp.int8), weight)


def _kernel(x_ref, parts_ref, live_ref, w_ref, x_out, normed_out, *, live, block, eps, plus_one):
    """Program (row r, column block c): the row's new residual stream, its squares summed over all H columns
    block by block (one float32 vector, then one reduction), and block c of both outputs."""
    r, c = pl.program_id(0), pl.program_id(1)
    h = x_ref.shape[1]

    def residual(at):
        cols = pl.ds(at, block)
        parts = [parts_ref[s, r, cols] for s in range(live.shape[0])]
        y = _combine(parts, live, mask=lambda s: live_ref[s, cols] != 0)
        return x_ref[r, cols] + y.astype(x_ref.dtype)

    squares = jnp.zeros((block,), jnp.float32)
    for at in range(0, h, block):
        xf = residual(at).astype(jnp.float32)
        squares = squares + xf * xf
    rstd = jax.lax.rsqrt(jnp.sum(squares) / h + eps)
    mine = residual(pl.multiple_of(c * block, block))
    x_out[...] = mine
    weight = w_ref[pl.ds(c * block, block)]
    normed_out[...] = scale_normed(mine.astype(jnp.float32) * rstd, weight, mine.dtype, plus_one)
