"""HitDensityGate: run verify only when the recent would-hit density predicts a win."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import checks


@dataclasses.dataclass(frozen=True)
class HitDensityGate:
    """The drafter always proposes; a step verifies only if at least `min_hits` of the last `window` steps hit.

    A step hits when its draft's first token equals the token greedy produced at that position: for a verify
    step, at least one draft token was accepted; for a decode step taken while a draft was on hand, the draft's
    first token equals the decoded token (it *would* have hit). The window starts empty (no hits), so a
    generation on which nothing hits never verifies and pays only the drafter's cost.
    """

    window: int = 16
    min_hits: int = 8

    def __post_init__(self):
        checks.integer(self.window, "HitDensityGate window", lo=1)
        checks.integer(self.min_hits, "HitDensityGate min_hits", lo=1)
        if not 1 <= self.min_hits <= self.window:
            raise ValueError(f"need 1 <= min_hits <= window, got min_hits={self.min_hits}, window={self.window}")

    def init(self) -> jax.Array:
        """int32 [window] ring of recent outcomes (1 = hit), newest first."""
        return jnp.zeros((self.window,), jnp.int32)

    def engaged(self, hits: jax.Array) -> jax.Array:
        return jnp.sum(hits) >= self.min_hits

    def record(self, hits: jax.Array, hit: jax.Array) -> jax.Array:
        return jnp.roll(hits, 1).at[0].set(hit.astype(jnp.int32))
