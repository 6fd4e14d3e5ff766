"""The generation loop as pure functions over a `Loop` pytree: start (a fresh state holding the prompt), prefill
chunks, the first round, then decode and verify rounds. The Engine jits each stage into its own executable and
drives them from the host; `generate_on_device` runs the same stages inside `lax.while_loop` and can be called
inside a user's `jax.jit`: `prefill_round`, then `generation_rounds`.

A round = step (decode_step or verify_step) -> greedy accept -> commit -> record tokens and stats -> drafter
proposes the next draft -> the gate decides whether the next round verifies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import checks
from jspec.accept import TieGuard, accept_chosen, greedy_accept, greedy_choice, near_tie, tolerant_accept
from jspec.config import ModelConfig
from jspec.gate import HitDensityGate
from jspec.sampling import Sampler, SamplerValues, SamplingMode, choose_rows, seen_rows
from jspec.state import DecodeState, init_state
from jspec.steps import (
    PREFILL_CHUNK,
    commit,
    decode_step,
    decode_tile,
    finish_prefill,
    prefill_chunk,
    run_chunks,
    verify_step,
    verify_tile,
    write_prompt,
)
from pallas_kernels import ROW_TILE

STOP_RUNNING, STOP_EOS, STOP_MAX_NEW, STOP_CACHE_END = range(4)
MAX_EOS_IDS = 8  # the fixed length of a request's EOS id array


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Static (hashable) settings of a generation loop; part of every compiled round's identity.

    prefill_chunk: the largest prefill chunk (positions); a prompt runs full chunks of it, then its rest in the
      smallest shape of `jspec.steps.chunk_sizes(prefill_chunk)` that holds it (the only padding).
    """

    max_len: int
    k: int
    dtype: str = "float32"
    drafter: Any = None  # a Drafter or None (plain greedy)
    gate: HitDensityGate | None = None
    tie_guard: TieGuard = TieGuard()
    prefill_chunk: int = PREFILL_CHUNK
    sampling: SamplingMode | None = None  # None: greedy; else which sampling processors run (jspec.sampling)

    def __post_init__(self):
        if not 1 <= self.k <= ROW_TILE - 1:
            raise ValueError(f"k={self.k} out of range: need 1 <= k and k + 1 <= row tile {ROW_TILE}")
        if self.drafter is not None and getattr(self.drafter, "k", None) not in (None, self.k):
            raise ValueError(f"drafter k={self.drafter.k} differs from the engine's k={self.k}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.sampling is not None and self.tie_guard != TieGuard():
            raise ValueError("TieGuard is a greedy diagnostic (near-ties of the argmax); it does not apply to sampling")

    @property
    def step_rows(self) -> int:
        """The rows a round uses: 1 without a drafter (decode only), else k + 1 (the pending token and the draft)."""
        return 1 if self.drafter is None else self.k + 1


def eos_array(eos_ids, cfg: ModelConfig) -> np.ndarray:
    """EOS ids -> int32 [MAX_EOS_IDS], -1 padded: one fixed shape, so every request of an Engine runs the same
    executables whatever its number of EOS ids. eos_ids: an int, a sequence of ints, () for none, or None for the
    model's own (`cfg.eos_token_ids`); each must be a token id of the vocabulary."""
    if eos_ids is None:
        eos_ids = cfg.eos_token_ids
    if isinstance(eos_ids, np.ndarray):
        eos_ids = eos_ids.tolist()
    ids = (eos_ids,) if not isinstance(eos_ids, Sequence) or isinstance(eos_ids, str) else tuple(eos_ids)
    ids = tuple(checks.integer(e, "eos_id", lo=0, hi=cfg.vocab_size - 1) for e in ids)
    if len(ids) > MAX_EOS_IDS:
        raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {len(ids)}")
    out = np.full((MAX_EOS_IDS,), -1, np.int32)
    out[: len(ids)] = ids
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counters:
    """int32 statistics accumulated on device."""

    steps: jax.Array
    decode_steps: jax.Array
    verify_steps: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    position_reached: jax.Array  # [k]
    position_accepted: jax.Array  # [k]
    near_ties: jax.Array
    tolerated: jax.Array
    gate_engaged: jax.Array
    would_hits: jax.Array

    @classmethod
    def zeros(cls, k: int) -> Counters:
        z = jnp.zeros((), jnp.int32)
        return cls(z, z, z, z, z, jnp.zeros((k,), jnp.int32), jnp.zeros((k,), jnp.int32), z, z, z, z)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Loop:
    """Carry of the generation loop.

    state: the DecodeState. draft int32 [k] / n_valid: the proposal for the next round. hits: the gate's ring.
    prompt_len, max_new, eos_ids int32 [MAX_EOS_IDS] (-1 padded), sampler (None: greedy): the request. prefilled:
    prompt positions in the
    cache so far. n_out: new tokens so far (the first comes from prefill); they are
    state.tokens[prompt_len : prompt_len + n_out]. use_verify: the next round verifies.
    """

    state: DecodeState
    draft: jax.Array
    n_valid: jax.Array
    hits: jax.Array
    prompt_len: jax.Array
    max_new: jax.Array
    eos_ids: jax.Array
    sampler: SamplerValues | None
    prefilled: jax.Array
    n_out: jax.Array
    stop: jax.Array
    use_verify: jax.Array
    counters: Counters

    @property
    def done(self) -> jax.Array:
        return self.stop != STOP_RUNNING


def start_loop(
    params: dict,
    cfg: ModelConfig,
    settings: LoopSettings,
    prompt: jax.Array,
    length,
    max_new,
    eos_ids,
    sampler=None,
    own=None,
):
    """prompt int32 [P] padded (P <= max_len), length int32 [] (1..P), max_new int32 [], eos_ids int32
    [MAX_EOS_IDS], sampler: SamplerValues (with settings.sampling) or None -> the Loop before prefill: a fresh
    state holding the prompt, the drafter's empty state. own: the drafter's own weights (`Drafter.weights`, a
    runtime argument like params; None for a drafter without weights), here and in every stage below."""
    if (sampler is None) != (settings.sampling is None):
        raise ValueError("start_loop: pass sampler values exactly when settings.sampling is set")
    state = write_prompt(init_state(cfg, settings.max_len, jnp.dtype(settings.dtype)), prompt)
    if settings.drafter is not None:
        state = dataclasses.replace(state, drafter=settings.drafter.init(params, cfg, state, own=own))
    gate = settings.gate
    zero = jnp.zeros((), jnp.int32)
    return Loop(
        state=state,
        draft=jnp.zeros((settings.k,), jnp.int32),
        n_valid=zero,
        hits=gate.init() if gate else jnp.zeros((1,), jnp.int32),
        prompt_len=jnp.asarray(length, jnp.int32),
        max_new=jnp.asarray(max_new, jnp.int32),
        eos_ids=jnp.asarray(eos_ids, jnp.int32),
        sampler=sampler,
        prefilled=zero,
        n_out=zero,
        stop=jnp.asarray(STOP_RUNNING, jnp.int32),
        use_verify=jnp.zeros((), bool),
        counters=Counters.zeros(settings.k),
    )


def _drafter_prefill(params, cfg: ModelConfig, settings: LoopSettings, own):
    """after(loop, hidden, start, n_valid) for a chunk loop: the drafter's own prefill over the chunk's rows."""

    def after(lp: Loop, hidden, start, n_valid) -> Loop:
        if settings.drafter is None:
            return lp
        mine = settings.drafter.prefill(params, cfg, lp.state, hidden, start, n_valid, lp.prompt_len, own=own)
        return dataclasses.replace(lp, state=dataclasses.replace(lp.state, drafter=mine))

    return after


def prefill_rounds(
    params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, max_chunks, size: int, own=None
) -> Loop:
    """Up to max_chunks (int32 []) prompt chunks of `size` positions (static: one of
    `chunk_sizes(settings.prefill_chunk)`; `jspec.steps.prefill_chunk`), each followed by the drafter's `prefill`
    over the chunk's hidden rows; stops when the prompt is in the cache."""

    after = _drafter_prefill(params, cfg, settings, own)

    def body(carry):
        lp, i = carry
        start = lp.prefilled
        n_valid = jnp.minimum(lp.prompt_len - start, size)
        state, hidden = prefill_chunk(params, cfg, lp.state, start, n_valid, size)
        lp = after(dataclasses.replace(lp, state=state), hidden, start, n_valid)
        return dataclasses.replace(lp, prefilled=start + n_valid), i + 1

    def more(carry):
        lp, i = carry
        return (lp.prefilled < lp.prompt_len) & (i < max_chunks)

    loop, _ = jax.lax.while_loop(more, body, (loop, jnp.zeros((), jnp.int32)))
    return loop


def first_round(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, own=None) -> Loop:
    """After the last prompt chunk: commit the first generated token (the argmax after the prompt), then draft and
    gate the first round."""
    state, logits = finish_prefill(params, cfg, loop.state, loop.prompt_len)
    if settings.sampling is not None:  # the first token is the sampler's too (from the prefill both runs share)
        length = loop.prompt_len
        mode = settings.sampling
        seen = (
            seen_rows(state.tokens, length - 1, state.tokens[length - 1][None], logits.shape[0])
            if mode.penalty
            else None
        )
        token = choose_rows(logits[None], length[None], mode, loop.sampler, seen)[0]
        state = dataclasses.replace(state, tokens=state.tokens.at[length].set(token))
    first = state.tokens[state.position][None]
    return _finish_round(params, cfg, settings, loop, state, first, jnp.asarray(1, jnp.int32), None, own)


def prefill_round(
    params: dict,
    cfg: ModelConfig,
    settings: LoopSettings,
    prompt: jax.Array,
    length,
    max_new,
    eos_ids,
    sampler=None,
    own=None,
) -> Loop:
    """The whole prefill on device: `prefilled_loop`, then `first_round` -> the Loop the rounds continue."""
    loop = prefilled_loop(params, cfg, settings, prompt, length, max_new, eos_ids, sampler, own)
    return first_round(params, cfg, settings, loop, own)


def prefilled_loop(
    params: dict,
    cfg: ModelConfig,
    settings: LoopSettings,
    prompt: jax.Array,
    length,
    max_new,
    eos_ids,
    sampler=None,
    own=None,
) -> Loop:
    """`start_loop`, then every prompt chunk on device (`jspec.steps.run_chunks`: full chunks, then the rest in the
    smallest shape that holds it, each followed by the drafter's prefill) -> the Loop `first_round` takes (what the
    host loop's `prefill_rounds` calls leave)."""
    loop = start_loop(params, cfg, settings, prompt, length, max_new, eos_ids, sampler, own)
    loop, end = run_chunks(
        params,
        cfg,
        loop,
        loop.prefilled,
        loop.prompt_len,
        settings.prefill_chunk,
        _drafter_prefill(params, cfg, settings, own),
        state_of=lambda lp: lp.state,
        put=lambda lp, st: dataclasses.replace(lp, state=st),
    )
    return dataclasses.replace(loop, prefilled=end)


def _sample_rows(settings: LoopSettings, loop: Loop, rows: jax.Array, row_tokens: jax.Array) -> jax.Array:
    """The sampler's choice (int32 [R]) for the rows a step uses of its logits tile, rows [R, V] (`_step_rows`: 1 in
    a decode step, k + 1 in a verify); row r's token takes position state.position + 1 + r. A row's choice is the
    same bits whatever R (the sampler's reductions are order-free: docs/design.md, rule 8), so a decode samples its
    one row."""
    state = loop.state  # before the step: position p, history[0..p]
    positions = state.position + 1 + jnp.arange(rows.shape[0], dtype=jnp.int32)
    penalty = settings.sampling.penalty
    seen = seen_rows(state.tokens, state.position, row_tokens[: rows.shape[0]], rows.shape[1]) if penalty else None
    return choose_rows(rows, positions, settings.sampling, loop.sampler, seen)


def _step_rows(tile: jax.Array, rows: int) -> jax.Array:
    """The first `rows` rows of a step's logits tile [T, V] (those the step uses), after a barrier (rule 7)."""
    return jax.lax.optimization_barrier(tile)[: min(rows, tile.shape[0])]


def _chooser(settings: LoopSettings, loop: Loop):
    """How a drafter picks a token from its own logits [V] for a position: the argmax, or with a sampler the same
    position-keyed choice the target makes (coupled drafting: the draft then equals the sample whenever the
    drafter's distribution is close; it never changes the output). The repetition penalty is left to the target."""
    if settings.sampling is None:
        return greedy_choice
    mode = dataclasses.replace(settings.sampling, penalty=False)
    return lambda logits, position: choose_rows(logits[None], jnp.reshape(position, (1,)), mode, loop.sampler)[0]


def decode_round(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, own=None) -> Loop:
    """One decode_step: commit its argmax (or the sampler's choice); record whether the pending draft would have
    hit."""
    if settings.sampling is None:
        state, logits = decode_step(params, cfg, loop.state)
        token = jnp.argmax(logits).astype(jnp.int32)
    else:
        state, tile, row_tokens = decode_tile(params, cfg, loop.state)
        token = _sample_rows(settings, loop, _step_rows(tile, 1), row_tokens)[0]
    state = commit(state, jnp.zeros((), jnp.int32), token)
    would_hit = (loop.n_valid > 0) & (loop.draft[0] == token)
    loop = dataclasses.replace(loop, counters=_count(loop.counters, False, would_hit=would_hit))
    return _finish_round(params, cfg, settings, loop, state, token[None], jnp.asarray(1, jnp.int32), would_hit, own)


def verify_round(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, own=None) -> Loop:
    """One verify_step over the pending token + draft: accept the matching prefix, commit, add the bonus token."""
    draft, n_valid = loop.draft, loop.n_valid
    guard = settings.tie_guard
    if settings.sampling is not None:  # accept a draft token iff it is the sampler's choice at its position
        state, tile, row_tokens = verify_tile(params, cfg, loop.state, draft)
        chosen = _sample_rows(settings, loop, _step_rows(tile, settings.k + 1), row_tokens)
        n_acc, token = accept_chosen(draft, chosen[: draft.shape[0] + 1], n_valid)
        tolerated = near = jnp.zeros((), jnp.int32)
    elif guard.tolerant:
        state, logits = verify_step(params, cfg, loop.state, draft)
        n_acc, token, tolerated = tolerant_accept(draft, logits, n_valid, guard.eps)
        near = jnp.zeros((), jnp.int32)
    else:
        state, logits = verify_step(params, cfg, loop.state, draft)
        n_acc, token = greedy_accept(draft, logits, n_valid)
        tolerated = jnp.zeros((), jnp.int32)
        near = near_tie(draft, logits, n_acc, n_valid, guard.eps).astype(jnp.int32) if guard.eps > 0 else 0
    state = commit(state, n_acc, token)
    counters = _count(loop.counters, True, n_valid, n_acc, near=near, tolerated=tolerated)
    committed = jnp.concatenate([draft, jnp.zeros((1,), jnp.int32)]).at[n_acc].set(token)
    loop = dataclasses.replace(loop, counters=counters)
    return _finish_round(params, cfg, settings, loop, state, committed, n_acc + 1, n_acc > 0, own)


def slot_round(
    params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, rows: int, own=None, one_split: bool = False
) -> Loop:
    """One round of one slot of a batch (`jspec.batch`, under `jax.vmap` over the slots): the slot's own tile of
    `rows` rows (`jspec.batch.slot_rows`: at least 1 without a drafter, k + 1 with one; its attention's partition
    `jspec.batch.one_split`) verifies its draft when
    loop.use_verify, else the same step with no draft valid decodes (row 0 is the decode step's, bit for bit: rule
    1). One step shape for every slot whatever each one does, so a batch step is one forward. Greedy or sampled; the
    default TieGuard only."""
    verified = loop.use_verify
    n_valid = jnp.where(verified, loop.n_valid, 0)
    decode_only = settings.drafter is None
    if decode_only:
        state, tile, row_tokens = decode_tile(params, cfg, loop.state, tile_rows=rows, one_split=one_split)
    else:
        state, tile, row_tokens = verify_tile(params, cfg, loop.state, loop.draft, tile_rows=rows, one_split=one_split)
    used = _step_rows(tile, settings.step_rows)
    if settings.sampling is None:
        chosen = jnp.argmax(used, axis=-1).astype(jnp.int32)
    else:
        chosen = _sample_rows(settings, loop, used, row_tokens)
    if decode_only:
        n_acc, token = jnp.zeros((), jnp.int32), chosen[0]
    else:
        n_acc, token = accept_chosen(loop.draft, chosen, n_valid)
    state = commit(state, n_acc, token)
    would_hit = ~verified & (loop.n_valid > 0) & (loop.draft[0] == token)
    counters = _count(loop.counters, verified, n_valid, n_acc, would_hit=would_hit)
    committed = jnp.concatenate([loop.draft, jnp.zeros((1,), jnp.int32)]).at[n_acc].set(token)
    hit = jnp.where(verified, n_acc > 0, would_hit)
    loop = dataclasses.replace(loop, counters=counters)
    return _finish_round(params, cfg, settings, loop, state, committed, n_acc + 1, hit, own)


def _count(c: Counters, verified, n_valid=0, n_acc=0, *, would_hit=False, near=0, tolerated=0) -> Counters:
    """The counters after a round: a verify round (verified: a bool, traced or not) of n_valid draft tokens with
    n_acc accepted, or a decode round (would_hit: its pending draft's first token was the decode's)."""
    v = jnp.asarray(verified, jnp.int32)
    positions = jnp.arange(c.position_reached.shape[0])
    return dataclasses.replace(
        c,
        decode_steps=c.decode_steps + 1 - v,
        verify_steps=c.verify_steps + v,
        drafted=c.drafted + v * n_valid,
        accepted=c.accepted + v * n_acc,
        position_reached=c.position_reached + v * ((positions < n_valid) & (positions <= n_acc)),
        position_accepted=c.position_accepted + v * (positions < n_acc),
        near_ties=c.near_ties + v * near,
        tolerated=c.tolerated + v * tolerated,
        would_hits=c.would_hits + (1 - v) * jnp.asarray(would_hit, jnp.int32),
    )


def _finish_round(params, cfg, settings: LoopSettings, loop: Loop, state: DecodeState, committed, n_new, hit, own):
    """Record the n_new committed tokens (stop at eos / budget / cache end), then draft and gate the next round."""
    is_eos = jnp.any(committed[:, None] == loop.eos_ids[None, :], axis=-1) & (jnp.arange(committed.shape[0]) < n_new)
    any_eos = jnp.any(is_eos)
    n_take = jnp.where(any_eos, jnp.argmax(is_eos) + 1, n_new).astype(jnp.int32)
    n_out = loop.n_out + n_take
    stop = jnp.select(
        [any_eos, state.position >= settings.max_len, n_out >= loop.max_new],
        [STOP_EOS, STOP_CACHE_END, STOP_MAX_NEW],
        STOP_RUNNING,
    ).astype(jnp.int32)
    c = loop.counters
    hits = loop.hits
    if settings.gate is not None and hit is not None:
        hits = settings.gate.record(hits, hit)
    if settings.drafter is None:
        draft, n_valid = loop.draft, jnp.zeros((), jnp.int32)
    else:
        choose = _chooser(settings, loop)
        mine, draft, n_valid = settings.drafter.propose(params, cfg, state, settings.k, choose, own=own)
        state = dataclasses.replace(state, drafter=mine)
        # Commit no token past the budget or the cache: n accepted + the bonus must fit.
        room = jnp.minimum(loop.max_new - n_out, settings.max_len - state.position) - 1
        n_valid = jnp.clip(jnp.minimum(n_valid, room), 0, settings.k).astype(jnp.int32)
    gate_open = jnp.asarray(True) if settings.gate is None else settings.gate.engaged(hits)
    use_verify = (n_valid > 0) & gate_open & (stop == STOP_RUNNING)
    counters = dataclasses.replace(
        c,
        steps=c.steps + (0 if hit is None else 1),
        gate_engaged=c.gate_engaged + (gate_open & (stop == STOP_RUNNING)).astype(jnp.int32),
    )
    return dataclasses.replace(
        loop,
        state=state,
        draft=draft.astype(jnp.int32),
        n_valid=n_valid,
        hits=hits,
        n_out=n_out,
        stop=stop,
        use_verify=use_verify,
        counters=counters,
    )


# What `generate_on_device` checks on device (bit -> the rule broken); DeviceGeneration.error holds their sum.
REQUEST_ERRORS = {
    1: "prompt_len must be in 1..len(prompt)",
    2: "max_new_tokens must be >= 1",
    4: "prompt_len + max_new_tokens must be <= max_len + 1 (the last token is produced but never fed back)",
    8: "every prompt token id must be in [0, vocab_size)",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceGeneration:
    """Result of `generate_on_device`: tokens int32 [max_len] (the new tokens, valid up to num_tokens),
    num_tokens int32 [], stop_reason int32 [] (index into jspec.stats.STOP_REASONS), counters, and error int32 []:
    0, or the sum of the REQUEST_ERRORS bits the request broke (then nothing ran: num_tokens is 0)."""

    tokens: jax.Array
    num_tokens: jax.Array
    stop_reason: jax.Array
    counters: Counters
    error: jax.Array

    def raise_if_error(self) -> DeviceGeneration:
        """On the host, after the call: raise ValueError naming every rule the request broke (of a batch's
        requests, `jspec.batch`: each by its index); else return self."""
        codes = np.asarray(self.error)
        for index, code in np.ndenumerate(codes):
            if code:
                broken = "; ".join(message for bit, message in REQUEST_ERRORS.items() if code & bit)
                which = f"request {index[0]}" if codes.ndim else "the request"
                raise ValueError(f"generate_on_device refused {which} (error {int(code)}): {broken}")
        return self


def request_error(cfg: ModelConfig, settings: LoopSettings, prompt: jax.Array, prompt_len, max_new) -> jax.Array:
    """int32 []: the REQUEST_ERRORS bits a traced request breaks (0: valid)."""
    length = jnp.asarray(prompt_len, jnp.int32)
    max_new = jnp.asarray(max_new, jnp.int32)
    real = jnp.arange(prompt.shape[0]) < length
    bad_token = jnp.any(real & ((prompt < 0) | (prompt >= cfg.vocab_size)))
    broken = (
        (length < 1) | (length > prompt.shape[0]),
        max_new < 1,
        length + max_new > settings.max_len + 1,
        bad_token,
    )
    return sum(jnp.where(b, bit, 0) for b, bit in zip(broken, REQUEST_ERRORS, strict=True)).astype(jnp.int32)


def run_rounds(
    params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, max_rounds, verify: bool, own=None
) -> Loop:
    """Up to max_rounds (int32 []) rounds of one kind on device: verify rounds if `verify`, else decode rounds.
    Returns early when the generation stops or the loop asks for the other kind (`loop.use_verify`)."""
    round_fn = verify_round if verify else decode_round

    def more(carry):
        lp, i = carry
        return ~lp.done & (lp.use_verify == verify) & (i < max_rounds)

    def body(carry):
        lp, i = carry
        return round_fn(params, cfg, settings, lp, own), i + 1

    loop, _ = jax.lax.while_loop(more, body, (loop, jnp.zeros((), jnp.int32)))
    return loop


def generate_on_device(
    params: dict,
    cfg: ModelConfig,
    prompt: jax.Array,
    prompt_len,
    max_new_tokens,
    settings: LoopSettings,
    eos_ids=None,
    sampler=None,
    drafter_params=None,
) -> DeviceGeneration:
    """The whole generation on device (`lax.while_loop`), jittable and callable inside a user's `jax.jit`.

    prompt int32 [T] (padded to any fixed length <= settings.max_len), prompt_len int32 [] (1..T), max_new_tokens
    int32 [] (>= 1, prompt_len + max_new_tokens <= max_len + 1), eos_ids: as `eos_array` (None: the model's own,
    (): none; static), or an int32 [MAX_EOS_IDS] array (-1 padded; traced is fine). sampler: a `jspec.Sampler`
    whose mode is settings.sampling (`engine.settings(sampler=...)`), or its `SamplerValues` (traced is fine: a new
    seed or temperature compiles nothing); None for greedy settings. drafter_params: the weights of a drafter that
    has its own (`jspec.DraftModel`: its `weights`; required then, a runtime argument, never a constant baked into
    the executable), else None. cfg and settings are static. Same rounds, same tokens as the Engine.

    Errors: what is static (shapes, dtypes, settings, EOS ids) raises at trace time. The values, which inside jit
    may be traced, are checked on device (`request_error`): a request breaking a rule runs nothing and returns
    num_tokens 0 with `error` set; call `raise_if_error()` on the fetched result to turn it into a ValueError.
    """
    checks.instance(cfg, ModelConfig, "cfg", "a jspec.ModelConfig", optional=False)
    checks.instance(settings, LoopSettings, "settings", "a jspec.LoopSettings (engine.settings(...))", optional=False)
    if jnp.ndim(prompt) != 1 or not jnp.issubdtype(jnp.result_type(prompt), jnp.integer):
        raise TypeError(f"prompt must be a 1-D integer array, got {jnp.shape(prompt)} {jnp.result_type(prompt)}")
    if prompt.shape[0] > settings.max_len:
        raise ValueError(f"prompt array of {prompt.shape[0]} tokens is longer than max_len {settings.max_len}")
    check_drafter_params(settings, drafter_params)
    eos = eos_ids if isinstance(eos_ids, jax.Array) else eos_array(eos_ids, cfg)
    values = sampler_values(sampler, settings)
    prompt = jnp.asarray(prompt, jnp.int32)
    error = request_error(cfg, settings, prompt, prompt_len, max_new_tokens)

    def run(_):
        return _generate(params, cfg, settings, prompt, prompt_len, max_new_tokens, eos, values, drafter_params)

    def refuse(_):
        empty = Counters.zeros(settings.k)
        zero = jnp.zeros((), jnp.int32)
        tokens = jnp.zeros((settings.max_len,), jnp.int32)
        return DeviceGeneration(tokens, zero, jnp.asarray(STOP_RUNNING, jnp.int32), empty, zero)

    out = jax.lax.cond(error == 0, run, refuse, None)
    return dataclasses.replace(out, error=error)


def check_drafter_params(settings: LoopSettings, drafter_params) -> None:
    """Raise unless drafter_params is given exactly when the settings' drafter has weights of its own."""
    needs = getattr(settings.drafter, "weights", None) is not None
    if needs != (drafter_params is not None):
        raise ValueError(
            "pass the drafter's weights as drafter_params=drafter.weights (a runtime argument)"
            if needs
            else "drafter_params given but the settings' drafter has no weights of its own"
        )


def sampler_values(sampler, settings: LoopSettings) -> SamplerValues | None:
    """The runtime sampling values of a request (a Sampler, SamplerValues or None), checked against the settings."""
    if isinstance(sampler, Sampler):
        if sampler.mode != settings.sampling:
            raise ValueError(
                f"the sampler's processors ({sampler.mode}) are not the settings' ({settings.sampling}): build the "
                "settings from the same sampler (engine.settings(sampler=...))"
            )
        return None if sampler.greedy else sampler.values()
    if sampler is not None and not isinstance(sampler, SamplerValues):
        raise TypeError(f"sampler must be a jspec.Sampler, SamplerValues or None, got {type(sampler).__name__}")
    if (sampler is None) != (settings.sampling is None):
        raise ValueError(
            "settings sample but no sampler was given" if sampler is None else "greedy settings take no sampler"
        )
    return sampler


def _generate(params, cfg: ModelConfig, settings: LoopSettings, prompt, prompt_len, max_new_tokens, eos, sampler, own):
    loop = prefill_round(params, cfg, settings, prompt, prompt_len, max_new_tokens, eos, sampler, own)
    loop = generation_rounds(params, cfg, settings, loop, own)
    tokens = jax.lax.dynamic_slice_in_dim(
        jnp.pad(loop.state.tokens, (0, settings.max_len)), loop.prompt_len, settings.max_len
    )
    return DeviceGeneration(tokens, loop.n_out, loop.stop, loop.counters, jnp.zeros((), jnp.int32))


def generation_rounds(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, own=None) -> Loop:
    """Every round after `prefill_round` until the Loop is done (decode rounds, or verify rounds where the loop
    asks), in one `lax.while_loop`."""

    def body(loop: Loop) -> Loop:
        if settings.drafter is None:
            return decode_round(params, cfg, settings, loop, own)
        return jax.lax.cond(
            loop.use_verify,
            lambda lp: verify_round(params, cfg, settings, lp, own),
            lambda lp: decode_round(params, cfg, settings, lp, own),
            loop,
        )

    return jax.lax.while_loop(lambda lp: ~lp.done, body, loop)
