"""Decode/verify attention against the KV cache (row-tile rule, docs/design.md rule 2).

`attention` is the decode/verify path: query rows at absolute positions start..start+M-1, each causal over the
cache. Row r's output is bit-identical for every M <= ROW_TILE. Prefill and the full forward use the flash path of
`pallas_kernels.prefill_attention` instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import backend as _backend


def attention(
    q: jax.Array,
    kv_cache: jax.Array,
    start: jax.Array,
    *,
    scale: float,
    rows: int | None = None,
    one_split: bool = False,
) -> jax.Array:
    """q [M <= ROW_TILE, Hq, D] at positions start..start+M-1; kv_cache [S, Hkv, 2, D] (keys at [:, :, 0], values
    at [:, :, 1]: one array, so a step writes its new rows with one update); -> [M, Hq, D] in q.dtype.

    Row r attends cache positions 0..start+r (the caller has written rows start..start+M-1 already).
    GQA: query head h uses KV head h // (Hq // Hkv). Softmax statistics in float32.
    rows (static, default M): only rows 0..rows-1 are queries (a row tile's valid rows); the output's rows from
    `rows` on are zero, and a kernel may skip them.
    one_split (static): the kernels read the whole cache as one split, with no combine, instead of the default
    partition (splits of 128 / 512 positions, docs/design.md rule 2): the partition of a batch whose slots alone
    fill the GPU (`jspec.batch.one_split`). Another partition, so other bits; rows stay exact across M. The
    reference backend computes without a partition and ignores it.
    """
    name = _backend.get_backend()
    if name != "reference":  # the kernel checks its inputs itself
        from pallas_kernels import attention_kernel

        whole = dict(split=kv_cache.shape[0], far_split=None) if one_split else {}
        return attention_kernel.attention(
            q, kv_cache, start, scale=scale, interpret=name == "interpret", rows=rows, **whole
        )
    m, hq, _ = q.shape
    if m > _backend.ROW_TILE:
        raise ValueError(f"attention takes at most {_backend.ROW_TILE} query rows, got {m}")
    rows = _backend.valid_rows(rows, m)
    _backend.kv_heads(hq, kv_cache)
    out = reference_attention(q, kv_cache, start, scale=scale)
    return out if rows == m else jnp.where((jnp.arange(m) < rows)[:, None, None], out, 0).astype(out.dtype)


def reference_attention(q, kv_cache, start, *, scale: float) -> jax.Array:
    """jnp reference (kv_cache [S, Hkv, 2, D]): rows padded to ROW_TILE, one fixed-shape computation over the whole
    cache, then slice.

    Masked positions get probability exactly 0 (and their values are zeroed, so stale cache rows never leak).
    """
    m, hq, d = q.shape
    s_len, hkv, _, _ = kv_cache.shape
    k_cache, v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]
    tile = _backend.ROW_TILE
    group = hq // hkv
    qp = jnp.pad(q, ((0, tile - m), (0, 0), (0, 0))).astype(jnp.float32).reshape(tile, hkv, group, d)
    scores = jnp.einsum("rhgd,shd->rhgs", qp, k_cache.astype(jnp.float32)) * scale
    limit = start + jnp.arange(tile)  # last visible position per row
    visible = jnp.arange(s_len)[None, :] <= limit[:, None]  # [R, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(visible[:, None, None, :], jnp.exp(scores - peak), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    values = jnp.where((jnp.arange(s_len) <= start + tile - 1)[:, None, None], v_cache.astype(jnp.float32), 0.0)
    out = jnp.einsum("rhgs,shd->rhgd", probs, values) / denom
    return _backend.first_rows(out.reshape(tile, hq, d), m).astype(q.dtype)
