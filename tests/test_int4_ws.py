"""Int4Codes, the prepared layout of the warp-specialized Mosaic GPU int4 kernel (pallas_kernels.int4_ws): exact
codes and round trip, the prefill product, which weights `prepare_ws` hands over, the errors on CPU backends, the
Engine's choice; plus the kernel's row-exactness when a GPU is present (it has no interpret mode)."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.exactness import bits
from pallas_kernels import backend, int4_ws, prepare
from pallas_kernels.int4 import Int4Weight, dequantize, pack, quantize, unpack_codes
from pallas_kernels.int4_ws import Int4Codes, prepare_codes, to_int4_weight
from pallas_kernels.matmul import Int4Halves, linear
from pallas_kernels.prepare import prepare_ws, ws_prep_nbytes
from tests.tiny import MOSAIC_GPU_TRACES, tiny_config, tiny_params

ON_GPU = jax.default_backend() == "gpu"


def _weight(k, n, seed=0, symmetric=True):
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal((k, n)).astype(np.float32), symmetric=symmetric)


def test_codes_are_q_minus_8_in_stored_order_and_round_trip():
    w = _weight(256, 64, seed=1)
    c = prepare_codes(w)
    assert c.codes.dtype == jnp.int4 and c.codes.shape == (1, 128, 256) and c.shape == w.shape  # one k step
    q = np.asarray(unpack_codes(w), np.int32).reshape(64, 8, 32)
    stored = np.asarray(c.codes.astype(jnp.int32))[0, :64].reshape(64, 8, 32)
    for p, k in enumerate([0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26]):  # thread 0's 8 k, then thread 1's first 4
        assert np.array_equal(stored[..., p], q[..., k] - 8)
    assert sorted(int4_ws.STORED_K) == list(range(32))
    assert np.array_equal(np.sort(stored, axis=-1), np.sort(q - 8, axis=-1))
    assert c.nbytes == 2 * w.nbytes  # N padded from 64 to 128
    back = to_int4_weight(c)
    assert np.array_equal(np.asarray(back.packed), np.asarray(w.packed))
    assert np.array_equal(bits(back.scales), bits(w.scales)) and back.zeros is None


def test_codes_pad_k_to_the_k_tile_with_zero_codes_and_scales():
    w = _weight(288, 128, seed=12)  # K = 9 blocks of 32: padded to 512
    c = prepare_codes(w)
    assert c.shape == (288, 128) and c.codes.shape == (2, 128, 256) and c.scales.shape == (2, 128, 8)  # step-major
    assert not np.asarray(c.codes[1, :, 32:].astype(jnp.int32)).any() and not np.asarray(c.scales[1, :, 1:]).any()
    # codes[i, n, j] is row n's stored code at k = 256 i + j: step 1 starts with block 8 (k 256..287)
    q = np.asarray(unpack_codes(w), np.int32)[:, 256:][:, int4_ws.STORED_K]
    assert np.array_equal(np.asarray(c.codes[1, :, :32].astype(jnp.int32)), q - 8)
    # scales[i, n, g] is row n's block 8 i + g: step 0 holds blocks 0..7, step 1 block 8 then the zero padding
    assert np.array_equal(bits(c.scales[0]), bits(w.scales[:, :8])) and np.array_equal(
        bits(c.scales[1, :, 0]), bits(w.scales[:, 8])
    )
    assert c.nbytes == w.nbytes * 512 // 288 and ws_prep_nbytes({"w": w}) == c.nbytes + 3 * 512 * 128
    back = to_int4_weight(c)
    assert np.array_equal(np.asarray(back.packed), np.asarray(w.packed))
    assert np.array_equal(bits(back.scales), bits(w.scales))
    x = jnp.asarray(np.random.default_rng(13).standard_normal((24, 288)), jnp.bfloat16)
    f = jax.jit(lambda x, w: linear(x, w, out_dtype=jnp.float32))
    assert np.array_equal(bits(f(x, w)), bits(f(x, c)))  # prefill path
    with backend.use_backend("reference"):
        assert np.array_equal(bits(f(x[:5], w)), bits(f(x[:5], c)))  # row-tile path


def test_codes_pad_n_to_the_weight_tile_and_the_product_drops_the_padded_columns():
    """A Gated DeltaNet in_proj's N (q, k, v, z heads, then 2 x 32 b and a columns) is no multiple of the 128-row
    tile: zero rows pad it, the round trip and every product give the unpadded weight's bits."""
    w = _weight(256, 200, seed=14)
    c = prepare_codes(w)
    assert c.shape == (256, 200) and c.codes.shape == (1, 256, 256) and c.scales.shape == (1, 256, 8)
    assert not np.asarray(c.codes[:, 200:].astype(jnp.int32)).any() and not np.asarray(c.scales[:, 200:]).any()
    assert ws_prep_nbytes({"w": w}) == w.nbytes * 256 // 200 + 3 * 256 * 256
    back = to_int4_weight(c)
    assert np.array_equal(np.asarray(back.packed), np.asarray(w.packed)) and back.shape == w.shape
    assert np.array_equal(bits(back.scales), bits(w.scales))
    x = jnp.asarray(np.random.default_rng(15).standard_normal((24, 256)), jnp.bfloat16)
    f = jax.jit(lambda x, w: linear(x, w, out_dtype=jnp.float32))
    assert f(x, c).shape == (24, 200) and np.array_equal(bits(f(x, w)), bits(f(x, c)))  # prefill path
    with backend.use_backend("reference"):
        assert np.array_equal(bits(f(x[:5], w)), bits(f(x[:5], c)))  # row-tile path


def test_asymmetric_weights_are_refused():
    with pytest.raises(ValueError, match="symmetric int4 weights only"):
        prepare_codes(_weight(64, 32, symmetric=False))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_product_on_codes_has_the_bits_of_the_int4_weight(dtype):
    w = _weight(128, 64, seed=2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((24, 128)), dtype)  # M > ROW_TILE: prefill path
    f = jax.jit(lambda x, w: linear(x, w, out_dtype=jnp.float32))
    assert np.array_equal(bits(f(x, w)), bits(f(x, prepare_codes(w))))


def test_row_tile_path_reference_serves_codes_interpret_refuses():
    """The jnp reference product takes Int4Codes (same bits as the Int4Weight); the Triton kernel does not."""
    w = _weight(256, 128, seed=10)
    x = jnp.asarray(np.random.default_rng(11).standard_normal((3, 256)), jnp.bfloat16)
    f = jax.jit(lambda x, w: linear(x, w, out_dtype=jnp.float32))
    with backend.use_backend("reference"):
        assert np.array_equal(bits(f(x, w)), bits(f(x, prepare_codes(w))))
    with backend.use_backend("interpret"), pytest.raises(ValueError, match="need the GPU 'pallas' kernel backend"):
        linear(x, prepare_codes(w))


def test_prepare_ws_takes_every_symmetric_weight():
    params = {
        "gate_up": _weight(256, 1024, seed=4),
        "down": _weight(256, 512, seed=5),
        "asym": _weight(256, 1024, seed=6, symmetric=False),
        "odd_k": _weight(288, 1024, seed=7),  # K not a multiple of the 256-k tile: padded
        "odd_n": _weight(256, 1056, seed=7),  # N not a multiple of the 128-row tile: padded
        "norm": jnp.ones((8,)),
    }
    out = prepare_ws(params)
    assert all(isinstance(out[k], Int4Codes) for k in ("gate_up", "down", "odd_k", "odd_n"))
    assert isinstance(out["asym"], Int4Weight)
    assert out["norm"] is params["norm"]


@pytest.mark.parametrize("scale", [2.0 ** (int4_ws.WEIGHT_SHIFT - 5), 2.0 ** (int4_ws.WEIGHT_SHIFT - 127), np.nan])
def test_prepare_ws_refuses_scales_outside_the_kernels_exact_range_naming_the_weight(scale):
    # the kernel's weights are bf16(code s) 2^-WEIGHT_SHIFT: a larger scale overflows its FMA operand, a smaller one
    # gives subnormal weights (other bits); zero scales (an all-zero block) are fine
    low, high = int4_ws.SCALE_RANGE
    ok = _weight(256, 128, seed=18)
    edges = dataclasses.replace(ok, scales=ok.scales.at[0, 0].set(low).at[0, 1].set(high / 2).at[1, 1].set(0))
    assert isinstance(prepare_ws({"w": edges})["w"], Int4Codes)
    bad = dataclasses.replace(ok, scales=ok.scales.at[5, 3].set(scale))
    with pytest.raises(ValueError, match=r"int4 weight \['layers'\]\[1\]\['down'\]: scales .* leave the Mosaic GPU"):
        prepare_ws({"layers": [{"down": ok}, {"down": bad}]})


def test_gpu_preparation_needing_more_than_the_free_device_memory_is_declined(monkeypatch):
    params = {"gate_up": _weight(256, 1024, seed=4), "down": _weight(256, 512, seed=5)}
    assert ws_prep_nbytes(params) == params["gate_up"].nbytes + params["down"].nbytes + 3 * 256 * 1024
    monkeypatch.setattr(prepare, "ws_prep_nbytes", lambda p: 3 << 30)
    monkeypatch.setattr(prepare, "device_free_bytes", lambda: 1 << 30)
    why = prepare.prep_shortfall(params, "bfloat16", "pallas")
    assert "stay on the Triton kernel" in why and "needs 3.0 GiB" in why and "1.0 GiB is free" in why
    monkeypatch.setattr(prepare, "device_free_bytes", lambda: None)  # no allocator statistics: no check
    assert prepare.prep_shortfall(params, "bfloat16", "pallas") is None


def test_engine_prepares_for_its_backend():
    cfg = tiny_config("qwen2")
    params = jspec.models.quantize_linears(tiny_params(cfg, jnp.float32, seed=3), lm_head=False)
    with backend.use_backend("reference"):  # the dequantized halves
        eng = jspec.Engine(params, cfg, max_len=32, k=2)
        assert eng.prepared and isinstance(eng.params["layers"][0]["down"], Int4Halves)
    with backend.use_backend("interpret"):
        assert not jspec.Engine(params, cfg, max_len=32, k=2).prepared
        with pytest.raises(ValueError, match="no int4 preparation for the 'interpret' kernel backend"):
            jspec.Engine(params, cfg, max_len=32, k=2, prepare=True)


@pytest.mark.parametrize("k,n,ctas,min_steps", [(3584, 37888, 132, 4), (18944, 3584, 132, 4), (1280, 512, 7, 1)])
def test_stream_k_partition_covers_every_unit_once_in_numbered_segments(k, n, ctas, min_steps):
    part = int4_ws.partition(k, n, int4_ws.Config(ctas=ctas, min_steps=min_steps))
    seen = np.zeros(part.units, int)
    slots = set()
    for c in range(part.ctas):
        lo, hi = c * part.units // part.ctas, (c + 1) * part.units // part.ctas
        assert 1 <= hi - lo <= part.per_cta
        seen[lo:hi] += 1
        for t in {u // part.steps for u in range(lo, hi)}:  # one segment per tile this CTA touches
            slots.add((t, c - part.cta_of(t * part.steps)))
    assert (seen == 1).all()
    assert slots == {(t, s) for t in range(part.tiles) for s in range(part.segments[t])}


@pytest.mark.parametrize(
    "k,n,wide,tile_per_cta",
    [
        (4096, 28672, True, True),  # Llama-3-8B gate_up: 28 steps per CTA; 112 wide tiles: one wave, 85% full
        (4096, 128256, True, True),  # Llama-3-8B lm_head: 501 tiles, 4 waves 95% full
        (3584, 152064, True, True),  # Qwen2.5-7B lm_head
        (5120, 27648, True, True),  # Qwen2.5-14B gate_up: 33 steps per CTA; 108 wide tiles, 82% full
        (4096, 24576, False, False),  # Qwen3.5 gate_up: 24 steps per CTA, one short of WIDE_MIN_STEPS
        (5120, 34816, True, False),  # the 27B-class hybrid's gate_up: 136 tiles, two waves 52% full: stream-K
        (14336, 4096, False, False),  # Llama-3-8B down: 14 steps per CTA, too few
        (5120, 7168, False, False),  # Qwen2.5-14B qkv
        (4096, 128 * 1001, False, False),  # N not a multiple of 256
    ],
)
def test_config_for_takes_wide_tiles_only_for_long_runs(k, n, wide, tile_per_cta, monkeypatch):
    monkeypatch.setattr(int4_ws, "sm_count", lambda: 132)
    cfg = int4_ws.config_for(k, n)
    assert cfg.tile_rows == (256 if wide else 128)
    assert int4_ws.fits(k, n, cfg)
    part = int4_ws.partition(k, n, cfg)
    if tile_per_cta:  # one CTA per tile: every tile computed whole by one CTA, no partials
        assert part.ctas == part.tiles == n // 256 and (part.segments == 1).all()
    else:  # stream-K: one CTA per SM
        assert part.ctas == 132


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _primitives(sub)


@pytest.mark.skipif(not MOSAIC_GPU_TRACES, reason="the kernel needs the Mosaic GPU API of jax >= 0.11")
def test_kernel_index_arithmetic_has_no_floor_division_sign_corrections():
    # jnp's // and % on the kernel's int32 indices add sign corrections, and Mosaic GPU asks ptxas for its version
    # (a process, ~7 ms) for each of their boolean conversions: on the H200 that was 8 of the 11 s it took to lower
    # a step executable. The indices are never negative, so the kernel divides with lax.div / lax.rem.
    cfg, k, n = int4_ws.Config(ctas=8), 1280, 512
    part = int4_ws.partition(k, n, cfg)
    args = [
        jax.ShapeDtypeStruct((16, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((k // int4_ws.TILE_K, n, int4_ws.TILE_K), jnp.int4),
        jax.ShapeDtypeStruct((k // int4_ws.TILE_K, n, int4_ws.TILE_K // 32), jnp.bfloat16),
    ]
    jaxpr = jax.make_jaxpr(lambda x, c, s: int4_ws._tile(x, c, s, cfg=cfg, part=part))(*args)
    names = set(_primitives(jaxpr.jaxpr))
    assert "div" in names and "sign" not in names


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize(
    "config",
    [
        int4_ws.Config(),
        int4_ws.Config(chunks=1),
        int4_ws.Config(ctas=7, min_steps=1),
        int4_ws.Config(ctas=4, min_steps=1),
        int4_ws.Config(ctas=7, min_steps=1, chunks=4),
        int4_ws.Config(ctas=5, min_steps=1, chunks=2, wg_rows=128),
    ],
)
@pytest.mark.parametrize("k", [1280, 1376])
def test_gpu_row_exact_and_close_to_the_reference(config, k):
    # n = 512: 4 tiles; k = 1280: 5 K steps, segments of 1..4 steps, one to three per tile; 1376 (43 blocks of 32):
    # codes padded to 1536. M <= 8 runs one 8-row tile (wgmma N = 8), M > 8 a 16-row tile: every row's bits are
    # M = 16's
    n = 512
    w = _weight(k, n, seed=8)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((16, k)), jnp.bfloat16)
    c = prepare_codes(w)
    ms = list(range(1, 17))
    f = jax.jit(lambda x, c: [int4_ws.rows_matmul(x[:m], c, config=config) for m in ms])
    ys = [np.asarray(y) for y in f(x, c)]
    for m, y in zip(ms, ys, strict=True):
        assert np.array_equal(bits(y), bits(ys[-1][:m])), f"row mismatch between M={m} and M=16"
    dense = np.asarray(x, np.float32) @ np.asarray(dequantize(w, jnp.bfloat16), np.float32)
    np.testing.assert_allclose(ys[-1], dense, rtol=0, atol=1e-4 * np.max(np.abs(dense)))


# (K, N, config) of the GPU tests of several tiles per launch and of live rows
TILE_CASES = [
    (1280, 512, None),
    (1280, 512, int4_ws.Config(ctas=7, min_steps=1)),  # several segments per tile
    (1280, 512, int4_ws.Config(ctas=5, min_steps=1, wg_rows=128)),
    (4096, 28672, None),  # Llama-3-8B gate_up: wide tiles, 4 row tiles per launch (a ring of 3)
]


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize("k,n,config", TILE_CASES)
def test_gpu_live_rows_compute_eight_rows_with_the_bits_of_the_full_tile(k, n, config):
    # a step's 16-row tile of which at most 8 rows are read (decode, verify k < 8) runs the kernel on 8 rows
    # (wgmma N = 8): every read row has the bits the full tile gives it, rows 8.. repeat rows 0..7; 9 read rows
    # run the full tile
    c = prepare_codes(_weight(k, n, seed=18))
    x = jnp.asarray(np.random.default_rng(19).standard_normal((16, k)), jnp.bfloat16)
    f = jax.jit(lambda x, c: [int4_ws.rows_matmul(x, c, config=config, live_rows=live) for live in (None, 1, 8, 9)])
    full, *narrow, nine = (np.asarray(y) for y in f(x, c))
    for y in narrow:
        assert np.array_equal(bits(y[:8]), bits(full[:8])) and np.array_equal(bits(y[8:]), bits(y[:8]))
    assert np.array_equal(bits(nine), bits(full))


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
def test_gpu_kernel_weights_are_the_formats_bits_across_the_scale_range():
    # one-hot rows pick single weights, y[i, n] = W[k_i, n]: every k (each nibble of the stored words), all 16 codes
    # and scales from the bottom to the top of SCALE_RANGE give the format's bf16(code s) exactly (`_dequantize`:
    # one FMA on subnormal pairs, the accumulator scaled back). A zero weight may come back as +0 where the format
    # has -0 (code 0 times a negative scale): the wgmma sums it with the zero products of the other k
    k, n = 512, 256
    rng = np.random.default_rng(22)
    low, high = np.log2(int4_ws.SCALE_RANGE)
    scales = np.exp2(rng.uniform(low, high - 1, (n, k // 32))) * rng.choice([1.0, -1.0], (n, k // 32))
    scales[: n // 2, 1] = 0.0  # all-zero blocks
    w = pack(rng.integers(0, 16, (n, k)), jnp.asarray(scales, jnp.bfloat16))
    c, f = prepare_codes(w), jax.jit(lambda x, c: int4_ws.rows_matmul(x, c))
    dense = np.asarray(dequantize(w, jnp.bfloat16), np.float32)
    for start in range(0, k, 16):
        x = jnp.zeros((16, k), jnp.bfloat16).at[np.arange(16), start + np.arange(16)].set(1.0)
        y, want = np.asarray(f(x, c)) + 0.0, dense[start : start + 16] + 0.0  # -0 + 0 = +0
        wrong = np.argwhere(bits(y) != bits(want))
        at = tuple(wrong[0]) if wrong.size else None
        assert at is None, f"{len(wrong)} differ, first k {start + at[0]} n {at[1]}: {y[at]!r}, format {want[at]!r}"


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
def test_gpu_default_config_is_config_for_the_shape_and_row_exact_with_wide_tiles(monkeypatch):
    # k = 2048, n = 16896: 1056 units of 128-row tiles, 8 steps per CTA on 132 CTAs; 528 of 256-row tiles, 4 per
    # CTA. With the step threshold lowered to 8 the rule takes the 256-row tiles, and rows_matmul's default must too
    monkeypatch.setattr(int4_ws, "sm_count", lambda: 132)
    monkeypatch.setattr(int4_ws, "WIDE_MIN_STEPS", 8)
    k, n = 2048, 16896
    wide = int4_ws.config_for(k, n)
    assert wide.tile_rows == 256
    c = prepare_codes(_weight(k, n, seed=12))
    x = jnp.asarray(np.random.default_rng(13).standard_normal((16, k)), jnp.bfloat16)
    ms = list(range(1, 17))
    ys = [np.asarray(y) for y in jax.jit(lambda x, c: [int4_ws.rows_matmul(x[:m], c) for m in ms])(x, c)]
    for m, y in zip(ms, ys, strict=True):
        assert np.array_equal(bits(y), bits(ys[-1][:m])), f"row mismatch between M={m} and M=16"
    assert np.array_equal(bits(ys[-1]), bits(np.asarray(int4_ws.rows_matmul(x, c, config=wide))))


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
def test_gpu_k_chunks_do_not_change_the_bits():
    # chunks only reorder conversion against the asynchronous wgmma: the same wgmma instructions accumulate in the
    # same k order, so 1, 2 and 4 chunks per step give the same bits (two partitions: one and several segments)
    k, n = 1280, 512
    c = prepare_codes(_weight(k, n, seed=10))
    x = jnp.asarray(np.random.default_rng(11).standard_normal((16, k)), jnp.bfloat16)
    for base in (int4_ws.Config(), int4_ws.Config(ctas=7, min_steps=1)):
        ys = [
            np.asarray(int4_ws.rows_matmul(x, c, config=dataclasses.replace(base, chunks=chunks)))
            for chunks in (1, 2, 4)
        ]
        assert all(np.array_equal(bits(y), bits(ys[0])) for y in ys[1:])


def test_launches_of_several_row_tiles_fit_shared_memory_and_keep_one_tile_unchanged():
    for cfg in (int4_ws.Config(), int4_ws.Config(wg_rows=128)):
        assert int4_ws.ring(cfg, 1) == cfg.stages  # one row tile: the ring of the decode and verify steps
        per = int4_ws.launch_tiles(cfg)
        assert 1 < per <= int4_ws.MAX_LAUNCH_TILES and int4_ws.ring(cfg, per) >= int4_ws.MIN_RING
        assert int4_ws.ring(cfg, per) * int4_ws.stage_bytes(cfg, per) + int4_ws.SMEM_RESERVE <= int4_ws.SMEM_BYTES
    # 64 rows (a B = 64 greedy round) in one launch with either tile, so each weight is read once a round
    assert int4_ws.launch_tiles(int4_ws.Config()) == 4 and int4_ws.launch_tiles(int4_ws.Config(wg_rows=128)) == 4


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize(
    "k,n,config",
    TILE_CASES + [(1280, 512, int4_ws.Config(ctas=7, min_steps=1, wide_wgmma=False))],  # + one wgmma per row tile
)
def test_gpu_several_row_tiles_per_launch_give_each_tile_its_own_bits(k, n, config):
    # R rows in ceil(R / 16) tiles, launches of up to launch_tiles of them: every row equals that row of its tile
    # computed alone (rows_matmul), bit for bit, whatever R and however the tiles group into launches
    c = prepare_codes(_weight(k, n, seed=14))
    x = jnp.asarray(np.random.default_rng(15).standard_normal((80, k)), jnp.bfloat16)
    alone = np.concatenate([np.asarray(int4_ws.rows_matmul(x[i : i + 16], c, config=config)) for i in range(0, 80, 16)])
    for r in (17, 32, 48, 64, 80):
        y = np.asarray(jax.jit(lambda x, c: int4_ws.tiles_matmul(x, c, config=config))(x[:r], c))
        assert np.array_equal(bits(y), bits(alone[:r])), f"R={r}: a row differs from its tile alone"


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernel needs a GPU")
@pytest.mark.parametrize("k,n", [(1280, 1056), (4096, 12352)])  # 12352: Qwen3.5's Gated DeltaNet in_proj
def test_gpu_padded_n_gives_the_columns_of_the_unpadded_tile_bits(k, n):
    # N padded to whole 128-row tiles: a column's bits are those of the same column of a weight whose padding
    # columns hold real codes (the same stored N, hence the same partition), at every M
    full = np.random.default_rng(16).standard_normal((k, int4_ws.padded_n(n))).astype(np.float32)
    cut, whole = prepare_codes(quantize(full[:, :n], symmetric=True)), prepare_codes(quantize(full, symmetric=True))
    x = jnp.asarray(np.random.default_rng(17).standard_normal((16, k)), jnp.bfloat16)
    ms = list(range(1, 17))
    f = jax.jit(lambda x, c: [int4_ws.rows_matmul(x[:m], c) for m in ms])
    ys, refs = [np.asarray(y) for y in f(x, cut)], [np.asarray(y) for y in f(x, whole)]
    for m, y, ref in zip(ms, ys, refs, strict=True):
        assert y.shape == (m, n) and np.array_equal(bits(y), bits(ref[:, :n])), f"M={m}: a column differs"
        assert np.array_equal(bits(y), bits(ys[-1][:m])), f"row mismatch between M={m} and M=16"
