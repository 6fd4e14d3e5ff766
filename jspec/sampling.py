"""Sampling that speculation cannot change: position-keyed Gumbel noise (docs/design.md, rule 8).

The token at absolute position t is

    choose(logits, t) = argmax_v( processed(logits)[v] + g_t[v] ),   g_t = Gumbel(0, 1) from fold_in(key(seed), t)

where `logits` is the float32 row that predicts position t and `processed` is HuggingFace's pipeline, in its order:
repetition penalty (over the context up to t - 1), temperature, top-k, top-p, min-p (each a mask to -inf of what
it removes). Gumbel-max makes choose an exact sample of softmax(processed). The noise depends on (seed, t) only, so
a verify row for position t chooses what the decode step at t chooses, and a draft token is accepted iff it equals
that choice. Temperature 0 is not sampling: the engine then takes the plain argmax path, bit for bit the greedy one.

Row-local and order-free: every reduction over the vocabulary is a max, a min, an integer count or a fixed-point
integer mass, never a float sum, whose order XLA picks per shape. So a row's processed logits and choice are the
same bits however many rows run beside it: a decode step samples its one row, a verify its k + 1, a batch its
slots' rows (docs/design.md, rule 8).

Static (part of the compiled identity, `SamplingMode`): which processors run. Runtime (`SamplerValues`, arrays of
the request): their parameters and the seed, so a new seed or temperature compiles nothing.

Exact thresholds without a sort: top-k keeps the logits >= the k-th largest (ties kept, as TopKLogitsWarper), top-p
keeps the tokens whose probability mass strictly above theirs is < top_p (TopPLogitsWarper's set; a tie group at
the cut is kept whole), each found by a 16-way search over the float32 bit patterns: `SEARCH_PASSES` fused
reductions over the whole row, never a prefix of the vocabulary that might cut the nucleus. top-p's masses are
integer sums of each token's probability relative to the top one's in fixed point (2 ** -24 of it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec import checks

SEARCH_WAYS = 16  # intervals per pass of the threshold search (15 candidates, the bracket's top the 16th)
SEARCH_PASSES = 8  # each pass cuts the bracket to ceil(1/16) of itself: 2 ** 32 bit patterns -> one in 8


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """Which processors run (static, hashable; from `Sampler.mode`)."""

    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalty: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerValues:
    """A request's sampling parameters as arrays (runtime values of the executables). key: uint32 [2] raw key data."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    penalty: jax.Array
    key: jax.Array

    @classmethod
    def neutral(cls) -> SamplerValues:
        """Values that sample nothing in particular (temperature 1, every processor off, key 0): an empty batch
        slot's placeholder, traceable."""
        one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
        return cls(one, jnp.zeros((), jnp.int32), one, zero, one, jnp.zeros((2,), jnp.uint32))


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Sample with HuggingFace's processors and position-keyed noise: the same seed gives the same tokens, with or
    without a drafter, for every k. temperature 0: greedy (the plain argmax). top_k 0 / top_p 1 / min_p 0 /
    repetition_penalty 1: that processor off. seed: an int in [0, 2**32)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self):
        checks.real(self.temperature, "temperature", lo=0.0)
        checks.integer(self.top_k, "top_k", lo=0)
        checks.real(self.top_p, "top_p", lo=0.0, hi=1.0, open_lo=True)
        checks.real(self.min_p, "min_p", lo=0.0, hi=1.0)
        checks.real(self.repetition_penalty, "repetition_penalty", lo=0.0, open_lo=True)
        checks.integer(self.seed, "seed", lo=0, hi=2**32 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def mode(self) -> SamplingMode | None:
        """The static part (None: greedy)."""
        if self.greedy:
            return None
        return SamplingMode(
            top_k=self.top_k > 0, top_p=self.top_p < 1.0, min_p=self.min_p > 0.0, penalty=self.repetition_penalty != 1
        )

    def values(self) -> SamplerValues:
        """The runtime part, as numpy arrays (one fixed structure for every Sampler of a mode)."""
        return SamplerValues(
            temperature=np.float32(self.temperature),
            top_k=np.int32(min(self.top_k, 2**31 - 1)),
            top_p=np.float32(self.top_p),
            min_p=np.float32(self.min_p),
            penalty=np.float32(self.repetition_penalty),
            key=np.asarray(jax.random.key_data(jax.random.PRNGKey(self.seed)), np.uint32),
        )


# ------------------------------------------------------------------------------------------- the processors
def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is x's order (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(u: jax.Array) -> jax.Array:
    bits = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_passing(stat, limit: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row: the smallest float32 t in the order-key bracket (lo, hi] (uint32 [R]: the test fails at lo and
    holds at hi) with stat(t) < limit ([R]). stat maps candidates t float32 [R, 1, W] to [R, W] (a count or a
    fixed-point mass above t, exact) and falls as t rises, so the test is monotone. Each of the SEARCH_PASSES passes
    (unrolled: on the H200 a fori_loop ran them as ~9 launches each, 166 us in all at V = 128256, unrolled 127 us)
    splits the bracket in SEARCH_WAYS and evaluates its 15 inner candidates in one reduction over the row broadcast
    to [R, V, 15]. A Pallas kernel of one launch per pass was no faster: the passes are compute-bound at ~9 us
    (docs/kernels.md, "Tried, did not pay")."""
    lo, hi, limit = lo[:, None], hi[:, None], limit[:, None]
    ways = jnp.arange(1, SEARCH_WAYS, dtype=jnp.uint32)
    for _ in range(SEARCH_PASSES):
        span = hi - lo
        step = jnp.maximum(span // SEARCH_WAYS + (span % SEARCH_WAYS != 0).astype(jnp.uint32), 1)  # ceil
        cand = jnp.minimum(lo + step * ways, hi)  # [R, 15], ascending
        ok = stat(_from_order_key(cand)[:, None, :]) < limit
        # the first passing candidate bounds from above, the last failing one from below
        lo, hi = (
            jnp.max(jnp.where(ok, lo, cand), axis=1, keepdims=True),
            jnp.min(jnp.where(ok, cand, hi), axis=1, keepdims=True),
        )
    return _from_order_key(hi[:, 0])


def _count_at_least(z: jax.Array):
    """stat for the search: t [R, 1, W] -> int32 [R, W], the number of z [R, V] >= t (an integer sum: exact)."""
    return lambda t: jnp.sum(z[:, :, None] >= t, axis=1, dtype=jnp.int32)


def _top_k(z: jax.Array, k: jax.Array) -> jax.Array:
    """z [R, V] with everything below the k-th largest (ties kept) set to -inf; k >= 1 (k >= V: nothing cut)."""
    k = jnp.minimum(k, z.shape[1])
    top = _order_key(jnp.max(z, axis=1))
    bottom = _order_key(jnp.min(z, axis=1))
    # count(z >= t) < k holds from just above the k-th largest value: the search finds that next value up
    limit = jnp.broadcast_to(k.astype(jnp.int32), top.shape)
    above = _smallest_passing(_count_at_least(z), limit, bottom, top + 1)
    kth = jnp.max(jnp.where(z < above[:, None], z, -jnp.inf), axis=1)  # the k-th largest itself
    return jnp.where(z >= kth[:, None], z, -jnp.inf)


def _relative(z: jax.Array) -> jax.Array:
    """float32 [R, V]: exp(z - max z) per row, each token's probability relative to the most probable one's (an
    elementwise function of z and its row's max, so the same bits however many rows run: no softmax sum)."""
    return jnp.exp(z - jnp.max(z, axis=1, keepdims=True))


MASS_BITS = 24  # top-p's fixed point: a token's mass is round(e * 2 ** 24), e its probability over the top one's
MASS_CHUNK = 128  # tokens per exact uint32 partial sum: 128 * 2 ** 24 = 2 ** 31


def _in_chunks(e: jax.Array) -> jax.Array:
    """e [R, V] -> [R, C, MASS_CHUNK]: the row zero-padded to C whole chunks."""
    return jnp.pad(e, ((0, 0), (0, -e.shape[1] % MASS_CHUNK))).reshape(e.shape[0], -1, MASS_CHUNK)


def _fixed_point(ec: jax.Array) -> jax.Array:
    """ec float32 [R, C, MASS_CHUNK] in [0, 1] (`_in_chunks`) -> uint32: round(e * 2 ** MASS_BITS) (every step
    exact: a scaling by a power of two, a rounding, a conversion of an integer <= 2 ** 24; padding stays 0)."""
    return jnp.round(ec * 2.0**MASS_BITS).astype(jnp.uint32)


def _over_chunks(sums: jax.Array) -> jax.Array:
    """uint32 chunk sums [R, C, ...] (each < 2 ** 31) -> float32 [R, ...]: their total, summed exactly in two 16-bit
    halves (C < 2 ** 16) and then rounded to float32 (a function of the two integers alone, never of an order)."""
    hi = jnp.sum(sums >> 16, axis=1, dtype=jnp.uint32)
    lo = jnp.sum(sums & 0xFFFF, axis=1, dtype=jnp.uint32)
    return hi.astype(jnp.float32) * 65536.0 + lo.astype(jnp.float32)


def _mass_above(ec: jax.Array, q: jax.Array):
    """stat for the search: t [R, 1, W] -> float32 [R, W], the fixed-point mass (q: `_fixed_point(ec)`) of the
    tokens with e > t (ec: e [R, V] `_in_chunks`)."""

    def stat(t):
        hit = ec[..., None] > t[:, :, None, :]  # [R, C, MASS_CHUNK, W]
        return _over_chunks(jnp.sum(jnp.where(hit, q[..., None], 0), axis=2, dtype=jnp.uint32))

    return stat


def _top_p(z: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the tokens whose probability mass strictly above theirs is < top_p (the most probable always). A
    token's mass is its e = `_relative(z)` in fixed point (2 ** -24 of the top token's, the resolution of
    transformers' float32 cumulative sum near 1), summed as integers: a row's bits are its own whatever other rows
    run (rule 8), where a float sum's order, and so its rounding, is XLA's choice per shape (1 ulp apart between 1
    and 8 rows on the H200: experiments/results/top_p_mass_h200.json)."""
    e = _relative(z)
    ec = _in_chunks(e)
    q = _fixed_point(ec)
    limit = top_p.astype(jnp.float32) * _over_chunks(jnp.sum(q, axis=2, dtype=jnp.uint32))
    zero, one = _order_key(jnp.zeros(limit.shape, jnp.float32)), _order_key(jnp.ones(limit.shape, jnp.float32))
    # mass(e > t) < top_p * mass(all) holds from the smallest kept e on
    threshold = _smallest_passing(_mass_above(ec, q), limit, zero, one)
    return jnp.where(e >= threshold[:, None], z, -jnp.inf)


def _min_p(z: jax.Array, min_p: jax.Array) -> jax.Array:
    """MinPLogitsWarper: keep the tokens with probability >= min_p x the top one's (p / p_max = `_relative`)."""
    return jnp.where(_relative(z) >= min_p, z, -jnp.inf)


def _penalize(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the penalty (multiplied if negative)."""
    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def processed(logits: jax.Array, mode: SamplingMode, values: SamplerValues, seen: jax.Array | None = None):
    """float32 logits [R, V] -> the processed logits [R, V] float32 (removed tokens -inf), HuggingFace's order:
    repetition penalty (seen: bool [R, V], the tokens of each row's context), temperature, top-k, top-p, min-p.
    Row r's output is a function of row r alone, the same bits for any R (order-free reductions)."""
    z = logits.astype(jnp.float32)
    if mode.penalty:
        z = _penalize(z, seen, values.penalty)
    z = z / values.temperature
    if mode.top_k:
        z = jnp.where(values.top_k > 0, _top_k(z, jnp.maximum(values.top_k, 1)), z)
    if mode.top_p:
        z = _top_p(z, values.top_p)
    if mode.min_p:
        z = _min_p(z, values.min_p)
    return z


def gumbel_rows(values: SamplerValues, positions: jax.Array, vocab: int) -> jax.Array:
    """float32 [R, vocab]: row r is the Gumbel noise of absolute position positions[r] (a function of the seed and
    that position only)."""
    key = jax.random.wrap_key_data(values.key)
    return jax.vmap(lambda t: jax.random.gumbel(jax.random.fold_in(key, t), (vocab,), jnp.float32))(positions)


def choose_rows(logits, positions, mode: SamplingMode, values: SamplerValues, seen=None) -> jax.Array:
    """The chosen token (int32 [R]) of each row of logits [R, V]; positions int32 [R]: the absolute position each
    row's token will take (the row's own position + 1)."""
    z = processed(logits, mode, values, seen)
    return jnp.argmax(z + gumbel_rows(values, positions, logits.shape[1]), axis=-1).astype(jnp.int32)


def seen_rows(history: jax.Array, position, row_tokens: jax.Array, vocab: int) -> jax.Array:
    """bool [R, vocab]: the tokens of row r's context, for a row tile at `position` (its row r at position + r):
    history[0..position] (int32 [L]; history[position] is the pending token, row 0's input) and the tile's inputs
    row_tokens[1..r]."""
    real = jnp.arange(history.shape[0]) <= position
    base = jnp.zeros((vocab,), bool).at[jnp.where(real, history, vocab)].set(True, mode="drop")
    later = jax.nn.one_hot(row_tokens[1:], vocab, dtype=jnp.int32)  # row r adds inputs 1..r
    added = jnp.concatenate([jnp.zeros((1, vocab), jnp.int32), jnp.cumsum(later, axis=0)]) > 0
    return base[None, :] | added
