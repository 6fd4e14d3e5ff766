"""Row-tile matmul kernel (pallas_kernels.int4_matmul) in Pallas interpret mode on CPU: row-exactness across M,
agreement with the jnp reference, shape handling; plus a GPU exactness check when a GPU is present."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.exactness import bits
from pallas_kernels import backend, int4_matmul
from pallas_kernels.int4 import quantize
from pallas_kernels.matmul import linear, reference_rows_matmul

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
    with pytest.raises(ValueError, match="no interpret mode"):
        int4_matmul.rows_matmul(x[:1], w, interpret=True, config=int4_matmul.Config(kernel="mosaic"))
    with pytest.raises(ValueError, match="Triton-lowered kernel only"):
        int4_matmul.rows_matmul(x[:1], jnp.zeros((64, 64)), interpret=True, config=int4_matmul.Config(kernel="mosaic"))
    with pytest.raises(ValueError, match="unknown kernel"):
        int4_matmul.rows_matmul(x[:1], w, interpret=True, config=int4_matmul.Config(kernel="cuda"))


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
