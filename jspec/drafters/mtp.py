"""MTPDrafter: drafts with the checkpoint's own multi-token-prediction head(s) (jspec/models/mtp.py).

Semantics (DeepSeek-V3 report 2.2, per MTP layer i = 0..L-1): layer i at true position t takes h_i[t] (h_0 = the
main model's final-normed hidden, h_{i+1} = layer i's chain hidden) and the token at t + i + 1, and predicts the
token at t + i + 2. Each layer keeps its own KV cache (in DecodeState.drafter) at true positions.

After every commit (last committed position p, newly committed positions q..p = rows 0..slot of state.hidden):
  layer 0 runs one row tile over q..p (tokens q+1..p+1 are all known: p+1 is the pending token) -> draft[0] from
  its last row; layer i >= 1 runs one row tile over q-i..p: rows up to p-i are real (their tokens are committed),
  the last i rows use the drafts d_0..d_{i-1} as tokens (speculative, overwritten as real rows next round) ->
  draft[i] from its last row. Layer i's hidden for position q-i comes from the previous round (`carry`).
  Drafts k > L chain the last layer one position further each step, fed its own chain hidden and its own draft
  (as vLLM's MTP proposer); those KV rows are speculative too and are overwritten before any real row reads them.
Every call is a ROW_TILE-row step (padded) through the family's attention layer, so it runs on the row-tile
kernels; a chain step has one real row, and only it attends (the attention kernel skips the others' work). The
drafts never affect the output tokens: verify accepts only what greedy would produce.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import checks
from jspec.accept import greedy_choice
from jspec.config import ModelConfig
from jspec.models.dense import kv_cache
from jspec.models.layers import Run
from jspec.models.layers import logits as logits_from_hidden
from jspec.models.mtp import init_mtp_params, mtp_layer
from jspec.state import DecodeState, physical_length
from pallas_kernels import ROW_TILE, Int4Weight, linear


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
    """Propose k tokens (k=None: the engine's k) with the model's MTP head; needs params["mtp"].

    coupled (default True): when sampling, draft each position with the target's own position-keyed choice on the
    head's logits (docs/design.md rule 8), so a draft equals the sample whenever the head's distribution is close;
    False: draft the head's argmax whatever the sampler (for comparison). Greedy decoding drafts the argmax either way.

    `MTPDrafter.over(params, token_ids)` drafts from those tokens only: each draft reads the lm_head of those tokens
    instead of the whole vocabulary's (a draft's largest product at a large vocabulary; FR-Spec, arXiv:2502.14856).
    The output stays the target's: verify checks every draft against the whole vocabulary.
    """

    k: int | None = None
    coupled: bool = True
    # {"lm_head": the head's rows of those tokens (a linear weight [H, N]), "ids": int32 [N]}: a runtime argument
    # of the executables (`own`), never part of the drafter's hash; None: the whole vocabulary.
    weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    vocab: int | None = dataclasses.field(default=None, init=False)  # N: the drafted tokens (shapes the executables)

    def __post_init__(self):
        if self.k is not None:
            checks.integer(self.k, "MTPDrafter k", lo=1, hi=ROW_TILE - 1)
        checks.instance(self.coupled, bool, "MTPDrafter coupled", "True or False", optional=False)
        if self.weights is not None:
            if not isinstance(self.weights, dict) or set(self.weights) != {"lm_head", "ids"}:
                raise ValueError("MTPDrafter weights must come from MTPDrafter.over(params, token_ids)")
            object.__setattr__(self, "vocab", int(self.weights["ids"].shape[0]))

    @classmethod
    def over(cls, params: dict, token_ids, k: int | None = None, coupled: bool = True) -> MTPDrafter:
        """An MTPDrafter drafting from token_ids only (distinct ids of the model's vocabulary; e.g. the most frequent
        in your text: `np.argsort(-np.bincount(corpus_ids, minlength=vocab_size))[:n]`). params: the model's
        weights, unsharded (the lm_head's rows of those tokens are copied; on a mesh every device holds the copy)."""
        head = params.get("lm_head")
        table = params["embed"] if head is None else head  # tied: the embedding's rows are the head's
        if (table.packed if isinstance(table, Int4Weight) else table).ndim != 2:  # stacked on a mesh: 3
            raise ValueError("MTPDrafter.over needs the model's unsharded params (build it before sharding them)")
        vocab_size = table.shape[0] if head is None else table.shape[1]
        ids = checks.token_ids(token_ids, "MTPDrafter.over token_ids", vocab_size)
        if np.unique(ids).size != ids.size:
            raise ValueError("MTPDrafter.over: token_ids repeat an id; give each token once")
        ids = jnp.asarray(ids)
        return cls(k, coupled, dict(lm_head=_head_rows(params, ids), ids=ids))

    def init(self, params: dict, cfg: ModelConfig, state: DecodeState, own=None):
        """Empty KV caches, one per MTP layer, and the carry [layers - 1, H]."""
        num_layers = _num_layers(params, cfg)
        # Chain steps write a row tile at up to position max_len - 1 + (ROW_TILE - 2): room for that tile too.
        length_rows = physical_length(state.max_len + ROW_TILE)
        caches = tuple(kv_cache(cfg, length_rows, state.hidden.dtype) for _ in range(num_layers))
        return dict(cache=caches, carry=jnp.zeros((num_layers - 1, cfg.hidden_size), state.hidden.dtype))

    def prefill(self, params: dict, cfg: ModelConfig, state: DecodeState, hidden, start, n_valid, length, own=None):
        """Fill every MTP layer's KV cache over one prompt chunk (hidden [C, H] at positions start..start+C-1).

        Layer i's row t takes the token at t + i + 1 from the prompt; rows whose token lies past the prompt
        (t >= length - 1 - i) get padding, and the first `propose` recomputes exactly those rows. The carry keeps
        layer i's chain hidden at position length - 2 - i (layer i + 1's first row) when this chunk holds it.
        """
        c = hidden.shape[0]
        run = Run.prefill(start, n_valid)
        caches, carry = list(state.drafter["cache"]), state.drafter["carry"]
        for i in range(len(caches)):
            index = start + i + 1 + jnp.arange(c, dtype=jnp.int32)
            tokens = jnp.take(state.tokens, index, mode="fill", fill_value=0)
            hidden, _, caches[i] = mtp_layer(params, cfg, hidden, tokens, caches[i], run, i)
            if i + 1 < len(caches):
                at = jnp.maximum(length - 2 - i, 0) - start
                held = (at >= 0) & (at < n_valid)
                row = jax.lax.dynamic_index_in_dim(hidden, jnp.clip(at, 0, c - 1), keepdims=False)
                carry = carry.at[i].set(jnp.where(held, row, carry[i]))
        return dict(cache=tuple(caches), carry=carry)

    def propose(self, params: dict, cfg: ModelConfig, state: DecodeState, k: int, choose=None, own=None):
        """(drafter state, draft int32 [k], k): draft[i] = choose(MTP logits, its position state.position + 1 + i)
        (choose None: the argmax; the loop passes the sampler's choice for coupled drafting)."""
        choose = choose if choose is not None and self.coupled else greedy_choice
        num_layers = min(k, _num_layers(params, cfg))  # layers past k are never used
        if k + num_layers > ROW_TILE:
            raise ValueError(
                f"MTPDrafter: k={k} with {num_layers} MTP layers needs k + layers <= {ROW_TILE} rows per tile"
            )
        p = state.position - 1  # last committed position
        n = state.slot + 1  # newly committed positions q..p
        q = p - state.slot
        known = jax.lax.dynamic_slice_in_dim(state.tokens, q + 1, ROW_TILE)  # tokens q+1 .. (p+1 pending)
        caches, carry = list(state.drafter["cache"]), []
        drafts = []
        hidden = state.hidden  # row r <-> position q + r
        for i in range(num_layers):
            # Rows in "unrolled" layout: row r <-> true position q - i + r; rows n+i.. are padding.
            if i:
                carry.append(hidden[n - 1])  # layer i-1 at position p - i + 1: layer i's first row next round
                hidden = jnp.concatenate([state.drafter["carry"][i - 1][None], hidden[:-1]])
            tokens = known
            for j, d in enumerate(drafts):
                tokens = tokens.at[n + j].set(d)
            # Short prompt (q < i): rows at negative positions are rolled out of the tile (never for layer 0).
            shift = jnp.maximum(i - q, 0) if i else 0
            start = q - i + shift
            chain, normed, caches[i] = mtp_layer(
                params,
                cfg,
                jnp.roll(hidden, -shift, axis=0),
                jnp.roll(tokens, -shift),
                caches[i],
                Run.step(start, ROW_TILE),
                i,
            )
            hidden = jnp.roll(chain, shift, axis=0)
            row = jnp.roll(normed, shift, axis=0)[n - 1 + i]
            drafts.append(choose(_draft_logits(params, cfg, row, own), p + 2 + i))
        last = hidden[n - 1 + num_layers - 1]  # the last layer's chain hidden at position p

        def chain_step(carry_state, offset):
            cache, h, d = carry_state
            rows_h = jnp.zeros((ROW_TILE, h.shape[-1]), h.dtype).at[0].set(h)
            rows_t = jnp.zeros((ROW_TILE,), jnp.int32).at[0].set(d)
            # one real row: only it attends (a row's bits do not depend on the others, docs/design.md rule 2)
            run = Run.step(p + offset, rows=1)
            chain, normed, cache = mtp_layer(params, cfg, rows_h, rows_t, cache, run, num_layers - 1)
            d = choose(_draft_logits(params, cfg, normed[0], own), p + 1 + num_layers + offset)
            return (cache, chain[0], d), d

        draft = jnp.stack(drafts)
        if k > num_layers:
            last_layer = num_layers - 1
            (caches[last_layer], _, _), more = jax.lax.scan(
                chain_step, (caches[last_layer], last, drafts[-1]), jnp.arange(1, k - num_layers + 1, dtype=jnp.int32)
            )
            draft = jnp.concatenate([draft, more])
        if carry:
            carry = state.drafter["carry"].at[: len(carry)].set(jnp.stack(carry))
        else:
            carry = state.drafter["carry"]
        return dict(cache=tuple(caches), carry=carry), draft, jnp.asarray(k, jnp.int32)


def prompt_first(prompt_ids, ranked_ids, n: int) -> np.ndarray:
    """n distinct token ids for `MTPDrafter.over`: the prompt's own tokens (the most repeated first), then the
    highest-ranked others. ranked_ids: token ids by falling frequency in text like yours. Edits copy the prompt's
    rare identifiers, which a frequency ranking misses: on the demo-hybrid's edit prompts, 512 of its 8192 tokens
    chosen this way kept the whole vocabulary's acceptance, the 512 most frequent alone about half of it
    (benchmarks/experiments/results/mtp_vocab_prompt_cpu.json). Every request gets the same n, so the same
    executables."""
    n = checks.integer(n, "prompt_first n", lo=1)
    tokens, counts = np.unique(np.asarray(prompt_ids, np.int64), return_counts=True)
    own = tokens[np.argsort(-counts, kind="stable")][:n]
    ranked = np.asarray(ranked_ids, np.int64)
    ids = np.concatenate([own, ranked[~np.isin(ranked, own)][: n - own.size]])
    if ids.size < n or np.unique(ids).size != n:
        raise ValueError(f"prompt_first: the prompt and ranked_ids give {np.unique(ids).size} distinct tokens, not {n}")
    return ids


def _head_rows(params: dict, ids: jax.Array):
    """The lm_head's columns of the tokens ids [N] as a linear weight [H, N] (the tied embedding's rows, transposed)."""
    head = params.get("lm_head")
    if head is None:
        return jnp.take(params["embed"], ids, axis=0).T
    if isinstance(head, Int4Weight):  # native layout: one row of codes and scales per output column
        zeros = None if head.zeros is None else jnp.take(head.zeros, ids, axis=0)
        return Int4Weight(jnp.take(head.packed, ids, axis=0), jnp.take(head.scales, ids, axis=0), zeros)
    return jnp.take(head, ids, axis=1)


def _draft_logits(params: dict, cfg: ModelConfig, row: jax.Array, own) -> jax.Array:
    """float32 [V] logits the draft is chosen from, for one final-normed hidden row [H]: the lm_head's, or (a
    drafter `over` some tokens) those tokens' logits and -inf elsewhere, so the argmax and the sampler's choice
    (the same function as the target's) can only pick them."""
    if own is None:
        return logits_from_hidden(params, cfg, row[None])[0]
    part = linear(row[None], own["lm_head"], out_dtype=jnp.float32)[0]
    return jnp.full((cfg.vocab_size,), -jnp.inf, jnp.float32).at[own["ids"]].set(part)


def _num_layers(params: dict, cfg: ModelConfig) -> int:
    """The MTP layers of params["mtp"], each checked against the layout `init_mtp_params` gives the config (every
    tensor present, each of its logical shape); raises naming the first tensor that is missing, extra or mis-shaped."""
    num_layers = len(params.get("mtp") or [])
    if num_layers == 0 or cfg.num_mtp_layers != num_layers:
        raise ValueError(
            f"MTPDrafter needs the model's MTP head: cfg.num_mtp_layers={cfg.num_mtp_layers}, params carry "
            f"{num_layers} MTP layer(s) (params['mtp']); load a checkpoint with MTP weights"
        )
    want = jax.eval_shape(lambda: init_mtp_params(cfg, jax.random.PRNGKey(0), num_layers=num_layers))
    for i, (have, expected) in enumerate(zip(params["mtp"], want, strict=True)):
        _check_tree(have, expected, f"params['mtp'][{i}]")
    return num_layers


def _check_tree(have, want, path: str) -> None:
    """have: a params subtree (dicts of arrays or int4 weights); want: its expected shapes (eval_shape)."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            raise ValueError(f"MTPDrafter: {path} must be a dict of tensors, got {type(have).__name__}")
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            what = f"{path}[{(missing or extra)[0]!r}]"
            raise ValueError(f"MTPDrafter: {what} is {'missing' if missing else 'not a tensor of an MTP layer'}")
        for key in want:
            _check_tree(have[key], want[key], f"{path}[{key!r}]")
        return
    shape = tuple(getattr(have, "shape", ()))  # an array, or an int4 weight's logical [K, N]
    if shape != tuple(want.shape):
        raise ValueError(f"MTPDrafter: {path} has shape {shape}, the config's MTP layer needs {tuple(want.shape)}")
