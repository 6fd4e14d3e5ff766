"""Warp-specialized Mosaic GPU split kernel of the decode/verify attention (Hopper, bfloat16 caches).

It computes the same partials as `attention_kernel._split_kernel` (per KV head and split of the cache: m, l in the
exp2 domain, out = acc / l in the cache dtype), and `attention_kernel.combine` merges them, so the partition, the
combine and the exactness argument (attention_kernel's docstring) are shared. One CTA per (KV head, 128-row chunk
of the query tile, split): a TMA warpgroup streams [block_k, head_dim] K and V blocks of the split through a
`stages`-deep ring; each of up to two consumer warpgroups holds 64 query rows (tile row i is row i % R of query
head i // R, R the rows per head of the call; rows past the real heads are zero) and runs, per block, S = Q K^T
(wgmma, float32),
the mask and online softmax in registers, and acc += P V (wgmma, P bfloat16 from registers). Blocks past the
last position any tile row attends are never loaded (the block count is dynamic), and CTAs of splits past it exit
at once. Per-row arithmetic is the same for every R: every wgmma is 64 rows whatever they hold, and a row's scores,
mask, softmax and P V run through the same instructions whatever its slot in the tile (the rows per head only
choose the slot). So a decode call (R = 2) runs one warpgroup where a full tile of 5 heads x 16 rows runs two.
GPU only (the Pallas Mosaic GPU API of jax >= 0.11).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import ROW_TILE

WG_ROWS = 64  # query rows per consumer warpgroup (the wgmma M)
BLOCK_K = 64  # cache positions per pipeline step (default)
_LOG2E = math.log2(math.e)


def stages(block_k: int, head_dim: int) -> int:
    """Ring depth: 4 for K and V blocks of up to 64 x 128 bf16 each, else 2 (shared memory, with the q tile)."""
    return 4 if block_k * head_dim <= 64 * 128 else 2


def fits(dtype, head_dim: int) -> bool:
    """Whether this kernel takes caches of `dtype` and `head_dim` (bf16; head_dim 64, 128 or 256)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and head_dim in (64, 128, 256)


def tile_rows(group: int, head_rows: int) -> int:
    """Rows of one KV head's query tile: group heads x head_rows rows, padded to WG_ROWS (one warpgroup) or to a
    multiple of 2 x WG_ROWS (chunks of two warpgroups)."""
    unit = WG_ROWS if group * head_rows <= WG_ROWS else 2 * WG_ROWS
    return -(-group * head_rows // unit) * unit


@functools.partial(jax.jit, static_argnames=("scale", "splits", "block_k", "ring"))
def split_partials(q, k_cache, v_cache, start_arr, *, scale, splits, block_k, ring):
    """q [R <= ROW_TILE, Hq, D] bf16 (R rows per head, row r at position start + r), caches [S, Hkv, D] bf16,
    start_arr int32 [1] -> partials o [Hkv, NS, T, D] bf16, m and l [Hkv, NS, T] float32 (T = tile_rows(group,
    R); row g * R + r is row r of the group's head g); splits past start + ROW_TILE - 1 are not written.
    `splits` is the attention_kernel.Splits partition (split sizes multiples of block_k);
    ring: pipeline depth (`stages` gives the default)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.attention_kernel import query_tile  # here: attention_kernel imports this module

    head_rows, hq, d = q.shape
    s_len, hkv, _ = k_cache.shape
    group = hq // hkv
    rows = tile_rows(group, head_rows)
    wgs = min(2, rows // WG_ROWS)
    chunks = rows // (wgs * WG_ROWS)
    n_split = splits.count(s_len)
    qt = query_tile(q, hkv, rows)
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    c = scale * _LOG2E

    def jspec_attention_ws(start_gmem, q_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem, q_smem, ml_smem, q_bar):
        head, chunk, j = jax.lax.axis_index("h"), jax.lax.axis_index("r"), jax.lax.axis_index("s")
        start = start_gmem[0]
        last = start + ROW_TILE - 1  # the last position any tile row attends
        first = splits.first(j)

        @pl.when(first <= last)
        def _():
            n_blocks = jnp.minimum(jax.lax.div(last - first, block_k) + 1, splits.blocks(j, block_k))
            first_block = jax.lax.div(first, block_k)

            def block(b):
                return first_block + b, head

            def body(idx, k_smem, v_smem, carry):
                acc, m, den = carry
                wg = jax.lax.axis_index("wg")
                base = first + idx[0] * block_k

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem.at[wg], k_smem.transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, block_k), jnp.float32))
                row0 = (chunk * wgs + wg) * WG_ROWS  # this warpgroup's first row in the KV head's tile
                row = row0 + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(base + col <= start + jax.lax.rem(row, head_rows), s * c, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_use, s.shape, [0]))
                alpha = jnp.where(m_new == m, 1.0, jnp.exp2(m - m_use))
                den = den * alpha + p.sum(axis=1)
                acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(jnp.bfloat16), v_smem)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                return acc, m_new, den

            def compute_context(eval_pipeline):
                wg = jax.lax.axis_index("wg")
                row0 = (chunk * wgs + wg) * WG_ROWS
                plgpu.copy_gmem_to_smem(q_gmem.at[head, pl.ds(row0, WG_ROWS)], q_smem.at[wg], q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])
                reduced = plgpu.Layout.WGMMA.reduce(1)
                init = (
                    plgpu.layout_cast(jnp.zeros((WG_ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), reduced),
                    plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), reduced),
                )
                acc, m, den = eval_pipeline(init)
                inv = jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)  # nothing visible: out = 0
                q_smem.at[wg][...] = (acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
                ml_smem.at[wg, 0][...] = m
                ml_smem.at[wg, 1][...] = den
                plgpu.commit_smem()
                rows_out = pl.ds(row0, WG_ROWS)
                plgpu.copy_smem_to_gmem(q_smem.at[wg], o_gmem.at[head, j, rows_out])
                plgpu.copy_smem_to_gmem(ml_smem.at[wg, 0], m_gmem.at[head, j, rows_out])
                plgpu.copy_smem_to_gmem(ml_smem.at[wg, 1], l_gmem.at[head, j, rows_out])
                plgpu.wait_smem_to_gmem(0)

            plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(n_blocks,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((block_k, d), block, transforms=tf),
                    plgpu.BlockSpec((block_k, d), block, transforms=tf),
                ],
                wg_axis="wg",
                num_compute_wgs=wgs,
                max_concurrent_steps=ring,
                compute_context=compute_context,
            )(k_gmem, v_gmem)

    out_type = (
        jax.ShapeDtypeStruct((hkv, n_split, rows, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((hkv, n_split, rows), jnp.float32),
        jax.ShapeDtypeStruct((hkv, n_split, rows), jnp.float32),
    )
    return plgpu.kernel(
        jspec_attention_ws,
        out_type=out_type,
        grid=(hkv, chunks, n_split),
        grid_names=("h", "r", "s"),
        num_threads=wgs + 1,
        thread_name="wg",
        scratch_types=dict(
            q_smem=plgpu.SMEM((wgs, WG_ROWS, d), jnp.bfloat16, transforms=tf),
            ml_smem=plgpu.SMEM((wgs, 2, WG_ROWS), jnp.float32),
            q_bar=plgpu.Barrier(num_barriers=wgs),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(start_arr, qt, k_cache.reshape(s_len, hkv * d), v_cache.reshape(s_len, hkv * d))
