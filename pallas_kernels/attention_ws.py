"""Warp-specialized Mosaic GPU split kernel of the decode/verify attention (Hopper, bfloat16 caches).

It computes the same partials as `attention_kernel._split_kernel` (per KV head and split of the cache: m, l in the
exp2 domain, out = acc / l in the cache dtype), and `attention_kernel.combine` merges them, so the partition, the
combine and the exactness argument (attention_kernel's docstring) are shared. The ROW_TILE query rows of a KV
head's `group` query heads are cut into chunks of R = `head_rows(group)` rows per head, one 64-row warpgroup tile
each (slot g * R + r of chunk c is row c * R + r of the group's head g; slots past the heads are zero).
A persistent grid of `ctas_per_head` CTAs per KV head: each takes one chunk holding a valid row (the valid row
count is data, like the start) and its share of the live splits, and runs them one after another in one pipeline:
a TMA warpgroup streams their [block_k, head_dim] K and V blocks through a `stages`-deep ring; a consumer warpgroup
runs, per block, S = Q K^T (wgmma, float32), the mask and online softmax in registers, and acc += P V (wgmma, P
bfloat16 from registers), starting a split's state fresh at its first block and storing its partial after its
last. Blocks past the last position any tile row attends are never loaded, and dead splits and chunks cost no CTA:
a decode runs chunk 0 only. So decode and verify run one kernel on the same shapes, whatever M; they differ only
in the data.

A batch's slots (jspec.batch, under `jax.vmap`) whose (slot, KV head) items outnumber the SMs run
`batch_split_partials` instead: one persistent grid over the whole batch, each CTA running several items' splits
in one pipeline of K and V blocks (the query tiles, only the batch's rows in memory, loaded a chunk ahead), so the
batch is one wave of CTAs rather than several waves each paying a pipeline's fill and drain. Both kernels run a
split with the same code (`_walk`, `_attend`, `_store`) and a row's place in its tile does not enter its
arithmetic, so a slot's rows are the same bits in either grid. GPU only (the Pallas Mosaic GPU API of jax >= 0.11).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import ROW_TILE, SMEM_BYTES, SMEM_RESERVE, sm_count

WG_ROWS = 64  # query rows per consumer warpgroup (the wgmma M)
BLOCK_K = 64  # cache positions per pipeline step (default)
_LOG2E = math.log2(math.e)


def stages(block_k: int, head_dim: int) -> int:
    """Ring depth: 4 for K and V blocks of up to 64 x 128 bf16 each, else 2 (shared memory, with the q tile)."""
    return 4 if block_k * head_dim <= 64 * 128 else 2


def fits(dtype, head_dim: int, group: int) -> bool:
    """Whether this kernel takes caches of `dtype` and `head_dim` with `group` query heads per KV head (bf16;
    head_dim 64, 128 or 256; at most WG_ROWS // 2 heads, so a chunk holds 2 rows of each)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and head_dim in (64, 128, 256) and group <= WG_ROWS // 2


def head_rows(group: int) -> int:
    """Rows per query head in one chunk: the most (even, <= ROW_TILE) that fit `group` heads in WG_ROWS."""
    return min(ROW_TILE, WG_ROWS // group // 2 * 2)


def ctas_per_head(hkv: int, chunks: int, n_split: int, batch: int = 1) -> int:
    """CTAs per KV head of a call on `batch` caches at once (a batch's slots under `jax.vmap`, each with its own
    Hkv x CTAs grid): sm_count() // (batch * hkv), so one wave of CTAs fills the GPU, but at least `chunks` (each
    chunk of the row tile needs a CTA) and no more than chunks x n_split, the (chunk, split) pairs a call can have
    live (a CTA past them would only start and exit). A large batch thus gets few CTAs per head, each running several
    splits in one pipeline, rather than a grid of mostly idle CTAs per slot."""
    return max(chunks, min(sm_count() // (batch * hkv), chunks * n_split))


def batch_grid(batch: int, hkv: int, head_dim: int, block_k: int = BLOCK_K) -> bool:
    """Whether a call on `batch` caches at once runs `batch_split_partials`: its (slot, KV head) items outnumber the
    SMs (a grid of one CTA each would run in several waves) and its ring of K and V tiles, two query tiles and the
    out tile fit in shared memory (head_dim 256 does not: 32 bytes over), rather than `split_partials` under
    `jax.vmap`."""
    ring = stages(block_k, head_dim)
    tiles = (ring * 2 * block_k + 3 * WG_ROWS) * head_dim * 2 + 2 * WG_ROWS * 4  # K, V ring; 2 q, out; m, l
    return batch * hkv > sm_count() and tiles + SMEM_RESERVE <= SMEM_BYTES


def batch_layout(group: int, m: int, multiple: int = 2) -> tuple[int, int, int]:
    """The query tiles of `batch_split_partials` for calls of m rows (the batch's rows per slot, static) ->
    (rows per query head R, chunks C, rows per chunk T): R = m rounded up to `multiple` (the combine's rows per
    program, which divides `head_rows`), at most `head_rows(group)`; C = ceil(m / R); T = group x R rounded up to
    8 (the tiles' row tiling). A decode of 4 heads a KV head moves 8 rows a tile where `split_partials` moves 64."""
    per_head = min(head_rows(group), -(-m // multiple) * multiple)
    return per_head, -(-m // per_head), -(-group * per_head // 8) * 8


def batch_ctas(items: int) -> int:
    """CTAs of `batch_split_partials` for `items` (slot, KV head) items: each takes ceil(items / SMs) of them, and
    the grid is the fewest CTAs that hold them all (512 items on 132 SMs: 128 CTAs of 4)."""
    per_cta = -(-items // sm_count())
    return -(-items // per_cta)


def _walk(splits, block_k: int, last, slot=0, slots=1):
    """The splits one CTA computes for one chunk whose rows attend positions up to `last` (traced): splits slot,
    slot + slots, ... of those holding a position <= last (traced slot, slots; 0, 1: all of them), near splits
    first -> (items: how many, steps: their blocks, locate: pipeline step t -> (split j, its first position, block
    within it, its block count)). The last live split needs only its blocks up to the one holding `last`."""
    near_blocks, far_blocks = splits.size // block_k, splits.far_size // block_k
    live = splits.live(last)  # splits 0 .. live - 1 hold a position <= last
    last_blocks = jax.lax.div(last - splits.first(live - 1), block_k) + 1

    def count(total):  # how many of splits 0 .. total - 1 are this CTA's
        return jnp.where(slot < slots, jnp.maximum(jax.lax.div(total - slot + slots - 1, slots), 0), 0)

    items = count(live)
    near_items = jnp.minimum(count(splits.near), items)
    near_steps = near_items * near_blocks

    def blocks_of(j):  # blocks split j reads: all of them, but the last live split's up to `last`
        full = splits.blocks(j, block_k)
        return jnp.where(j == live - 1, jnp.minimum(full, last_blocks), full)

    def locate(t):
        in_near = t < near_steps
        far_t = jnp.maximum(t - near_steps, 0)
        k = jnp.where(in_near, jax.lax.div(t, near_blocks), near_items + jax.lax.div(far_t, far_blocks))
        b = jnp.where(in_near, jax.lax.rem(t, near_blocks), jax.lax.rem(far_t, far_blocks))
        j = slot + k * slots
        return j, splits.first(j), b, blocks_of(j)

    # only the CTA's last split can be the truncated last live split
    last_j = slot + (items - 1) * slots
    steps = near_steps + (items - near_items) * far_blocks - splits.blocks(last_j, block_k) + blocks_of(last_j)
    return items, jnp.where(items > 0, steps, 0), locate


def _fresh_state(d: int):
    """The online softmax state of a split before its first block: acc [WG_ROWS, D] = 0, m = -inf, l = 0
    [WG_ROWS] (float32, in the wgmma layouts)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    reduced = plgpu.Layout.WGMMA.reduce(1)
    return (
        plgpu.layout_cast(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), reduced),
        plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), reduced),
    )


def _attend(q_smem, k_smem, v_smem, state, *, fresh, base, chunk_start, per_head: int, c: float, block_k: int):
    """One [block_k, D] K and V block at positions base.. into a split's online softmax state (acc, m, l; exp2
    domain; fresh: the split's first block, the state starts over): S = Q K^T (wgmma, float32), tile row r sees
    positions <= chunk_start + r % per_head, then acc += P V (P bfloat16 from registers) -> the new state."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    acc, m, den = state
    acc = jnp.where(fresh, 0.0, acc)  # a select, not a branch: no wgmma under a branch
    m = jnp.where(fresh, -jnp.inf, m)
    den = jnp.where(fresh, 0.0, den)

    def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_smem.transpose((1, 0)))
        return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, block_k), jnp.float32))
    row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    s = jnp.where(base + col <= chunk_start + jax.lax.rem(row, per_head), s * c, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_use, s.shape, [0]))
    alpha = jnp.where(m_new == m, 1.0, jnp.exp2(m - m_use))
    den = den * alpha + p.sum(axis=1)
    acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(jnp.bfloat16), v_smem)

    return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, den


def _store(state, o_smem, ml_smem, o_dst, m_dst, l_dst, rows: int = WG_ROWS) -> None:
    """A split's partial from its final state: out = acc / l (0 where nothing was visible) in bfloat16, m and l,
    through shared memory into the gmem slices o_dst [rows, D], m_dst and l_dst [rows] (the tile's first `rows`
    rows, a multiple of 8)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    acc, m, den = state
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store has read o_smem, ml_smem
    inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)
    o_smem[...] = (acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
    ml_smem.at[0][...] = m
    ml_smem.at[1][...] = den
    plgpu.commit_smem()
    first = pl.ds(0, rows)
    plgpu.copy_smem_to_gmem(o_smem if rows == WG_ROWS else o_smem.at[first], o_dst)
    plgpu.copy_smem_to_gmem(ml_smem.at[0, first], m_dst)
    plgpu.copy_smem_to_gmem(ml_smem.at[1, first], l_dst)


def _split_step(
    q_smem, k_smem, v_smem, state, at, *, o_smem, ml_smem, parts, per_head: int, c: float, block_k: int, chunk_rows: int
):
    """One pipeline step of a split: at = (split j, its first position, block b in it, its block count nb, the
    chunk's first row position, the partials' index before the split, the chunk) -> block b into the state
    (`_attend`), and after the split's last block its partial stored into parts (o, m, l gmem refs) at
    [*index, j, the chunk's chunk_rows rows]. -> the new state."""
    j, first, b, nb, chunk_start, index, chunk = at
    state = _attend(
        q_smem,
        k_smem,
        v_smem,
        state,
        fresh=b == 0,
        base=first + b * block_k,
        chunk_start=chunk_start,
        per_head=per_head,
        c=c,
        block_k=block_k,
    )

    @pl.when(b == nb - 1)  # the split ends: store its partial
    def _():
        dst = (*index, j, pl.ds(chunk * chunk_rows, chunk_rows))
        _store(state, o_smem, ml_smem, *(ref.at[dst] for ref in parts), rows=chunk_rows)

    return state


def _pipeline(body, steps, in_specs, ring: int, compute_context, *refs) -> None:
    """Both kernels' pipeline: `steps` steps of body over in_specs' blocks of refs, one TMA warpgroup streaming
    them through a `ring`-deep ring and one consumer warpgroup (compute_context sets it up and runs it)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=1,
        max_concurrent_steps=ring,
        compute_context=compute_context,
    )(*refs)


def _tf():
    """The tiling and swizzle of every [*, D] bfloat16 shared-memory tile (q, K, V, out)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@functools.partial(jax.jit, static_argnames=("scale", "splits", "block_k", "ring", "ctas", "batch"))
def split_partials(q, kv_cache, start_arr, *, scale, splits, block_k, ring, ctas=None, batch=1):
    """q [M <= ROW_TILE, Hq, D] bf16 (row r at position start + r), kv_cache [S, Hkv, 2, D] bf16, start_arr int32 [2] =
    (start, valid rows) -> partials o [Hkv, NS, C * WG_ROWS, D] bf16, m and l [Hkv, NS, C * WG_ROWS] float32 in
    chunk layout (module docstring; C chunks of head_rows(group) rows per head). Splits past start + ROW_TILE - 1
    and chunks past the valid rows are not written. `splits` is the attention_kernel.Splits partition (split
    sizes multiples of block_k); ring: pipeline depth (`stages` gives the default); ctas: CTAs per KV head (None:
    `ctas_per_head` for `batch` caches run at once under `jax.vmap`).

    Persistent grid: with L chunks holding a valid row, CTA c of a KV head computes chunk c % L of the live splits
    s, s + n, s + 2 n, ... (s = c // L, n = ctas // L; CTAs with s >= n idle) one after another in one pipeline: a
    split's state starts fresh at its first block and its partial is stored after its last. A split's blocks and
    arithmetic do not depend on which CTA computes it or on what it computed before, so neither do its bits."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.attention_kernel import query_tile  # here: attention_kernel imports this module

    _, hq, d = q.shape
    s_len, hkv, _, _ = kv_cache.shape
    group = hq // hkv
    per_head = head_rows(group)
    chunks = -(-ROW_TILE // per_head)
    n_split = splits.count(s_len)
    ctas = ctas or ctas_per_head(hkv, chunks, n_split, batch)
    if ctas < chunks:
        raise ValueError(f"attention: {ctas} CTAs per KV head cannot hold the {chunks} chunks of a row tile")
    qt = query_tile(q, hkv, per_head, WG_ROWS)
    tf = _tf()
    c = scale * _LOG2E

    def jspec_attention_ws(start_gmem, q_gmem, kv_gmem, o_gmem, m_gmem, l_gmem, q_smem, o_smem, ml_smem, q_bar):
        kernel_args = dict(parts=(o_gmem, m_gmem, l_gmem), per_head=per_head, c=c, block_k=block_k, chunk_rows=WG_ROWS)
        head, cta = jax.lax.axis_index("h"), jax.lax.axis_index("c")
        start, valid = start_gmem[0], start_gmem[1]
        live_chunks = jax.lax.div(valid + per_head - 1, per_head)
        chunk, slot = jax.lax.rem(cta, live_chunks), jax.lax.div(cta, live_chunks)
        slots = jax.lax.div(jnp.int32(ctas), live_chunks)  # CTAs per chunk
        chunk_start = start + chunk * per_head  # position of this chunk's tile row 0
        items, steps, locate = _walk(splits, block_k, start + ROW_TILE - 1, slot, slots)

        @pl.when(items > 0)
        def _():
            def block(t, kv):  # the cache viewed [S, Hkv * 2 * D]: head h's keys are column block 2 h, values 2 h + 1
                _, first, b, _ = locate(t)
                return jax.lax.div(first, block_k) + b, 2 * head + kv

            def body(idx, k_smem, v_smem, state):
                j, first, b, nb = locate(idx[0])
                at = (j, first, b, nb, chunk_start, (head,), chunk)
                return _split_step(q_smem, k_smem, v_smem, state, at, o_smem=o_smem, ml_smem=ml_smem, **kernel_args)

            def compute_context(eval_pipeline):
                plgpu.copy_gmem_to_smem(q_gmem.at[head, pl.ds(chunk * WG_ROWS, WG_ROWS)], q_smem, q_bar)
                plgpu.barrier_wait(q_bar)
                eval_pipeline(_fresh_state(d))
                plgpu.wait_smem_to_gmem(0)

            keys = plgpu.BlockSpec((block_k, d), lambda t: block(t, 0), transforms=tf)
            values = plgpu.BlockSpec((block_k, d), lambda t: block(t, 1), transforms=tf)
            _pipeline(body, steps, [keys, values], ring, compute_context, kv_gmem, kv_gmem)

    rows = chunks * WG_ROWS
    out_type = (
        jax.ShapeDtypeStruct((hkv, n_split, rows, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((hkv, n_split, rows), jnp.float32),
        jax.ShapeDtypeStruct((hkv, n_split, rows), jnp.float32),
    )
    return plgpu.kernel(
        jspec_attention_ws,
        out_type=out_type,
        grid=(hkv, ctas),
        grid_names=("h", "c"),
        num_threads=2,
        thread_name="wg",
        scratch_types=dict(
            q_smem=plgpu.SMEM((WG_ROWS, d), jnp.bfloat16, transforms=tf),
            o_smem=plgpu.SMEM((WG_ROWS, d), jnp.bfloat16, transforms=tf),
            ml_smem=plgpu.SMEM((2, WG_ROWS), jnp.float32),
            q_bar=plgpu.Barrier(),
        ),
        compiler_params=_compiler_params(),
    )(start_arr, qt, kv_cache.reshape(s_len, hkv * 2 * d))


@functools.partial(jax.jit, static_argnames=("scale", "splits", "block_k", "ring", "combine_rows"))
def batch_split_partials(q, kv_cache, start_arr, *, scale, splits, block_k, ring, combine_rows=2):
    """A batch's partials in one persistent grid: q [B, m, Hq, D] bf16 (m <= ROW_TILE rows per slot), kv_cache
    [B, S, Hkv, 2, D] bf16, start_arr int32 [B, 2] (each slot's start and valid rows) -> o [B, Hkv, NS, C * T, D]
    bf16, m and l [B, Hkv, NS, C * T] float32 in the `batch_layout(group, m, combine_rows)` layout (R rows a head, C
    chunks of T rows; `query_tile`'s order), where slot b's rows are the bits of `split_partials`' of (q[b],
    kv_cache[b], start_arr[b]) (splits and chunks neither computes are left unwritten).

    The B x Hkv (slot, KV head) items are dealt to `batch_ctas` CTAs, item i to CTA i % G. A CTA runs all the live
    chunks and splits of its items one after another in one pipeline of K and V blocks: one item's loads overlap
    the previous item's arithmetic, and the batch runs in one wave where a grid of one CTA per item runs in
    B x Hkv / SMs waves, each paying its pipeline's fill and drain. A chunk's query tile holds only its T rows in
    memory (a decode of 4 heads: 8 rows, not the 64 of a warpgroup's tile): the consumer loads it into one of two
    64-row buffers whose other rows stay zero, the next chunk's while this one computes, and stores the partials'
    first T rows. A split's blocks and arithmetic are `split_partials`' (`_attend`, `_store`; fresh state at its
    first block) and a row's place in the tile does not enter its arithmetic, so its bits depend neither on the CTA
    that computes it, nor on what that CTA computed before, nor on the layout."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.attention_kernel import query_tile  # here: attention_kernel imports this module

    batch, m, hq, d = q.shape
    _, s_len, hkv, _, _ = kv_cache.shape
    group = hq // hkv
    per_head, chunks, chunk_rows = batch_layout(group, m, combine_rows)
    n_split = splits.count(s_len)
    items = batch * hkv
    grid = batch_ctas(items)
    per_cta = -(-items // grid)
    s_blocks = s_len // block_k
    qt = jax.vmap(lambda x: query_tile(x, hkv, per_head, chunk_rows, chunks))(q).reshape(items * chunks, chunk_rows, d)
    tf = _tf()
    c = scale * _LOG2E

    def jspec_attention_ws_batch(start_gmem, q_gmem, kv_gmem, o_gmem, m_gmem, l_gmem, q_smem, q_bar, o_smem, ml_smem):
        kernel_args = dict(
            parts=(o_gmem, m_gmem, l_gmem), per_head=per_head, c=c, block_k=block_k, chunk_rows=chunk_rows
        )
        cta = jax.lax.axis_index("c")
        # this CTA's items cta, cta + grid, ...: slot, KV head, last attended position, steps a chunk, first step,
        # chunks before it (its first chunk's index among the CTA's)
        mine, total, tiles = [], jnp.int32(0), jnp.int32(0)
        for i in range(per_cta):
            item = cta + i * grid
            real = item < items
            item = jnp.minimum(item, items - 1)
            slot = jax.lax.div(item, hkv)
            last = start_gmem[slot, 0] + ROW_TILE - 1
            _, chunk_steps, _ = _walk(splits, block_k, last)
            live_chunks = jnp.where(real, jax.lax.div(start_gmem[slot, 1] + per_head - 1, per_head), 0)
            mine.append((slot, jax.lax.rem(item, hkv), last, chunk_steps, total, tiles))
            total = total + live_chunks * chunk_steps
            tiles = tiles + live_chunks

        def at(t):
            """Pipeline step t -> (slot, KV head, chunk, split j, its first position, block b in it, its block
            count, the chunk's first row position, the chunk's index among the CTA's, whether t is its first
            step, its steps)."""
            item = mine[0]
            for later in mine[1:]:  # the last item starting at or before t (an empty item is passed over)
                item = tuple(jnp.where(t >= later[4], new, old) for new, old in zip(later, item, strict=True))
            slot, head, last, chunk_steps, offset, tiles_before = item
            chunk, step = jax.lax.div(t - offset, chunk_steps), jax.lax.rem(t - offset, chunk_steps)
            _, _, locate = _walk(splits, block_k, last)
            j, first, b, nb = locate(step)
            row0 = last - (ROW_TILE - 1) + chunk * per_head
            return slot, head, chunk, j, first, b, nb, row0, tiles_before + chunk, step == 0, chunk_steps

        def load_query(t, buf):
            """The query tile of the chunk whose first step is t -> rows 0 .. T - 1 of buffer buf (async)."""
            slot, head, chunk = at(t)[:3]
            dst = q_smem.at[buf] if chunk_rows == WG_ROWS else q_smem.at[buf, pl.ds(0, chunk_rows)]
            plgpu.copy_gmem_to_smem(q_gmem.at[(slot * hkv + head) * chunks + chunk], dst, q_bar.at[buf])

        def kv_block(t, kv):  # the caches viewed [B * S, Hkv * 2 * D]
            slot, head, _, _, first, b, *_ = at(t)
            return slot * s_blocks + jax.lax.div(first, block_k) + b, 2 * head + kv

        def body(idx, k_smem, v_smem, state):
            t = idx[0]
            slot, head, chunk, j, first, b, nb, row0, tile, starts, chunk_steps = at(t)
            buf = jax.lax.rem(tile, 2)

            @pl.when(starts)  # a chunk's first step: its queries have landed; the next chunk's start loading
            def _():
                plgpu.barrier_wait(q_bar.at[buf])

                @pl.when(t + chunk_steps < total)
                def _():
                    load_query(t + chunk_steps, 1 - buf)

            step = (j, first, b, nb, row0, (slot, head), chunk)
            kw = dict(o_smem=o_smem, ml_smem=ml_smem, **kernel_args)
            return _split_step(q_smem.at[buf], k_smem, v_smem, state, step, **kw)

        def compute_context(eval_pipeline):
            if chunk_rows < WG_ROWS:  # the rows past a chunk's T stay zero (written before any load lands)
                zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, d), jnp.bfloat16), plgpu.Layout.WGMMA)
                q_smem.at[0][...] = zeros
                q_smem.at[1][...] = zeros
                plgpu.commit_smem()
            load_query(jnp.int32(0), 0)
            eval_pipeline(_fresh_state(d))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(total > 0)
        def _():
            keys = plgpu.BlockSpec((block_k, d), lambda t: kv_block(t, 0), transforms=tf)
            values = plgpu.BlockSpec((block_k, d), lambda t: kv_block(t, 1), transforms=tf)
            _pipeline(body, total, [keys, values], ring, compute_context, kv_gmem, kv_gmem)

    rows = chunks * chunk_rows
    out_type = (
        jax.ShapeDtypeStruct((batch, hkv, n_split, rows, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, hkv, n_split, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, hkv, n_split, rows), jnp.float32),
    )
    return plgpu.kernel(
        jspec_attention_ws_batch,
        out_type=out_type,
        grid=(grid,),
        grid_names=("c",),
        num_threads=2,
        thread_name="wg",
        scratch_types=dict(
            q_smem=plgpu.SMEM((2, WG_ROWS, d), jnp.bfloat16, transforms=tf),
            q_bar=plgpu.Barrier(num_barriers=2),
            o_smem=plgpu.SMEM((WG_ROWS, d), jnp.bfloat16, transforms=tf),
            ml_smem=plgpu.SMEM((2, WG_ROWS), jnp.float32),
        ),
        compiler_params=_compiler_params(),
    )(start_arr, qt, kv_cache.reshape(batch * s_len, hkv * 2 * d))


def _compiler_params():
    """Both kernels' Mosaic GPU compiler parameters (approximate exp2, lane semantics)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)
