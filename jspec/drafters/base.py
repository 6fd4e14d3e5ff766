"""The Drafter protocol: pure functions traced into the engine's step executables."""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jspec.config import ModelConfig
from jspec.state import DecodeState


class Drafter(Protocol):
    """A drafter is a frozen, hashable dataclass (it is part of the compiled executables' identity).

    k: its own draft length, or None to take the engine's k.
    init: called inside prefill; returns the drafter's own state pytree (stored in DecodeState.drafter).
    propose: called after every commit; returns (state, draft int32 [k], n_valid int32 []) where only the
      first n_valid draft tokens are proposals (0 = a miss: nothing proposed). Must not change anything in
      the state but its own `drafter` field.
    """

    k: int | None

    def init(
        self, params: dict, cfg: ModelConfig, state: DecodeState, prompt_hidden: jax.Array, length: jax.Array
    ) -> Any: ...

    def propose(
        self, params: dict, cfg: ModelConfig, state: DecodeState, k: int
    ) -> tuple[DecodeState, jax.Array, jax.Array]: ...
