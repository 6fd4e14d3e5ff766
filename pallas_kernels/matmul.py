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


def linear(
    x: jax.Array, w: Weight, bias: jax.Array | None = None, *, out_dtype=None, live_rows: int | None = None
) -> jax.Array:
    """x [M, K] (float32 | bfloat16) @ W [K, N] (+ bias [N]) -> [M, N] in out_dtype (default x.dtype).

    Accumulates in float32; the bias is added in float32 before the single cast to out_dtype. live_rows (static,
    the row-tile path): the leading rows the caller reads, the step's valid rows (`jspec.models.layers.Run`); the
    Mosaic GPU int4 kernel computes only 8 rows for at most 8 of them, every read row with its bits
    (`int4_ws.rows_matmul`); the other products compute every row.
    """
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"linear: x has K={k} but the weight is {tuple(w.shape)} ([K, N])")
    if m <= _backend.ROW_TILE:
        y = _row_tiles(x, w, live_rows)
    else:
        y = _product(x, w)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def _row_tiles(x: jax.Array, w: Weight, live_rows: int | None = None) -> jax.Array:
    """`rows_matmul`, and under `jax.vmap` (a batch of sequences, each with its rows: jspec.batch) one row-tile
    product over all their rows: x [B, M, K] is flattened to B * M rows and cut into tiles of ROW_TILE
    (`tiles_matmul`), so the weights are read once per tile (or per launch of several tiles), not once per
    sequence. Row r's result is the same bits wherever it sits in a tile (rule 1), so no sequence's rows depend on
    another's (docs/design.md, rule 9); the batch computes every row whatever live_rows."""
    return _row_tiles_under(_backend.get_backend(), live_rows)(x, w)


@functools.cache
def _row_tiles_under(name: str, live_rows: int | None = None):
    """`_row_tiles` under kernel backend `name` with `live_rows`, one custom_vmap function per pair: JAX (0.11)
    caches a custom_vmap body's trace by the function and its input types, so one function for every backend (or
    live_rows) would reuse the trace of the first one it ran under after a switch (`backend.use_backend`),
    silently."""

    @jax.custom_batching.custom_vmap
    def row_tiles(x, w):
        return rows_matmul(x, w, live_rows=live_rows)

    @row_tiles.def_vmap
    def _(axis_size: int, in_batched, x: jax.Array, w: Weight):
        x_batched, w_batched = in_batched
        if any(jax.tree.leaves(w_batched)):
            raise ValueError("linear: the weight is batched under vmap; the row-tile path batches rows, never weights")
        if not x_batched:
            return row_tiles(x, w), False
        b, m, k = x.shape
        flat = x.reshape(b * m, k)
        if b * m > _backend.ROW_TILE:  # the tiles slice a materialized array: XLA fuses none with x's producer
            flat = jax.lax.optimization_barrier(flat)  # (rule 7)
        y = tiles_matmul(flat, w)
        return y.reshape(b, m, y.shape[-1]), True

    return row_tiles


def tiles_matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [R, K] (any R >= 1) @ W -> float32 [R, N] in row tiles of ROW_TILE, each tile's rows the bits
    `rows_matmul` gives it alone. The Mosaic GPU kernel takes several tiles per launch (`int4_ws.tiles_matmul`:
    the weights streamed once for them); the other backends run one product per tile."""
    if isinstance(w, Int4Codes) and _backend.get_backend() == "pallas":
        from pallas_kernels import int4_ws

        return int4_ws.tiles_matmul(x, w)
    tile = _backend.ROW_TILE
    return jnp.concatenate([rows_matmul(x[i : i + tile], w) for i in range(0, x.shape[0], tile)])


def rows_matmul(x: jax.Array, w: Weight, *, live_rows: int | None = None) -> jax.Array:
    """Row-tile product: x [M <= ROW_TILE, K] @ W [K, N] -> float32 [M, N], row r independent of M (live_rows:
    `linear`'s)."""
    name = _backend.get_backend()
    if name == "reference":
        return reference_rows_matmul(x, w)
    if isinstance(w, Int4Halves):
        raise ValueError(f"Int4Halves (prepare_reference) are for the 'reference' kernel backend, not {name!r}")
    if isinstance(w, Int4Codes):
        if name != "pallas":  # the jnp reference above serves them too; the Triton kernel does not
            raise ValueError(f"Int4Codes (prepare_ws) need the GPU 'pallas' kernel backend, not {name!r}")
        from pallas_kernels import int4_ws

        return int4_ws.rows_matmul(x, w, live_rows=live_rows)
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
