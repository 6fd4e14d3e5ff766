"""The contract over random combinations: speculative tokens == plain decoding's, greedy or sampled with the same
seed, whatever the family, dtype, int4 or not, drafter (prompt lookup, MTP with 1 or 2 layers, a draft model of
another family, the model drafting for itself), k, prefill chunk, loop (host / on device), gate, eos and batch.

The targeted tests each fix most of these; this one draws them together (hypothesis). The suite draws
JSPEC_FUZZ_EXAMPLES (default 3) combinations; set it higher for a longer search.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from jspec.models import family_module, quantize_linears
from jspec.models.mtp import init_mtp_params
from tests.tiny import tiny_config

VOCAB = 48
FAMILIES = ("qwen2", "llama", "glm4", "qwen3_next", "qwen3_5")
EXAMPLES = int(os.environ.get("JSPEC_FUZZ_EXAMPLES", "3"))


@functools.cache
def _model(family: str, dtype: str, int4: bool, mtp_layers: int, seed: int):
    """(cfg, params): a tiny 2-layer model, with mtp_layers MTP layers (0: none), int4 linears or not."""
    cfg = tiny_config(family, vocab_size=VOCAB)
    if mtp_layers:
        layout = "qwen3_next" if family.startswith("qwen3") else "deepseek"
        cfg = dataclasses.replace(cfg, num_mtp_layers=mtp_layers, mtp_layout=layout)
    params = family_module(cfg).init_params(cfg, jax.random.PRNGKey(seed), jnp.float32, scale=0.1)
    if mtp_layers:
        params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(seed + 1), jnp.float32, num_layers=mtp_layers)
    if int4:
        params = quantize_linears(params, lm_head=False)
    return cfg, jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, params)


tokens = st.integers(0, VOCAB - 1)
# Half of the prompts repeat a short unit, so prompt lookup finds drafts.
prompts = st.one_of(
    st.lists(tokens, min_size=3, max_size=40),
    st.tuples(st.lists(tokens, min_size=2, max_size=6), st.integers(3, 40)).map(lambda u: (u[0] * 40)[: u[1]]),
)
samplers = st.one_of(
    st.none(),
    st.builds(
        jspec.Sampler,
        temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
        top_k=st.sampled_from([0, 5, 20]),
        top_p=st.sampled_from([1.0, 0.9, 0.5]),
        min_p=st.sampled_from([0.0, 0.05]),
        repetition_penalty=st.sampled_from([1.0, 1.2]),
        seed=st.integers(0, 2**31 - 1),
    ),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(FAMILIES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    int4=st.booleans(),
    drafter=st.sampled_from(["lookup", "mtp", "draft_model", "self"]),
    mtp_layers=st.integers(1, 2),
    other=st.sampled_from(FAMILIES),
    k=st.integers(1, 7),
    sampler=samplers,
    chunk=st.sampled_from([8, 16, None]),
    on_device=st.booleans(),
    gated=st.booleans(),
    prompt=prompts,
    new=st.integers(4, 20),
    eos=st.one_of(st.just(()), tokens.map(lambda t: (t,))),
    batch=st.booleans(),
)
def test_speculative_equals_plain_decoding(
    family, dtype, int4, drafter, mtp_layers, other, k, sampler, chunk, on_device, gated, prompt, new, eos, batch
):
    cfg, params = _model(family, dtype, int4, mtp_layers if drafter == "mtp" else 0, 0)
    if drafter == "lookup":
        chosen = jspec.PromptLookup()
    elif drafter == "mtp":
        chosen = jspec.MTPDrafter()
    elif drafter == "self":
        chosen = jspec.DraftModel(params, cfg)
    else:
        draft_cfg, draft_params = _model(other, dtype, False, 0, 7)
        chosen = jspec.DraftModel(draft_params, draft_cfg)
    max_len = len(prompt) + new + 4
    alone = jspec.Engine(params, cfg, max_len=max_len, k=k, prefill_chunk=chunk)
    label = f"{family} {dtype} int4={int4} {drafter} k={k} chunk={chunk} sampler={sampler}"
    if batch:  # generate_batch (2 slots, 3 prompts): each prompt's tokens are those it gets alone
        many = [prompt, prompt[::-1][: max(2, len(prompt) // 2)], prompt[:3]]
        engine = jspec.Engine(params, cfg, max_len=max_len, k=k, prefill_chunk=chunk, batch_size=2)
        got = engine.generate_batch(many, new, drafter=chosen, sampler=sampler, eos_id=eos).results
        assert [r.tokens for r in got] == [alone.generate(p, new, eos_id=eos, sampler=sampler).tokens for p in many]
        return
    gate = jspec.HitDensityGate(window=4, min_hits=1) if gated else None
    plain = alone.generate(prompt, new, eos_id=eos, sampler=sampler).tokens
    out = alone.generate(prompt, new, eos_id=eos, sampler=sampler, drafter=chosen, gate=gate, on_device=on_device)
    assert out.tokens == plain, f"{label} on_device={on_device} gated={gated}"
