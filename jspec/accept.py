"""Greedy acceptance of a draft against verify logits, and the TieGuard near-tie diagnostics.

One argmax for every path (`jnp.argmax`: the lowest index wins a tie, docs/design.md rule 4). A draft token is
accepted iff it equals that argmax, so speculative output equals plain greedy output token for token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import checks


def greedy_choice(logits: jax.Array, position) -> jax.Array:
    """The `choose(logits [V], position)` of greedy decoding (a drafter's, `jspec.drafters.base.Drafter.propose`):
    the argmax, int32 []; the position is not used."""
    del position
    return jnp.argmax(logits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TieGuard:
    """Near-tie handling at the first rejected draft position.

    eps == 0 (default): strict, exact greedy; nothing is counted.
    eps > 0: a rejected draft token whose logit is within eps of the row maximum counts as a
      `near_tie_rejection` (diagnostic only; the output stays exact).
    tolerant=True (opt-in, needs eps > 0): such near-tie tokens are ACCEPTED. Output may then differ from
      greedy; the stats mark the generation inexact. Never the default.
    """

    eps: float = 0.0
    tolerant: bool = False

    def __post_init__(self):
        checks.real(self.eps, "TieGuard eps", lo=0.0)
        checks.instance(self.tolerant, bool, "TieGuard tolerant", "True or False", optional=False)
        if self.tolerant and self.eps == 0:
            raise ValueError("TieGuard(tolerant=True) needs eps > 0")

    @property
    def exact(self) -> bool:
        return not self.tolerant


def greedy_accept(draft: jax.Array, logits: jax.Array, n_valid=None):
    """draft int32 [k], logits float32 [k + 1, V] -> (n_accepted int32 [], next_token int32 []).

    n_accepted = length of the longest prefix of the (first n_valid) draft tokens that equal the row argmax;
    next_token = argmax of row n_accepted (the bonus / correction token).
    """
    return accept_chosen(draft, jnp.argmax(logits, axis=-1).astype(jnp.int32), n_valid)


def accept_chosen(draft: jax.Array, chosen: jax.Array, n_valid=None):
    """draft int32 [k], chosen int32 [k + 1] (the token each verify row chooses: argmax or the sampler's) ->
    (n_accepted, next_token): the longest prefix of the (first n_valid) draft equal to chosen, and chosen at the
    first mismatch (the bonus / correction token)."""
    k = draft.shape[0]
    valid = jnp.arange(k) < (k if n_valid is None else n_valid)
    match = (draft.astype(jnp.int32) == chosen[:k]) & valid
    n_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
    return n_accepted, chosen[n_accepted]


def near_tie(draft: jax.Array, logits: jax.Array, n_accepted, n_valid, eps: float) -> jax.Array:
    """bool []: the draft token at the first rejected position (if it was valid) is within eps of its row max."""
    k = draft.shape[0]
    at = jnp.minimum(n_accepted, k - 1)
    row = logits[at]
    gap = jnp.max(row) - row[draft[at]]
    return (n_accepted < n_valid) & (gap <= eps)


def tolerant_accept(draft: jax.Array, logits: jax.Array, n_valid, eps: float):
    """Like greedy_accept, but a draft token within eps of its row max is accepted (INEXACT, opt-in).

    Returns (n_accepted, next_token, n_near_tie_accepted)."""
    k = draft.shape[0]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    rows = logits[:k]
    gap = jnp.max(rows, axis=-1) - jnp.take_along_axis(rows, draft[:, None].astype(jnp.int32), axis=-1)[:, 0]
    exact_match = draft.astype(jnp.int32) == greedy[:k]
    ok = (exact_match | (gap <= eps)) & (jnp.arange(k) < n_valid)
    prefix = jnp.cumprod(ok.astype(jnp.int32))
    n_accepted = jnp.sum(prefix)
    n_tolerated = jnp.sum(prefix * (~exact_match).astype(jnp.int32))
    return n_accepted, greedy[n_accepted], n_tolerated
