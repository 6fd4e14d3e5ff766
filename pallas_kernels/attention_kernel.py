"""Pallas decode/verify attention: row-exact for any number of query rows, flash-decoding over a fixed KV split.

Two kernels (Pallas Triton lowering on GPU, Pallas interpret mode on CPU; on the GPU the split kernel of bfloat16
caches is the warp-specialized Mosaic GPU kernel of `attention_ws`, which writes the same partials):

1. `_split_kernel`, grid (kv_heads, number of splits). Program (h, j) takes the query rows of KV head h (the
   `group` query heads that share it, ROW_TILE rows each, stacked into one row tile and padded to a power of 2 of
   heads: 40/8 heads -> 8 x 16 = 128 rows, one tensor-core dot per step) and the cache positions of split j
   (`Splits`: `split` positions each before position `far_from`, `far_split` each from there). It walks them in blocks
   of `block_k` with an online softmax (float32 statistics, exp2 domain) and writes the partial (max m, sum l,
   out = acc / l) of every row. Splits that start past start + ROW_TILE - 1 do no work; inside a split, blocks past
   that position are not visited.
2. `_combine_kernel`, grid (q_heads, ceil(M / combine_rows)): merges the live splits' partials of each row in one
   pass (global max of m first, then one weighted sum in ascending split order, `combine_chunk` splits per step, no
   rescaling) and writes [M rounded up to combine_rows, Hq, D]; rows past the call's valid ones are written as
   zeros. A partition of one split (the whole cache: a batch engine's, when its slots alone fill the GPU) has
   nothing to merge, and no combine runs: its partial is the output (`only_split`).

Why row r is bit-identical for every M and every start that keep its position t = start + r (docs/design.md, rule 2):
- Rows are padded to ROW_TILE and the valid row count is data (next to the start), so every call runs the same
  split kernel on the same shapes. What the count changes is which work is skipped: the Mosaic GPU split kernel's
  chunks holding no valid row exit, the combine writes zeros for rows past the valid ones. The combine's grid
  covers the call's M rows only (one program per `combine_rows` of them): a program's rows depend on no other
  program, and its code is the same whatever the grid, so row r is the same bits in a decode's one program per
  head and a verify's eight. A computed row's arithmetic never depends on the count. No XLA op touches the partials
  (the combine is a kernel), and the only op after it is the slice to M rows.
- The partition (block_k, split) is a function of absolute position only. Row r's arithmetic on a block or split
  depends only on its query row, the cache rows <= t and its own mask.
- What a call may add beyond t is exactly neutral: a block fully past t has scores -inf, so the running max is
  unchanged, the rescale factor is forced to exactly 1 and the probabilities are exactly 0 (stale values are never
  multiplied by a nonzero weight); a split fully past t has m = -inf, l = 0, out = 0 and weight exactly 0 in the
  combine, the same as a split that was never computed (whose garbage partials are masked at the load, never read).
- The combine's max is order-free; its sum runs over fixed-shape chunks in a fixed order, and every split a row
  does not see adds an exact zero, so the sum does not depend on how many splits the call computed.
The defaults are the variants selected on the H200 (benchmarks/results/attention_h200.json; the split sizes and the
combine's variants in docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as _pl_triton

from pallas_kernels import attention_ws
from pallas_kernels.backend import ROW_TILE, kv_heads, valid_rows

FOLD_HEADS = True  # one dot over all query heads of a KV head (heads padded to a power of 2); False: one per head
# The flash-decoding partition (cache positions per split), a function of absolute position only: splits of
# NEAR_SPLIT positions before NEAR_UNTIL, of SPLIT from there. Short splits near the start give a short context
# enough programs (H200, Llama-3-8B shape at context 384: 8.5 vs 14.9 us of attention per layer with 512 everywhere;
# at 4096 17.9 vs 17.2 us); all are multiples of every block_k below.
SPLIT = 512
NEAR_SPLIT = 128
NEAR_UNTIL = 1024
NUM_WARPS = 8
# (block_k cache positions per inner step, pipeline stages), in order of preference; `split_tiles` takes the first
# whose shared-memory footprint fits. (64, 3) is the variant measured best on the H200 at head_dim 128 bf16; at
# head_dim 256 (Qwen3-Next) it asked for 256 KiB, over the H200's 227 KiB per block.
TILE_CHOICES = ((64, 3), (32, 3), (32, 2), (16, 2), (16, 1))
SMEM_BUDGET = 160 * 1024  # bytes for the q tile and the pipelined K/V blocks; the rest is left to Triton's scratch
COMBINE_ROWS = 2  # rows of one query head per combine program
COMBINE_CHUNK = 32  # splits loaded per combine step (a power of 2; the split count need not be)
COMBINE_WARPS = 4
COMBINE_STAGES = 2  # pipeline stages of the combine's loop over chunks

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Splits:
    """The KV partition, a function of absolute position only: splits of `size` positions up to `far_from`, then of
    `far_size` (equal sizes: one uniform partition). `far_from` is a multiple of `size`."""

    size: int
    far_size: int
    far_from: int

    @property
    def near(self) -> int:
        """Splits before far_from."""
        return self.far_from // self.size

    def count(self, s_len: int) -> int:
        """Splits covering a cache of s_len positions."""
        if s_len <= self.far_from:
            return -(-s_len // self.size)
        return self.near + -(-(s_len - self.far_from) // self.far_size)

    def first(self, j):
        """First position of split j (traced)."""
        if not self.near:
            return j * self.far_size
        return jnp.where(j < self.near, j * self.size, self.far_from + (j - self.near) * self.far_size)

    def blocks(self, j, block_k: int):
        """Blocks of block_k positions in split j (traced, or static when uniform)."""
        if not self.near:
            return self.far_size // block_k
        near, far = jnp.int32(self.size // block_k), jnp.int32(self.far_size // block_k)
        return jnp.where(j < self.near, near, far)

    def live(self, last):
        """Splits holding a position <= last: splits 0 .. live - 1 (traced)."""
        if not self.near:
            return last // self.far_size + 1
        far = self.near + (last - self.far_from) // self.far_size + 1
        return jnp.where(last < self.far_from, last // self.size + 1, far)


_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [m, k] times b (contracting b's axis `contract_b`) -> [m, n] float32; float32 operands stay IEEE float32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _split_kernel(start_ref, q_ref, kv_ref, o_ref, m_ref, l_ref, *, scale, slices, block_k, splits):
    """One (KV head, split) program. q_ref [rows, D]: row i is tile row i % R of query head i // R of this KV
    head's group; kv_ref the whole cache [S, Hkv, 2, D]; o_ref [rows, D] (q dtype), m_ref/l_ref [rows] float32.
    `slices` (static) are the row ranges that each take one dot: all rows at once (heads folded) or one head each."""
    head, j = pl.program_id(0), pl.program_id(1)
    start = start_ref[0]
    last = start + ROW_TILE - 1  # the last position any row of the tile attends
    first = splits.first(j)

    @pl.when(first <= last)
    def _():
        n_blocks = jnp.minimum((last - first) // block_k + 1, splits.blocks(j, block_k))
        c = scale * _LOG2E
        qs = [q_ref[pl.ds(lo, n), :] for lo, n in slices]
        limits = [(start + jnp.arange(n, dtype=jnp.int32) % ROW_TILE)[:, None] for _, n in slices]

        def step(b, carry):
            base = first + b * block_k
            kb = kv_ref[pl.ds(base, block_k), head, 0, :]
            vb = kv_ref[pl.ds(base, block_k), head, 1, :]
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


def _combine_kernel(start_ref, o_ref, m_ref, l_ref, out_ref, *, splits, chunk):
    """One (query head, row group) program. start_ref [2] (start, valid rows); o_ref [NS, RC, D]; m_ref/l_ref
    [NS, RC] float32; out_ref [RC, D]. Rows from the valid ones on are no query rows (the split kernel may not
    have computed them): they are written as zeros, a select on the finished rows, so a valid row's bits do not
    depend on the valid count.

    One pass, no rescaling chain: first the max M over the live splits' m (order-free, so exact), then
    num = sum_i exp2(m_i - M) * l_i * o_i and den = sum_i exp2(m_i - M) * l_i over the live splits in ascending
    order, `chunk` splits per step (a fixed-shape sum inside a step, steps added in order). The steps' loads do not
    depend on each other. Splits >= live were never computed (their partials are garbage): their loads are masked
    to m = -inf, l = 0, o = 0 (never read), so they add exact zeros, as does a live split a row sees nothing of.
    """
    rows, d = out_ref.shape
    valid = start_ref[1]
    first = pl.program_id(1) * rows

    @pl.when(first >= valid)
    def _():
        out_ref[...] = jnp.zeros((rows, d), out_ref.dtype)

    @pl.when(first < valid)
    def _():
        row = first + jnp.arange(rows, dtype=jnp.int32)
        out = _combine_rows(start_ref, o_ref, m_ref, l_ref, splits=splits, chunk=chunk)
        out_ref[...] = jnp.where((row < valid)[:, None], out, 0.0).astype(out_ref.dtype)


def _combine_rows(start_ref, o_ref, m_ref, l_ref, *, splits, chunk):
    """The merged rows [RC, D] float32 of one combine program (refs as in `_combine_kernel`)."""
    live = splits.live(start_ref[0] + ROW_TILE - 1)  # splits 0..live-1 were computed
    steps = (live + chunk - 1) // chunk
    lane = jnp.arange(chunk, dtype=jnp.int32)

    def load(ref, ci, fill):
        shape = (chunk, *ref.shape[1:])
        ok = (ci * chunk + lane < live).reshape((chunk,) + (1,) * (len(shape) - 1))
        return _pl_triton.load(
            ref.at[pl.ds(ci * chunk, chunk)], mask=jnp.broadcast_to(ok, shape), other=jnp.full(shape, fill, ref.dtype)
        )

    rows, d = o_ref.shape[1:]
    top = jax.lax.fori_loop(
        0,
        steps,
        lambda ci, mx: jnp.maximum(mx, jnp.max(load(m_ref, ci, -jnp.inf), axis=0)),
        jnp.full((rows,), -jnp.inf, jnp.float32),
    )

    def step(ci, carry):
        num, den = carry
        w = jnp.exp2(load(m_ref, ci, -jnp.inf) - top[None, :]) * load(l_ref, ci, 0.0)  # [chunk, RC]
        o = load(o_ref, ci, 0.0).astype(jnp.float32)
        return num + jnp.sum(w[:, :, None] * o, axis=0), den + jnp.sum(w, axis=0)

    init = (jnp.zeros((rows, d), jnp.float32), jnp.zeros((rows,), jnp.float32))
    num, den = jax.lax.fori_loop(0, steps, step, init)
    return num * (1.0 / den)[:, None]


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


def _compiler_params(interpret: bool, warps: int, stages: int):
    return None if interpret else _pl_triton.CompilerParams(num_warps=warps, num_stages=stages)


def _check_inputs(q, kv_cache):
    if q.ndim != 3:
        raise ValueError(f"expected q [M, Hq, D], got {q.shape}")
    m, hq, d = q.shape
    kv_heads(hq, kv_cache)
    if not 1 <= m <= ROW_TILE:
        raise ValueError(f"attention takes 1..{ROW_TILE} query rows, got {m}")
    if kv_cache.shape[3] != d:
        raise ValueError(f"q {q.shape} does not fit kv_cache {kv_cache.shape} (head_dim)")
    if q.dtype not in _DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(f"q and kv_cache must share one dtype of float32/bfloat16, got {q.dtype} and {kv_cache.dtype}")


def _check_tiles(d, s_len, block_k, splits: Splits, combine_rows, combine_chunk):
    pow2 = [x > 0 and not x & (x - 1) for x in (d, block_k, combine_chunk)]
    sizes_ok = splits.size % block_k == 0 and splits.far_size % block_k == 0 and splits.far_from % splits.size == 0
    if not all(pow2) or not sizes_ok or ROW_TILE % combine_rows:
        raise ValueError(
            f"head_dim {d}, block_k {block_k} and combine_chunk {combine_chunk} must be powers of 2, the split sizes "
            f"{splits.size} and {splits.far_size} multiples of block_k, far_from {splits.far_from} a multiple of "
            f"the split {splits.size} and combine_rows {combine_rows} a divisor of {ROW_TILE}"
        )
    if s_len % block_k or s_len < ROW_TILE:
        raise ValueError(f"cache length {s_len} must be a multiple of block_k={block_k} and >= {ROW_TILE}")


def attention(
    q: jax.Array,
    kv_cache: jax.Array,
    start: jax.Array,
    *,
    scale: float,
    interpret: bool,
    rows: int | None = None,
    fold_heads: bool = FOLD_HEADS,
    block_k: int | None = None,
    split: int = NEAR_SPLIT,
    far_split: int | None = SPLIT,
    far_from: int = NEAR_UNTIL,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    combine_rows: int = COMBINE_ROWS,
    combine_chunk: int = COMBINE_CHUNK,
    combine_warps: int = COMBINE_WARPS,
    combine_stages: int = COMBINE_STAGES,
    mosaic: bool | None = None,
    ctas: int | None = None,
) -> jax.Array:
    """q [M <= ROW_TILE, Hq, D] at positions start..start+M-1 (start: int32 scalar, may be traced); kv_cache
    [S, Hkv, 2, D] (keys, values) in q.dtype (float32 or bfloat16) -> [M, Hq, D] in q.dtype.

    rows (default M): only q rows 0..rows-1 are queries (a row tile's valid rows); the output's rows from `rows`
    on are zero. The count reaches the kernels as data, so every M and every rows run the same kernels on the
    same shapes: the Mosaic GPU split kernel skips the chunks holding no valid row (a decode of 5 query heads per
    KV head runs one 64-row chunk of 5 x 12 rows, not two), the Triton one computes every row.
    Row r attends cache positions 0..start+r; the caller guarantees start + ROW_TILE <= S (positions past
    start + ROW_TILE - 1 may hold stale finite data; blocks past the one holding start + ROW_TILE - 1 are never
    read). GQA: query head h uses KV head h // (Hq // Hkv). The tuning arguments change the bits (never the row
    exactness); a model keeps the defaults (block_k / num_stages None: `split_tiles` picks them from the shape).
    The partition: splits of `split` positions before position `far_from`, of `far_split` from there (far_split
    None: of `split` everywhere). mosaic: compute the partials with the warp-specialized Mosaic GPU kernel
    (`attention_ws`; GPU, bfloat16, head_dim 64/128/256) instead of the Triton one; None: whenever it fits (not in
    interpret mode). Of the split kernel's tuning arguments only block_k and num_stages (its ring depth) apply to it
    (None: `attention_ws.BLOCK_K` and `attention_ws.stages`), and it alone takes ctas, its CTAs per KV head (None:
    `attention_ws.ctas_per_head`), which never changes the bits.
    """
    _check_inputs(q, kv_cache)
    m, hq, d = q.shape
    rows = valid_rows(rows, m)
    group = hq // kv_cache.shape[1]
    if mosaic is None:
        mosaic = not interpret and attention_ws.fits(q.dtype, d, group)
    elif mosaic and (interpret or not attention_ws.fits(q.dtype, d, group)):
        raise ValueError(
            f"the Mosaic GPU attention kernel takes bfloat16 caches with head_dim 64, 128 or 256 and at most "
            f"{attention_ws.WG_ROWS // 2} query heads per KV head on the GPU, got {q.dtype} head_dim {d}, {group} "
            f"heads{' in interpret mode' if interpret else ''}"
        )
    if mosaic:
        block_k = block_k or attention_ws.BLOCK_K
        num_stages = num_stages or attention_ws.stages(block_k, d)
        if attention_ws.head_rows(group) % combine_rows:
            raise ValueError(
                f"combine_rows {combine_rows} must divide the Mosaic GPU kernel's {attention_ws.head_rows(group)} "
                f"rows per head (group of {group} query heads)"
            )
    elif ctas is not None:
        raise ValueError(f"attention: ctas={ctas} applies to the Mosaic GPU split kernel only")
    else:
        tile = _tile_heads(group, fold_heads) * ROW_TILE
        auto_block, auto_stages = split_tiles(tile, d, jnp.dtype(q.dtype).itemsize)
        block_k = block_k or auto_block
        num_stages = num_stages or auto_stages
    splits = Splits(split, far_split, far_from) if far_split else Splits(split, split, 0)
    _check_tiles(d, kv_cache.shape[0], block_k, splits, combine_rows, combine_chunk)
    tile = _slot_tile(
        m=m,
        scale=float(scale),
        interpret=interpret,
        fold_heads=fold_heads,
        block_k=block_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        combine_rows=combine_rows,
        combine_chunk=combine_chunk,
        combine_warps=combine_warps,
        combine_stages=combine_stages,
        mosaic=mosaic,
        ctas=ctas,
    )
    start_arr = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(rows, jnp.int32)])
    return tile(q, kv_cache, start_arr)[:m]


@functools.cache
def _slot_tile(**static):
    """`_attention_tile` with these static arguments as a function of (q, kv_cache, start_arr) alone, which under
    `jax.vmap` (a batch's slots, jspec.batch: each with its own queries, cache and start) runs as one call of every
    kernel over the slots, its Mosaic GPU grid sized for all of them: few CTAs per slot and KV head
    (`attention_ws.ctas_per_head` of the batch), each running several splits in one pipeline, where the per-slot
    default would launch a GPU's worth of mostly idle CTAs for every slot; and once the (slot, KV head) items
    outnumber the SMs, one persistent grid over the batch (`attention_ws.batch_split_partials`: each CTA runs
    several items, one wave). A split's arithmetic is the same in every grid and no arithmetic mixes two slots,
    so each slot's rows are the bits of its call alone (docs/design.md, rules 2 and 9)."""

    @jax.custom_batching.custom_vmap
    def tile(q, kv_cache, start_arr):
        return _attention_tile(q, kv_cache, start_arr, **static)

    @tile.def_vmap
    def _(axis_size, in_batched, q, kv_cache, start_arr):
        sized = static["mosaic"] and static["ctas"] is None  # the Mosaic GPU grid, sized for the batch
        whole = sized and all(in_batched)  # every slot its own queries, cache ([B, S, Hkv, 2, D]) and start
        if whole and attention_ws.batch_grid(axis_size, kv_cache.shape[2], kv_cache.shape[4], static["block_k"]):
            return _batch_tile(q, kv_cache, start_arr, **static), True
        call = functools.partial(_attention_tile, **dict(static, batch=axis_size if sized else 1))
        return jax.vmap(call, in_axes=tuple(0 if b else None for b in in_batched))(q, kv_cache, start_arr), True

    return tile


_STATIC = (
    "m",
    "scale",
    "interpret",
    "fold_heads",
    "block_k",
    "splits",
    "num_warps",
    "num_stages",
    "combine_rows",
    "combine_chunk",
    "combine_warps",
    "combine_stages",
    "mosaic",
    "ctas",
)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "batch"))
def _attention_tile(
    q,
    kv_cache,
    start_arr,
    *,
    m,
    scale,
    interpret,
    fold_heads,
    block_k,
    splits,
    num_warps,
    num_stages,
    combine_rows,
    combine_chunk,
    combine_warps,
    combine_stages,
    mosaic,
    ctas,
    batch=1,
):
    """q [m, Hq, D] (the call's rows, m <= ROW_TILE), start_arr int32 [2] (start, valid rows) ->
    [ceil(m / combine_rows) * combine_rows, Hq, D] in q.dtype, rows from the valid ones on zero. batch: how many
    calls run at once under `jax.vmap` (`_slot_tile`), which sizes the Mosaic GPU grid."""
    if mosaic:
        parts = attention_ws.split_partials(
            q,
            kv_cache,
            start_arr,
            scale=scale,
            splits=splits,
            block_k=block_k,
            ring=num_stages,
            ctas=ctas,
            batch=batch,
        )
    else:
        parts = split_partials(
            q,
            kv_cache,
            start_arr,
            scale=scale,
            interpret=interpret,
            fold_heads=fold_heads,
            block_k=block_k,
            splits=splits,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    group = q.shape[1] // kv_cache.shape[1]
    return _merge(
        start_arr,
        parts,
        q_heads=q.shape[1],
        head_rows=attention_ws.head_rows(group) if mosaic else ROW_TILE,
        chunk_rows=attention_ws.WG_ROWS if mosaic else parts[0].shape[2],
        m=m,
        splits=splits,
        interpret=interpret,
        combine_rows=combine_rows,
        combine_chunk=combine_chunk,
        combine_warps=combine_warps,
        combine_stages=combine_stages,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _batch_tile(q, kv_cache, start_arr, **static):
    """`_attention_tile` of B slots at once in one persistent Mosaic GPU grid: q [B, m, Hq, D], kv_cache
    [B, S, Hkv, 2, D], start_arr int32 [B, 2] -> [B, out rows, Hq, D], slot b's rows the bits of
    `_attention_tile(q[b], kv_cache[b], start_arr[b])` (the split kernels' partials agree bit for bit, and the
    combine runs per slot)."""
    parts = attention_ws.batch_split_partials(
        q,
        kv_cache,
        start_arr,
        scale=static["scale"],
        splits=static["splits"],
        block_k=static["block_k"],
        ring=static["num_stages"],
        combine_rows=static["combine_rows"],
    )
    group = q.shape[2] // kv_cache.shape[2]
    per_head, _, chunk_rows = attention_ws.batch_layout(group, q.shape[1], static["combine_rows"])
    merge = functools.partial(
        _merge,
        q_heads=q.shape[2],
        head_rows=per_head,
        chunk_rows=chunk_rows,
        **{k: static[k] for k in ("m", "splits", "interpret")},
        **{k: static[k] for k in ("combine_rows", "combine_chunk", "combine_warps", "combine_stages")},
    )
    return jax.vmap(merge)(start_arr, parts)


def _merge(
    start_arr,
    parts,
    *,
    q_heads,
    head_rows,
    chunk_rows,
    m,
    splits,
    interpret,
    combine_rows,
    combine_chunk,
    combine_warps,
    combine_stages,
):
    """The combine of a call's split partials (`query_tile` layout: head_rows rows a query head, chunks of
    chunk_rows rows) into its first ceil(m / combine_rows) * combine_rows rows [.., q_heads, D]; a partition of one
    split has nothing to combine (`only_split`)."""
    layout = dict(q_heads=q_heads, head_rows=head_rows, chunk_rows=chunk_rows)
    out_rows = -(-m // combine_rows) * combine_rows
    if parts[0].shape[1] == 1:
        return only_split(start_arr, parts[0], out_rows=out_rows, **layout)
    return combine(
        start_arr,
        *parts,
        **layout,
        splits=splits,
        interpret=interpret,
        rows=combine_rows,
        chunk=combine_chunk,
        warps=combine_warps,
        stages=combine_stages,
        out_rows=out_rows,
    )


def only_split(start_arr, o_part, *, q_heads, head_rows, chunk_rows, out_rows):
    """The rows of a partition of one split (`split` = the cache length, far_split None): its partial out = acc / l
    is the attention itself, so no combine runs; o_part [Hkv, 1, T, D] (`query_tile` layout) -> its first out_rows
    rows [out_rows, q_heads, D], rows from start_arr[1] (the valid ones) on zero. A move of values, no arithmetic,
    so a row's bits are the split kernel's whatever the call's M (rule 7: no reduction for XLA to fuse a slice into)."""
    hkv, _, t, d = o_part.shape
    group, chunks = q_heads // hkv, t // chunk_rows
    o = o_part[:, 0].reshape(hkv, chunks, chunk_rows, d)[:, :, : group * head_rows]
    o = o.reshape(hkv, chunks, group, head_rows, d).transpose(1, 3, 0, 2, 4).reshape(chunks * head_rows, q_heads, d)
    return jnp.where((jnp.arange(out_rows) < start_arr[1])[:, None, None], o[:out_rows], jnp.zeros((), o.dtype))


def query_tile(q: jax.Array, hkv: int, head_rows: int, chunk_rows: int, chunks: int | None = None) -> jax.Array:
    """q [M <= ROW_TILE, Hq, D] (a call's rows) -> the split kernels' query tiles [Hkv, C * chunk_rows, D], C =
    chunks (None: ceil(ROW_TILE / head_rows), the whole row tile) chunks: row c * chunk_rows + g * head_rows + r is
    row c * head_rows + r of query head g of the KV head (zero from M on); zero rows after the group's heads in each
    chunk. The M rows are moved first and the tile padded after, so a decode (M = 1, one chunk) moves no padding:
    under a batch's vmap the padded tiles are written once, never transposed."""
    m, hq, d = q.shape
    group = hq // hkv
    chunks = chunks or -(-ROW_TILE // head_rows)
    heads = q.reshape(m, hkv, group, d).transpose(1, 2, 0, 3)  # [Hkv, group, M, D]
    heads = jnp.pad(heads, ((0, 0), (0, 0), (0, chunks * head_rows - m), (0, 0)))
    qt = heads.reshape(hkv, group, chunks, head_rows, d).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(hkv, chunks, group * head_rows, d)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, chunk_rows - group * head_rows), (0, 0)))
    return qt.reshape(hkv, chunks * chunk_rows, d)


def split_partials(q, kv_cache, start_arr, *, scale, interpret, fold_heads, block_k, splits, num_warps, num_stages):
    """q [M <= ROW_TILE, Hq, D], start_arr int32 [2] (start, valid rows: this kernel computes every tile row)
    -> the split kernel's partials (o [Hkv, NS, T, D] in q.dtype, m [Hkv, NS, T], l [Hkv, NS, T] float32; T =
    padded heads x ROW_TILE rows, `query_tile` layout with one chunk). Splits past start_arr[0] + ROW_TILE - 1 are
    not written."""
    _, hq, d = q.shape
    s_len, hkv, _, _ = kv_cache.shape
    group = hq // hkv
    heads = _tile_heads(group, fold_heads)
    rows = heads * ROW_TILE
    slices = ((0, rows),) if fold_heads else tuple((g * ROW_TILE, ROW_TILE) for g in range(group))
    n_split = splits.count(s_len)
    dtype = q.dtype
    qt = query_tile(q, hkv, ROW_TILE, rows)

    scalar = pl.BlockSpec((1,), lambda *_: (0,))
    whole_cache = pl.BlockSpec((s_len, hkv, 2, d), lambda h, j: (0, 0, 0, 0))
    return pl.pallas_call(
        functools.partial(_split_kernel, scale=scale, slices=slices, block_k=block_k, splits=splits),
        grid=(hkv, n_split),
        in_specs=[scalar, pl.BlockSpec((None, rows, d), lambda h, j: (h, 0, 0)), whole_cache],
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
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret,
        name="jspec_attention_split",
    )(start_arr, qt, kv_cache)


def combine(
    start_arr,
    o_part,
    m_part,
    l_part,
    *,
    q_heads,
    head_rows,
    chunk_rows,
    splits,
    interpret,
    rows,
    chunk,
    warps,
    stages,
    out_rows=ROW_TILE,
):
    """The split kernel's partials o_part [Hkv, NS, T, D] (`query_tile` layout: chunks of chunk_rows rows,
    head_rows per query head), m_part/l_part [Hkv, NS, T] float32, start_arr int32 [2] (start, valid rows) ->
    the first out_rows (a multiple of `rows`, <= ROW_TILE) tile rows [out_rows, q_heads, D] in o_part.dtype, rows
    from the valid ones on zero. `rows` rows per program (a divisor of head_rows and chunk_rows): a program's rows
    do not depend on the others, so a call that needs the first M rows runs only their programs (a decode one per
    query head, not ROW_TILE / rows). Splits past start_arr[0] + ROW_TILE - 1 are never read."""
    hkv, n_split, _, d = o_part.shape
    group = q_heads // hkv

    def part_index(h, r):
        first = r * rows  # tile row of the program's first row
        c = first // head_rows
        return h // group, 0, (c * chunk_rows + (h % group) * head_rows + first - c * head_rows) // rows

    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits, chunk=chunk),
        grid=(q_heads, out_rows // rows),
        in_specs=[
            pl.BlockSpec((2,), lambda *_: (0,)),
            pl.BlockSpec((None, n_split, rows, d), lambda h, r: (*part_index(h, r), 0)),
            pl.BlockSpec((None, n_split, rows), part_index),
            pl.BlockSpec((None, n_split, rows), part_index),
        ],
        out_specs=pl.BlockSpec((rows, None, d), lambda h, r: (r, h, 0)),
        out_shape=jax.ShapeDtypeStruct((out_rows, q_heads, d), o_part.dtype),
        compiler_params=_compiler_params(interpret, warps, stages),
        interpret=interpret,
        name="jspec_attention_combine",
    )(start_arr, o_part, m_part, l_part)
