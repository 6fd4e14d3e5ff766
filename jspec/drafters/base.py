"""The Drafter protocol: pure functions traced into the engine's step executables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from jspec.config import ModelConfig
from jspec.state import DecodeState


class Drafter(Protocol):
    """A drafter is a frozen, hashable dataclass (it is part of the compiled executables' identity).

    k: its own draft length, or None to take the engine's k.
    weights: the drafter's own weights (a pytree: `jspec.DraftModel`'s model, run in its embedding's dtype; the head
      of `jspec.MTPDrafter.over`, run in the engine's), or None (the default when the attribute is absent). They are
      a runtime argument of the executables, never part of the drafter's hash: the engine passes them (prepared for
      its kernel backend) to every method as `own`; None for a drafter without.
    init: called before the prompt (state holds the prompt's tokens, nothing in the cache yet); returns the
      drafter's own empty state pytree (stored in DecodeState.drafter; None for a stateless drafter).
    prefill: called after every prompt chunk with the chunk's final-normed hidden rows [C, H] at positions
      start..start+C-1 (the first n_valid real) and the prompt length; returns the drafter's state.
    propose: called after every commit, with `choose(logits [V] float32, position int32 []) -> int32 []`, how the
      target would pick the token at a position from logits (the argmax, or the sampler's position-keyed choice:
      a drafter with logits of its own drafts with it, coupled drafting); returns (the drafter's new state,
      draft int32 [k], n_valid int32 []) where only the first n_valid draft tokens are proposals (0 = a miss:
      nothing proposed). draft[i] is a guess for position state.position + 1 + i.
    """

    k: int | None

    def init(self, params: dict, cfg: ModelConfig, state: DecodeState, own: Any = None) -> Any: ...

    def prefill(
        self,
        params: dict,
        cfg: ModelConfig,
        state: DecodeState,
        hidden: jax.Array,
        start,
        n_valid,
        length,
        own: Any = None,
    ) -> Any: ...

    def propose(
        self, params: dict, cfg: ModelConfig, state: DecodeState, k: int, choose: Callable, own: Any = None
    ) -> tuple[Any, jax.Array, jax.Array]: ...
