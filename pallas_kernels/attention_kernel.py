"""Pallas decode/verify attention: row-exact for any number of query rows, flash-decoding over a fixed KV split.

Two kernels (Pallas Triton lowering on GPU, Pallas interpret mode on CPU):

1. `_split_kernel`, grid (kv_heads, ceil(S / split)). Program (h, j) takes the query rows of KV head h (the
   `group` query heads that share it, ROW_TILE rows each, stacked into one row tile and padded to a power of 2 of
   heads: 40/8 heads -> 8 x 16 = 128 rows, one tensor-core dot per step) and the cache positions
   [j*split, (j+1)*split). It walks them in blocks of `block_k` with an online softmax (float32 statistics, exp2
   domain) and writes the partial (max m, sum l, out = acc / l) of every row. Splits that start past
   start + ROW_TILE - 1 do no work; inside a split, blocks past that position are not visited.
2. `_combine_kernel`, grid (q_heads, ROW_TILE // combine_rows): merges the live splits' partials of each row in
   ascending split order (chunks of `combine_chunk` splits, sequential inside a chunk) and writes [R, Hq, D].

Why row r is bit-identical for every M and every start that keep its position t = start + r (DESIGN 2.2):
- Rows are padded to ROW_TILE, so every call runs the same kernels on the same shapes; no XLA op touches the
  partials (the combine is a kernel), and the only op after it is the slice to M rows.
- The partition (block_k, split) is a function of absolute position only. Row r's arithmetic on a block or split
  depends only on its query row, the cache rows <= t and its own mask.
- What a call may add beyond t is exactly neutral: a block fully past t has scores -inf, so the running max is
  unchanged, the rescale factor is forced to exactly 1 and the probabilities are exactly 0 (stale values are never
  multiplied by a nonzero weight); a split fully past t has m = -inf, l = 0, out = 0 and weight exactly 0 in the
  combine, the same as a split that was never computed.
The defaults are the variant selected on the H200 (benchmarks/results/attention_h200.json, KERNEL_NOTES.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import ROW_TILE

try:  # Triton-specific compiler parameters; only needed to compile for a GPU.
    from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover - depends on the installed jaxlib
    _pl_triton = None

FOLD_HEADS = True  # one dot over all query heads of a KV head (heads padded to a power of 2); False: one per head
SPLIT = 512  # cache positions per split (flash-decoding partition); a multiple of every block_k below
NUM_WARPS = 8
# (block_k cache positions per inner step, pipeline stages), in order of preference; `split_tiles` takes the first
# whose shared-memory footprint fits. (64, 3) is the variant measured best on the H200 at head_dim 128 bf16; at
# head_dim 256 (Qwen3-Next) it asked for 256 KiB, over the H200's 227 KiB per block.
TILE_CHOICES = ((64, 3), (32, 3), (32, 2), (16, 2), (16, 1))
SMEM_BUDGET = 160 * 1024  # bytes for the q tile and the pipelined K/V blocks; the rest is left to Triton's scratch
COMBINE_ROWS = 2  # rows of one query head per combine program
COMBINE_CHUNK = 16  # splits loaded per combine step

_LOG2E = math.log2(math.e)
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [m, k] times b (contracting b's axis `contract_b`) -> [m, n] float32; float32 operands stay IEEE float32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _split_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, scale, slices, block_k, split):
    """One (KV head, split) program. q_ref [rows, D]: row i is tile row i % R of query head i // R of this KV
    head's group; k_ref/v_ref the whole cache [S, Hkv, D]; o_ref [rows, D] (q dtype), m_ref/l_ref [rows] float32.
    `slices` (static) are the row ranges that each take one dot: all rows at once (heads folded) or one head each."""
    head, j = pl.program_id(0), pl.program_id(1)
    start = start_ref[0]
    last = start + ROW_TILE - 1  # the last position any row of the tile attends
    first = j * split

    @pl.when(first <= last)
    def _():
        n_blocks = jnp.minimum((last - first) // block_k + 1, split // block_k)
        c = scale * _LOG2E
        qs = [q_ref[pl.ds(lo, n), :] for lo, n in slices]
        limits = [(start + jnp.arange(n, dtype=jnp.int32) % ROW_TILE)[:, None] for _, n in slices]

        def step(b, carry):
            base = first + b * block_k
            kb = k_ref[pl.ds(base, block_k), head, :]
            vb = v_ref[pl.ds(base, block_k), head, :]
            pos = (base + jnp.arange(block_k, dtype=jnp.int32))[None, :]
            new = []
            for q, limit, (m, den, acc) in zip(qs, limits, carry, strict=True):
                s = jnp.where(pos <= limit, _dot(q, kb, 1) * c, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp2(s - m_use[:, None])
                alpha = jnp.where(m_new == m, 1.0, jnp.exp2(m - m_use))
                den = den * alpha + jnp.sum(p, axis=1)
                acc = acc * alpha[:, None] + _dot(p.astype(vb.dtype), vb, 0)
                new.append((m_new, den, acc))
            return tuple(new)

        d = q_ref.shape[-1]
        init = tuple(
            (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n, d), jnp.float32))
            for _, n in slices
        )
        carry = jax.lax.fori_loop(0, n_blocks, step, init)
        for (lo, n), (m, den, acc) in zip(slices, carry, strict=True):
            inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)  # nothing visible: out = 0
            o_ref[pl.ds(lo, n), :] = (acc * inv[:, None]).astype(o_ref.dtype)
            m_ref[pl.ds(lo, n)] = m
            l_ref[pl.ds(lo, n)] = den


def _combine_kernel(start_ref, o_ref, m_ref, l_ref, out_ref, *, split, chunk):
    """One (query head, row group) program. o_ref [NS, RC, D]; m_ref/l_ref [NS, RC]; out_ref [RC, D]."""
    live = (start_ref[0] + ROW_TILE - 1) // split + 1  # splits 0..live-1 were computed

    def step(ci, carry):
        mx, num, den = carry
        idx = [ci * chunk + i for i in range(chunk)]
        ms = [jnp.where(i < live, m_ref[jnp.minimum(i, live - 1)], -jnp.inf) for i in idx]
        mx_new = functools.reduce(jnp.maximum, ms, mx)
        beta = jnp.where(mx_new == mx, 1.0, jnp.exp2(mx - mx_new))
        num = num * beta[:, None]
        den = den * beta
        for i, m in zip(idx, ms, strict=True):
            safe = jnp.minimum(i, live - 1)
            w = jnp.exp2(m - mx_new) * l_ref[safe]  # exactly 0 for a dead split or a row with nothing visible
            num = num + w[:, None] * o_ref[safe].astype(jnp.float32)
            den = den + w
        return mx_new, num, den

    rows, d = out_ref.shape
    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    _, num, den = jax.lax.fori_loop(0, (live + chunk - 1) // chunk, step, init)
    out_ref[...] = (num * (1.0 / den)[:, None]).astype(out_ref.dtype)


def split_tiles(rows: int, head_dim: int, itemsize: int) -> tuple[int, int]:
    """(block_k, num_stages) of the split kernel for a row tile of `rows` query rows: the first of TILE_CHOICES
    whose q tile + stages x (K and V blocks) fit SMEM_BUDGET. A function of the shape only (never of M)."""
    for block_k, stages in TILE_CHOICES:
        if (rows + 2 * stages * block_k) * head_dim * itemsize <= SMEM_BUDGET:
            return block_k, stages
    raise ValueError(
        f"attention: a tile of {rows} query rows x head_dim {head_dim} ({itemsize}-byte elements) does not fit "
        f"the kernel's {SMEM_BUDGET // 1024} KiB shared-memory budget"
    )


def _tile_heads(group: int, fold_heads: bool) -> int:
    """Query heads per KV head in one program's q tile: padded to a power of 2 when folded into one dot."""
    return 1 << (group - 1).bit_length() if fold_heads else group


def _check_inputs(q, k_cache, v_cache):
    if q.ndim != 3 or k_cache.ndim != 3:
        raise ValueError(f"expected q [M, Hq, D] and caches [S, Hkv, D], got {q.shape} and {k_cache.shape}")
    m, hq, d = q.shape
    _, hkv, dk = k_cache.shape
    if not 1 <= m <= ROW_TILE:
        raise ValueError(f"attention takes 1..{ROW_TILE} query rows, got {m}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if dk != d or hq % hkv:
        raise ValueError(f"q {q.shape} does not fit caches {k_cache.shape} (head_dim, or heads not a multiple)")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache must share one dtype of float32/bfloat16, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )


def _check_tiles(d, s_len, block_k, split, combine_rows):
    if d & (d - 1) or block_k & (block_k - 1) or split % block_k or ROW_TILE % combine_rows:
        raise ValueError(
            f"head_dim {d} and block_k {block_k} must be powers of 2, split {split} a multiple of "
            f"block_k and combine_rows {combine_rows} a divisor of {ROW_TILE}"
        )
    if s_len % block_k or s_len < ROW_TILE:
        raise ValueError(f"cache length {s_len} must be a multiple of block_k={block_k} and >= {ROW_TILE}")


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    start: jax.Array,
    *,
    scale: float,
    interpret: bool,
    fold_heads: bool = FOLD_HEADS,
    block_k: int | None = None,
    split: int = SPLIT,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    combine_rows: int = COMBINE_ROWS,
    combine_chunk: int = COMBINE_CHUNK,
) -> jax.Array:
    """q [M <= ROW_TILE, Hq, D] at positions start..start+M-1 (start: int32 scalar, may be traced); caches
    [S, Hkv, D] in q.dtype (float32 or bfloat16) -> [M, Hq, D] in q.dtype.

    Row r attends cache positions 0..start+r; the caller guarantees start + ROW_TILE <= S (positions past
    start + ROW_TILE - 1 may hold stale finite data; blocks past the one holding start + ROW_TILE - 1 are never
    read). GQA: query head h uses KV head h // (Hq // Hkv). The tuning arguments change the bits (never the row
    exactness); a model keeps the defaults (block_k / num_stages None: `split_tiles` picks them from the shape).
    """
    _check_inputs(q, k_cache, v_cache)
    _, hq, d = q.shape
    rows = _tile_heads(hq // k_cache.shape[1], fold_heads) * ROW_TILE
    auto_block, auto_stages = split_tiles(rows, d, jnp.dtype(q.dtype).itemsize)
    block_k = auto_block if block_k is None else block_k
    num_stages = auto_stages if num_stages is None else num_stages
    _check_tiles(d, k_cache.shape[0], block_k, split, combine_rows)
    if not interpret and _pl_triton is None:
        raise RuntimeError("compiled Pallas attention needs jax.experimental.pallas.triton (a GPU jaxlib)")
    m = q.shape[0]
    out = _attention_tile(
        jnp.pad(q, ((0, ROW_TILE - m), (0, 0), (0, 0))),
        k_cache,
        v_cache,
        jnp.asarray(start, jnp.int32).reshape(1),
        scale=float(scale),
        interpret=interpret,
        fold_heads=fold_heads,
        block_k=block_k,
        split=split,
        num_warps=num_warps,
        num_stages=num_stages,
        combine_rows=combine_rows,
        combine_chunk=combine_chunk,
    )
    return out[:m]


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "interpret",
        "fold_heads",
        "block_k",
        "split",
        "num_warps",
        "num_stages",
        "combine_rows",
        "combine_chunk",
    ),
)
def _attention_tile(
    q,
    k_cache,
    v_cache,
    start_arr,
    *,
    scale,
    interpret,
    fold_heads,
    block_k,
    split,
    num_warps,
    num_stages,
    combine_rows,
    combine_chunk,
):
    """q [ROW_TILE, Hq, D] (rows padded), start_arr int32 [1] -> [ROW_TILE, Hq, D] in q.dtype."""
    _, hq, d = q.shape
    s_len, hkv, _ = k_cache.shape
    group = hq // hkv
    heads = _tile_heads(group, fold_heads)
    rows = heads * ROW_TILE
    slices = ((0, rows),) if fold_heads else tuple((g * ROW_TILE, ROW_TILE) for g in range(group))
    n_split = -(-s_len // split)
    dtype = q.dtype
    # [M, Hq, D] -> [Hkv, heads * R, D]: row g * R + r is tile row r of query head g of the KV head.
    qt = q.reshape(ROW_TILE, hkv, group, d).transpose(1, 2, 0, 3)
    qt = jnp.pad(qt, ((0, 0), (0, heads - group), (0, 0), (0, 0))).reshape(hkv, rows, d)

    def params(warps, stages):
        return None if interpret else _pl_triton.CompilerParams(num_warps=warps, num_stages=stages)

    scalar = pl.BlockSpec((1,), lambda *_: (0,))
    whole_cache = pl.BlockSpec((s_len, hkv, d), lambda h, j: (0, 0, 0))
    o_part, m_part, l_part = pl.pallas_call(
        functools.partial(_split_kernel, scale=scale, slices=slices, block_k=block_k, split=split),
        grid=(hkv, n_split),
        in_specs=[scalar, pl.BlockSpec((None, rows, d), lambda h, j: (h, 0, 0)), whole_cache, whole_cache],
        out_specs=[
            pl.BlockSpec((None, None, rows, d), lambda h, j: (h, j, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda h, j: (h, j, 0)),
            pl.BlockSpec((None, None, rows), lambda h, j: (h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((hkv, n_split, rows, d), dtype),
            jax.ShapeDtypeStruct((hkv, n_split, rows), jnp.float32),
            jax.ShapeDtypeStruct((hkv, n_split, rows), jnp.float32),
        ],
        compiler_params=params(num_warps, num_stages),
        interpret=interpret,
        name="jspec_attention_split",
    )(start_arr, qt, k_cache, v_cache)

    rc = combine_rows
    per_head = ROW_TILE // rc

    def part_index(h, r):
        return h // group, 0, (h % group) * per_head + r

    return pl.pallas_call(
        functools.partial(_combine_kernel, split=split, chunk=combine_chunk),
        grid=(hq, per_head),
        in_specs=[
            scalar,
            pl.BlockSpec((None, n_split, rc, d), lambda h, r: (*part_index(h, r), 0)),
            pl.BlockSpec((None, n_split, rc), part_index),
            pl.BlockSpec((None, n_split, rc), part_index),
        ],
        out_specs=pl.BlockSpec((rc, None, d), lambda h, r: (r, h, 0)),
        out_shape=jax.ShapeDtypeStruct((ROW_TILE, hq, d), dtype),
        compiler_params=params(4, 2),
        interpret=interpret,
        name="jspec_attention_combine",
    )(start_arr, o_part, m_part, l_part)
