"""Chunked prefill: the flash attention path against a dense softmax, no [T, T] array anywhere, chunk boundaries in
the Engine (speculative == greedy over many chunks), memory bounded by the chunk and the cache, long-prompt errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.models import dense, family_module, hybrid
from jspec.state import init_state
from pallas_kernels import chunk_attention, use_backend
from tests.tiny import tiny_config, tiny_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dense_softmax_attention(q, kv, start):
    """float64 numpy: row i of q [C, Hq, D] attends kv positions 0..start+i (GQA), full softmax."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    c, hq, d = q.shape
    s, hkv = kv.shape[:2]
    keys, values = np.repeat(kv[:, :, 0], hq // hkv, axis=1), np.repeat(kv[:, :, 1], hq // hkv, axis=1)
    scores = np.einsum("chd,shd->hcs", q, keys) * d**-0.5
    scores = np.where(np.arange(s)[None, :] <= start + np.arange(c)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hcs,shd->chd", probs, values)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("start,rows,group", [(0, 40, 2), (37, 24, 1), (50, 24, 4)])
def test_chunk_attention_matches_a_dense_softmax(backend, dtype, start, rows, group):
    """Rows at start.. over a 64-position cache: block boundaries crossed, GQA, the last case's rows running past
    the cache end (they see the whole cache). Cache rows no query sees hold NaN: never read."""
    rng = np.random.default_rng(start)
    hkv, d, s_len = 2, 16, 64
    q = rng.standard_normal((rows, hkv * group, d))
    kv = rng.standard_normal((s_len, hkv, 2, d))
    kv[start + rows :] = np.nan
    want = dense_softmax_attention(q, np.nan_to_num(kv), start)
    with use_backend(backend):
        got = chunk_attention(jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.int32(start), scale=d**-0.5)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_a_full_forward_is_differentiable_on_every_backend(backend):
    """The trainers differentiate `dense.forward`: the kernel's backward (the jnp path's) gives the gradient of a
    dense softmax attention (float64 numpy, by central differences along one random direction)."""
    rng = np.random.default_rng(0)
    c, hkv, group, d = 24, 2, 2, 16
    q = rng.standard_normal((c, hkv * group, d))
    kv = rng.standard_normal((c, hkv, 2, d))
    weights = rng.standard_normal((c, hkv * group, d))
    direction = rng.standard_normal(q.shape), rng.standard_normal(kv.shape)

    def loss(q, kv):
        return jnp.sum(chunk_attention(q, kv, 0, scale=d**-0.5) * weights)

    with use_backend(backend):
        dq, dkv = jax.grad(loss, argnums=(0, 1))(jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32))
    got = np.sum(np.asarray(dq, np.float64) * direction[0]) + np.sum(np.asarray(dkv, np.float64) * direction[1])
    eps = 1e-4
    plus = np.sum(dense_softmax_attention(q + eps * direction[0], kv + eps * direction[1], 0) * weights)
    minus = np.sum(dense_softmax_attention(q - eps * direction[0], kv - eps * direction[1], 0) * weights)
    np.testing.assert_allclose(got, (plus - minus) / (2 * eps), rtol=1e-4)


def _shapes(jaxpr):
    """Every intermediate shape of a (closed) jaxpr, sub-jaxprs of loops, conds and calls included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield getattr(var.aval, "shape", ())
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _shapes(inner)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_next"])
def test_no_prompt_by_prompt_array_in_forward_or_prefill(family):
    """Neither the full forward nor a prefill of T = 600 positions builds an array with two axes >= T (the scores
    of a whole prompt); the 256-key blocks of the flash path are the largest."""
    cfg = tiny_config(family)
    params = tiny_params(cfg) if family == "qwen2" else hybrid.init_params(cfg, jax.random.PRNGKey(0))
    t = 600
    tokens = jnp.zeros((t,), jnp.int32)
    state = init_state(cfg, t + 8, jnp.float32)
    traced = [
        jax.make_jaxpr(lambda p, x: family_module(cfg).forward(p, cfg, x))(params, tokens),
        jax.make_jaxpr(lambda p, s, x: jspec.prefill(p, cfg, s, x, jnp.int32(t), 128))(params, state, tokens),
    ]
    for closed in traced:
        big = [s for s in _shapes(closed.jaxpr) if sum(dim >= t for dim in s) >= 2]
        assert big == []


@pytest.mark.parametrize("on_device", [False, True])
def test_many_chunks_speculative_equals_greedy(on_device):
    """A 100-token prompt in chunks of 16 (7 chunks, the last padded): prompt lookup with and without the gate
    gives greedy's tokens, and greedy's prefill logits equal a one-chunk prefill's within float32 rounding."""
    cfg = tiny_config("llama")
    params = tiny_params(cfg, seed=3)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, cfg.vocab_size, 25)] * 4
    engine = jspec.Engine(params, cfg, max_len=160, k=4, prefill_chunk=16)
    greedy = engine.generate(prompt, 40, on_device=on_device)
    for gate in (None, jspec.HitDensityGate(window=4, min_hits=1)):
        spec = engine.generate(prompt, 40, drafter=jspec.PromptLookup(), gate=gate, on_device=on_device)
        assert spec.tokens == greedy.tokens and spec.stats.verify_steps > 0
    fill = jax.jit(jspec.prefill, static_argnums=(1, 5))
    padded = np.asarray(prompt + [0] * 28, np.int32)
    _, chunked = fill(params, cfg, init_state(cfg, 160, jnp.float32), padded, len(prompt), 16)
    _, whole = fill(params, cfg, init_state(cfg, 160, jnp.float32), padded, len(prompt), 128)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)


def test_a_prompt_longer_than_the_cache_is_refused_before_compute():
    cfg = tiny_config("qwen2")
    engine = jspec.Engine(tiny_params(cfg), cfg, max_len=40, k=2, prefill_chunk=16)
    with pytest.raises(ValueError, match=r"prompt of 45 tokens .* max_len is 40"):
        engine.generate(list(range(1, 46)), 4)
    assert engine.num_compiles == 0


def test_the_default_chunk_fits_the_cache():
    cfg = tiny_config("qwen2")
    params = tiny_params(cfg)
    assert jspec.Engine(params, cfg, max_len=40).prefill_chunk == 48
    assert jspec.Engine(params, cfg, max_len=20_000).prefill_chunk == jspec.steps.PREFILL_CHUNK
    with pytest.raises(ValueError, match="prefill_chunk"):
        jspec.Engine(params, cfg, max_len=40, prefill_chunk=0)


PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np
    import checkpoints, jspec

    params, cfg = checkpoints.load(checkpoints.demo_dir())
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 8192).tolist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = jspec.Engine(params, cfg, max_len=8192 + 8, k=4)
        out = engine.generate(prompt, 4)
    # VmHWM: this process's own peak RSS (ru_maxrss would inherit the forking parent's across exec)
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    json.dump(dict(tokens=out.tokens, peak=peak, chunk=engine.prefill_chunk, warnings=[str(w.message) for w in caught]),
              sys.stdout)
    """
)


def test_an_8192_token_prompt_on_the_demo_model_stays_under_3_gb():
    """The whole process (jax, the model, an 8200-position cache, 16 prefill chunks, 4 tokens) peaks under 3 GB.
    Before chunking, the prompt's [Hq, T, T] float32 scores alone took 2 GB per layer. The demo model's
    max_position_embeddings (512) is far below the cache: the Engine warns."""
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert len(out["tokens"]) == 4 and out["chunk"] == jspec.steps.PREFILL_CHUNK
    assert out["peak"] < 3 * 2**30, f"peak RSS {out['peak'] / 2**30:.2f} GiB"
    assert any("max_position_embeddings" in w for w in out["warnings"])


def test_max_len_beyond_the_trained_positions_warns():
    cfg = tiny_config("qwen2", max_position_embeddings=64)
    with pytest.warns(UserWarning, match=r"max_len 100 .* max_position_embeddings 64"):
        jspec.Engine(tiny_params(cfg), cfg, max_len=100)


def test_dense_prefill_rows_past_the_cache_are_dropped():
    """A chunk whose padding runs past the physical cache writes only the rows that fit (a dynamic_update_slice
    would have moved the whole write back over real rows)."""
    cache = jnp.zeros((8, 1, 2, 2))
    rows = jnp.ones((4, 1, 2, 2)) * jnp.arange(1, 5)[:, None, None, None]
    out = np.asarray(dense.write_rows(cache, rows, jnp.int32(6)))
    assert out[:6].sum() == 0 and list(out[6:, 0, 0, 0]) == [1, 2]


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 4e-2), ("float32", 5e-3)])
@pytest.mark.parametrize("head_dim,group", [(16, 2), (32, 1), (64, 1), (128, 4), (256, 2)])
def test_compiled_chunk_attention_matches_a_dense_softmax(head_dim, group, dtype, tol):
    """The Pallas kernel as the GPU compiles it (the tiles of every head_dim and dtype: float32's must fit shared
    memory too): a 512-row chunk at position 1000 of a 2048-position cache, and a full forward's fresh keys (start
    0, 300 rows, no padding multiple)."""
    rng = np.random.default_rng(head_dim)
    hkv = 2
    for start, rows, s_len in ((1000, 512, 2048), (0, 300, 300)):
        q = rng.standard_normal((rows, hkv * group, head_dim))
        kv = rng.standard_normal((s_len, hkv, 2, head_dim))
        want = dense_softmax_attention(q, kv, start)
        got = chunk_attention(jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.int32(start), scale=head_dim**-0.5)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
