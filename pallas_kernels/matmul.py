"""`linear`: y = x @ W (+ bias) for dense or int4 W, with the row-tile rule on the decode/verify path.

Rows M <= ROW_TILE (decode and verify) go through the row-tile path: the rows are padded to ROW_TILE and the
product runs on that fixed tile, so row r of the result is bit-identical for every M. Larger M (prefill, the
full forward) goes through a plain product without padding; both greedy and speculative decoding start from the
same prefill, so it never needs to agree with the row-tile path bit for bit.

The jnp reference product of an int4 W never builds the interleaved dense W: it dequantizes the low nibbles
(W[0::2], even k) and the high nibbles (W[1::2], odd k) separately (`int4.dequantize_halves`, the format's one
formula, in the packed [N, K // 2] layout) and sums two dots, x[:, 0::2] @ W[0::2] + x[:, 1::2] @ W[1::2]. On
CPU that dequantization dominates a decode step, so `prepare_reference` can do it once: it replaces every
Int4Weight of a params tree by its `Int4Halves` (more memory: 2 or 4 bytes per weight instead of 0.5), and the
reference product then runs on the stored halves with the same dots, giving the same bits as dequantizing on
every call.

On the GPU, `prepare_ws` (what `Engine` does by default with bfloat16 activations) does the same kind of one-time
preparation for the int4 weights: it replaces every symmetric one by its `Int4Codes`
(re-biased, K padded to the k tile, N to the weight tile) served by the warp-specialized Mosaic GPU kernel of
`pallas_kernels.int4_ws`, faster than the Triton row-tile kernel on every measured shape (docs/kernels.md).
The jnp reference product takes `Int4Codes` too, with the bits of the `Int4Weight` they came from.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend as _backend
from pallas_kernels.int4 import Int4Weight, dequantize_halves
from pallas_kernels.int4_ws import Int4Codes, to_int4_weight
from pallas_kernels.residual_norm import add_rms_norm, rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Halves:
    """An Int4Weight W [K, N] dequantized for the reference backend: even = W[0::2].T, odd = W[1::2].T, [N, K // 2]."""

    even: jax.Array
    odd: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (K, N)."""
        n, half = self.even.shape
        return (2 * half, n)

    @property
    def nbytes(self) -> int:
        return self.even.nbytes + self.odd.nbytes


Weight = jax.Array | Int4Weight | Int4Halves | Int4Codes


def linear(x: jax.Array, w: Weight, bias: jax.Array | None = None, *, out_dtype=None) -> jax.Array:
    """x [M, K] (float32 | bfloat16) @ W [K, N] (+ bias [N]) -> [M, N] in out_dtype (default x.dtype).

    Accumulates in float32; the bias is added in float32 before the single cast to out_dtype.
    """
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"linear: x has K={k} but the weight is {tuple(w.shape)} ([K, N])")
    if m <= _backend.ROW_TILE:
        y = _row_tiles(x, w)
    else:
        y = _product(x, w)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _row_tiles(x: jax.Array, w: Weight) -> jax.Array:
    """`rows_matmul`, and under `jax.vmap` (a batch of sequences, each with its rows: jspec.batch) one row-tile
    product over all their rows: x [B, M, K] is flattened to B * M rows and cut into tiles of ROW_TILE
    (`tiles_matmul`), so the weights are read once per tile (or per launch of several tiles), not once per
    sequence. Row r's result is the same bits wherever it sits in a tile (rule 1), so no sequence's rows depend on
    another's (docs/design.md, rule 9)."""
    return _row_tiles_under(_backend.get_backend())(x, w)


@functools.cache
def _row_tiles_under(name: str):
    """`_row_tiles` under kernel backend `name`, one custom_vmap function per backend: JAX (0.11) caches a
    custom_vmap body's trace by the function and its input types, so one function for every backend would reuse
    the trace of the first backend it ran under after a switch (`backend.use_backend`), silently."""

    @jax.custom_batching.custom_vmap
    def row_tiles(x, w):
        return rows_matmul(x, w)

    @row_tiles.def_vmap
    def _(axis_size: int, in_batched, x: jax.Array, w: Weight):
        x_batched, w_batched = in_batched
        if any(jax.tree.leaves(w_batched)):
            raise ValueError("linear: the weight is batched under vmap; the row-tile path batches rows, never weights")
        if not x_batched:
            return row_tiles(x, w), False
        y = tiles_matmul(_flat_rows(x), w)
        return y.reshape(*x.shape[:2], y.shape[-1]), True

    return row_tiles


def _flat_rows(x: jax.Array) -> jax.Array:
    """A batch's rows x [B, M, C] -> [B * M, C] for the row tiles. Past one tile the tiles slice a materialized
    array: XLA fuses none with x's producer (rule 7)."""
    b, m, c = x.shape
    flat = x.reshape(b * m, c)
    return jax.lax.optimization_barrier(flat) if b * m > _backend.ROW_TILE else flat


def linear_add_norm(
    x: jax.Array, h: jax.Array, w: Weight, bias: jax.Array | None, norm_weight: jax.Array, *, eps: float, plus_one: bool
) -> tuple[jax.Array, jax.Array]:
    """A pre-norm layer's residual add of a product and the RMSNorm after it: x [M, N] (the residual stream),
    h [M, K] -> (x + linear(h, w, bias), `rms_norm` of that with norm_weight [N]), both [M, N] in x.dtype.

    Rows M <= ROW_TILE on `Int4Codes` with the "pallas" backend, without a bias: the product's launches
    (`int4_ws.launch_partials`) and one `residual_norm.add_rms_norm` kernel on their partials, one launch where
    XLA makes two. Otherwise that composition. The choice depends on the weight, the bias and the backend only,
    never on M, so decode and verify rows agree bit for bit (rule 1); under `jax.vmap` (a batch) all sequences'
    rows run in the same tiles, as in `linear` (rule 9)."""
    if bias is None and isinstance(w, Int4Codes) and h.shape[0] <= _backend.ROW_TILE:
        if _backend.get_backend() == "pallas":
            return _add_norm_rows(eps, plus_one)(x, h, w, norm_weight)
    x = x + linear(h, w, bias)
    return x, rms_norm(x, norm_weight, eps, plus_one=plus_one)


@functools.cache
def _add_norm_rows(eps: float, plus_one: bool):
    """`linear_add_norm`'s fused path for one norm convention, a custom_vmap function (as `_row_tiles_under`)."""

    def fused(x, h, w, norm_weight):
        from pallas_kernels import int4_ws

        m = h.shape[0]
        xp = jnp.pad(x, ((0, -m % _backend.ROW_TILE), (0, 0)))
        outs, at = [], 0
        for parts, live in int4_ws.launch_partials(h, w):
            rows = parts.shape[1]
            outs.append(add_rms_norm(xp[at : at + rows], parts, live, norm_weight, eps=eps, plus_one=plus_one))
            at += rows
        joined = (jnp.concatenate(o) if len(o) > 1 else o[0] for o in zip(*outs, strict=True))
        return tuple(_backend.first_rows(y, m) for y in joined)

    add_norm_rows = jax.custom_batching.custom_vmap(fused)

    @add_norm_rows.def_vmap
    def _(axis_size: int, in_batched, x, h, w, norm_weight):
        x_batched, h_batched, w_batched, norm_batched = in_batched
        if any(jax.tree.leaves(w_batched)) or norm_batched:
            raise ValueError("linear_add_norm: a weight is batched under vmap; the row-tile path batches rows only")
        if not (x_batched or h_batched):
            return add_norm_rows(x, h, w, norm_weight), (False, False)
        x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        h = h if h_batched else jnp.broadcast_to(h, (axis_size, *h.shape))
        out = add_norm_rows(_flat_rows(x), _flat_rows(h), w, norm_weight)
        return tuple(o.reshape(x.shape) for o in out), (True, True)

    return add_norm_rows


def tiles_matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [R, K] (any R >= 1) @ W -> float32 [R, N] in row tiles of ROW_TILE, each tile's rows the bits
    `rows_matmul` gives it alone. The Mosaic GPU kernel takes several tiles per launch (`int4_ws.tiles_matmul`:
    the weights streamed once for them); the other backends run one product per tile."""
    if isinstance(w, Int4Codes) and _backend.get_backend() == "pallas":
        from pallas_kernels import int4_ws

        return int4_ws.tiles_matmul(x, w)
    tile = _backend.ROW_TILE
    return jnp.concatenate([rows_matmul(x[i : i + tile], w) for i in range(0, x.shape[0], tile)])


def rows_matmul(x: jax.Array, w: Weight) -> jax.Array:
    """Row-tile product: x [M <= ROW_TILE, K] @ W [K, N] -> float32 [M, N], row r independent of M."""
    name = _backend.get_backend()
    if name == "reference":
        return reference_rows_matmul(x, w)
    if isinstance(w, Int4Halves):
        raise ValueError(f"Int4Halves (prepare_reference) are for the 'reference' kernel backend, not {name!r}")
    if isinstance(w, Int4Codes):
        if name != "pallas":  # the jnp reference above serves them too; the Triton kernel does not
            raise ValueError(f"Int4Codes (prepare_ws) need the GPU 'pallas' kernel backend, not {name!r}")
        from pallas_kernels import int4_ws

        return int4_ws.rows_matmul(x, w)
    from pallas_kernels import int4_matmul

    return int4_matmul.rows_matmul(x, w, interpret=name == "interpret")


def reference_rows_matmul(x: jax.Array, w: Weight) -> jax.Array:
    """jnp reference of the row-tile product: pad to ROW_TILE rows, one fixed-shape product, then slice.

    Below a full tile an optimization barrier keeps XLA from sinking the slice into the dot (`backend.first_rows`).
    """
    m = x.shape[0]
    tile = _backend.ROW_TILE
    if m > tile:
        raise ValueError(f"rows_matmul takes at most {tile} rows, got {m}")
    return _backend.first_rows(_product(jnp.pad(x, ((0, tile - m), (0, 0))), w), m)


def _product(x: jax.Array, w: Weight) -> jax.Array:
    """x [M, K] @ W [K, N] -> float32 [M, N]; int4 W as the two nibble-half dots (module docstring)."""
    if isinstance(w, Int4Codes):
        w = to_int4_weight(w)
    if isinstance(w, Int4Weight):
        w = Int4Halves(*dequantize_halves(w, x.dtype))
    if not isinstance(w, Int4Halves):
        return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if jnp.dtype(w.even.dtype).itemsize < jnp.dtype(x.dtype).itemsize:
        raise ValueError(f"Int4Halves prepared in {w.even.dtype} cannot serve {x.dtype} activations (prepare again)")
    # float32 -> bfloat16 is the formula's one rounding; the barrier makes the dots see materialized halves,
    # whether computed here or prepared, so both give the same bits
    even, odd = jax.lax.optimization_barrier((w.even.astype(x.dtype), w.odd.astype(x.dtype)))
    dims = (((1,), (1,)), ((), ()))  # x [M, K // 2] . halves [N, K // 2] over K // 2
    dot = jax.lax.dot_general(x[:, 0::2], even, dims, preferred_element_type=jnp.float32)
    return dot + jax.lax.dot_general(x[:, 1::2], odd, dims, preferred_element_type=jnp.float32)
