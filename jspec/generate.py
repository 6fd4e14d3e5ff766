"""The generation loop as pure functions over a `Loop` pytree: start (a fresh state holding the prompt), prefill
chunks, the first round, then decode and verify rounds. The Engine jits each stage into its own executable and
drives them from the host; `generate_on_device` runs the same stages inside `lax.while_loop` and can be called
inside a user's `jax.jit`.

A round = step (decode_step or verify_step) -> greedy accept -> commit -> record tokens and stats -> drafter
proposes the next draft -> the gate decides whether the next round verifies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.accept import TieGuard, greedy_accept, near_tie, tolerant_accept
from jspec.config import ModelConfig
from jspec.gate import HitDensityGate
from jspec.state import DecodeState, init_state
from jspec.steps import PREFILL_CHUNK, commit, decode_step, finish_prefill, prefill_chunk, verify_step, write_prompt
from pallas_kernels import ROW_TILE

STOP_RUNNING, STOP_EOS, STOP_MAX_NEW, STOP_CACHE_END = range(4)
MAX_EOS_IDS = 8  # the fixed length of a request's EOS id array


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Static (hashable) settings of a generation loop; part of every compiled round's identity.

    prefill_chunk: prompt positions per prefill chunk (every chunk runs at this one shape; the last is padded).
    """

    max_len: int
    k: int
    dtype: str = "float32"
    drafter: Any = None  # a Drafter or None (plain greedy)
    gate: HitDensityGate | None = None
    tie_guard: TieGuard = TieGuard()
    prefill_chunk: int = PREFILL_CHUNK

    def __post_init__(self):
        if not 1 <= self.k <= ROW_TILE - 1:
            raise ValueError(f"k={self.k} out of range: need 1 <= k and k + 1 <= row tile {ROW_TILE}")
        if self.drafter is not None and getattr(self.drafter, "k", None) not in (None, self.k):
            raise ValueError(f"drafter k={self.drafter.k} differs from the engine's k={self.k}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


def eos_array(eos_ids) -> np.ndarray:
    """EOS ids (an int, a sequence of ints, or None) -> int32 [MAX_EOS_IDS], -1 padded: one fixed shape, so every
    request of an Engine runs the same executables whatever its number of EOS ids."""
    ids = () if eos_ids is None else (eos_ids,) if isinstance(eos_ids, int | np.integer) else tuple(eos_ids)
    if len(ids) > MAX_EOS_IDS:
        raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {len(ids)}")
    out = np.full((MAX_EOS_IDS,), -1, np.int32)
    out[: len(ids)] = [int(e) for e in ids]
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
    prompt_len, max_new, eos_ids int32 [MAX_EOS_IDS] (-1 padded): the request. prefilled: prompt positions in the
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
    prefilled: jax.Array
    n_out: jax.Array
    stop: jax.Array
    use_verify: jax.Array
    counters: Counters

    @property
    def done(self) -> jax.Array:
        return self.stop != STOP_RUNNING


def start_loop(params: dict, cfg: ModelConfig, settings: LoopSettings, prompt: jax.Array, length, max_new, eos_ids):
    """prompt int32 [P] padded (P <= max_len), length int32 [] (1..P), max_new int32 [], eos_ids int32
    [MAX_EOS_IDS] -> the Loop before prefill: a fresh state holding the prompt, the drafter's empty state."""
    state = write_prompt(init_state(cfg, settings.max_len, jnp.dtype(settings.dtype)), prompt)
    if settings.drafter is not None:
        state = dataclasses.replace(state, drafter=settings.drafter.init(params, cfg, state))
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
        prefilled=zero,
        n_out=zero,
        stop=jnp.asarray(STOP_RUNNING, jnp.int32),
        use_verify=jnp.zeros((), bool),
        counters=Counters.zeros(settings.k),
    )


def prefill_rounds(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, max_chunks) -> Loop:
    """Up to max_chunks (int32 []) prompt chunks of settings.prefill_chunk positions (`jspec.steps.prefill_chunk`),
    each followed by the drafter's `prefill` over the chunk's hidden rows; stops when the prompt is in the cache."""
    size = settings.prefill_chunk

    def body(carry):
        lp, i = carry
        start = lp.prefilled
        n_valid = jnp.minimum(lp.prompt_len - start, size)
        state, hidden = prefill_chunk(params, cfg, lp.state, start, n_valid, size)
        if settings.drafter is not None:
            mine = settings.drafter.prefill(params, cfg, state, hidden, start, n_valid, lp.prompt_len)
            state = dataclasses.replace(state, drafter=mine)
        return dataclasses.replace(lp, state=state, prefilled=start + n_valid), i + 1

    def more(carry):
        lp, i = carry
        return (lp.prefilled < lp.prompt_len) & (i < max_chunks)

    loop, _ = jax.lax.while_loop(more, body, (loop, jnp.zeros((), jnp.int32)))
    return loop


def first_round(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop) -> Loop:
    """After the last prompt chunk: commit the first generated token (the argmax after the prompt), then draft and
    gate the first round."""
    state, _ = finish_prefill(params, cfg, loop.state, loop.prompt_len)
    first = state.tokens[state.position][None]
    return _finish_round(params, cfg, settings, loop, state, first, jnp.asarray(1, jnp.int32), None)


def prefill_round(
    params: dict, cfg: ModelConfig, settings: LoopSettings, prompt: jax.Array, length, max_new, eos_ids
) -> Loop:
    """The whole prefill on device: `start_loop`, every chunk, `first_round` -> the Loop the rounds continue."""
    loop = start_loop(params, cfg, settings, prompt, length, max_new, eos_ids)
    loop = prefill_rounds(params, cfg, settings, loop, jnp.iinfo(jnp.int32).max)
    return first_round(params, cfg, settings, loop)


def decode_round(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop) -> Loop:
    """One decode_step: commit its argmax; record whether the pending draft would have hit."""
    state, logits = decode_step(params, cfg, loop.state)
    token = jnp.argmax(logits).astype(jnp.int32)
    state = commit(state, jnp.zeros((), jnp.int32), token)
    would_hit = (loop.n_valid > 0) & (loop.draft[0] == token)
    c = loop.counters
    counters = dataclasses.replace(
        c, decode_steps=c.decode_steps + 1, would_hits=c.would_hits + would_hit.astype(jnp.int32)
    )
    loop = dataclasses.replace(loop, counters=counters)
    return _finish_round(params, cfg, settings, loop, state, token[None], jnp.asarray(1, jnp.int32), would_hit)


def verify_round(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop) -> Loop:
    """One verify_step over the pending token + draft: accept the matching prefix, commit, add the bonus token."""
    draft, n_valid = loop.draft, loop.n_valid
    state, logits = verify_step(params, cfg, loop.state, draft)
    guard = settings.tie_guard
    c = loop.counters
    if guard.tolerant:
        n_acc, token, tolerated = tolerant_accept(draft, logits, n_valid, guard.eps)
        near = jnp.zeros((), jnp.int32)
    else:
        n_acc, token = greedy_accept(draft, logits, n_valid)
        tolerated = jnp.zeros((), jnp.int32)
        near = near_tie(draft, logits, n_acc, n_valid, guard.eps).astype(jnp.int32) if guard.eps > 0 else 0
    state = commit(state, n_acc, token)
    positions = jnp.arange(settings.k)
    counters = dataclasses.replace(
        c,
        verify_steps=c.verify_steps + 1,
        drafted=c.drafted + n_valid,
        accepted=c.accepted + n_acc,
        position_reached=c.position_reached + ((positions < n_valid) & (positions <= n_acc)).astype(jnp.int32),
        position_accepted=c.position_accepted + (positions < n_acc).astype(jnp.int32),
        near_ties=c.near_ties + near,
        tolerated=c.tolerated + tolerated,
    )
    committed = jnp.concatenate([draft, jnp.zeros((1,), jnp.int32)]).at[n_acc].set(token)
    loop = dataclasses.replace(loop, counters=counters)
    return _finish_round(params, cfg, settings, loop, state, committed, n_acc + 1, n_acc > 0)


def _finish_round(params, cfg, settings: LoopSettings, loop: Loop, state: DecodeState, committed, n_new, hit):
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
        state, draft, n_valid = settings.drafter.propose(params, cfg, state, settings.k)
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceGeneration:
    """Result of `generate_on_device`: tokens int32 [max_len] (the new tokens, valid up to num_tokens),
    num_tokens int32 [], stop_reason int32 [] (index into jspec.stats.STOP_REASONS), counters."""

    tokens: jax.Array
    num_tokens: jax.Array
    stop_reason: jax.Array
    counters: Counters


def run_rounds(params: dict, cfg: ModelConfig, settings: LoopSettings, loop: Loop, max_rounds, verify: bool) -> Loop:
    """Up to max_rounds (int32 []) rounds of one kind on device: verify rounds if `verify`, else decode rounds.
    Returns early when the generation stops or the loop asks for the other kind (`loop.use_verify`)."""
    round_fn = verify_round if verify else decode_round

    def more(carry):
        lp, i = carry
        return ~lp.done & (lp.use_verify == verify) & (i < max_rounds)

    def body(carry):
        lp, i = carry
        return round_fn(params, cfg, settings, lp), i + 1

    loop, _ = jax.lax.while_loop(more, body, (loop, jnp.zeros((), jnp.int32)))
    return loop


def generate_on_device(
    params: dict,
    cfg: ModelConfig,
    prompt: jax.Array,
    prompt_len,
    max_new_tokens,
    settings: LoopSettings,
    eos_ids=(),
) -> DeviceGeneration:
    """The whole generation on device (`lax.while_loop`), jittable and callable inside a user's `jax.jit`.

    prompt int32 [T] (padded to any fixed length <= settings.max_len), prompt_len int32 [] (1..T),
    max_new_tokens int32 [] (prompt_len + max_new_tokens <= max_len is the caller's responsibility here; the
    Engine checks it), eos_ids: an int, a sequence of up to MAX_EOS_IDS ints (static), or an int32 [MAX_EOS_IDS]
    array (-1 padded; traced is fine). cfg and settings are static. Same rounds, same tokens as the Engine.
    """
    eos = eos_ids if isinstance(eos_ids, jax.Array) else eos_array(eos_ids)
    loop = prefill_round(params, cfg, settings, prompt, prompt_len, max_new_tokens, eos)

    def body(loop: Loop) -> Loop:
        if settings.drafter is None:
            return decode_round(params, cfg, settings, loop)
        return jax.lax.cond(
            loop.use_verify,
            lambda lp: verify_round(params, cfg, settings, lp),
            lambda lp: decode_round(params, cfg, settings, lp),
            loop,
        )

    loop = jax.lax.while_loop(lambda lp: ~lp.done, body, loop)
    tokens = jax.lax.dynamic_slice_in_dim(
        jnp.pad(loop.state.tokens, (0, settings.max_len)), loop.prompt_len, settings.max_len
    )
    return DeviceGeneration(tokens=tokens, num_tokens=loop.n_out, stop_reason=loop.stop, counters=loop.counters)
