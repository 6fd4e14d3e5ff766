"""greedy_accept, TieGuard, prompt lookup and the gate as pure functions; exactness near ties."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.accept import near_tie, tolerant_accept
from jspec.drafters.prompt_lookup import lookup
from tests.tiny import ScriptDrafter, tiny_config, tiny_params


def _logits(rows: list[int], vocab: int = 10) -> jnp.ndarray:
    out = np.zeros((len(rows), vocab), np.float32)
    for i, t in enumerate(rows):
        out[i, t] = 1.0
    return jnp.asarray(out)


@pytest.mark.parametrize(
    "draft,greedy_rows,n_valid,expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, (3, 4)),  # all accepted, bonus 4
        ([1, 2, 3], [1, 5, 3, 4], 3, (1, 5)),  # second rejected: correction 5
        ([7, 2, 3], [1, 2, 3, 4], 3, (0, 1)),  # first rejected
        ([1, 2, 3], [1, 2, 3, 4], 2, (2, 3)),  # third is not a proposal
        ([1, 2, 3], [1, 2, 3, 4], 0, (0, 1)),  # a miss proposes nothing
    ],
)
def test_greedy_accept(draft, greedy_rows, n_valid, expected):
    n, token = jspec.greedy_accept(jnp.asarray(draft), _logits(greedy_rows), n_valid)
    assert (int(n), int(token)) == expected


def test_greedy_accept_lowest_index_wins_a_tie():
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert [int(v) for v in jspec.greedy_accept(jnp.asarray([2]), logits)] == [0, 1]
    assert [int(v) for v in jspec.greedy_accept(jnp.asarray([1]), logits)] == [1, 0]


def test_near_tie_and_tolerant_accept():
    logits = jnp.asarray([[0.0, 1.0, 0.9995], [0.0, 0.0, 3.0]])
    draft = jnp.asarray([2])
    n, _ = jspec.greedy_accept(draft, logits)
    assert int(n) == 0
    assert bool(near_tie(draft, logits, n, 1, 1e-3)) and not bool(near_tie(draft, logits, n, 1, 1e-4))
    n, token, tolerated = tolerant_accept(draft, logits, 1, 1e-3)
    assert (int(n), int(token), int(tolerated)) == (1, 2, 1)


def test_tie_guard_validation():
    assert jspec.TieGuard().exact
    with pytest.raises(ValueError, match="eps > 0"):
        jspec.TieGuard(tolerant=True)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        jspec.TieGuard(eps=-1.0)


@pytest.mark.parametrize(
    "history,last,expected_draft,expected_n",
    [
        ([1, 2, 3, 9, 1, 2], 5, [3, 9, 1], 3),  # trigram miss, bigram [1, 2] at 0 -> 3 9 1
        ([5, 6, 5, 6, 5, 6], 5, [5, 6, 0], 2),  # most recent match of [6, 5, 6] starts at 1 -> 5 6 (known)
        ([1, 2, 3, 4], 3, [0, 0, 0], 0),  # no earlier occurrence: a miss
        ([4, 7, 4, 8, 4], 4, [8, 4, 0], 2),  # unigram 4: most recent earlier 4 at index 2 -> 8 4
        ([3, 3, 3], 2, [3, 0, 0], 1),  # [3, 3] at 0 -> continuation index 2 (the pending token itself)
    ],
)
def test_prompt_lookup(history, last, expected_draft, expected_n):
    tokens = jnp.asarray(history + [0] * 8, jnp.int32)
    draft, n = lookup(tokens, jnp.int32(last), 3, 1, 3)
    assert int(n) == expected_n
    assert list(np.asarray(draft))[:expected_n] == expected_draft[:expected_n]


def test_prompt_lookup_ignores_stale_tokens_past_the_pending_one():
    tokens = jnp.asarray([1, 2, 8, 8, 1, 2, 7, 7, 7], jnp.int32)  # 7s are stale (past index 5)
    draft, n = lookup(tokens, jnp.int32(5), 4, 1, 3)
    assert int(n) == 4 and list(np.asarray(draft)) == [8, 8, 1, 2]


def test_prompt_lookup_validation():
    with pytest.raises(ValueError):
        jspec.PromptLookup(ngram_max=1, ngram_min=2)
    with pytest.raises(ValueError):
        jspec.PromptLookup(k=0)


def test_gate_ring():
    gate = jspec.HitDensityGate(window=3, min_hits=2)
    hits = gate.init()
    assert not bool(gate.engaged(hits))
    for hit in (True, False, True):
        hits = gate.record(hits, jnp.asarray(hit))
    assert bool(gate.engaged(hits))
    hits = gate.record(gate.record(hits, jnp.asarray(False)), jnp.asarray(False))
    assert not bool(gate.engaged(hits))
    with pytest.raises(ValueError):
        jspec.HitDensityGate(window=2, min_hits=3)


def _tie_model(near: bool):
    """Untied lm_head whose upper half of the vocabulary duplicates the lower half: every row has an exact
    tie (near=False; argmax takes the lower token) or a near tie (near=True: a 1e-6 relative perturbation)."""
    cfg = tiny_config("qwen2")
    params = tiny_params(cfg, seed=3)
    head = np.array(params["lm_head"])
    half = cfg.vocab_size // 2
    head[:, half:] = head[:, :half] * (1 + 1e-6 if near else 1.0)
    return cfg, {**params, "lm_head": jnp.asarray(head)}, half


@pytest.mark.parametrize("near", [False, True])
def test_ties_strict_mode_stays_exact(near):
    cfg, params, half = _tie_model(near)
    eng = jspec.Engine(params, cfg, max_len=48, k=3)
    prompt = [3, 9, 27, 81 % cfg.vocab_size]
    expected = eng.generate(prompt, 24).tokens
    # Propose the tie partner of each greedy token: equal (or nearly equal) logit, other index.
    partner = tuple((t + half) % cfg.vocab_size for t in prompt + expected)
    drafter = ScriptDrafter(partner, vocab=cfg.vocab_size)
    strict = eng.generate(prompt, 24, drafter=drafter, tie_guard=jspec.TieGuard(eps=1e-3))
    assert strict.tokens == expected and strict.stats.exact
    assert strict.stats.accepted == 0
    assert strict.stats.near_tie_rejections == strict.stats.verify_steps > 0
    tolerant = eng.generate(prompt, 24, drafter=drafter, tie_guard=jspec.TieGuard(eps=1e-3, tolerant=True))
    assert tolerant.stats.tolerated_near_ties > 0 and not tolerant.stats.exact
