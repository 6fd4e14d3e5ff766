"""DraftModel: a second model drafting inside the round with its own cache. Output == the target's plain output
(greedy and sampled), every family as target and as drafter, k 1 / 3 / 7, host and device loop; a model drafting
for itself is accepted in full, with and without the gate (the wiring: its caches, catch-up and rewind, are right);
shared executables; bad input."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import jspec
from jspec.models import hybrid
from tests.tiny import tiny_config, tiny_params


@functools.cache
def model(family: str, seed: int, dtype: str = "float32", **overrides):
    cfg = tiny_config(family, **overrides)
    if cfg.is_hybrid:
        return hybrid.init_params(cfg, jax.random.PRNGKey(seed), jnp.dtype(dtype), 0.1), cfg
    return tiny_params(cfg, jnp.dtype(dtype), seed), cfg


@functools.cache
def engine(family: str, k: int, dtype: str = "float32") -> jspec.Engine:
    params, cfg = model(family, 1, dtype)
    return jspec.Engine(params, cfg, max_len=80, k=k, prefill_chunk=16)


PROMPT = [4, 9, 4, 9, 13, 2, 4, 9, 4, 9, 13, 2, 7, 7, 8, 9, 4, 9, 4, 9, 13]  # 21 tokens: two prefill chunks


def draft(family: str, seed: int = 2, **overrides) -> jspec.DraftModel:
    params, cfg = model(family, seed, **overrides)
    return jspec.DraftModel(params, cfg)


CASES = [  # (target, drafter family, k, on_device, dtype, sampled): every family as target and as drafter
    ("llama", "qwen2", 3, False, "float32", False),
    ("qwen2", "qwen3_next", 7, True, "bfloat16", True),
    ("qwen3_next", "glm4", 1, True, "float32", True),
    ("glm4", "qwen3_5", 7, False, "bfloat16", False),
    ("qwen3_5", "llama", 3, False, "float32", False),
]


@pytest.mark.parametrize("target,drafter,k,on_device,dtype,sampled", CASES)
def test_draft_model_speculation_equals_plain_decoding(target, drafter, k, on_device, dtype, sampled):
    """Greedy, and (sampled) the same seed's plain sampling, with drafting coupled to the position-keyed noise. The
    random drafters' drafts rarely hit, so every round verifies and rejects: the rewind path, every round."""
    eng = engine(target, k, dtype)
    d = draft(drafter)
    greedy = eng.generate(PROMPT, 30, eos_id=()).tokens
    out = eng.generate(PROMPT, 30, eos_id=(), drafter=d, on_device=on_device)
    assert out.tokens == greedy and out.stats.verify_steps > 0
    if sampled:
        sampler = jspec.Sampler(temperature=0.8, seed=5)
        plain = eng.generate(PROMPT, 30, eos_id=(), sampler=sampler).tokens
        assert eng.generate(PROMPT, 30, eos_id=(), sampler=sampler, drafter=d, on_device=on_device).tokens == plain


@pytest.mark.parametrize("family,gated", [("qwen2", False), ("qwen3_next", True)])
def test_a_model_drafting_for_itself_is_accepted_in_full(family, gated):
    """Its drafts are the target's own tokens (the same step arithmetic), so every verify accepts all k: the draft
    caches, the catch-up of the bonus token and the rewind to the accepted prefix are right. With the gate: decode
    rounds (which still draft) until the first hit opens it."""
    k = 3
    params, cfg = model(family, 1)
    eng = engine(family, k)
    gate = jspec.HitDensityGate(window=4, min_hits=1) if gated else None
    n = 1 + 6 * (k + 1)
    out = eng.generate(PROMPT, n, eos_id=(), drafter=jspec.DraftModel(params, cfg), gate=gate)
    assert out.tokens == eng.generate(PROMPT, n, eos_id=()).tokens
    if gated:
        assert out.stats.decode_steps >= 1 and out.stats.verify_steps >= 4  # the gate opened after a decode round
        assert out.stats.accepted == out.stats.drafted  # every draft accepted (the last one cut to the budget)
    else:
        assert out.stats.verify_steps == 6 and out.stats.mean_accepted == k + 1


def test_draft_weights_are_runtime_arguments():
    """Two drafters of one config share the executables (no compile for the second); their drafts differ."""
    eng = engine("qwen2", 3)
    a, b = draft("llama", seed=2), draft("llama", seed=3)
    first = eng.generate(PROMPT, 20, eos_id=(), drafter=a)
    compiles = eng.num_compiles
    second = eng.generate(PROMPT, 20, eos_id=(), drafter=b)
    assert eng.num_compiles == compiles and a == b and hash(a) == hash(b)
    assert first.tokens == second.tokens and first.stats.accepted != second.stats.accepted
    bf16 = jspec.DraftModel(*model("llama", 2, "bfloat16"))  # another layout: executables of its own
    assert bf16 != a and eng.generate(PROMPT, 20, eos_id=(), drafter=bf16).tokens == first.tokens


def test_vocabularies_may_differ_by_padding_rows_only():
    eng = engine("qwen2", 3)
    padded = draft("llama", vocab_size=97)  # one padding row more than the target's 96
    assert eng.generate(PROMPT, 12, eos_id=(), drafter=padded).tokens == eng.generate(PROMPT, 12, eos_id=()).tokens
    with pytest.raises(ValueError, match="vocabulary of 480 tokens against the target's 96"):
        eng.generate(PROMPT, 12, drafter=draft("llama", vocab_size=480))
    with pytest.raises(TypeError, match="DraftModel params must be"):
        jspec.DraftModel([1, 2], model("llama", 2)[1])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jspec.DraftModel.load("/no/such/checkpoint")
    with pytest.raises(ValueError, match="differs from the engine's k"):
        eng.generate(PROMPT, 12, drafter=dataclasses.replace(draft("llama"), k=2))
    settings, prompt = eng.settings(drafter=draft("llama")), jnp.asarray(PROMPT + [0] * 11)
    with pytest.raises(ValueError, match="drafter_params=drafter.weights"):  # never a constant in the executable
        jspec.generate_on_device(eng.params, eng.cfg, prompt, len(PROMPT), 8, settings, eos_ids=())
    with pytest.raises(ValueError, match="has no weights of its own"):
        jspec.generate_on_device(
            eng.params, eng.cfg, prompt, len(PROMPT), 8, eng.settings(), eos_ids=(), drafter_params=eng.params
        )
