"""Speculative generation == plain greedy, token for token; stats, stopping, compiles, bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from jspec.models import family_module, quantize_linears
from pallas_kernels import Int4Weight
from tests.tiny import ScriptDrafter, tiny_config, tiny_params

MAX_LEN = 64
FAMILIES = ("qwen2", "llama", "glm4")


@functools.cache
def engine(family: str = "qwen2", dtype: str = "float32", k: int = 4) -> jspec.Engine:
    cfg = tiny_config(family)
    return jspec.Engine(tiny_params(cfg, jnp.dtype(dtype), seed=1), cfg, max_len=MAX_LEN, k=k)


@functools.cache
def greedy(family: str, dtype: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    return engine(family, dtype, 1).generate(list(prompt), max_new).tokens


prompts = st.one_of(
    st.lists(st.integers(0, 95), min_size=1, max_size=16),
    st.lists(st.integers(0, 95), min_size=1, max_size=4).flatmap(
        lambda unit: st.integers(2, 4).map(lambda reps: (unit * reps)[:16])
    ),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    k=st.sampled_from([1, 2, 3, 5, 7, 15]),
    gated=st.booleans(),
    on_device=st.booleans(),
    prompt=prompts,
)
def test_speculative_equals_greedy(family, dtype, k, gated, on_device, prompt):
    max_new = 24
    expected = greedy(family, dtype, tuple(prompt), max_new)
    gate = jspec.HitDensityGate(window=4, min_hits=2) if gated else None
    result = engine(family, dtype, k).generate(
        prompt, max_new, drafter=jspec.PromptLookup(), gate=gate, on_device=on_device
    )
    assert result.tokens == expected
    assert result.stats.exact


@pytest.mark.parametrize("on_device", [False, True])
def test_on_device_greedy_equals_host_greedy(on_device):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert engine().generate(prompt, 30, on_device=on_device).tokens == greedy("qwen2", "float32", tuple(prompt), 30)


def test_generate_on_device_inside_user_jit():
    eng = engine()
    prompt = [7, 7, 8, 9, 7, 7, 8]
    settings_ = eng.settings(drafter=jspec.PromptLookup())

    @jax.jit
    def user_fn(params, padded, length):
        out = jspec.generate_on_device(params, eng.cfg, padded, length, 20, settings_)
        return out.tokens, out.num_tokens

    padded = jnp.zeros((16,), jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt))
    tokens, n = user_fn(eng.params, padded, len(prompt))
    assert list(np.asarray(tokens[: int(n)])) == greedy("qwen2", "float32", tuple(prompt), 20)


def test_engine_compiles_with_jspec_compiler_options(monkeypatch):
    """The Engine's executables get `jspec.compiler_options()` (on a GPU: launches, no autotuning; none elsewhere):
    an option name XLA does not know fails the compile with XLA's own error, never silently."""
    from jspec import engine as engine_module

    assert jspec.compiler_options("cpu") is None
    assert jspec.compiler_options("gpu") == engine_module.GPU_COMPILER_OPTIONS
    # prefill's products are never autotuned (rule 10: the same bits in every process)
    assert engine_module.GPU_COMPILER_OPTIONS["xla_gpu_autotune_level"] == 0
    # the prefill's dynamic-slice copies stay on the main stream: async on other streams, their first run left every
    # later decode step of the process slower (docs/performance.md, "process state")
    disabled = engine_module.GPU_COMPILER_OPTIONS["xla_disable_hlo_passes"].split(",")
    assert "dynamic-slice-copy-fusion-async-wrapper" in disabled
    # every name is one XLA knows (XLA:CPU takes the GPU's debug options too)
    jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options=engine_module.GPU_COMPILER_OPTIONS)
    eng = engine()
    fresh = jspec.Engine(eng.params, eng.cfg, max_len=MAX_LEN, k=4)
    monkeypatch.setattr(engine_module, "compiler_options", lambda: {"xla_jspec_no_such_option": 1})
    with pytest.raises(Exception, match="xla_jspec_no_such_option"):
        fresh.generate([1, 2, 3], 4)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("on_device", [False, True])
def test_oracle_drafter_accepts_everything(k, on_device):
    prompt = [11, 22, 33, 44, 55]
    m = 3
    max_new = 1 + m * (k + 1)
    expected = greedy("qwen2", "float32", tuple(prompt), max_new)
    oracle = ScriptDrafter(tuple(prompt + expected))
    result = engine(k=k).generate(prompt, max_new, drafter=oracle, on_device=on_device)
    assert result.tokens == expected
    assert result.stats.verify_steps == m and result.stats.decode_steps == 0
    assert result.stats.mean_accepted == k + 1
    assert result.stats.per_position_acceptance == [1.0] * k


@pytest.mark.parametrize("on_device", [False, True])
def test_always_wrong_drafter_accepts_nothing(on_device):
    prompt = [11, 22, 33, 44, 55]
    expected = greedy("qwen2", "float32", tuple(prompt), 20)
    wrong = ScriptDrafter(tuple(prompt + expected), offset=1)
    result = engine(k=3).generate(prompt, 20, drafter=wrong, on_device=on_device)
    assert result.tokens == expected
    assert result.stats.mean_accepted == 1.0 and result.stats.accepted == 0
    # The last round has room for the bonus token only, so it decodes.
    assert result.stats.verify_steps == 18 and result.stats.decode_steps == 1


def test_gate_keeps_decoding_when_nothing_hits():
    prompt = [11, 22, 33, 44, 55]
    expected = greedy("qwen2", "float32", tuple(prompt), 20)
    wrong = ScriptDrafter(tuple(prompt + expected), offset=1)
    result = engine(k=3).generate(prompt, 20, drafter=wrong, gate=jspec.HitDensityGate(window=8, min_hits=2))
    assert result.tokens == expected
    assert result.stats.verify_steps == 0 and result.stats.decode_steps == 19
    assert result.stats.gate_engaged == 0


def test_gate_engages_when_drafts_hit():
    prompt = [11, 22, 33, 44, 55]
    expected = greedy("qwen2", "float32", tuple(prompt), 40)
    oracle = ScriptDrafter(tuple(prompt + expected))
    result = engine(k=3).generate(prompt, 40, drafter=oracle, gate=jspec.HitDensityGate(window=4, min_hits=2))
    assert result.tokens == expected
    # Two would-hits open the gate, then every round verifies; the last round has room for one token only.
    assert result.stats.would_hits == 2 and result.stats.verify_steps == 9 and result.stats.decode_steps == 3


def test_no_compiles_after_warmup():
    eng = jspec.Engine(engine().params, engine().cfg, max_len=MAX_LEN, k=3, prefill_chunk=16)
    drafter, gate = jspec.PromptLookup(), jspec.HitDensityGate(window=4, min_hits=1)
    for prompt_len in (5, 20):  # one chunk and two: the same executables
        eng.generate(list(range(1, prompt_len + 1)), 8, drafter=drafter, gate=gate, eos_id=[5, 6])
    warm = eng.num_compiles
    assert warm == 5  # start, prefill chunks, first round, decode rounds, verify rounds
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for prompt, n, rounds in (([4, 5, 6, 4, 5, 6, 4], 30, 16), ([9] * 12, 11, 1), (list(range(30)), 17, 3)):
            eng.generate(prompt, n, drafter=drafter, gate=gate, eos_id=5, rounds_per_call=rounds)
    finally:
        jax.monitoring.clear_event_listeners()
    assert eng.num_compiles == warm
    assert compiles == []


def test_stop_reasons():
    prompt = [2, 4, 6, 8]
    expected = greedy("qwen2", "float32", tuple(prompt), 20)
    eng = engine(k=3)
    eos = expected[4]
    first = expected.index(eos)
    for on_device in (False, True):
        r = eng.generate(prompt, 20, drafter=jspec.PromptLookup(), eos_id=eos, on_device=on_device)
        assert r.tokens == expected[: first + 1] and r.stats.stop_reason == "eos"
        r = eng.generate(prompt, 20, on_device=on_device)
        assert r.stats.stop_reason == "max_new_tokens" and len(r.tokens) == 20
    r = eng.generate(prompt, None, drafter=jspec.PromptLookup())
    assert r.stats.stop_reason == "cache_end" and len(r.tokens) == MAX_LEN - len(prompt) + 1
    assert r.tokens[:20] == expected


@pytest.mark.parametrize("rounds_per_call", [1, 2, 5, 64])
def test_host_loop_gives_the_same_run_for_any_rounds_per_call(rounds_per_call):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    expected = greedy("qwen2", "float32", tuple(prompt), 40)
    eos = expected[29]
    first = expected.index(eos)
    eng = engine(k=3)
    reference = eng.generate(prompt, 40, drafter=jspec.PromptLookup(), eos_id=eos, on_device=True)
    r = eng.generate(prompt, 40, drafter=jspec.PromptLookup(), eos_id=eos, rounds_per_call=rounds_per_call)
    assert r.tokens == expected[: first + 1] and r.stats.stop_reason == "eos"
    same = ("steps", "decode_steps", "verify_steps", "drafted", "accepted", "per_position_reached", "new_tokens")
    assert {f: getattr(r.stats, f) for f in same} == {f: getattr(reference.stats, f) for f in same}
    assert r.stats.verify_steps > 0 and r.stats.decode_steps > 0
    assert r.stats.decode_time_s > 0 and r.stats.verify_time_s > 0  # each device call runs rounds of one kind


@pytest.mark.parametrize("k", [7, 15])
def test_speculation_up_to_the_cache_end_stays_exact(k):
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    expected = engine(k=1).generate(prompt, None).tokens
    assert len(expected) == MAX_LEN - len(prompt) + 1
    for on_device in (False, True):
        r = engine(k=k).generate(prompt, None, drafter=jspec.PromptLookup(), on_device=on_device)
        assert r.tokens == expected and r.stats.stop_reason == "cache_end"


def test_bad_input_raises_before_compute():
    eng = engine()
    before = eng.num_compiles
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.generate([], 4)
    with pytest.raises(ValueError, match="token id 96 at index 1 is out of range for vocab_size 96"):
        eng.generate([1, 96], 4)
    with pytest.raises(ValueError, match="token id -1 at index 0 is out of range"):
        eng.generate([-1, 3], 4)
    with pytest.raises(
        ValueError, match=r"prompt of 60 tokens \+ max_new_tokens 5 = 65 exceeds the cache: max_len is 64"
    ):
        eng.generate([1] * 60, 5)
    for prompt_len in (MAX_LEN, MAX_LEN + 6):
        no_room = f"prompt of {prompt_len} tokens leaves no room in the cache: max_len is 64"
        with pytest.raises(ValueError, match=no_room):
            eng.generate([1] * prompt_len, None)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        eng.generate([1], 0)
    for k, bound in ((0, ">= 1"), (16, "<= 15")):
        with pytest.raises(ValueError, match=f"k must be {bound}, got {k}"):
            jspec.Engine(eng.params, eng.cfg, max_len=MAX_LEN, k=k)
    with pytest.raises(ValueError, match="differs"):
        eng.generate([1, 2], 4, drafter=jspec.PromptLookup(k=2))
    with pytest.raises(ValueError, match="rounds_per_call must be >= 1, got 0"):
        eng.generate([1, 2], 4, rounds_per_call=0)
    assert eng.num_compiles == before
    assert eng.generate([3, 1, 4], 5).tokens == greedy("qwen2", "float32", (3, 1, 4), 5)  # nothing was lost


def test_forward_rejects_bad_tokens():
    eng = engine()
    with pytest.raises(ValueError, match="out of range"):
        jspec.forward(eng.params, eng.cfg, [0, 96])
    with pytest.raises(ValueError, match="non-empty"):
        jspec.forward(eng.params, eng.cfg, [])


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
@pytest.mark.parametrize("params_dtype, dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_engine_computes_in_its_dtype_whatever_the_params(family, params_dtype, dtype):
    """Engine(dtype=) runs activations and caches in dtype for params of the other one: the tokens of an Engine over
    the params cast by hand (every floating array but the int4 weights and the Gated DeltaNet's A_log and dt_bias,
    float32 here as an import stores them), with and without a drafter; those stay float32 in its params."""
    cfg = tiny_config(family)
    fresh = family_module(cfg).init_params(cfg, jax.random.PRNGKey(3), jnp.dtype(params_dtype), scale=0.1)
    params = quantize_linears(fresh, lm_head=False)

    def by_hand(path, x):
        kept = isinstance(x, Int4Weight) or path[-1].key in ("A_log", "dt_bias")
        return x if kept or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    cast = jax.tree_util.tree_map_with_path(by_hand, params, is_leaf=lambda x: isinstance(x, Int4Weight))
    reference = jspec.Engine(cast, cfg, max_len=MAX_LEN, k=3)
    ours = jspec.Engine(params, cfg, max_len=MAX_LEN, k=3, dtype=dtype)
    assert reference.dtype == ours.dtype == dtype
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    greedy = reference.generate(prompt, 12).tokens
    assert ours.generate(prompt, 12).tokens == greedy
    assert ours.generate(prompt, 12, drafter=jspec.PromptLookup()).tokens == greedy
    kept = [x for layer in ours.params["layers"] for name, x in layer.items() if name in ("A_log", "dt_bias")]
    assert all(x.dtype == jnp.float32 for x in kept) and len(kept) == 2 * (family == "qwen3_5")


def test_generate_convenience_matches_engine():
    prompt = [9, 8, 7]
    r = jspec.generate(engine().params, engine().cfg, prompt, max_new_tokens=12, drafter=jspec.PromptLookup())
    assert r.tokens == greedy("qwen2", "float32", tuple(prompt), 12)
