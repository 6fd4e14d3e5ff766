"""DraftModel: a small model of the same vocabulary drafting inside the round, with its own cache.

It prefills the prompt chunk by chunk beside the target (its own cache and recurrent state in the drafter state),
then after every commit it catches up on the tokens it has not processed yet (one row-tile step of 2 rows: the
target's bonus token, and the last draft token when every draft was accepted) and drafts k tokens autoregressively
(k - 1 more one-row steps), each drafted with the target's own choice (`choose`: the argmax, or the position-keyed
sample: coupled drafting). After a verify it keeps the rows of the draft tokens that were accepted, so it never
re-runs a token: the next round starts where the accepted prefix ends. Its weights are a runtime argument of the
executables (`own`), never constants in them: a DraftModel is hashed and compared by its config, k and the weights'
layout (tree, shapes, dtypes), never their values.

Drafter state: cache (the draft family's cache over the target's positions), base int32 [] (the position of the
first draft of the last round: rows < base hold real tokens), drafts int32 [k] (the last round's draft), saved
(recurrent families: the recurrent state after the real rows and after each speculative row, [k] per leaf).
Drafts never change the output: the target accepts only the tokens it would choose itself.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jspec import checks
from jspec.accept import greedy_choice
from jspec.config import ModelConfig
from jspec.models import family_module
from jspec.models.hybrid import candidate_state, with_committed_state
from jspec.models.layers import logits as logits_from_hidden
from jspec.state import DecodeState, physical_length
from pallas_kernels import ROW_TILE

# Vocabularies may differ by padding rows (Qwen2.5-0.5B's 151936 against 7B's 152064): by at most the larger of these
# (rows, fraction of the larger vocabulary). A bigger difference is another tokenizer.
VOCAB_PADDING = (256, 0.01)
K_MAX = ROW_TILE - 1  # the drafter state holds room for the longest draft a row tile verifies


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Draft with another (smaller) model of the target's vocabulary: DraftModel(draft_params, draft_cfg).

    params / cfg: the draft model, any supported family, int4 or dense, float32 or bfloat16 activations (its
    embedding's dtype). k: its draft length (None: the engine's).
    """

    params: Any = dataclasses.field(compare=False, hash=False, repr=False)
    cfg: ModelConfig
    k: int | None = None
    # The weights' tree, shapes and dtypes (not their values): two drafters differing in these (int4 or dense,
    # float32 or bfloat16) need executables of their own.
    layout: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        checks.instance(self.cfg, ModelConfig, "DraftModel cfg", "a jspec.ModelConfig", optional=False)
        if not isinstance(self.params, dict) or "embed" not in self.params:
            raise TypeError(
                f"DraftModel params must be a model's weights (a dict with 'embed'), got {type(self.params)}"
            )
        if self.k is not None:
            checks.integer(self.k, "DraftModel k", lo=1, hi=ROW_TILE - 1)
        leaves, tree = jax.tree.flatten(self.params)
        shapes = tuple((tuple(jnp.shape(x)), jnp.result_type(x).name) for x in leaves)
        object.__setattr__(self, "layout", (str(tree), shapes))

    @classmethod
    def load(cls, checkpoint: str | os.PathLike, k: int | None = None, **load_options) -> DraftModel:
        """A DraftModel from a checkpoint directory (`jspec.load`: jspec or HuggingFace)."""
        from jspec.model import load

        model = load(checkpoint, **load_options)
        return cls(model.params, model.cfg, k)

    @property
    def weights(self):
        """The runtime argument of the executables (the Engine prepares it for its kernel backend)."""
        return self.params

    def check_target(self, cfg: ModelConfig, max_len: int) -> None:
        """Raise unless the vocabularies match up to padding rows; warn when the target's cache runs past the
        positions the draft model was trained on."""
        small, large = sorted((cfg.vocab_size, self.cfg.vocab_size))
        rows, fraction = VOCAB_PADDING
        if large - small > max(rows, fraction * large):
            raise ValueError(
                f"DraftModel: vocabulary of {self.cfg.vocab_size} tokens against the target's {cfg.vocab_size}: "
                f"only padding rows may differ (at most {rows} or {fraction:.0%}); a drafter needs the target's "
                "tokenizer"
            )
        if max_len > self.cfg.max_position_embeddings:
            warnings.warn(
                f"DraftModel: max_len {max_len} exceeds the draft model's max_position_embeddings "
                f"{self.cfg.max_position_embeddings}: its drafts past those positions may be poor (the output is not "
                "affected)",
                stacklevel=3,
            )

    # ------------------------------------------------------------------------------------------------ protocol
    def init(self, params, cfg: ModelConfig, state: DecodeState, own=None):
        """Empty draft caches over the target's positions (room for the drafting tiles past max_len)."""
        dtype = jnp.dtype(own["embed"].dtype)
        cache = family_module(self.cfg).init_cache(self.cfg, physical_length(state.max_len + ROW_TILE), dtype)
        saved = tuple(
            jax.tree.map(lambda leaf: jnp.zeros((K_MAX,) + leaf.shape, leaf.dtype), candidate_state(layer, 0))
            for layer in cache
            if isinstance(layer, dict)
        )
        zero = jnp.zeros((), jnp.int32)
        return dict(cache=cache, base=zero, drafts=jnp.full((K_MAX,), -1, jnp.int32), saved=saved)

    def prefill(self, params, cfg: ModelConfig, state: DecodeState, hidden, start, n_valid, length, own=None):
        """The draft model's own prefill of the same chunk (tokens from the history)."""
        mine = state.drafter
        c = hidden.shape[0]
        tokens = jnp.take(state.tokens, start + jnp.arange(c, dtype=jnp.int32), mode="fill", fill_value=0)
        _, cache = family_module(self.cfg).prefill_chunk(own, self.cfg, tokens, mine["cache"], start, n_valid)
        saved = _save(mine["saved"], cache, 0, jnp.zeros((), jnp.int32))  # the committed state: slot 0
        return dict(mine, cache=cache, base=start + n_valid, saved=saved)

    def propose(self, params, cfg: ModelConfig, state: DecodeState, k: int, choose=None, own=None):
        """Catch up on the unprocessed tokens (1 or 2), then draft k tokens; see the module docstring."""
        choose = choose or greedy_choice
        mine = state.drafter
        family = family_module(self.cfg)
        pending = state.position  # the target's pending token sits here
        base, last = mine["base"], mine["drafts"]
        index = jnp.arange(k - 1, dtype=jnp.int32)
        kept = jnp.where(base + index < pending, jnp.take(state.tokens, base + index), -2) == last[: k - 1]
        m = jnp.sum(jnp.cumprod(kept.astype(jnp.int32)))  # speculative rows of last round that were accepted
        first = base + m  # the first row to (re)process
        count = pending - first + 1  # 1, or 2 when every draft was accepted
        cache = _restore(mine["cache"], mine["saved"], m)
        rows = jnp.zeros((ROW_TILE,), jnp.int32).at[:2].set(jnp.take(state.tokens, first + jnp.arange(2), mode="clip"))
        hidden, cache = family.step(own, self.cfg, rows, cache, first, jnp.zeros((), jnp.int32), 2)
        row = jax.lax.dynamic_index_in_dim(hidden, count - 1, keepdims=False)
        d0 = choose(self._logits(own, cfg, row), pending + 1)
        saved = _save(mine["saved"], cache, 0, count - 1)  # the state after the real rows

        def speculate(carry, i):
            cache, slot, token, saved = carry
            tile = jnp.zeros((ROW_TILE,), jnp.int32).at[0].set(token)
            hidden, cache = family.step(own, self.cfg, tile, cache, pending + i, slot, 1)
            token = choose(self._logits(own, cfg, hidden[0]), pending + 1 + i)
            return (cache, jnp.zeros((), jnp.int32), token, _save(saved, cache, i, jnp.zeros((), jnp.int32))), token

        steps = jnp.arange(1, k, dtype=jnp.int32)
        (cache, _, _, saved), rest = jax.lax.scan(speculate, (cache, count - 1, d0, saved), steps)
        draft = jnp.concatenate([d0[None], rest])
        drafts = mine["drafts"].at[:k].set(draft)
        return dict(cache=cache, base=pending + 1, drafts=drafts, saved=saved), draft, jnp.asarray(k, jnp.int32)

    # ------------------------------------------------------------------------------------------------ helpers
    def _logits(self, own, cfg: ModelConfig, row: jax.Array) -> jax.Array:
        """The draft's float32 logits [V_target] for one final-normed hidden row (padding rows cut or -inf)."""
        z = logits_from_hidden(own, self.cfg, row[None])[0]
        if z.shape[0] >= cfg.vocab_size:
            return z[: cfg.vocab_size]
        return jnp.pad(z, (0, cfg.vocab_size - z.shape[0]), constant_values=-jnp.inf)


def _save(saved: tuple, cache: tuple, index, slot) -> tuple:
    """saved with entry `index` set to each recurrent layer's `candidate_state` at `slot`."""
    layers = [layer for layer in cache if isinstance(layer, dict)]
    return tuple(
        jax.tree.map(lambda kept, now: kept.at[index].set(now), store, candidate_state(layer, slot))
        for store, layer in zip(saved, layers, strict=True)
    )


def _restore(cache: tuple, saved: tuple, index) -> tuple:
    """cache with each recurrent layer's candidate slot 0 set to its saved state `index` (slot 0 is where the next
    step starts)."""
    stores = iter(saved)
    out = []
    for layer in cache:
        if isinstance(layer, dict):
            store = next(stores)
            layer = with_committed_state(layer, jax.tree.map(lambda kept: kept[index], store))
        out.append(layer)
    return tuple(out)
