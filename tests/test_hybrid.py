"""Hybrid Gated-DeltaNet families (qwen3_next, qwen3_5): HuggingFace oracle, step-level bit exactness of verify vs
decode (recurrent rollback by state selection), speculative == greedy end to end, import, MoE refusal."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
import jspec
from checkpoints.hf_hybrid import qwen3_next_in_proj_order
from jspec.config import ModelConfig, UnsupportedModelError
from jspec.exactness import bits
from jspec.loop import LoopSettings, decode_round, eos_array, prefill_round
from jspec.models import hybrid, quantize_linears
from jspec.state import init_state
from pallas_kernels import ROW_TILE, Int4Weight, quantize, use_backend
from pallas_kernels.recurrent import (
    chunk_gated_delta,
    gdn_gates,
    gdn_query_key,
    gdn_rows,
    gdn_step,
    l2_normalize,
    stored_values,
)
from tests.conftest import TINY_HF_CONFIGS
from tests.tiny import ScriptDrafter, tiny_config

MAX_LEN = 96
# the recurrent kernel compiled (Triton) runs on a GPU only
ON_GPU_ONLY = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
VOCAB = 96
HF_TOKENS = 80  # > 64: the chunked prefill crosses a chunk boundary


@functools.cache
def tiny_params(dtype: str = "float32", int4: bool = False) -> dict:
    params = hybrid.init_params(tiny_config("qwen3_next"), jax.random.PRNGKey(0), jnp.dtype(dtype), scale=0.1)
    return quantize_linears(params, lm_head=False) if int4 else params


# ---------------------------------------------------------------------------------------------------------------
# HuggingFace oracle.


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5"])
def test_hf_oracle_logits_and_greedy(variant, tiny_hf_model):
    import torch

    model, path = tiny_hf_model(variant)
    params, cfg = checkpoints.load_hf(path)
    assert cfg.family == variant and cfg.layer_types == tuple(model.config.layer_types)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, HF_TOKENS)
    with torch.no_grad():
        expected = model(torch.tensor(ids[None])).logits[0].numpy()
    logits = np.asarray(jspec.forward(params, cfg, ids))
    assert np.max(np.abs(logits - expected)) <= 1e-4 * np.max(np.abs(expected))

    engine = jspec.Engine(params, cfg, max_len=128, k=3, prefill_chunk=16)
    # Prefill over five chunks (the recurrent state crosses four boundaries, the last chunk padded); for qwen3_next
    # also a prompt shorter than the conv window.
    for prompt in (ids[:75], ids[:2]) if variant == "qwen3_next" else (ids[:75],):
        ids_t = torch.tensor(prompt[None])
        with torch.no_grad():  # an explicit mask: token 0 in a prompt is not padding
            out = model.generate(
                ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )
        assert engine.generate(prompt.tolist(), 32).tokens == out[0, prompt.size :].tolist()


def test_hf_import_layouts(tiny_hf_model):
    """qwen3_next's grouped projections land in the [q | k | v | z | b | a] layout; int4 reorders output channels."""
    from safetensors.numpy import load_file

    _, path = tiny_hf_model("qwen3_next")
    t = load_file(str(path / "model.safetensors"))
    params, cfg = checkpoints.load_hf(path)
    la = "model.layers.0.linear_attn"
    fused = np.concatenate([t[f"{la}.in_proj_qkvz.weight"], t[f"{la}.in_proj_ba.weight"]]).T
    order = qwen3_next_in_proj_order(cfg)
    assert sorted(order.tolist()) == list(range(fused.shape[1]))
    p = params["layers"][0]
    np.testing.assert_array_equal(p["in_proj"], fused[:, order])
    # Head 0 of the first key group: q rows 0..15 of in_proj_qkvz, then k rows 16..31, then the group's v / z.
    np.testing.assert_array_equal(p["in_proj"][:, :16], t[f"{la}.in_proj_qkvz.weight"][:16].T)
    np.testing.assert_array_equal(p["conv"], t[f"{la}.conv1d.weight"][:, 0, :].T)
    assert p["A_log"].dtype == jnp.float32 and p["dt_bias"].dtype == jnp.float32

    q_params, _ = checkpoints.load_hf(path, dtype="bfloat16", quantize="int4")
    q = q_params["layers"][0]
    assert all(isinstance(q[n], Int4Weight) for n in ("in_proj", "out", "gate_up", "down"))
    assert q["A_log"].dtype == jnp.float32 and q["conv"].dtype == jnp.bfloat16
    direct = quantize(jnp.asarray(p["in_proj"], jnp.float32))
    assert np.array_equal(q["in_proj"].packed, direct.packed) and np.array_equal(q["in_proj"].scales, direct.scales)


# ---------------------------------------------------------------------------------------------------------------
# Config: MoE refusal, dense Qwen3-Next configs.


def _hf_dict(variant: str, **changes) -> dict:
    model_type, kwargs = TINY_HF_CONFIGS[variant]
    return {**kwargs, "model_type": model_type, **changes}


@pytest.mark.parametrize(
    "changes,layer",
    [
        (dict(num_experts=8, mlp_only_layers=[0]), 1),
        (dict(num_experts=8, decoder_sparse_step=2), 1),
        (dict(num_experts=None), 0),  # absent: transformers' default is 512 experts
    ],
)
def test_moe_refused_naming_the_layer(changes, layer):
    d = _hf_dict("qwen3_next", **changes)
    if changes.get("num_experts", 0) is None:
        del d["num_experts"]
    with pytest.raises(UnsupportedModelError, match=f"MoE is not supported yet: layer {layer} "):
        ModelConfig.from_hf(d)


def test_moe_model_type_refused():
    with pytest.raises(UnsupportedModelError, match="MoE is not supported yet: layer 0"):
        ModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": {}})


def test_dense_configs_load():
    cfg = ModelConfig.from_hf(_hf_dict("qwen3_next", num_experts=8, mlp_only_layers=[0, 1, 2, 3]))
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.rope.partial_rotary_factor == 0.25 and cfg.norm_plus_one and cfg.attn_output_gate
    cfg = ModelConfig.from_hf({"model_type": "qwen3_5", "text_config": _hf_dict("qwen3_5")})
    assert cfg.family == "qwen3_5" and cfg.attention_bias and cfg.o_bias
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)


# ---------------------------------------------------------------------------------------------------------------
# Step level: verify row i == decode at position p + i, bit for bit; rollback selects a candidate state.


@functools.cache
def _steps(dtype: str, int4: bool):
    cfg = tiny_config("qwen3_next")
    params = tiny_params(dtype, int4)
    prompt = np.asarray([5, 17, 3, 42, 8, 8, 9, 1, 77, 30, 2, 11, 4], np.int32)
    padded = np.zeros((16,), np.int32)
    padded[: prompt.size] = prompt
    state = init_state(cfg, MAX_LEN, jnp.dtype(dtype))
    state, _ = jax.jit(jspec.prefill, static_argnums=(1, 5))(params, cfg, state, padded, prompt.size, 8)

    def decode_and_force(p, s, token):
        s, logits = jspec.decode_step(p, cfg, s)
        return jspec.commit(s, jnp.int32(0), token), logits

    verify = jax.jit(lambda p, s, d: jspec.verify_step(p, cfg, s, d))
    return cfg, params, state, jax.jit(decode_and_force), verify


@pytest.mark.parametrize("dtype,int4", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_verify_rows_equal_decode(dtype, int4):
    cfg, params, state, decode, verify = _steps(dtype, int4)
    draft = np.random.default_rng(0).integers(0, cfg.vocab_size, ROW_TILE).astype(np.int32)
    decoded, s = [], state
    for i in range(ROW_TILE):
        s, logits = decode(params, s, draft[i])
        decoded.append(np.asarray(logits))
    for k in (1, 2, 3, 7, 15) if (dtype, int4) == ("float32", False) else (1, 3, 15):
        _, logits = verify(params, state, draft[:k])
        for i in range(k + 1):
            assert np.array_equal(bits(logits[i]), bits(decoded[i])), f"{dtype} int4={int4} k={k} row {i}"


def test_stored_values_hold_what_a_bfloat16_buffer_holds():
    """`stored_values` (the conv's inputs, rounded so XLA cannot drop the rounding) gives the bits of a bfloat16
    round trip over five decades, ties, zeros and infinities; float16, whose subnormals reduce_precision does not
    round as a convert does, is refused."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(512).astype(np.float32) * s for s in (1e-30, 1e-3, 1.0, 1e3, 1e30)])
    ties = ((0x3F00 + np.arange(256, dtype=np.uint32)) << 16 | 0x8000).view(np.float32)  # halfway between bfloat16s
    x = np.concatenate([x, ties, np.array([0.0, -0.0, np.inf, -np.inf], np.float32)])
    got = jax.jit(stored_values, static_argnums=1)(x, jnp.bfloat16)
    want = jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)
    assert np.array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="stored_values takes float32 or bfloat16, got float16"):
        stored_values(x, jnp.float16)


def test_commit_selects_the_post_state():
    """After verify + commit(n), the next decode equals decoding the accepted tokens one by one (same bits, state
    and conv window included): the rollback is a selection of candidate slot n."""
    cfg, params, state, decode, verify = _steps("float32", False)
    draft = np.asarray([4, 9, 16, 25, 36, 49, 64], np.int32)
    after_verify, _ = verify(params, state, draft)
    for n in (0, 2, 6):
        s = state
        for i in range(n + 1):
            s, _ = decode(params, s, draft[i] if i < n else 1)
        rolled = jspec.commit(after_verify, jnp.int32(n), jnp.int32(1))
        assert int(rolled.slot) == n and int(rolled.position) == int(s.position)
        for c_ref, c_rolled in zip(s.cache, rolled.cache, strict=True):
            if isinstance(c_ref, dict):
                want, got = hybrid.candidate_state(c_ref, 0), hybrid.candidate_state(c_rolled, n)
                for name in ("ssm", "conv"):
                    assert np.array_equal(bits(want[name]), bits(got[name]))
        _, expect = decode(params, s, 0)
        _, got = decode(params, rolled, 0)
        assert np.array_equal(bits(got), bits(expect))


GDN_BACKENDS = ["reference", "interpret", pytest.param("pallas", marks=ON_GPU_ONLY)]


def _gdn_inputs(seed: int, h: int = 4, nk: int = 2, dk: int = 16, dv: int = 32, width: int = 4):
    """Random gdn_rows inputs for a full row tile: (cache {"ssm": float32 [R, h, dk, dv], "conv": bfloat16
    [R + W - 2, C]}, inputs float32 [R, 2 C + 2 h] (conv output columns, b, a, then conv inputs: bfloat16 values),
    a_log, dt_bias [h]), C = 2 nk dk + h dv."""
    rng = np.random.default_rng(seed)
    r, channels = ROW_TILE, 2 * nk * dk + h * dv
    states = jnp.asarray(rng.normal(size=(r, h, dk, dv)), jnp.float32)
    conv = jnp.asarray(rng.normal(size=(r + width - 2, channels)), jnp.bfloat16)
    raw = jnp.asarray(rng.normal(size=(r, channels)), jnp.bfloat16).astype(jnp.float32)
    inputs = jnp.concatenate([jnp.asarray(rng.normal(size=(r, channels + 2 * h)), jnp.float32), raw], axis=1)
    a_log = jnp.asarray(np.log(rng.uniform(0.5, 4.0, h)), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=h), jnp.float32)
    return dict(conv=conv, ssm=states), inputs, a_log, dt_bias


def _gdn_rows(rows: int, nk: int = 2):
    """gdn_rows over `_gdn_inputs`' layout, jitted: (cache, slot, inputs, a_log, dt_bias) -> (cache, out)."""
    return jax.jit(functools.partial(gdn_rows, rows=rows, key_heads=nk))


def _same_bits(a, b) -> bool:
    return all(np.array_equal(bits(x), bits(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("backend", GDN_BACKENDS)
def test_gdn_rows_row_invariant(backend):
    """One call over 16 rows == 16 one-row calls chained through slot 0, bit for bit, recurrent state, conv window
    and output alike; kernel == reference (the conv cache, pure data movement, bit for bit)."""
    r = ROW_TILE
    cache, inputs, a_log, dt_bias = _gdn_inputs(1)
    with use_backend(backend):  # the backend is read at trace time: a fresh jit per backend
        all_cache, all_out = _gdn_rows(r)(cache, 5, inputs, a_log, dt_bias)
        c, slot, one_row = cache, 5, _gdn_rows(1)
        for i in range(r):
            c, out = one_row(c, slot, jnp.roll(inputs, -i, axis=0), a_log, dt_bias)
            slot = 0
            assert np.array_equal(bits(out[0]), bits(all_out[i])) and not np.any(np.asarray(out[1:]))
            assert _same_bits(hybrid.candidate_state(c, 0), hybrid.candidate_state(all_cache, i))
    with use_backend("reference"):
        ref_cache, ref_out = _gdn_rows(r)(cache, 5, inputs, a_log, dt_bias)
    assert np.array_equal(bits(all_cache["conv"]), bits(ref_cache["conv"]))
    np.testing.assert_allclose(all_out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(all_cache["ssm"], ref_cache["ssm"], rtol=1e-5, atol=1e-5)


def test_gdn_rows_computes_the_recurrence_of_its_raw_inputs():
    """The reference backend == gdn_step applied row by row to the prepared inputs (value head i on key head
    i // 2: the query / key columns repeated, L2-normalised, q scaled; g and beta from the gate columns); the conv
    cache == the slot's window less its first row ++ the tile's conv inputs."""
    nk, dk, h, dv, rows, slot = 2, 16, 4, 32, 5, 3
    cache, inputs, a_log, dt_bias = _gdn_inputs(2)
    with use_backend("reference"):
        got, got_out = _gdn_rows(rows)(cache, slot, inputs, a_log, dt_bias)
    channels = 2 * nk * dk + h * dv
    conv, b, a = inputs[:, :channels], inputs[:, channels : channels + h], inputs[:, channels + h : channels + 2 * h]
    q, k = (
        jnp.repeat(x.reshape(-1, nk, dk), h // nk, axis=1) for x in (conv[:, : nk * dk], conv[:, nk * dk : 2 * nk * dk])
    )
    q, k = gdn_query_key(q, k)
    v = conv[:, 2 * nk * dk :].reshape(-1, h, dv)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    state = cache["ssm"][slot]
    for i in range(rows):
        state, out = jax.vmap(gdn_step)(state, q[i], k[i], v[i], g[i], beta[i])
        np.testing.assert_allclose(got_out[i], out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["ssm"][i], state, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got_out[rows:]))
    want_conv = np.concatenate([np.asarray(cache["conv"][slot + 1 : slot + 3]), np.asarray(inputs[:, -channels:])])
    assert np.array_equal(bits(got["conv"]), bits(want_conv.astype(jnp.bfloat16)))


def test_gdn_gates_match_the_transformers_formula():
    """g = -exp(A_log) softplus(a + dt_bias) <= 0, beta = sigmoid(b), float32 (transformers' Qwen3.5 layer)."""
    a = jnp.asarray([[-30.0, -1.0, 0.0, 2.5, 40.0]], jnp.float32)
    b = jnp.asarray([[-3.0, -0.5, 0.0, 0.5, 3.0]], jnp.float32)
    a_log, dt_bias = jnp.log(jnp.arange(1.0, 6.0)), jnp.linspace(-1.0, 1.0, 5)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    x = np.asarray(a + dt_bias, np.float64)
    np.testing.assert_allclose(g, -np.arange(1.0, 6.0) * np.logaddexp(x, 0.0), rtol=1e-6)
    np.testing.assert_allclose(beta, 1 / (1 + np.exp(-np.asarray(b, np.float64))), rtol=1e-6)
    assert g.dtype == beta.dtype == jnp.float32 and bool(jnp.all(g <= 0))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(key_heads=3),
            "over 3 key heads need 456 input columns (query | key | value | b | a | conv inputs), got 392",
        ),
        (
            dict(columns=391),
            "over 2 key heads need 392 input columns (query | key | value | b | a | conv inputs), got 391",
        ),
        (dict(channels=100), "the conv cache must be [16 + W - 2, 192] (16 candidate slots), got (18, 100)"),
        (dict(rows=17), "rows=17 must be in 1..16"),
    ],
)
def test_gdn_rows_refuses_a_mismatched_layout(kwargs, message):
    cache, inputs, a_log, dt_bias = _gdn_inputs(3)
    args = dict(key_heads=2, rows=1, columns=inputs.shape[1], channels=cache["conv"].shape[1]) | kwargs
    inputs = inputs[:, : args.pop("columns")]
    cache = dict(cache, conv=cache["conv"][:, : args.pop("channels")])
    with pytest.raises(ValueError, match=re.escape(message)):
        gdn_rows(cache, 0, inputs, a_log, dt_bias, **args)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("backend", GDN_BACKENDS)
def test_gdn_rows_bits_do_not_depend_on_a_known_slot(backend, rows):
    """A slot XLA knows to be constant (generate_on_device's greedy loop: always 0) gives the bits of a traced slot.

    Without the barrier on the row count, interpret mode saw a trip count of 1, inlined the row loop and contracted
    the other product of exp(g) S + k u^T into an FMA on XLA:CPU."""
    cache, inputs, a_log, dt_bias = _gdn_inputs(4)
    step = functools.partial(gdn_rows, rows=rows, key_heads=2)
    with use_backend(backend):
        traced = jax.jit(step)(cache, 0, inputs, a_log, dt_bias)
        known = jax.jit(lambda c, *a: step(c, jnp.int32(0), *a))(cache, inputs, a_log, dt_bias)
    assert _same_bits(traced, known)


def test_chunked_prefill_equals_the_recurrence():
    """The chunked algorithm over 150 positions (three chunks) == the step applied position by position."""
    rng = np.random.default_rng(3)
    t, h, dk, dv = 150, 3, 16, 8
    q = l2_normalize(jnp.asarray(rng.normal(size=(t, h, dk)), jnp.float32)) * dk**-0.5
    k = l2_normalize(jnp.asarray(rng.normal(size=(t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0, 0.1, (t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (t, h)), jnp.float32)
    out, final = jax.jit(chunk_gated_delta)(q, k, v, g, beta)

    def step(state, xs):
        return jax.vmap(gdn_step)(state, *xs)

    expected_final, expected = jax.lax.scan(step, jnp.zeros((h, dk, dv), jnp.float32), (q, k, v, g, beta))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, expected_final, rtol=1e-5, atol=1e-5)


def test_prefill_chunks_carry_the_state_and_padding_leaves_it_alone():
    """One unpadded chunk, chunks of 5 (the last padded) and one padded 64-row chunk leave the same recurrent state
    and conv window in slot 0 and the same logits: the state crosses chunk boundaries, padding never enters it."""
    cfg, params = tiny_config("qwen3_next"), tiny_params()
    prompt = np.asarray([5, 17, 3, 42, 8, 8, 9, 1, 77, 30, 2, 11, 4], np.int32)
    padded = np.full((32,), 7, np.int32)  # the padding is a real token id: it must not reach the state
    padded[: prompt.size] = prompt
    fill = jax.jit(jspec.prefill, static_argnums=(1, 5))
    results = [fill(params, cfg, init_state(cfg, MAX_LEN, jnp.float32), padded, prompt.size, c) for c in (13, 5, 64)]
    (a, la), others = results[0], results[1:]
    for b, lb in others:
        np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
        for ca, cb in zip(a.cache, b.cache, strict=True):
            if isinstance(ca, dict):
                sa, sb = hybrid.candidate_state(ca, 0), hybrid.candidate_state(cb, 0)
                for name in ("ssm", "conv"):
                    np.testing.assert_allclose(sa[name], sb[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# End to end: speculative == greedy.


@functools.cache
def engine(k: int) -> jspec.Engine:
    return jspec.Engine(tiny_params(), tiny_config("qwen3_next"), max_len=MAX_LEN, k=k)


@functools.cache
def greedy(prompt: tuple[int, ...], max_new: int) -> list[int]:
    return engine(3).generate(list(prompt), max_new).tokens


RANDOM_PROMPT = tuple(int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 20))
REPETITIVE_PROMPT = (11, 12, 13, 14, 15, 16) * 4


@pytest.mark.parametrize("prompt", [RANDOM_PROMPT, REPETITIVE_PROMPT], ids=["random", "repetitive"])
@pytest.mark.parametrize("gated,on_device", [(False, False), (True, False), (True, True)])
def test_prompt_lookup_equals_greedy(prompt, gated, on_device):
    gate = jspec.HitDensityGate(window=4, min_hits=1) if gated else None
    result = engine(3).generate(list(prompt), 40, drafter=jspec.PromptLookup(), gate=gate, on_device=on_device)
    assert result.tokens == greedy(prompt, 40)
    assert result.stats.exact
    if prompt == REPETITIVE_PROMPT:
        assert result.stats.verify_steps > 0 and result.stats.accepted > 0


def test_on_device_greedy_loop_matches_host_rounds():
    """generate_on_device's greedy while loop (slot a loop-invariant 0) leaves the bits of the host loop's decode
    rounds: the whole loop state, recurrent states included, int4 bfloat16 in interpret mode."""
    cfg, params = tiny_config("qwen3_next"), tiny_params("bfloat16", True)
    settings = LoopSettings(max_len=MAX_LEN, k=3, dtype="bfloat16")
    prompt = np.zeros((32,), np.int32)
    prompt[:20] = RANDOM_PROMPT
    request = (jnp.int32(20), jnp.int32(6), eos_array((), cfg))
    with use_backend("interpret"):
        first = jax.jit(lambda p, t: prefill_round(p, cfg, settings, t, *request))
        round_ = jax.jit(lambda p, loop: decode_round(p, cfg, settings, loop))

        def on_device(p, t):  # generate_on_device's loop, returning the final Loop
            body = functools.partial(decode_round, p, cfg, settings)
            return jax.lax.while_loop(lambda loop: ~loop.done, body, prefill_round(p, cfg, settings, t, *request))

        device = jax.jit(on_device)(params, prompt)
        host = first(params, prompt)
        while not host.done:
            host = round_(params, host)
    assert int(host.n_out) == 6
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(host), jax.tree.leaves(device), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)


@pytest.mark.parametrize("on_device", [False, True])
def test_oracle_and_wrong_drafters(on_device):
    k, rounds = 3, 5
    max_new = 1 + rounds * (k + 1)
    prompt = list(RANDOM_PROMPT)
    expected = greedy(RANDOM_PROMPT, max_new)
    oracle = ScriptDrafter(tuple(prompt + expected), vocab=VOCAB)
    result = engine(k).generate(prompt, max_new, drafter=oracle, on_device=on_device)
    assert result.tokens == expected
    assert result.stats.verify_steps == rounds and result.stats.mean_accepted == k + 1
    if not on_device:
        wrong = dataclasses.replace(oracle, offset=1)
        result = engine(k).generate(prompt, max_new, drafter=wrong)
        assert result.tokens == expected
        assert result.stats.mean_accepted == 1.0 and result.stats.accepted == 0
