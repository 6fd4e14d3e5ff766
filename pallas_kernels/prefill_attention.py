"""Prefill and full-forward attention: flash-style (online softmax over key blocks), never a [T, T] score matrix.

`chunk_attention(q, kv, start, scale=...)`: query rows q [C, Hq, D] at absolute positions start .. start + C - 1
against a key/value array kv [S, Hkv, 2, D] (keys at [:, :, 0], values at [:, :, 1]: a layer's KV cache, or the
fresh keys of a full forward). Row i attends positions 0 .. start + i, causally; keys are visited in blocks of
`block_k` positions with a running max and sum (float32 statistics), and blocks past a row's position are never
read. Memory: the output plus one [Hq, C, block_k] block of scores (the jnp path) or one [block_q, block_k] tile
per program (the kernel), whatever S and start are.

Backends (`pallas_kernels.backend`):
- "pallas" (GPU) / "interpret" (CPU): a Pallas kernel (Triton lowering), grid (query heads, query blocks of
  `block_q` rows): a program walks the key blocks 0 .. (its last row's position) // block_k of its KV head with an
  online softmax in the exp2 domain and writes its rows once. Query heads of one KV head run in neighbouring
  programs, so the GPU's L2 serves their shared key blocks.
- "reference" (CPU): the same online softmax in jnp, the whole chunk per key block, in a `fori_loop` whose trip
  count is the number of live key blocks; with a static start and shapes (a full forward) the loop is a scan,
  differentiable, its body rematerialized in the backward pass so a gradient stores no score blocks either.
A full forward (a static start) is differentiable on every backend: the kernel's backward pass is the jnp path's
(`checkpoints.train_demo` and `train_drafter` train through `jspec.models.dense.forward`).

Prefill is outside the decode / verify bit-equality (greedy and speculative decoding share it): this path only
has to be deterministic, which every backend is (fixed block order, no atomics).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend

REFERENCE_BLOCK_K = 256  # keys per step of the jnp path (a divisor of the cache's 256-position granularity)
KERNEL_TILES = {  # head_dim -> (block_q, block_k, num_warps, num_stages) of the kernel on the GPU
    16: (64, 64, 4, 2),
    32: (64, 64, 4, 2),
    64: (128, 64, 4, 3),
    128: (128, 64, 8, 3),
    256: (64, 32, 8, 2),
}
# float32 q / kv where the tiles above overflow the H200's 227 KB of shared memory (at head_dim 128 float32 they
# asked 256.5 KB: the query tile and 3 stages of key and value blocks, twice the bytes of bfloat16)
FLOAT32_TILES = {
    128: (64, 64, 4, 2),
    256: (32, 32, 4, 2),
}
INTERPRET_TILES = (16, 16)  # (block_q, block_k) in interpret mode: tiny tests still cross several blocks
_LOG2E = math.log2(math.e)


def chunk_attention(q: jax.Array, kv: jax.Array, start, *, scale: float) -> jax.Array:
    """q [C, Hq, D] at positions start .. start + C - 1 (start int32, static or traced), kv [S, Hkv, 2, D] in
    q.dtype -> [C, Hq, D] in q.dtype. Row i attends kv positions 0 .. min(start + i, S - 1) (the caller has written
    them). GQA: query head h uses KV head h // (Hq // Hkv). Softmax statistics in float32."""
    c, hq, d = q.shape
    hkv = _backend.kv_heads(hq, kv)
    if kv.shape[3] != d or kv.dtype != q.dtype:
        raise ValueError(f"chunk_attention: q {q.shape} {q.dtype} does not fit kv {kv.shape} {kv.dtype}")
    del hkv
    name = _backend.get_backend()
    if name == "reference":
        return _reference(q, kv, start, scale=scale)
    if isinstance(start, int):  # a full forward: differentiable (training), the backward the jnp path's
        return _differentiable_kernel(q, kv, start, float(scale), name == "interpret")
    return _kernel_call(q, kv, start, scale=scale, interpret=name == "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _differentiable_kernel(q, kv, start: int, scale: float, interpret: bool):
    """The kernel with a static start, with a VJP: the kernel has none of its own, so the backward pass is the jnp
    reference's (`_reference` recomputed from q and kv, its blocks rematerialized: no score matrix stored)."""
    return _kernel_call(q, kv, start, scale=scale, interpret=interpret)


def _differentiable_fwd(q, kv, start, scale, interpret):
    return _differentiable_kernel(q, kv, start, scale, interpret), (q, kv)


def _differentiable_bwd(start, scale, interpret, residuals, grad):
    _, vjp = jax.vjp(lambda q, kv: _reference(q, kv, start, scale=scale), *residuals)
    return vjp(grad)


_differentiable_kernel.defvjp(_differentiable_fwd, _differentiable_bwd)


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    pad = -x.shape[0] % multiple
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) if pad else x


def _live_blocks(start, rows: int, s_len: int, block_k: int):
    """Key blocks holding a position some row of a `rows`-row tile at `start` attends (static when start is)."""
    last = start + rows - 1
    if isinstance(last, int):
        return min(last // block_k + 1, s_len // block_k)
    return jnp.minimum(last // block_k + 1, s_len // block_k)


# ------------------------------------------------------------------------------------------------ jnp reference
def _reference(q, kv, start, *, scale: float, block_k: int = REFERENCE_BLOCK_K):
    c, hq, d = q.shape
    block_k = min(block_k, -(-kv.shape[0] // 16) * 16)
    kv = _pad_rows(kv, block_k)
    hkv = kv.shape[1]
    qg = q.astype(jnp.float32).reshape(c, hkv, hq // hkv, d)
    row_pos = (start + jnp.arange(c, dtype=jnp.int32))[:, None]  # [C, 1]
    precision = jax.lax.Precision.HIGHEST

    @jax.checkpoint
    def body(b, carry):
        m, den, acc = carry  # [Hkv, G, C], [Hkv, G, C], [Hkv, G, C, D]
        pos = b * block_k + jnp.arange(block_k, dtype=jnp.int32)
        block = jax.lax.dynamic_slice_in_dim(kv, b * block_k, block_k).astype(jnp.float32)
        block = jnp.where((pos <= row_pos[-1, 0])[:, None, None, None], block, 0.0)  # rows no query sees: never read
        s = jnp.einsum("chgd,khd->hgck", qg, block[:, :, 0], precision=precision) * scale
        s = jnp.where(pos[None, :] <= row_pos, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_use[..., None])
        alpha = jnp.exp(m - m_use)
        den = den * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("hgck,khd->hgcd", p, block[:, :, 1], precision=precision)
        return m_new, den, acc

    shape = (hkv, hq // hkv, c)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (d,)))
    _, den, acc = jax.lax.fori_loop(0, _live_blocks(start, c, kv.shape[0], block_k), body, init)
    out = acc / den[..., None]  # every row sees position 0 at least: den > 0
    return jnp.moveaxis(out, 2, 0).reshape(c, hq, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------------- Pallas kernel
def _kernel(start_ref, q_ref, kv_ref, o_ref, *, scale, group, block_q, block_k, s_len, rows_in_call):
    """One (query head, query block) program: q_ref / o_ref [block_q, D], kv_ref the whole kv [S, Hkv, 2, D].
    Query rows past the call's `rows_in_call` are padding: nothing past the last real row's position is read."""
    head, qb = pl.program_id(0), pl.program_id(1)
    kv_head = head // group
    first_row = start_ref[0] + qb * block_q
    rows = (first_row + jnp.arange(block_q, dtype=jnp.int32))[:, None]
    last = jnp.minimum(first_row + block_q, start_ref[0] + rows_in_call) - 1  # the last position a real row sees
    n_blocks = jnp.minimum(last // block_k + 1, s_len // block_k)
    q = q_ref[...]
    c = scale * _LOG2E
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))

    def step(b, carry):
        m, den, acc = carry
        base = b * block_k
        pos = base + jnp.arange(block_k, dtype=jnp.int32)
        seen = (pos <= last)[:, None]  # positions past every real row's: stale, never used
        kb = jnp.where(seen, kv_ref[pl.ds(base, block_k), kv_head, 0, :], 0)
        vb = jnp.where(seen, kv_ref[pl.ds(base, block_k), kv_head, 1, :], 0)
        s = jax.lax.dot_general(q, kb, dims, precision=precision, preferred_element_type=jnp.float32) * c
        s = jnp.where(pos[None, :] <= rows, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        den = den * alpha + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        return m_new, den, acc * alpha[:, None] + pv

    d = q_ref.shape[-1]
    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, d), jnp.float32),
    )
    _, den, acc = jax.lax.fori_loop(0, n_blocks, step, init)
    o_ref[...] = (acc / den[:, None]).astype(o_ref.dtype)


def kernel_tiles(head_dim: int, itemsize: int, interpret: bool) -> tuple[int, int, int, int]:
    """(block_q, block_k, num_warps, num_stages) of the kernel for head_dim and the bytes of an element (a function
    of the shape and dtype only)."""
    if interpret:
        return (*INTERPRET_TILES, 4, 1)
    if head_dim not in KERNEL_TILES:
        raise ValueError(f"chunk_attention: no GPU kernel tiles for head_dim {head_dim} (have {sorted(KERNEL_TILES)})")
    if itemsize == 4 and head_dim in FLOAT32_TILES:
        return FLOAT32_TILES[head_dim]
    return KERNEL_TILES[head_dim]


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _kernel_call(q, kv, start, *, scale: float, interpret: bool):
    c, hq, d = q.shape
    hkv = kv.shape[1]
    block_q, block_k, warps, stages = kernel_tiles(d, q.dtype.itemsize, interpret)
    qp = _pad_rows(q, block_q)
    kv = _pad_rows(kv, block_k)
    s_len = kv.shape[0]
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    kernel = functools.partial(
        _kernel, scale=float(scale), group=hq // hkv, block_q=block_q, block_k=block_k, s_len=s_len, rows_in_call=c
    )
    tile = pl.BlockSpec((block_q, None, d), lambda h, i: (i, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(hq, qp.shape[0] // block_q),
        in_specs=[
            pl.BlockSpec((1,), lambda *_: (0,)),
            tile,
            pl.BlockSpec((s_len, hkv, 2, d), lambda h, i: (0, 0, 0, 0)),
        ],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="jspec_prefill_attention",
    )(jnp.reshape(jnp.asarray(start, jnp.int32), (1,)), qp, kv)
    return out[:c]
