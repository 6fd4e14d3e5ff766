"""Prompt lookup (n-gram) drafting over the on-device token history."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import checks
from jspec.config import ModelConfig
from jspec.state import DecodeState


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Find the most recent earlier occurrence of the last n tokens (n from ngram_max down to ngram_min; the
    longest n that matches wins, then the most recent match) and propose the up to k tokens that followed it.

    Runs inside the jitted step over the fixed-shape history (O(max_len * ngram_max) compares per step).
    """

    ngram_max: int = 3
    ngram_min: int = 1
    k: int | None = None

    def __post_init__(self):
        checks.integer(self.ngram_max, "PromptLookup ngram_max", lo=1)
        checks.integer(self.ngram_min, "PromptLookup ngram_min", lo=1)
        if self.k is not None:
            checks.integer(self.k, "PromptLookup k", lo=1)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"PromptLookup k must be >= 1, got {self.k}")

    def init(self, params, cfg: ModelConfig, state: DecodeState, own=None):
        return None

    def prefill(self, params, cfg: ModelConfig, state: DecodeState, hidden, start, n_valid, length, own=None):
        return None

    def propose(self, params, cfg: ModelConfig, state: DecodeState, k: int, choose=None, own=None):
        draft, n_valid = lookup(state.tokens, state.position, k, self.ngram_min, self.ngram_max)
        return None, draft, n_valid


def lookup(tokens: jax.Array, last: jax.Array, k: int, ngram_min: int, ngram_max: int):
    """tokens int32 [L] (known up to index `last` inclusive) -> (draft int32 [k], n_valid int32 []).

    A match of the n-gram ending at `last` is a start j < last - n + 1 with tokens[j:j+n] equal to it; its
    continuation tokens[j+n : j+n+k] is cut to the known tokens (index <= last).
    """
    length = tokens.shape[0]
    index = jnp.arange(length)
    found = jnp.asarray(-1, jnp.int32)  # continuation start of the chosen match
    for n in range(ngram_max, ngram_min - 1, -1):
        match = (index + n <= last) & (last - n + 1 >= 0)
        for i in range(n):
            want = tokens[jnp.maximum(last - n + 1 + i, 0)]
            match &= jnp.roll(tokens, -i) == want
        latest = jnp.max(jnp.where(match, index, -1)).astype(jnp.int32)
        found = jnp.where((found < 0) & (latest >= 0), latest + n, found)
    start = jnp.maximum(found, 0)
    draft = jax.lax.dynamic_slice(jnp.pad(tokens, (0, k)), (start,), (k,))
    n_valid = jnp.where(found >= 0, jnp.minimum(k, last - found + 1), 0).astype(jnp.int32)
    return draft, n_valid
