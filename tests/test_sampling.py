"""Sampling (docs/design.md rule 8): the processors against transformers' own, the position-keyed Gumbel choice as an
exact sample (chi-square), verify rows choosing what decode chooses bit for bit, and the contract: speculative
sampled tokens == non-speculative sampled tokens for the same seed, with every drafter, k and loop."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jspec
from jspec import sampling
from jspec.exactness import bits
from jspec.models import hybrid
from jspec.models.mtp import init_mtp_params
from jspec.sampling import Sampler, choose_rows, processed, seen_rows
from jspec.state import init_state
from jspec.steps import commit, decode_tile, verify_tile
from tests.tiny import tiny_config, tiny_params

V = 200


def hf_processed(logits: np.ndarray, s: Sampler, seen: np.ndarray | None = None) -> np.ndarray:
    """transformers' logits processors in generate's order, on float32 logits [R, V]; seen: bool [R, V]."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.tensor(logits)
    if s.repetition_penalty != 1.0:
        out = []
        for row, mask in zip(scores, seen, strict=True):  # input_ids: the seen tokens of each row
            ids = torch.tensor(np.flatnonzero(mask))[None]
            out.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(ids, row[None].clone())[0])
        scores = torch.stack(out)
    ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(s.temperature)(ids, scores)
    if s.top_k:
        scores = TopKLogitsWarper(s.top_k)(ids, scores)
    if s.top_p < 1.0:
        scores = TopPLogitsWarper(s.top_p)(ids, scores)
    if s.min_p:
        scores = MinPLogitsWarper(s.min_p)(ids, scores)
    return scores.numpy()


def ours(logits: np.ndarray, s: Sampler, seen=None) -> np.ndarray:
    return np.asarray(jax.jit(processed, static_argnums=1)(jnp.asarray(logits), s.mode, s.values(), seen))


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


PROCESSORS = {
    "temperature": Sampler(temperature=0.7),
    "top_k": Sampler(temperature=1.3, top_k=17),
    "top_k 1": Sampler(top_k=1),
    "top_k past the vocabulary": Sampler(top_k=5000),
    "top_p": Sampler(temperature=0.8, top_p=0.9),
    "top_p tiny": Sampler(top_p=1e-6),
    "min_p": Sampler(min_p=0.05),
    "penalty": Sampler(repetition_penalty=1.3),
    "reward": Sampler(repetition_penalty=0.7),
    "all": Sampler(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, repetition_penalty=1.2),
}


@pytest.mark.parametrize("case", list(PROCESSORS))
def test_processed_distribution_equals_transformers(case):
    s = PROCESSORS[case]
    rng = np.random.default_rng(len(case))
    logits = (rng.standard_normal((6, V)) * 3).astype(np.float32)
    seen = rng.random((6, V)) < 0.2
    want = softmax(hf_processed(logits, s, seen))
    got = softmax(ours(logits, s, jnp.asarray(seen)))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    assert np.array_equal(got > 0, want > 0)  # the same tokens removed


def test_ties_at_the_cut():
    """top-k keeps every logit tied with the k-th (as TopKLogitsWarper); top-p keeps a tie group at the cut whole
    (transformers keeps whichever members its sort puts last: a subset of ours, the rest the same)."""
    row = np.full((1, V), -5.0, np.float32)
    row[0, :3] = [4.0, 3.0, 3.0]
    row[0, 10:14] = 2.0  # four tied tokens
    s = Sampler(top_k=5)
    np.testing.assert_array_equal(np.isfinite(ours(row, s)), np.isfinite(hf_processed(row, s)))
    assert np.isfinite(ours(row, s)).sum() == 7  # ranks 4..7 tie with the 5th
    p = softmax(row)[0]
    s = Sampler(top_p=float(p[:3].sum() + 1.5 * p[10]))  # the cut falls inside the tie group
    kept, theirs = np.isfinite(ours(row, s))[0], np.isfinite(hf_processed(row, s))[0]
    assert kept[:3].all() and kept[10:14].all() and kept.sum() == 7
    assert (theirs <= kept).all() and theirs[:3].all()


@pytest.mark.parametrize("weighted", [False, True])
def test_threshold_search_finds_the_smallest_passing_float(weighted):
    """The search's threshold passes its test (the fixed-point mass or the count above it < the limit) and the float
    one bit pattern below fails it: exact, not a bracket; over a vocabulary of 5000, top-p 0.9 and top-k 50. The
    reference recomputes the masses in numpy from the definition (round(e * 2 ** 24) as exact integers)."""
    rng = np.random.default_rng(1)
    z = rng.standard_normal((4, 5000)).astype(np.float32) * 3
    x = np.asarray(sampling._relative(jnp.asarray(z))) if weighted else z
    q = np.round(x.astype(np.float64) * 2.0**sampling.MASS_BITS).astype(np.int64)  # e <= 1: exact in float64

    def stat(t):  # numpy: the exact integer mass (rounded once to float32, as jspec) or the count
        if not weighted:
            return (x >= t[:, None]).sum(1)
        m = np.where(x > t[:, None], q, 0).sum(1)
        return np.float32(m >> 16) * np.float32(65536) + np.float32(m & 0xFFFF)

    if weighted:
        total = q.sum(1)
        limit = np.float32(0.9) * (np.float32(total >> 16) * np.float32(65536) + np.float32(total & 0xFFFF))
        ec = sampling._in_chunks(jnp.asarray(x))
        lo, hi = sampling._order_key(jnp.zeros(4)), sampling._order_key(jnp.ones(4))
        fn = sampling._mass_above(ec, sampling._fixed_point(ec))
    else:
        limit = np.full(4, 50, np.int32)
        lo = sampling._order_key(jnp.min(jnp.asarray(x), axis=1))
        hi = sampling._order_key(jnp.max(jnp.asarray(x), axis=1)) + 1
        fn = sampling._count_at_least(jnp.asarray(x))
    t = np.asarray(jax.jit(lambda lim, lo, hi: sampling._smallest_passing(fn, lim, lo, hi))(limit, lo, hi))
    assert (stat(t) < limit).all() and (stat(np.nextafter(t, np.float32(-np.inf))) >= limit).all()


@pytest.mark.parametrize("case", ["all", "top_p", "min_p", "top_k"])
def test_a_row_samples_the_same_bits_alone_or_beside_others(case):
    """Rule 8's order-free reductions: the processed logits and choice of a row are the same bits run alone, among
    8 rows (a k = 7 verify) and under a vmap over 3 batch slots, at the Llama-3 vocabulary (XLA picks its
    reductions by shape; a float sum over the vocabulary would be free to differ)."""
    vocab = 128256
    s = dataclasses.replace(PROCESSORS[case], seed=5)
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((3, 8, vocab)) * 4, jnp.float32)
    seen = jnp.asarray(rng.random((3, 8, vocab)) < 0.01) if s.mode.penalty else None
    positions = jnp.arange(40, 64, dtype=jnp.int32).reshape(3, 8)

    values = s.values()

    def run(z, p, seen):
        return processed(z, s.mode, values, seen), choose_rows(z, p, s.mode, values, seen)

    batch = jax.jit(jax.vmap(run))(logits, positions, seen)
    rows = jax.jit(run)(logits[1], positions[1], None if seen is None else seen[1])
    for r in range(8):
        alone = jax.jit(run)(
            logits[1, r : r + 1], positions[1, r : r + 1], None if seen is None else seen[1, r : r + 1]
        )
        for got in (rows, jax.tree.map(lambda a: a[1], batch)):
            assert np.array_equal(bits(got[0][r]), bits(alone[0][0])) and int(got[1][r]) == int(alone[1][0]), r


def _draws(logits: np.ndarray, s: Sampler, seeds: int, positions) -> np.ndarray:
    """tokens [seeds, len(positions)]: choose at each position for seeds 0..seeds-1 (one row of logits)."""
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.PRNGKey(i)))(jnp.arange(seeds, dtype=jnp.uint32))
    base = s.values()
    rows = jnp.broadcast_to(jnp.asarray(logits)[None], (len(positions), logits.shape[-1]))

    @jax.jit
    def one(key):
        values = dataclasses.replace(base, key=key)
        return choose_rows(rows, jnp.asarray(positions, jnp.int32), s.mode, values)

    return np.asarray(jax.lax.map(one, keys, batch_size=2000))


def test_choose_is_an_exact_sample_of_the_processed_softmax():
    """20k seeds at one position: frequencies match softmax(processed) (chi-square over the kept tokens; a token
    outside them, e.g. a top-k cut off by one, fails); and two positions draw independently (shared noise would
    make them equal almost always)."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(60) * 1.5).astype(np.float32)
    s = Sampler(temperature=0.8, top_k=12, seed=0)
    probs = softmax(hf_processed(logits[None], s))[0]
    draws = _draws(logits, s, 20_000, [7, 8])
    counts = np.bincount(draws[:, 0], minlength=60)
    kept = probs > 0
    assert counts[~kept].sum() == 0 and kept.sum() == 12
    _, p_value = scipy.stats.chisquare(counts[kept], probs[kept] * counts.sum())
    assert p_value > 1e-3
    same = np.mean(draws[:, 0] == draws[:, 1])
    assert abs(same - np.sum(probs**2)) < 0.02


# --------------------------------------------------------------------------------------------- step level
def test_sampled_verify_rows_equal_decode_rows_bitwise():
    """The processed logits and the choice of verify row i (of its k + 1) equal, bit for bit, those of the decode step
    at p + i, which samples its one row (as the engine's steps), every processor on."""
    cfg = tiny_config("qwen2")
    params = tiny_params(cfg, seed=4)
    s = Sampler(temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, repetition_penalty=1.2, seed=3)
    values = s.values()
    prompt = np.asarray([5, 17, 3, 42, 8, 8, 9, 1, 77, 30, 2], np.int32)
    state, _ = jax.jit(jspec.prefill, static_argnums=1)(params, cfg, init_state(cfg, 64, jnp.float32), prompt, 11)

    def sample(state, tile, row_tokens):
        positions = state.position + 1 + jnp.arange(tile.shape[0], dtype=jnp.int32)
        seen = seen_rows(state.tokens, state.position, row_tokens, cfg.vocab_size)
        z = processed(tile, s.mode, values, seen)
        return z, choose_rows(tile, positions, s.mode, values, seen)

    @jax.jit
    def decode(state, forced):
        after, tile, row_tokens = decode_tile(params, cfg, state)
        z, chosen = sample(state, jax.lax.optimization_barrier(tile)[:1], row_tokens[:1])
        return commit(after, jnp.int32(0), forced), z[0], chosen[0]

    @jax.jit
    def verify(state, draft):
        _, tile, row_tokens = verify_tile(params, cfg, state, draft)
        rows = draft.shape[0] + 1
        return sample(state, jax.lax.optimization_barrier(tile)[:rows], row_tokens[:rows])

    draft = np.asarray([11, 60, 2, 2, 95, 7, 33], np.int32)
    vz, vchosen = verify(state, draft)
    for i, forced in enumerate([*draft, 0]):
        state, dz, dchosen = decode(state, forced)
        assert np.array_equal(bits(vz[i]), bits(dz)) and int(vchosen[i]) == int(dchosen), f"row {i}"


# ------------------------------------------------------------------------------------------------- contract
@functools.cache
def model(family: str, dtype: str, mtp: bool = False):
    cfg = tiny_config(family)
    if mtp:
        cfg = dataclasses.replace(cfg, num_mtp_layers=1, mtp_layout="qwen3_next" if cfg.is_hybrid else "deepseek")
    key = jax.random.PRNGKey(5)
    params = hybrid.init_params(cfg, key, jnp.dtype(dtype), 0.1) if cfg.is_hybrid else tiny_params(cfg, dtype, 5)
    if mtp:
        params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(6), jnp.dtype(dtype))
    return params, cfg


@functools.cache
def engine(family: str, dtype: str, k: int, mtp: bool = False) -> jspec.Engine:
    params, cfg = model(family, dtype, mtp)
    return jspec.Engine(params, cfg, max_len=64, k=k, prefill_chunk=16)


# A covering design over the contract's axes (each family twice, each dtype, k, drafter, gate and loop several
# times; temperatures 0.3 / 0.7 / 1.0 / 1.5 with and without top-k / top-p / the penalty), one engine per case.
CONTRACT = [
    ("qwen2", "float32", 1, "lookup", False, False, Sampler(temperature=0.3, seed=11)),
    ("qwen2", "bfloat16", 7, "mtp", True, True, Sampler(temperature=1.0, top_p=0.9, seed=12)),
    ("llama", "bfloat16", 3, "lookup", True, False, Sampler(temperature=0.3, top_k=8, seed=13)),
    ("llama", "float32", 7, "mtp", False, True, Sampler(temperature=1.5, repetition_penalty=1.3, seed=14)),
    ("glm4", "float32", 3, "mtp", True, False, Sampler(temperature=0.7, top_k=8, top_p=0.9, seed=15)),
    ("glm4", "bfloat16", 1, "lookup", False, True, Sampler(temperature=1.0, seed=2**32 - 1)),
    ("qwen3_next", "float32", 7, "lookup", True, True, Sampler(temperature=1.0, top_p=0.9, seed=17)),
    ("qwen3_next", "bfloat16", 3, "mtp", False, False, Sampler(temperature=0.3, repetition_penalty=1.3, seed=18)),
]


@pytest.mark.parametrize("family,dtype,k,drafter,gated,on_device,sampler", CONTRACT)
def test_speculative_sampling_equals_plain_sampling(family, dtype, k, drafter, gated, on_device, sampler):
    mtp = drafter == "mtp"
    eng = engine(family, dtype, k, mtp)
    prompt = [4, 9, 4, 9, 4, 9, 13, 2, 4, 9, 4, 9]
    plain = eng.generate(prompt, 24, sampler=sampler, eos_id=()).tokens
    gate = jspec.HitDensityGate(window=4, min_hits=1) if gated else None
    drafting = jspec.MTPDrafter() if mtp else jspec.PromptLookup()
    out = eng.generate(prompt, 24, sampler=sampler, drafter=drafting, gate=gate, on_device=on_device, eos_id=())
    assert out.tokens == plain
    assert out.stats.verify_steps > 0 or gated and out.stats.would_hits == 0  # a gate opens only on would-hits
    assert out.stats.sampler == dataclasses.asdict(sampler)


def test_seeds_repeat_and_differ():
    eng = engine("qwen2", "float32", 3)
    prompt = [4, 9, 4, 9, 13]
    runs = {seed: eng.generate(prompt, 30, sampler=Sampler(seed=seed), eos_id=()).tokens for seed in (1, 2, 3)}
    assert eng.generate(prompt, 30, sampler=Sampler(seed=2), eos_id=()).tokens == runs[2]
    assert len({tuple(t) for t in runs.values()}) == 3
    compiles = eng.num_compiles
    eng.generate(prompt, 30, sampler=Sampler(seed=9, temperature=0.4), eos_id=())  # new values: no compile
    assert eng.num_compiles == compiles
    greedy = eng.generate(prompt, 30, eos_id=()).tokens
    assert eng.generate(prompt, 30, sampler=Sampler(temperature=0.0), eos_id=()).tokens == greedy


BAD = {
    "negative temperature": (dict(temperature=-0.1), ValueError, "temperature must be >= 0"),
    "nan temperature": (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    "top_p 0": (dict(top_p=0.0), ValueError, "top_p must be > 0"),
    "top_p above 1": (dict(top_p=1.5), ValueError, "top_p must be <= 1"),
    "negative top_k": (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    "float top_k": (dict(top_k=2.5), TypeError, "top_k must be an integer"),
    "negative min_p": (dict(min_p=-0.1), ValueError, "min_p must be >= 0"),
    "min_p above 1": (dict(min_p=1.5), ValueError, "min_p must be <= 1"),
    "penalty 0": (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be > 0"),
    "negative seed": (dict(seed=-1), ValueError, "seed must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sampler_settings_are_refused(case):
    kwargs, error, message = BAD[case]
    with pytest.raises(error, match=message):
        Sampler(**kwargs)
