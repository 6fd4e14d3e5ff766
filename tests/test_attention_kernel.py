"""Pallas decode/verify attention (pallas_kernels/attention_kernel.py) in interpret mode on CPU, and its Mosaic GPU
split kernel (pallas_kernels/attention_ws.py: cross-lowered on jax >= 0.11, run when a GPU is present).

Row exactness (docs/design.md, rule 2): row r of a call with M rows at `start` is bit-identical to the M=1 call at
position start + r, for every M in 1..ROW_TILE, across block and split boundaries, with different stale data past each
call's rows. Agreement with the jnp reference is checked with tolerances.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.exactness import bits
from pallas_kernels import ROW_TILE, attention_kernel, attention_ws, use_backend
from pallas_kernels import attention as dispatch_attention
from pallas_kernels.attention import reference_attention
from tests.tiny import MOSAIC_GPU_TRACES

ON_GPU = jax.default_backend() == "gpu"
S, HQ, HKV, D = 1024, 8, 2, 64  # default partition: blocks of 64, splits of 128 (512 from position 1024 on)
SCALE = D**-0.5


def _history(dtype, seed=0, s_len=S, hq=HQ, hkv=HKV, d=D):
    """True per-position queries [S, Hq, D] and the kv cache [S, Hkv, 2, D] (random, O(1), in dtype)."""
    kq, kkv = jax.random.split(jax.random.PRNGKey(seed), 2)
    q = jax.random.normal(kq, (s_len, hq, d), jnp.float32).astype(dtype)
    kv = jax.random.normal(kkv, (s_len, hkv, 2, d), jnp.float32).astype(dtype)
    return q, kv


def _rows_from(position, s_len):
    """bool [S, 1, 1, 1]: the cache rows at positions >= position."""
    return (jnp.arange(s_len) >= position)[:, None, None, None]


def _with_stale(cache, start, m, seed):
    """The cache as one call at `start` with m rows sees it: rows >= start + m hold other (large, finite) data."""
    noise = 30.0 * jax.random.normal(jax.random.PRNGKey(seed), cache.shape, jnp.float32)
    return jnp.where(_rows_from(start + m, cache.shape[0]), noise.astype(cache.dtype), cache)


def _call(q_hist, kv_hist, start, m, seed, interpret=True, **kw):
    """attention on rows start..start+m-1 of the history, with call-specific stale data past them."""
    kv = _with_stale(kv_hist, start, m, seed)
    q = q_hist[start : start + m]
    scale = q.shape[-1] ** -0.5
    return np.asarray(attention_kernel.attention(q, kv, jnp.int32(start), scale=scale, interpret=interpret, **kw))


def _check_rows_exact(dtype, positions, ms, s_len=S, hq=HQ, hkv=HKV, d=D, **kw):
    """Every row of every (M, start) call covering `positions` equals the M=1 call at that row's position."""
    q_hist, kv_hist = _history(dtype, s_len=s_len, hq=hq, hkv=hkv, d=d)
    decode = {t: _call(q_hist, kv_hist, t, 1, seed=1000 + t, **kw)[0] for t in positions}
    lo, hi = min(positions), max(positions)
    for m in ms:
        for start in range(max(lo - m + 1, 0), hi - m + 2, max(1, m // 3)):
            rows = _call(q_hist, kv_hist, start, m, seed=7 * start + m, **kw)
            for r in range(m):
                t = start + r
                if t in decode:
                    assert np.array_equal(bits(rows[r]), bits(decode[t])), f"M={m} start={start} row {r} (t={t})"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(dtype):
    q_hist, kv_hist = _history(dtype, seed=3)
    tol = 2e-5 if dtype == jnp.float32 and not ON_GPU else 2e-2  # a GPU runs float32 dots at TF32
    reference = jax.jit(functools.partial(reference_attention, scale=SCALE))
    for m, start in [(1, 0), (16, 0), (5, 63), (16, 500), (1, 511), (5, 512), (16, S - ROW_TILE)]:
        kv = _with_stale(kv_hist, start, ROW_TILE, seed=start)
        q = q_hist[start : start + m]
        out = attention_kernel.attention(q, kv, jnp.int32(start), scale=SCALE, interpret=True)
        ref = reference(q, kv, jnp.int32(start))
        assert out.shape == (m, HQ, D) and out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,boundary", [(jnp.float32, 512), (jnp.bfloat16, attention_kernel.NEAR_UNTIL)])
def test_rows_exact_across_m_at_split_boundary(dtype, boundary):
    # positions boundary-7..boundary+7 cross a split boundary of the default partition (also a block boundary) with
    # every M in 1..16: 511|512 between two near splits, NEAR_UNTIL - 1|NEAR_UNTIL from the near splits to the far.
    # Each boundary in one of the two dtypes (a case costs ~25 s in interpret mode).
    _check_rows_exact(dtype, list(range(boundary - 7, boundary + 8)), range(1, ROW_TILE + 1), s_len=boundary + 256)


@pytest.mark.parametrize("fold_heads", [True, False])
def test_rows_exact_small_partition(fold_heads):
    # blocks of 16 and splits of 32: positions 26..70 cross 2 split and 5 block boundaries (uneven S // split too);
    # both row-tile layouts (all heads in one dot, one dot per head), 3 query heads per KV head (padded to 4).
    _check_rows_exact(
        jnp.float32,
        list(range(26, 71)),
        [1, 2, 7, 16],
        s_len=272,
        hq=6,
        block_k=16,
        split=32,
        fold_heads=fold_heads,
    )
    q_hist, kv_hist = _history(jnp.float32, s_len=272, hq=6)
    q, start = q_hist[40:56], jnp.int32(40)
    out = attention_kernel.attention(
        q, kv_hist, start, scale=SCALE, interpret=True, block_k=16, split=32, fold_heads=fold_heads
    )
    ref = reference_attention(q, kv_hist, start, scale=SCALE)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_rows_exact_under_jit():
    """Inside jit (as the model calls it) the pad and slice around the kernel must not change row bits."""
    q_hist, kv_hist = _history(jnp.bfloat16, seed=5)
    t0 = 509
    kv = _with_stale(kv_hist, t0 + ROW_TILE, 0, seed=9)  # one cache for all calls: true rows up to t0 + 15
    run = jax.jit(functools.partial(attention_kernel.attention, scale=SCALE, interpret=True))
    decode = {t0 + r: np.asarray(run(q_hist[t0 + r : t0 + r + 1], kv, jnp.int32(t0 + r)))[0] for r in range(16)}
    for m in (3, 16):
        rows = np.asarray(run(q_hist[t0 : t0 + m], kv, jnp.int32(t0)))
        for r in range(m):
            assert np.array_equal(bits(rows[r]), bits(decode[t0 + r])), f"M={m} row {r}"


def test_blocks_past_the_tile_are_never_read():
    """NaN in every block after the one holding start + 15 leaves the output finite and unchanged."""
    q_hist, kv_hist = _history(jnp.float32, seed=7)
    start = 600  # tile covers 600..615, inside block 576..639; blocks from 640 on are never read
    q = q_hist[start : start + 4]
    clean = attention_kernel.attention(q, kv_hist, jnp.int32(start), scale=SCALE, interpret=True)
    kv_bad = jnp.where(_rows_from(640, S), jnp.nan, kv_hist)
    dirty = attention_kernel.attention(q, kv_bad, jnp.int32(start), scale=SCALE, interpret=True)
    assert np.array_equal(bits(clean), bits(dirty))


def test_dispatch_rejects_a_cache_that_is_not_one_kv_array():
    q_hist, kv_hist = _history(jnp.float32, seed=11)
    for backend in ("interpret", "reference"):
        with use_backend(backend), pytest.raises(ValueError, match=r"kv_cache \[S, Hkv, 2, D\]"):
            dispatch_attention(q_hist[:4], kv_hist[:, :, 0], jnp.int32(0), scale=SCALE)


def test_dispatch_uses_kernel_in_interpret_backend():
    q_hist, kv_hist = _history(jnp.float32, seed=11)
    q = q_hist[100:108]
    direct = attention_kernel.attention(q, kv_hist, jnp.int32(100), scale=SCALE, interpret=True)
    with use_backend("interpret"):
        routed = dispatch_attention(q, kv_hist, jnp.int32(100), scale=SCALE)
    assert np.array_equal(bits(direct), bits(routed))


def _lowered_for_cuda(**kw) -> str:
    """The compiled path for the 14B shape (40 / 8 heads, head_dim 128, bf16), lowered for CUDA on this machine."""
    shapes = [((16, 40, 128), jnp.bfloat16), ((2048, 8, 2, 128), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes] + [jax.ShapeDtypeStruct((), jnp.int32)]
    fn = jax.jit(functools.partial(attention_kernel.attention, scale=128**-0.5, interpret=False, **kw))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("splits", [{}, dict(split=256, far_split=1024, far_from=1024)])
def test_lowers_for_gpu(splits):
    """The Triton path lowers for CUDA on a CPU-only machine: both kernels become Triton calls."""
    assert _lowered_for_cuda(mosaic=False, **splits).count("triton") >= 2


@pytest.mark.skipif(not MOSAIC_GPU_TRACES, reason="the Mosaic GPU kernel traces on jax >= 0.11 only")
def test_mosaic_split_kernel_is_the_gpu_default_and_lowers():
    """Compiled bf16 attention traces to the Mosaic GPU split kernel (then the Triton combine), and that kernel
    lowers for CUDA on this machine for 1, 2 and 4 chunks (16 / 12 / 8 / 4 rows per head) and head_dim 64 / 128 /
    256."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(16, 40, 128), (2048, 8, 2, 128)]]
    fn = functools.partial(attention_kernel.attention, scale=128**-0.5, interpret=False)
    jaxpr = str(jax.make_jaxpr(fn)(*args, jnp.int32(0)))
    assert "jspec_attention_ws" in jaxpr and "jspec_attention_combine" in jaxpr
    assert "jspec_attention_split" not in jaxpr
    splits = attention_kernel.Splits(attention_kernel.NEAR_SPLIT, attention_kernel.SPLIT, attention_kernel.NEAR_UNTIL)
    for hq, hkv, d in [(8, 2, 64), (40, 8, 128), (28, 4, 128), (32, 2, 128), (16, 2, 256)]:
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(ROW_TILE, hq, d), (2048, hkv, 2, d)]]
        kernel = functools.partial(
            attention_ws.split_partials, scale=d**-0.5, splits=splits, block_k=64, ring=attention_ws.stages(64, d)
        )
        text = jax.jit(kernel).trace(*args, jax.ShapeDtypeStruct((2,), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in text.as_text()


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_rows_past_the_valid_ones_are_zero_and_the_rest_unchanged(backend):
    """rows=r: rows 0..r-1 bit-equal to the call on those rows alone, the rest of the tile exactly zero."""
    q_hist, kv_hist = _history(jnp.float32, seed=5)
    start = 1017
    q = q_hist[start : start + ROW_TILE]
    with use_backend(backend):
        for valid in (1, 4, 7):
            out = np.asarray(dispatch_attention(q, kv_hist, jnp.int32(start), scale=SCALE, rows=valid))
            alone = np.asarray(dispatch_attention(q[:valid], kv_hist, jnp.int32(start), scale=SCALE))
            assert out.shape == q.shape
            assert np.array_equal(bits(out[:valid]), bits(alone)) and not out[valid:].any()
        with pytest.raises(ValueError, match="valid rows"):
            dispatch_attention(q, kv_hist, jnp.int32(start), scale=SCALE, rows=ROW_TILE + 1)


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 64), (40, 8, 128), (28, 4, 128), (32, 2, 128), (16, 2, 256)])
def test_gpu_mosaic_rows_exact_across_the_split_boundary(hq, hkv, d):
    """Query tiles of 1 chunk (4 heads x 16 rows), 2 (5 x 12 and 5 x 4; 7 x 8 twice; 8 x 8 twice) and 4 (16 x 4
    rows), of which a call runs those holding valid rows; positions 1017..1031 cross the near / far split boundary
    at 1024 and a block boundary, every M in 1..16. rows=r on a full 16-row q: the first r rows equal the M = r
    call, the rest are zero."""
    positions = list(range(attention_kernel.NEAR_UNTIL - 7, attention_kernel.NEAR_UNTIL + 8))
    _check_rows_exact(
        jnp.bfloat16, positions, range(1, ROW_TILE + 1), s_len=1280, hq=hq, hkv=hkv, d=d, interpret=False, mosaic=True
    )
    q_hist, kv_hist = _history(jnp.bfloat16, s_len=1280, hq=hq, hkv=hkv, d=d)
    q = q_hist[1017 : 1017 + ROW_TILE]
    for valid in (1, 3, 8):
        kw = dict(scale=d**-0.5, interpret=False, mosaic=True)
        out = np.asarray(attention_kernel.attention(q, kv_hist, jnp.int32(1017), rows=valid, **kw))
        alone = np.asarray(attention_kernel.attention(q[:valid], kv_hist, jnp.int32(1017), **kw))
        assert np.array_equal(bits(out[:valid]), bits(alone)) and not out[valid:].any()
    for start in (0, 61, 1020):
        q = q_hist[start : start + ROW_TILE]
        out = attention_kernel.attention(q, kv_hist, jnp.int32(start), scale=d**-0.5, interpret=False)
        ref = reference_attention(q, kv_hist, jnp.int32(start), scale=d**-0.5)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize("hq, hkv, d", [(40, 8, 128), (32, 2, 128)])
@pytest.mark.parametrize("combine_chunk", [attention_kernel.COMBINE_CHUNK, 4])
def test_gpu_mosaic_bits_do_not_depend_on_the_cta_count(hq, hkv, d, combine_chunk):
    """The persistent grid with 4 CTAs per KV head (each computing many splits of 64 and 128 positions in one
    pipeline, 1 to 4 chunks) gives the default grid's bits on every row, and stays row-exact across M; with
    combine_chunk 4 the combine merges the 14 splits in 4 steps instead of one."""
    kw = dict(split=64, far_split=128, far_from=512, interpret=False, mosaic=True, combine_chunk=combine_chunk)
    positions = list(range(1017, 1032))
    _check_rows_exact(jnp.bfloat16, positions, (1, 5, 9, 16), s_len=1280, hq=hq, hkv=hkv, d=d, ctas=4, **kw)
    q_hist, kv_hist = _history(jnp.bfloat16, s_len=1280, hq=hq, hkv=hkv, d=d)
    for start, valid in [(0, 16), (70, 1), (700, 5), (1017, 16), (1020, 9)]:
        q = q_hist[start : start + ROW_TILE]
        few, default = (
            np.asarray(
                attention_kernel.attention(q, kv_hist, jnp.int32(start), rows=valid, scale=d**-0.5, ctas=ctas, **kw)
            )
            for ctas in (4, None)
        )
        assert np.array_equal(bits(few), bits(default)), f"start={start} rows={valid}"


@pytest.mark.parametrize(
    "interpret, hq, hkv, d",
    [(True, HQ, HKV, D), pytest.param(False, 32, 8, 128, marks=pytest.mark.skipif(not ON_GPU, reason="needs a GPU"))],
)
def test_slots_under_vmap_get_the_bits_of_their_calls_alone(interpret, hq, hkv, d):
    """`jax.vmap` over slots (jspec.batch) runs the kernels once for all the slots (on the GPU, a Mosaic grid sized
    for the batch, `attention_ws.ctas_per_head`): each slot's rows are the bits of its call alone, whatever the other
    slots' starts and caches, for a decode (M = 1) and a verify tile (M = 8); with one cache shared by every query
    (in_axes None) too. On the GPU also against an explicit CTA count (another grid, the same bits)."""
    dtype = jnp.float32 if interpret else jnp.bfloat16
    s_len, starts = 640, (3, 120, 250, 505, 611)
    hists = [_history(dtype, seed=40 + i, s_len=s_len, hq=hq, hkv=hkv, d=d) for i in range(len(starts))]
    kw = dict(scale=d**-0.5, interpret=interpret)
    for m in (1, 8):
        qs = jnp.stack([q[t : t + m] for (q, _), t in zip(hists, starts, strict=True)])
        kvs = jnp.stack([_with_stale(kv, t, m, seed=t) for (_, kv), t in zip(hists, starts, strict=True)])
        at = jnp.asarray(starts, jnp.int32)
        call = lambda q, kv, t: attention_kernel.attention(q, kv, t, **kw)  # noqa: E731
        batched = np.asarray(jax.jit(jax.vmap(call))(qs, kvs, at))
        shared = np.asarray(jax.vmap(call, in_axes=(0, None, 0))(qs, kvs[0], at))
        for i, t in enumerate(starts):
            alone = np.asarray(attention_kernel.attention(qs[i], kvs[i], jnp.int32(t), **kw))
            assert np.array_equal(bits(batched[i]), bits(alone)), f"slot {i}, M = {m}"
            alone = np.asarray(attention_kernel.attention(qs[i], kvs[0], jnp.int32(t), **kw))
            assert np.array_equal(bits(shared[i]), bits(alone)), f"slot {i} on a shared cache, M = {m}"
        if not interpret:
            fixed = jax.vmap(lambda q, kv, t: attention_kernel.attention(q, kv, t, ctas=5, **kw))(qs, kvs, at)
            assert np.array_equal(bits(np.asarray(fixed)), bits(batched)), f"ctas=5, M = {m}"


@pytest.mark.parametrize(
    "interpret, hq, hkv, d",
    [(True, HQ, HKV, D), pytest.param(False, 32, 8, 128, marks=pytest.mark.skipif(not ON_GPU, reason="needs a GPU"))],
)
def test_one_split_runs_no_combine_and_keeps_rows_exact(interpret, hq, hkv, d):
    """The partition of one split (the whole cache: a large batch's, `jspec.batch.one_split`) runs the split kernel
    alone, no combine: its rows are exact across M (positions across a block boundary, every call with stale data
    past its tile), rows past the valid ones are zero, they match the reference, and under `jax.vmap` each slot
    gets the bits of its call alone."""
    dtype = jnp.float32 if interpret else jnp.bfloat16
    s_len = 512
    kw = dict(split=s_len, far_split=None, interpret=interpret)
    _check_rows_exact(dtype, list(range(249, 264)), (1, 5, ROW_TILE), s_len=s_len, hq=hq, hkv=hkv, d=d, **kw)
    q_hist, kv_hist = _history(dtype, seed=11, s_len=s_len, hq=hq, hkv=hkv, d=d)
    call = jax.jit(lambda q, kv, t: attention_kernel.attention(q, kv, t, scale=d**-0.5, **kw))
    tol = 2e-5 if interpret and not ON_GPU else 2e-2  # a GPU runs float32 dots at TF32, XLA's default precision
    for start, m in [(0, 1), (61, 5), (300, ROW_TILE), (s_len - ROW_TILE, 3)]:
        q, at = q_hist[start : start + m], jnp.int32(start)
        kernels = call.lower(q, kv_hist, at).as_text(debug_info=True)
        assert "jspec_attention_combine" not in kernels and "jspec_attention" in kernels
        out = np.asarray(call(q, kv_hist, at), np.float32)
        ref = np.asarray(reference_attention(q, kv_hist, at, scale=d**-0.5), np.float32)
        np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    q = q_hist[100 : 100 + ROW_TILE]
    some = np.asarray(attention_kernel.attention(q, kv_hist, jnp.int32(100), rows=3, scale=d**-0.5, **kw))
    alone = np.asarray(call(q[:3], kv_hist, jnp.int32(100)))
    assert np.array_equal(bits(some[:3]), bits(alone)) and not some[3:].any()
    starts = jnp.asarray([3, 250, 497], jnp.int32)
    qs = jnp.stack([q_hist[t : t + 8] for t in (3, 250, 497)])
    kvs = jnp.stack([_with_stale(kv_hist, t, 8, seed=t) for t in (3, 250, 497)])
    batched = np.asarray(jax.vmap(call)(qs, kvs, starts))
    for i in range(3):
        assert np.array_equal(bits(batched[i]), bits(np.asarray(call(qs[i], kvs[i], starts[i])))), f"slot {i}"


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize("slots, hq, hkv, d", [(40, 16, 4, 128), (17, 40, 8, 128), (70, 4, 2, 64)])
@pytest.mark.parametrize("one_split", [False, True])
def test_gpu_batch_grid_gives_each_slot_the_bits_of_its_call_alone(slots, hq, hkv, d, one_split):
    """A batch whose (slot, KV head) items outnumber the SMs runs one persistent grid over all of it
    (`attention_ws.batch_split_partials`: CTAs running several slots' splits in one pipeline): each slot's rows are
    the bits of its call alone (one slot's grid), for a decode, a verify tile and (40 heads on 8: two 64-row chunks
    of 12 rows a head) a full row tile, every slot at its own start across the near/far split boundary; in the
    default partition and in one split of the whole cache (no combine)."""
    assert attention_ws.batch_grid(slots, hkv, d)
    s_len = 1536
    starts = [(97 * i + 5) % (s_len - ROW_TILE) for i in range(slots)]
    q_hist, kv_hist = _history(jnp.bfloat16, seed=3, s_len=s_len, hq=hq, hkv=hkv, d=d)
    kw = dict(scale=d**-0.5, interpret=False, **(dict(split=s_len, far_split=None) if one_split else {}))
    call = lambda q, kv, t: attention_kernel.attention(q, kv, t, **kw)  # noqa: E731
    for m in (1, 8, ROW_TILE):
        qs = jnp.stack([q_hist[t : t + m] for t in starts])
        kvs = jnp.stack([_with_stale(kv_hist, t, m, seed=t) for t in starts])
        at = jnp.asarray(starts, jnp.int32)
        batched = jax.jit(jax.vmap(call))
        assert "jspec_attention_ws_batch" in batched.lower(qs, kvs, at).as_text()
        out = np.asarray(batched(qs, kvs, at))
        for i, t in enumerate(starts):
            alone = np.asarray(attention_kernel.attention(qs[i], kvs[i], jnp.int32(t), **kw))
            assert np.array_equal(bits(out[i]), bits(alone)), f"slot {i} at {t}, M = {m}"


def test_batch_grid_deals_every_item_to_one_wave():
    """The batch grid is taken only where one CTA per (slot, KV head) item would need more than one wave, and its
    CTAs hold every item, at most ceil(items / SMs) each, with no CTA left without one."""
    sms = attention_ws.sm_count()
    assert not attention_ws.batch_grid(1, sms, 128) and attention_ws.batch_grid(2, sms // 2 + 1, 128)
    assert not attention_ws.batch_grid(2 * sms, 1, 256)  # its ring of q, K and V would not fit in shared memory
    for items in (sms + 1, 2 * sms, 512, 1000, 4096):
        ctas, per_cta = attention_ws.batch_ctas(items), -(-items // sms)
        assert ctas <= sms and ctas * per_cta >= items > (ctas - 1) * per_cta, items


def test_batch_layout_moves_only_the_calls_rows():
    """The batch grid's query tiles (`attention_ws.batch_layout`) hold a call's m rows per head, rounded up to the
    combine's rows and capped at the single-call layout's rows per head; a chunk's rows fit one warpgroup tile and
    its 8-row tiling; a Llama-3 decode (4 heads a KV head, m = 1) moves 8 rows a tile, not 64."""
    assert attention_ws.batch_layout(4, 1) == (2, 1, 8)
    assert attention_ws.batch_layout(4, ROW_TILE) == (attention_ws.head_rows(4), 1, attention_ws.WG_ROWS)
    for group in (1, 2, 4, 5, 8, 16, 32):
        for m in range(1, ROW_TILE + 1):
            per_head, chunks, chunk_rows = attention_ws.batch_layout(group, m)
            assert per_head % 2 == 0 and per_head <= attention_ws.head_rows(group)
            assert chunks * per_head >= m > (chunks - 1) * per_head
            assert group * per_head <= chunk_rows <= attention_ws.WG_ROWS and chunk_rows % 8 == 0, (group, m)


@pytest.mark.parametrize(
    "q_shape, cache_shape, dtype, match",
    [
        ((17, 8, 64), (1024, 2, 2, 64), jnp.float32, "query rows"),
        ((4, 6, 64), (1024, 4, 2, 64), jnp.float32, "heads"),
        ((4, 8, 64), (1024, 2, 64), jnp.float32, r"kv_cache \[S, Hkv, 2, D\]"),
        ((4, 8, 64), (1024, 2, 3, 64), jnp.float32, r"kv_cache \[S, Hkv, 2, D\]"),
        ((4, 8, 32), (1024, 2, 2, 64), jnp.float32, "head_dim"),
        ((4, 8, 64), (1000, 2, 2, 64), jnp.float32, "cache length"),
        ((4, 8, 64), (1024, 2, 2, 64), jnp.float16, "dtype"),
        ((4, 8, 48), (1024, 2, 2, 48), jnp.float32, "powers of 2"),
        ((4, 8, 64), (1024, 2, 2, 64), jnp.float32, "Mosaic GPU attention kernel takes bfloat16"),
        ((4, 8, 64), (1024, 2, 2, 64), jnp.bfloat16, "in interpret mode"),
        ((4, 66, 64), (1024, 2, 2, 64), jnp.bfloat16, "at most 32 query heads per KV head"),
        ((4, 8, 64), (1024, 2, 2, 64), jnp.float32, "ctas=4 applies to the Mosaic GPU split kernel only"),
    ],
)
def test_rejects_bad_input(q_shape, cache_shape, dtype, match):
    q = jnp.zeros(q_shape, dtype)
    cache = jnp.zeros(cache_shape, dtype)
    kw = (
        dict(mosaic=True) if any(word in match for word in ("Mosaic GPU attention", "interpret", "query heads")) else {}
    )
    kw.update(dict(ctas=4) if "ctas" in match else {})
    with pytest.raises(ValueError, match=match):
        attention_kernel.attention(q, cache, jnp.int32(0), scale=1.0, interpret=True, **kw)


def test_split_tiles_fit_the_budget_and_keep_the_measured_default():
    """(block_k, stages) come from the shape: the H200-measured (64, 3) at head_dim 128 bf16, smaller tiles where
    the q tile and the pipelined K/V blocks would exceed the shared-memory budget, a clear error past it."""
    assert attention_kernel.split_tiles(128, 128, 2) == (64, 3)
    for rows, d, size in [(128, 256, 2), (128, 128, 4), (64, 256, 4), (128, 256, 4)]:
        block_k, stages = attention_kernel.split_tiles(rows, d, size)
        assert (rows + 2 * stages * block_k) * d * size <= attention_kernel.SMEM_BUDGET
        assert attention_kernel.SPLIT % block_k == 0 and (block_k, stages) != (64, 3)
    with pytest.raises(ValueError, match="shared-memory budget"):
        attention_kernel.split_tiles(1024, 256, 4)


def test_rows_exact_with_the_head_dim_256_tiles():
    """head_dim 256 float32 (64-row tile) takes the (16, 2) tiles: rows stay exact across the split boundary."""
    assert attention_kernel.split_tiles(4 * ROW_TILE, 256, 4) == (16, 2)
    _check_rows_exact(jnp.float32, positions=(510, 511, 512, 513), ms=(1, 5, 16), d=256)


def test_rows_exact_over_many_combine_chunks():
    """17 splits of 16 (not a power of 2) merged 4 per combine step: positions 124..131 cross the split and combine
    chunk boundary at 128, and calls there compute different numbers of splits and chunks."""
    _check_rows_exact(
        jnp.float32,
        list(range(124, 132)),
        [1, 5, 16],
        s_len=272,
        block_k=16,
        split=16,
        combine_chunk=4,
        combine_rows=4,
    )


@pytest.mark.parametrize("splits", [(32, 32, 0), (32, 64, 64), (16, 64, 32), (32, 96, 96)])
def test_splits_count_first_and_live_agree_with_the_partition(splits):
    part = attention_kernel.Splits(*splits)
    for s_len in (16, 48, 64, 96, 272):
        bounds = [0]
        while bounds[-1] < s_len:
            size = part.size if bounds[-1] < part.far_from else part.far_size
            bounds.append(bounds[-1] + size)
        assert part.count(s_len) == len(bounds) - 1
        for j, lo in enumerate(bounds[:-1]):
            assert int(part.first(jnp.int32(j))) == lo and int(part.blocks(jnp.int32(j), 16)) * 16 == bounds[j + 1] - lo
        for last in range(s_len):
            assert int(part.live(jnp.int32(last))) == sum(lo <= last for lo in bounds[:-1])


def test_rows_exact_with_longer_splits_far_out():
    # splits of 32 up to position 64, then of 64: positions 52..140 cross the 64 and 128 boundaries
    kw = dict(s_len=272, block_k=16, split=32, far_split=64, far_from=64)
    _check_rows_exact(jnp.float32, list(range(52, 141)), [1, 3, 16], **kw)
    q_hist, kv_hist = _history(jnp.float32, s_len=272)
    q, start = q_hist[120:136], jnp.int32(120)
    out = attention_kernel.attention(
        q, kv_hist, start, scale=SCALE, interpret=True, block_k=16, split=32, far_split=64, far_from=64
    )
    ref = reference_attention(q, kv_hist, start, scale=SCALE)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf])
def test_combine_never_reads_dead_splits(poison):
    """The partials of splits past start + 15 are never written; garbage there (NaN, inf) leaves every bit of the
    combine's output unchanged, and so does a combine step that holds only dead splits."""
    q_hist, kv_hist = _history(jnp.float32, seed=13, s_len=272)
    start = jnp.array([40, ROW_TILE], jnp.int32)  # positions 40..55: splits 0..3 of 16 are live, 4..16 dead
    o, m, s = attention_kernel.split_partials(
        q_hist[40:56],
        kv_hist,
        start,
        scale=SCALE,
        interpret=True,
        fold_heads=True,
        num_warps=4,
        num_stages=1,
        block_k=16,
        splits=attention_kernel.Splits(16, 16, 0),
    )
    dead = (jnp.arange(o.shape[1]) >= 4)[None, :, None]
    bad = [jnp.where(dead[..., None], poison, o), jnp.where(dead, poison, m), jnp.where(dead, poison, s)]
    outs = []
    for chunk in (2, 8):
        kw = dict(q_heads=HQ, head_rows=ROW_TILE, chunk_rows=o.shape[2], splits=attention_kernel.Splits(16, 16, 0))
        kw.update(interpret=True, rows=2, chunk=chunk)
        kw.update(warps=4, stages=2)
        clean = attention_kernel.combine(start, o, m, s, **kw)
        dirty = attention_kernel.combine(start, *bad, **kw)
        assert np.all(np.isfinite(np.asarray(dirty))) and np.array_equal(bits(clean), bits(dirty)), chunk
        outs.append(clean)
    call = attention_kernel.attention(
        q_hist[40:56], kv_hist, start[0], scale=SCALE, interpret=True, combine_chunk=8, block_k=16, split=16
    )
    assert np.array_equal(bits(outs[1]), bits(call))
    ref = reference_attention(q_hist[40:56], kv_hist, start[0], scale=SCALE)
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_combine_reads_the_chunked_layout_of_the_mosaic_kernel():
    """The Mosaic GPU kernel's partials come in chunks of 64 rows with R rows per query head (`query_tile`). The
    same partials moved from the Triton kernel's one-chunk layout into chunks of R = 2 / 6 / 12 rows per head
    combine to the same bits for the valid rows (zeros past them), and `query_tile` puts each query row where the
    chunk layout says, a call's M rows as if padded with zeros to the tile."""
    q_hist, kv_hist = _history(jnp.float32, seed=21)
    q, start, valid = q_hist[1001 : 1001 + ROW_TILE], 1001, 11
    start_arr = jnp.array([start, valid], jnp.int32)
    splits = attention_kernel.Splits(attention_kernel.NEAR_SPLIT, attention_kernel.SPLIT, attention_kernel.NEAR_UNTIL)
    kw = dict(interpret=True, fold_heads=True, block_k=64, splits=splits, num_warps=4, num_stages=1)
    parts = attention_kernel.split_partials(q, kv_hist, start_arr, scale=SCALE, **kw)
    combine_kw = dict(q_heads=HQ, splits=splits, interpret=True, rows=2, chunk=32, warps=4, stages=2)
    one_chunk = attention_kernel.combine(
        start_arr, *parts, head_rows=ROW_TILE, chunk_rows=parts[0].shape[2], **combine_kw
    )
    group = HQ // HKV
    for per_head in (2, 6, 12):
        chunks = -(-ROW_TILE // per_head)
        tiles = np.asarray(attention_kernel.query_tile(q, HKV, per_head, 64))
        source = np.zeros(chunks * 64, np.int64)  # chunk-layout slot -> one-chunk row (padding slots: row 0)
        for c in range(chunks):
            for g in range(group):
                for r in range(per_head):
                    if c * per_head + r < ROW_TILE:
                        source[c * 64 + g * per_head + r] = g * ROW_TILE + c * per_head + r
                        for h in range(HKV):
                            want = np.asarray(q[c * per_head + r, h * group + g])
                            assert np.array_equal(tiles[h, c * 64 + g * per_head + r], want)
        for m in (1, 5, per_head + 1, ROW_TILE):  # a call's m rows: the tile of those rows followed by zeros
            zeroed = jnp.zeros_like(q).at[:m].set(q[:m])
            want = np.asarray(attention_kernel.query_tile(zeroed, HKV, per_head, 64))
            assert np.array_equal(bits(attention_kernel.query_tile(q[:m], HKV, per_head, 64)), bits(want))
        moved = [p[:, :, source] for p in parts]
        out = attention_kernel.combine(start_arr, *moved, head_rows=per_head, chunk_rows=64, **combine_kw)
        assert np.array_equal(bits(out[:valid]), bits(one_chunk[:valid])) and not np.asarray(out[valid:]).any()


def test_rejects_a_combine_chunk_that_is_not_a_power_of_2():
    q, cache = jnp.zeros((4, 8, 64), jnp.float32), jnp.zeros((1024, 2, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="combine_chunk 12 must be"):
        attention_kernel.attention(q, cache, jnp.int32(0), scale=1.0, interpret=True, combine_chunk=12)
