"""Batched generation as pure functions over a batch of Loops (every leaf of `jspec.loop.Loop` with a leading
[B] axis, one entry per slot): empty slots, a prompt prefilled into one slot, rounds of every slot at once.

A batch round is `jax.vmap` of `jspec.loop.slot_round` over the slots. Each slot owns its rows (its pending
token and up to k draft tokens, padded so that a small batch fills a row tile: `slot_rows`), its cache,
recurrent state, position, drafter state, gate, sampler and stop reason. Under the vmap every weight product
flattens all the slots' rows into row tiles read once for the batch (`pallas_kernels.matmul`); attention, the
recurrent update and sampling run per slot. No reduction meets two slots' rows, so a sequence's bits do not
depend on its neighbours nor on the slot it occupies (docs/design.md, rule 9). A stopped (or empty) slot keeps
its state: its rows still run, their results are dropped (its caches take the writes: nothing reads them again,
`_keep_stopped`).

The Engine drives these from the host (`Engine.generate_batch`: a slot that stops takes the next prompt);
`generate_batch_on_device` runs a fixed set of B prompts in one executable, callable inside a user's `jax.jit`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import checks
from jspec.config import ModelConfig
from jspec.loop import (
    MAX_EOS_IDS,
    STOP_MAX_NEW,
    STOP_RUNNING,
    DeviceGeneration,
    Loop,
    LoopSettings,
    check_drafter_params,
    prefill_round,
    request_error,
    slot_round,
    start_loop,
)
from jspec.sampling import SamplerValues
from pallas_kernels import ROW_TILE
from pallas_kernels.backend import sm_count


def slot_rows(settings: LoopSettings, batch_size: int) -> int:
    """The rows of one slot in a batch step: `settings.step_rows` (1 without a drafter, else k + 1); but where the
    batch's rows would not fill one row tile and batch_size divides it, ROW_TILE // batch_size, so the batch runs one
    whole tile as the single-sequence steps do. A part tile cuts every product's result to its rows behind an
    optimization barrier (`pallas_kernels.backend.first_rows`), which keeps XLA from fusing the product's epilogue
    (the int4 kernel's partials' sum) into its consumer: kernels of their own in every layer. The extra rows are
    padding; no row's bits change (rule 1)."""
    rows = settings.step_rows
    if batch_size * rows < ROW_TILE and ROW_TILE % batch_size == 0:
        return ROW_TILE // batch_size
    return rows


def one_split(cfg: ModelConfig, batch_size: int) -> bool:
    """Whether a batch round's attention reads each slot's cache as one split, with no combine (the decode /
    verify partition otherwise cuts it into splits of 128 / 512 positions, docs/design.md rule 2): when the
    batch's (slot, KV head) items fill the GPU's SMs (`pallas_kernels.backend.sm_count`: 132 on the H200, and
    wherever no count is known) with no SM for a second CTA an item, a CTA runs an item's splits one after another,
    so splits buy no parallelism, only their partials' stores and a combine (H200, Llama-3-8B shape, B = 64:
    benchmarks/experiments/results/attention_batch_partition_h200.json). A static of the engine, a function of
    its batch size and model alone: a sequence's bits never depend on its neighbours or its slot (rule 9), but may
    differ from an engine of another batch size, as they may between row tiles."""
    return 2 * batch_size * cfg.num_kv_heads > sm_count()


def empty_batch(params: dict, cfg: ModelConfig, settings: LoopSettings, batch_size: int, own=None) -> Loop:
    """batch_size empty slots: fresh Loops marked stopped (a stopped slot never changes until `fill_slot`)."""
    sampler = None if settings.sampling is None else SamplerValues.neutral()
    eos = jnp.full((MAX_EOS_IDS,), -1, jnp.int32)
    one = start_loop(params, cfg, settings, jnp.zeros((settings.max_len,), jnp.int32), 1, 1, eos, sampler, own)
    one = dataclasses.replace(one, stop=jnp.asarray(STOP_MAX_NEW, jnp.int32))
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch_size, *jnp.shape(x))), one)


def fill_slot(params, cfg, settings, batch: Loop, slot, prompt, length, max_new, eos_ids, sampler=None, own=None):
    """batch with slot `slot` (int32 []) replaced by a new request, prefilled and past its first round (what
    `jspec.loop.prefill_round` gives one sequence: the same bits as a generation of its own). Arguments as
    `jspec.loop.start_loop`."""
    one = prefill_round(params, cfg, settings, prompt, length, max_new, eos_ids, sampler, own)
    return jax.tree.map(lambda b, x: b.at[slot].set(x), batch, one)


def batch_round(params: dict, cfg: ModelConfig, settings: LoopSettings, batch: Loop, own=None) -> Loop:
    """One round of every running slot. A stopped slot keeps its Loop except its caches (`_keep_stopped`)."""
    size = batch.done.shape[0]
    rows, whole = slot_rows(settings, size), one_split(cfg, size)
    new = jax.vmap(lambda lp: slot_round(params, cfg, settings, lp, rows, own, whole))(batch)
    return _keep_stopped(batch.done, batch, new)


def _keep_stopped(done: jax.Array, old: Loop, new: Loop) -> Loop:
    """new with every stopped slot's (done: bool [B]) Loop from old, but for the caches: the KV and recurrent
    caches and the drafter's state are new's in every slot. A stopped slot's step wrote only cache rows at and past
    its position (and its recurrent state), which nothing reads before `fill_slot` prefills the slot afresh;
    selecting them back would copy every slot's whole cache each round (at B = 64 of the Llama-3-8B shape,
    max_len 400: 3.4 GB, ~3 ms of a 17 ms round on the H200)."""
    caches = lambda lp: dataclasses.replace(lp, state=dataclasses.replace(lp.state, cache=None, drafter=None))  # noqa: E731
    kept = _where_slots(done, caches(old), caches(new))
    return dataclasses.replace(
        kept, state=dataclasses.replace(kept.state, cache=new.state.cache, drafter=new.state.drafter)
    )


def _where_slots(mask: jax.Array, a, b):
    """Pytrees a, b with a leading [B] axis: slot i from a where mask[i] (bool [B]), else from b."""
    return jax.tree.map(lambda x, y: jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, y), a, b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Occupancy:
    """rounds: batch rounds run; slot_rounds: running slots summed over those rounds (int32 [] each)."""

    rounds: jax.Array
    slot_rounds: jax.Array


def run_batch_rounds(params, cfg, settings, batch: Loop, max_rounds, until_a_stop, own=None):
    """Up to max_rounds (int32 []) batch rounds while a slot runs; with until_a_stop (bool []) also return once a
    slot that was running stops (so the host can refill it). -> (batch, Occupancy of these rounds)."""
    was_done = batch.done

    def more(carry):
        b, occ = carry
        stopped = jnp.any(b.done & ~was_done)
        return jnp.any(~b.done) & (occ.rounds < max_rounds) & ~(until_a_stop & stopped)

    def body(carry):
        b, occ = carry
        running = jnp.sum(~b.done).astype(jnp.int32)
        return batch_round(params, cfg, settings, b, own), Occupancy(occ.rounds + 1, occ.slot_rounds + running)

    zero = jnp.zeros((), jnp.int32)
    return jax.lax.while_loop(more, body, (batch, Occupancy(zero, zero)))


def generate_batch_on_device(
    params: dict,
    cfg: ModelConfig,
    prompts: jax.Array,
    prompt_lens,
    max_new_tokens,
    settings: LoopSettings,
    eos_ids,
    sampler: SamplerValues | None = None,
    drafter_params=None,
) -> DeviceGeneration:
    """B prompts generated together on device, one slot each, jittable and callable inside a user's `jax.jit`.

    prompts int32 [B, T] (each padded, T <= max_len), prompt_lens int32 [B], max_new_tokens int32 [B], eos_ids
    int32 [B, MAX_EOS_IDS] (-1 padded; `jspec.loop.eos_array` per prompt), sampler: SamplerValues with a leading
    [B] axis (one per prompt, all of settings.sampling's processors) or None (greedy settings); drafter_params as
    `jspec.loop.generate_on_device`. Returns a DeviceGeneration whose every field has a leading [B] axis. The slots
    are prefilled one after another, then every round runs all of them; each slot's tokens are those of its
    prompt generated alone (docs/design.md, rule 9). A request that breaks a rule (`request_error`) leaves its slot
    empty: its num_tokens is 0 and its error bits are set; the other slots run.
    """
    checks.instance(settings, LoopSettings, "settings", "a jspec.LoopSettings (engine.settings(...))", optional=False)
    if jnp.ndim(prompts) != 2 or not jnp.issubdtype(jnp.result_type(prompts), jnp.integer):
        raise TypeError(f"prompts must be a 2-D integer array [B, T], got {jnp.shape(prompts)}")
    b, t = prompts.shape
    if t > settings.max_len:
        raise ValueError(f"prompt arrays of {t} tokens are longer than max_len {settings.max_len}")
    for name, x, shape in (
        ("prompt_lens", prompt_lens, (b,)),
        ("max_new_tokens", max_new_tokens, (b,)),
        ("eos_ids", eos_ids, (b, MAX_EOS_IDS)),
    ):
        if jnp.shape(x) != shape:
            raise ValueError(f"{name} must have shape {shape} (one per prompt), got {jnp.shape(x)}")
    if (sampler is None) != (settings.sampling is None):
        raise ValueError("pass sampler values (a leading [B] axis) exactly when the settings sample")
    check_drafter_params(settings, drafter_params)
    prompts = jnp.pad(jnp.asarray(prompts, jnp.int32), ((0, 0), (0, settings.max_len - t)))
    lens, max_new = jnp.asarray(prompt_lens, jnp.int32), jnp.asarray(max_new_tokens, jnp.int32)
    eos = jnp.asarray(eos_ids, jnp.int32)
    errors = jax.vmap(lambda p, n, m: request_error(cfg, settings, p[:t], n, m))(prompts, lens, max_new)
    batch = empty_batch(params, cfg, settings, b, drafter_params)

    def fill(i, batch):
        values = None if sampler is None else jax.tree.map(lambda x: x[i], sampler)
        run = lambda bt: fill_slot(  # noqa: E731
            params, cfg, settings, bt, i, prompts[i], lens[i], max_new[i], eos[i], values, drafter_params
        )
        return jax.lax.cond(errors[i] == 0, run, lambda bt: bt, batch)

    batch = jax.lax.fori_loop(0, b, fill, batch)
    batch, _ = run_batch_rounds(params, cfg, settings, batch, jnp.iinfo(jnp.int32).max, False, drafter_params)
    start = lens[:, None] + jnp.arange(settings.max_len)[None, :]
    tokens = jnp.take_along_axis(jnp.pad(batch.state.tokens, ((0, 0), (0, settings.max_len))), start, axis=1)
    filled = errors == 0
    n_out = jnp.where(filled, batch.n_out, 0)
    stop = jnp.where(filled, batch.stop, STOP_RUNNING)
    counters = _where_slots(filled, batch.counters, jax.tree.map(jnp.zeros_like, batch.counters))
    return DeviceGeneration(tokens, n_out, stop, counters, errors)
