"""Batched generation (jspec.batch, Engine.generate_batch; docs/design.md rule 9): a sequence's bits and tokens do
not depend on what the other slots hold nor on its slot; speculative == plain per sequence; batch_size 1 is
`generate`; slots that stop take the next prompt; the on-device variant; bad input."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.batch import batch_round, empty_batch, fill_slot, slot_rows
from jspec.exactness import bits
from jspec.loop import eos_array
from jspec.models import hybrid
from jspec.models.mtp import init_mtp_params
from jspec.steps import verify_tile
from pallas_kernels import use_backend
from tests.tiny import tiny_config, tiny_params

MAX_LEN = 64


@functools.cache
def model(family: str, mtp: bool = False):
    cfg = tiny_config(family)
    if mtp:
        cfg = dataclasses.replace(cfg, num_mtp_layers=1, mtp_layout="qwen3_next" if cfg.is_hybrid else "deepseek")
    key = jax.random.PRNGKey(5)
    params = hybrid.init_params(cfg, key, jnp.float32, 0.1) if cfg.is_hybrid else tiny_params(cfg, "float32", 5)
    if mtp:
        params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(6), jnp.float32)
    return params, cfg


@functools.cache
def engine(family: str, batch_size: int, mtp: bool = False) -> jspec.Engine:
    params, cfg = model(family, mtp)
    return jspec.Engine(params, cfg, max_len=MAX_LEN, k=3, prefill_chunk=16, batch_size=batch_size)


def prompts(cfg, lengths=(5, 11, 3, 20, 7, 9, 2), seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = [[int(t) for t in rng.integers(0, cfg.vocab_size, size=n)] for n in lengths]
    if len(out) > 1:
        out[1] = out[1][:4] * 3  # a repetitive prompt: prompt lookup drafts from it
    return out


def test_slot_rows_fill_a_row_tile_when_a_small_batch_would_not():
    """A slot's rows: 1 without a drafter, k + 1 with one, widened to ROW_TILE // B where the batch's rows would
    fill less than one row tile and B divides it (one whole tile, as the single-sequence steps run)."""
    settings = engine("qwen2", 1).settings
    greedy, k3 = settings(), settings(drafter=jspec.PromptLookup())
    k7 = dataclasses.replace(k3, k=7)
    assert [slot_rows(greedy, b) for b in (1, 2, 3, 4, 8, 16, 64)] == [16, 8, 1, 4, 2, 1, 1]
    assert [slot_rows(k3, b) for b in (1, 2, 3, 4, 5, 16)] == [16, 8, 4, 4, 4, 4]
    assert [slot_rows(k7, b) for b in (1, 2, 3, 4)] == [16, 8, 8, 8]


@pytest.mark.parametrize("slots", [2, 4, 5])
def test_slot_logits_bits_do_not_depend_on_the_other_slots_or_the_slot(slots):
    """One verify-shaped batch step (4 rows a slot, 8 at 2 slots: one row tile for 2 or 4 slots, two for 5, the
    fifth slot's rows in the second): a sequence's logits rows are the same bits in the first slot beside other
    prompts (other lengths, other drafts), in the last slot beside others again, and with the other slots empty."""
    params, cfg = model("qwen2")
    settings = engine("qwen2", slots).settings(drafter=jspec.PromptLookup())
    rows = slot_rows(settings, slots)
    mine = prompts(cfg, (9,), seed=1)[0]

    def logits_of(order: list, seed: int):
        """The logits [rows, V] of `mine` with the other slots holding prompts ("x") or empty (None)."""
        batch = empty_batch(params, cfg, settings, slots)
        others = iter(prompts(cfg, (6, 13, 4, 8), seed=seed))
        for slot, what in enumerate(order):
            if what is None:
                continue
            p = mine if what == "mine" else next(others)
            padded = np.zeros((MAX_LEN,), np.int32)
            padded[: len(p)] = p
            batch = fill_slot(params, cfg, settings, batch, slot, padded, len(p), 10, eos_array((), cfg))
        drafts = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (slots, settings.k)), jnp.int32)
        drafts = drafts.at[order.index("mine")].set(jnp.asarray([3, 1, 4], jnp.int32))
        step = jax.jit(jax.vmap(lambda st, d: verify_tile(params, cfg, st, d, tile_rows=rows)[1]))
        return np.asarray(step(batch.state, drafts))[order.index("mine")]

    alone = logits_of(["mine"] + [None] * (slots - 1), 0)
    assert np.array_equal(bits(alone), bits(logits_of(["mine"] + ["x"] * (slots - 1), 1)))
    assert np.array_equal(bits(alone), bits(logits_of(["x"] * (slots - 1) + ["mine"], 2)))


@pytest.mark.parametrize(
    "family,mtp,drafter,sampled",
    [
        ("qwen2", False, "lookup", False),
        ("llama", False, None, True),
        ("qwen3_next", False, "lookup", True),
        ("glm4", True, "mtp", False),
        ("qwen3_next", True, "mtp", True),
    ],
)
def test_batch_tokens_equal_each_prompt_generated_alone(family, mtp, drafter, sampled):
    """7 prompts of other lengths and budgets through 3 slots (slots stop and take the next prompt mid-run), greedy
    or sampled with a seed per prompt: every sequence's tokens equal `generate` of it alone without a drafter."""
    params, cfg = model(family, mtp)
    eng = engine(family, 3, mtp)
    ps = prompts(cfg)
    budgets = [12, 3, 20, 8, 1, 15, 10]
    samplers = [jspec.Sampler(temperature=0.9, top_p=0.9, seed=i) for i in range(len(ps))] if sampled else None
    d = {"lookup": jspec.PromptLookup(), "mtp": jspec.MTPDrafter(), None: None}[drafter]
    out = eng.generate_batch(ps, budgets, drafter=d, sampler=samplers, eos_id=())
    for i, (p, budget) in enumerate(zip(ps, budgets, strict=True)):
        alone = eng.generate(p, budget, sampler=None if samplers is None else samplers[i], eos_id=())
        assert out.results[i].tokens == alone.tokens, f"prompt {i}"
        assert out.results[i].stats.new_tokens == budget and out.results[i].stats.stop_reason == "max_new_tokens"
    if drafter is not None:
        assert sum(r.stats.verify_steps for r in out.results) > 0  # not vacuous: drafts were verified
    assert out.stats.new_tokens == sum(budgets) and 0 < out.stats.slot_occupancy <= 1


def test_batch_of_one_and_eos_and_draft_models():
    """batch_size 1 runs `generate`'s tokens; an EOS stops its sequence alone; a draft model drafts per slot."""
    params, cfg = model("qwen2")
    ps = prompts(cfg)[:4]
    one = engine("qwen2", 1)
    want = [one.generate(p, 10, eos_id=()).tokens for p in ps]
    assert [r.tokens for r in one.generate_batch(ps, 10, eos_id=()).results] == want
    eos = want[0][4]  # prompt 0 stops at its fifth token; the others where (and if) that token comes
    out = engine("qwen2", 2).generate_batch(ps, 10, eos_id=eos)
    for r, w in zip(out.results, want, strict=True):
        cut = w.index(eos) + 1 if eos in w else len(w)
        assert r.tokens == w[:cut] and r.stats.stop_reason == ("eos" if eos in w else "max_new_tokens")
    dcfg = tiny_config("llama")
    drafted = engine("qwen2", 2).generate_batch(ps, 10, drafter=jspec.DraftModel(tiny_params(dcfg, seed=9), dcfg))
    assert [r.tokens for r in drafted.results] == [one.generate(p, 10).tokens for p in ps]


@pytest.mark.parametrize("drafter", [None, "mtp"])
def test_small_hybrid_batch_of_whole_tile_slots_equals_generate(drafter):
    """2 slots of a hybrid with its MTP head, 8 rows each (`slot_rows`: one row tile for the batch): each
    sequence's tokens are `generate`'s alone, its recurrent state advanced by its valid rows only."""
    params, cfg = model("qwen3_next", True)
    eng = engine("qwen3_next", 2, True)
    ps = prompts(cfg)[:3]
    d = jspec.MTPDrafter() if drafter else None
    out = eng.generate_batch(ps, 9, drafter=d, eos_id=())
    assert [r.tokens for r in out.results] == [eng.generate(p, 9, eos_id=()).tokens for p in ps]
    if drafter:
        assert sum(r.stats.verify_steps for r in out.results) > 0


def test_generate_batch_on_device_inside_jit():
    """A fixed set of prompts in one executable, under the caller's jax.jit: each slot's tokens are its prompt's
    alone; a bad request (prompt_len 0) leaves its slot empty and is reported by its index."""
    params, cfg = model("llama")
    eng = engine("llama", 4)
    ps = prompts(cfg, (5, 11, 3, 8))
    settings = eng.settings(drafter=jspec.PromptLookup())
    padded = np.zeros((4, 24), np.int32)
    for i, p in enumerate(ps):
        padded[i, : len(p)] = p
    lens = np.asarray([len(p) for p in ps], np.int32)
    eos = np.stack([eos_array((), cfg)] * 4)
    run = jax.jit(lambda pr, n: jspec.generate_batch_on_device(params, cfg, pr, n, np.full(4, 9), settings, eos))
    out = jax.device_get(run(padded, lens)).raise_if_error()
    for i, p in enumerate(ps):
        assert list(out.tokens[i, : out.num_tokens[i]]) == eng.generate(p, 9, eos_id=()).tokens
    bad = jax.device_get(run(padded, np.where(np.arange(4) == 2, 0, lens).astype(np.int32)))
    assert int(bad.num_tokens[2]) == 0 and int(bad.error[2]) == 1
    assert list(bad.tokens[0, : bad.num_tokens[0]]) == list(out.tokens[0, : out.num_tokens[0]])
    with pytest.raises(ValueError, match="refused request 2"):
        bad.raise_if_error()


def test_batch_bad_input():
    params, cfg = model("qwen2")
    eng = engine("qwen2", 2)
    with pytest.raises(ValueError, match="batch_size"):
        jspec.Engine(params, cfg, max_len=MAX_LEN, batch_size=0)
    with pytest.raises(ValueError, match="prompt list is empty"):
        eng.generate_batch([], 4)
    with pytest.raises(ValueError, match="prompt 1: "):
        eng.generate_batch([[1, 2], [1, cfg.vocab_size], [3]], 4)
    with pytest.raises(ValueError, match="prompt 2: .*exceeds the cache"):
        eng.generate_batch([[1], [2], [3] * 60], 10)
    with pytest.raises(ValueError, match="max_new_tokens: 2 values for 3 prompts"):
        eng.generate_batch([[1], [2], [3]], [4, 5])
    with pytest.raises(ValueError, match="sampler 1's processors"):
        eng.generate_batch([[1], [2]], 4, sampler=[jspec.Sampler(top_p=0.9), jspec.Sampler()])
    with pytest.raises(TypeError, match="list of token-id sequences"):
        eng.generate_batch("hello", 4)
    with pytest.raises(jspec.MemoryBudgetError, match="batch_size=100000"):
        jspec.Engine(params, cfg, max_len=4096, batch_size=100_000)


def test_one_split_batches_keep_each_sequence_its_own_tokens(monkeypatch):
    """Where the slots fill the GPU (here an SM count patched down to 2), a batch round's attention reads each slot's
    cache as one split and runs no combine (`jspec.batch.one_split`; the interpret kernels, where the reference
    backend has no partition): a sequence's tokens are the same beside other prompts as alone in the engine, and
    prompt lookup gives the plain batch's tokens. The default SM count keeps the partition at these sizes."""
    params, cfg = model("qwen2")
    assert not jspec.batch.one_split(cfg, 3) and jspec.batch.one_split(cfg, 64)  # 2 KV heads, 132 SMs
    monkeypatch.setattr(jspec.batch, "sm_count", lambda: 2)
    assert jspec.batch.one_split(cfg, 3)
    ps, budgets = prompts(cfg)[:4], [12, 3, 10, 8]
    with use_backend("interpret"):
        eng = jspec.Engine(params, cfg, max_len=MAX_LEN, k=3, prefill_chunk=16, batch_size=3)
        settings = eng.settings()
        batch = empty_batch(params, cfg, settings, 3)
        kernels = jax.jit(lambda b: batch_round(params, cfg, settings, b)).lower(batch).as_text(debug_info=True)
        assert "jspec_attention_split" in kernels and "jspec_attention_combine" not in kernels
        plain = eng.generate_batch(ps, budgets, eos_id=())
        lookup = eng.generate_batch(ps, budgets, drafter=jspec.PromptLookup(), eos_id=())
        for i, p in enumerate(ps):
            alone = eng.generate_batch([p], budgets[i], eos_id=()).results[0].tokens  # the other slots empty
            assert plain.results[i].tokens == alone == lookup.results[i].tokens, f"prompt {i}"
            # the default partition's tokens too: another partition's last bits flip none of this float32 model's
            # tokens (a check that the one split computes the attention, not a contract)
            assert alone == eng.generate(p, budgets[i], eos_id=()).tokens, f"prompt {i}"
    assert sum(r.stats.verify_steps for r in lookup.results) > 0  # not vacuous: drafts were verified
