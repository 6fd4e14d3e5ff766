"""Row-tile matmul kernel (pallas_kernels.int4_matmul) in Pallas interpret mode on CPU: row-exactness across M,
agreement with the jnp reference, shape handling; plus a GPU exactness check when a GPU is present. The jnp
reference product (pallas_kernels.matmul): row-exactness, prepared Int4Halves giving the same bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.exactness import bits
from jspec.models import quantize_linears
from pallas_kernels import backend, int4_matmul
from pallas_kernels import prepare as prepare_module
from pallas_kernels.int4 import Int4Weight, dequantize, quantize
from pallas_kernels.matmul import Int4Halves, linear, reference_rows_matmul
from pallas_kernels.prepare import prepare_reference, prepared_nbytes
from tests.tiny import ScriptDrafter, tiny_config, tiny_params

ON_GPU = jax.default_backend() == "gpu"


def _all_m(w, x, ms, interpret=True, config=None):
    """rows_matmul(x[:m], w) for each m, traced in one jitted function (one compile)."""
    f = jax.jit(lambda x, w: [int4_matmul.rows_matmul(x[:m], w, interpret=interpret, config=config) for m in ms])
    return [np.asarray(y) for y in f(x, w)]


def _case(kind, k, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((k, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((16, k)), dtype)
    if kind == "dense":
        return x, jnp.asarray(wf, dtype)
    return x, quantize(wf, symmetric=kind == "int4_sym")


def _assert_row_exact(ys, ms):
    full = ys[-1]
    assert ms[-1] == 16 and full.shape[0] == 16
    for m, y in zip(ms, ys, strict=True):
        assert y.shape == (m, full.shape[1]) and y.dtype == np.float32
        assert np.array_equal(bits(y), bits(full[:m])), f"row mismatch between M={m} and M=16"


def test_row_exact_every_m_int4_bf16():
    x, w = _case("int4_sym", 256, 128, jnp.bfloat16)
    ms = list(range(1, 17))
    _assert_row_exact(_all_m(w, x, ms), ms)


@pytest.mark.parametrize(
    "kind,dtype",
    [("int4_sym", jnp.float32), ("int4_asym", jnp.bfloat16), ("int4_asym", jnp.float32), ("dense", jnp.float32)],
)
def test_row_exact_and_matches_reference(kind, dtype):
    x, w = _case(kind, 192, 96, dtype, seed=1)
    ms = [1, 3, 8, 16]
    ys = _all_m(w, x, ms)
    _assert_row_exact(ys, ms)
    ref = np.asarray(reference_rows_matmul(x, w))
    scale = np.max(np.abs(ref))
    np.testing.assert_allclose(ys[-1], ref, rtol=0, atol=2e-5 * scale)


def test_dense_bf16_weights_are_cast_like_the_reference():
    x, w = _case("dense", 64, 64, jnp.bfloat16, seed=2)
    wf32 = w.astype(jnp.float32)  # float32 weights with bfloat16 activations: cast to bf16 in the kernel
    y = np.asarray(int4_matmul.rows_matmul(x[:5], wf32, interpret=True))
    ref = np.asarray(reference_rows_matmul(x[:5], wf32))
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.max(np.abs(ref)))


@pytest.mark.parametrize("k,n", [(96, 192), (160, 48)])
def test_tile_remainders(k, n):
    """K and N that are not multiples of the default tiles (tiny-model shapes) pick smaller fitting tiles."""
    x, w = _case("int4_sym", k, n, jnp.float32, seed=3)
    y = np.asarray(int4_matmul.rows_matmul(x[:2], w, interpret=True))
    ref = np.asarray(reference_rows_matmul(x[:2], w))
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * np.max(np.abs(ref)))


def test_split_k_config_is_row_exact_and_combines_in_order():
    x, w = _case("int4_sym", 512, 64, jnp.bfloat16, seed=4)
    cfg = int4_matmul.Config(block_n=32, block_k=128, split_k=2)
    ms = [1, 7, 16]
    ys = _all_m(w, x, ms, config=cfg)
    _assert_row_exact(ys, ms)
    ref = np.asarray(reference_rows_matmul(x, w))
    np.testing.assert_allclose(ys[-1], ref, rtol=0, atol=2e-5 * np.max(np.abs(ref)))


def test_errors_name_the_constraint():
    x, w = _case("int4_sym", 64, 64, jnp.float32)
    with pytest.raises(ValueError, match="1..16 rows"):
        int4_matmul.rows_matmul(jnp.zeros((17, 64)), w, interpret=True)
    with pytest.raises(ValueError, match="K=32"):
        int4_matmul.rows_matmul(jnp.zeros((2, 32)), w, interpret=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        int4_matmul.rows_matmul(jnp.zeros((2, 64), jnp.int32), w, interpret=True)
    with pytest.raises(ValueError, match="N divisible by 16"):
        int4_matmul.rows_matmul(x[:1], jnp.zeros((64, 40)), interpret=True)
    with pytest.raises(ValueError, match="K divisible by 16"):
        int4_matmul.rows_matmul(jnp.zeros((1, 40)), jnp.zeros((40, 32)), interpret=True)
    with pytest.raises(ValueError, match="split_k=3 must divide"):
        int4_matmul.rows_matmul(x[:1], w, interpret=True, config=int4_matmul.Config(block_n=32, block_k=32, split_k=3))


MODEL_SHAPES = [  # (K, N) of the linear layers of the supported model sizes
    *[(3584, n) for n in (4608, 3584, 2 * 18944, 152064)] + [(18944, 3584)],  # Qwen2.5-7B
    *[(5120, n) for n in (7168, 5120, 2 * 13824, 152064)] + [(13824, 5120)],  # Qwen2.5-14B
    *[(4096, n) for n in (6144, 4096, 2 * 14336, 128256)] + [(14336, 4096)],  # Llama-3-8B
    *[(4096, n) for n in (5120, 4096, 2 * 13696, 151552)] + [(13696, 4096)],  # GLM-4-9B
]


@pytest.mark.parametrize("interpret", [True, False])
def test_real_model_shapes_get_valid_configs(interpret):
    for k, n in MODEL_SHAPES:
        for int4 in (True, False):
            cfg = int4_matmul.choose_config(k, n, int4=int4, interpret=interpret)
            steps = k // cfg.block_k
            assert n % cfg.block_n == 0 and k % cfg.block_k == 0 and steps % cfg.split_k == 0, (k, n, cfg)
            assert cfg.block_k >= 128, (k, n, cfg)  # at least 64 packed bytes per row per step


def test_linear_dispatches_to_the_kernel_under_interpret_backend():
    x, w = _case("int4_asym", 128, 64, jnp.bfloat16, seed=5)
    with backend.use_backend("interpret"):
        y = linear(x[:3], w, out_dtype=jnp.float32)
    direct = int4_matmul.rows_matmul(x[:3], w, interpret=True)
    assert np.array_equal(bits(y), bits(direct))


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas kernels need a GPU")
@pytest.mark.parametrize("kind", ["int4_sym", "int4_asym", "dense"])
def test_gpu_row_exact(kind):
    x, w = _case(kind, 1024, 512, jnp.bfloat16, seed=6)
    ms = list(range(1, 17))
    ys = _all_m(w, x, ms, interpret=False)
    _assert_row_exact(ys, ms)
    ref = np.asarray(reference_rows_matmul(x, w))
    np.testing.assert_allclose(ys[-1], ref, rtol=0, atol=1e-4 * np.max(np.abs(ref)))


# ------------------------------------------------------------------ jnp reference product and prepared halves
def _reference_all_m(w, x, ms):
    f = jax.jit(lambda x, w: [reference_rows_matmul(x[:m], w) for m in ms])
    return [np.asarray(y) for y in f(x, w)]


@pytest.mark.parametrize("kind", ["int4_sym", "int4_asym"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_row_exact_every_m_and_prepared_same_bits(kind, dtype):
    """Row r of the reference product is the same for every M, with int4 weights and with prepared halves."""
    x, w = _case(kind, 256, 96, dtype, seed=7)
    ms = list(range(1, 17))
    ys = _reference_all_m(w, x, ms)
    _assert_row_exact(ys, ms)
    prepared = prepare_reference(w, jnp.float32)  # float32 halves serve bfloat16 activations by one rounding
    for y, yp in zip(ys, _reference_all_m(prepared, x, ms), strict=True):
        assert np.array_equal(bits(y), bits(yp))
    dense = np.asarray(x, np.float32) @ np.asarray(dequantize(w, dtype), np.float32)
    np.testing.assert_allclose(ys[-1], dense, rtol=0, atol=1e-5 * np.max(np.abs(dense)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_prefill_with_prepared_halves_same_bits(dtype):
    x, w = _case("int4_asym", 128, 64, dtype, seed=8)
    xs = jnp.concatenate([x, x[::-1] * 0.5])  # 32 rows: the prefill (M > ROW_TILE) path
    bias = jnp.linspace(-1.0, 1.0, 64)
    f = jax.jit(lambda x, w: linear(x, w, bias, out_dtype=jnp.float32))
    prepared = prepare_reference(w, dtype)
    for rows in (xs, xs[:5]):
        assert np.array_equal(bits(f(rows, w)), bits(f(rows, prepared)))
    dense = np.asarray(xs, np.float32) @ np.asarray(dequantize(w, dtype), np.float32) + np.asarray(bias)
    np.testing.assert_allclose(np.asarray(f(xs, w)), dense, rtol=0, atol=1e-5 * np.max(np.abs(dense)))


def test_prepared_halves_errors_and_sizes():
    x, w = _case("int4_sym", 64, 32, jnp.float32, seed=9)
    params = {"w": w, "norm": jnp.ones((64,))}
    prepared = prepare_reference(params, jnp.bfloat16)
    assert isinstance(prepared["w"], Int4Halves) and prepared["w"].shape == (64, 32)
    assert prepared["norm"] is params["norm"]
    assert prepared_nbytes(params, jnp.bfloat16) == prepared["w"].nbytes == 64 * 32 * 2
    with pytest.raises(ValueError, match="cannot serve float32"):
        reference_rows_matmul(x[:2], prepared["w"])
    with backend.use_backend("interpret"), pytest.raises(ValueError, match="'reference' kernel backend"):
        linear(x[:2], prepared["w"])


def test_engine_prepared_weights_same_tokens():
    """Engine(prepare=True) runs on Int4Halves and gives the tokens of Engine(prepare=False), greedy and
    speculative."""
    cfg = tiny_config("qwen2")
    params = quantize_linears(tiny_params(cfg, jnp.float32, seed=3), lm_head=False)
    assert isinstance(params["layers"][0]["down"], Int4Weight)
    prompt = [5, 17, 42, 5, 17]
    runs = {}
    for prepare in (False, True):
        eng = jspec.Engine(params, cfg, max_len=48, k=3, prepare=prepare)
        assert eng.prepared == prepare
        greedy = eng.generate(prompt, 24).tokens
        spec = eng.generate(prompt, 24, drafter=ScriptDrafter(tuple(prompt + greedy))).tokens
        assert spec == greedy
        runs[prepare] = greedy
    assert runs[True] == runs[False]


def test_engine_warns_when_the_prepared_copy_does_not_fit(monkeypatch):
    """The automatic choice never falls back silently: too little memory for the halves -> a warning, per-step
    dequantization, same tokens."""
    cfg = tiny_config("qwen2")
    params = quantize_linears(tiny_params(cfg, jnp.float32, seed=3), lm_head=False)
    monkeypatch.setattr(prepare_module, "reference_prep_fits", lambda *a, **k: False)
    with pytest.warns(UserWarning, match="dequantized in every step"):
        eng = jspec.Engine(params, cfg, max_len=32, k=2)
    assert not eng.prepared
    assert (
        eng.generate([5, 17, 42], 6).tokens
        == jspec.Engine(params, cfg, max_len=32, k=2, prepare=True).generate([5, 17, 42], 6).tokens
    )


def test_first_rows_barrier_only_below_a_full_tile():
    """A slice below the full row tile sits behind an optimization barrier (XLA cannot sink it into the product); the
    full tile has neither, so XLA may fuse the product's epilogue into its consumer."""
    y = jnp.arange(backend.ROW_TILE * 3, dtype=jnp.float32).reshape(backend.ROW_TILE, 3)
    for m in (1, 7, backend.ROW_TILE):
        jaxpr = str(jax.make_jaxpr(lambda a, m=m: backend.first_rows(a * 2, m))(y))
        assert ("optimization_barrier" in jaxpr) == (m < backend.ROW_TILE), jaxpr
        np.testing.assert_array_equal(backend.first_rows(y, m), y[:m])
