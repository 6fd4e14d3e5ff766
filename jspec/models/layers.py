"""Building blocks shared by the model families: how a pass meets the cache (`Run`), RMSNorm, rotary embedding,
SwiGLU, logits, and the embedding and row-parallel products that meet the other shards of a tensor-parallel model
(cfg.tensor_parallel > 1, inside `jax.shard_map` over the mesh axis TP_AXIS: jspec.tensor_parallel)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import TP_AXIS, ModelConfig, RopeConfig
from pallas_kernels import linear

FORWARD, PREFILL, STEP = "forward", "prefill", "step"


@dataclasses.dataclass(frozen=True)
class Run:
    """How one pass of a model meets its cache (built inside a traced function; kind and rows are static).

    forward: the full causal forward, no cache, positions 0..T-1.
    prefill: a prompt chunk at positions start..start+T-1 whose first n_valid rows are real (the rest padding):
      it writes its cache rows and attends the cache with the flash path; recurrent layers continue from the
      committed state and leave theirs after row n_valid - 1.
    step: a row tile (T = ROW_TILE) at start whose first `rows` rows are valid, through the row-exact kernels;
      recurrent layers advance from candidate `slot` (docs/design.md, rules 1-3); one_split (static): the attention
      reads the whole cache as one split (`pallas_kernels.attention`; a large batch's partition, `jspec.batch`).
    """

    kind: str
    start: Any = 0
    n_valid: Any = None
    slot: Any = None
    rows: int | None = None
    one_split: bool = False

    @classmethod
    def forward(cls) -> Run:
        return cls(FORWARD)

    @classmethod
    def prefill(cls, start, n_valid=None) -> Run:
        return cls(PREFILL, start=start, n_valid=n_valid)

    @classmethod
    def step(cls, start, rows: int, slot=None, one_split: bool = False) -> Run:
        return cls(STEP, start=start, slot=slot, rows=rows, one_split=one_split)

    @property
    def live_rows(self) -> int | None:
        """The rows whose products a pass reads (`pallas_kernels.linear`'s live_rows): a step's valid rows; None
        (every row) for the forward and a prefill chunk."""
        return self.rows if self.kind == STEP else None

    def positions(self, t: int) -> jax.Array:
        """int32 [t]: the absolute positions of the pass's t rows."""
        return self.start + jnp.arange(t, dtype=jnp.int32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, plus_one: bool = False) -> jax.Array:
    """x [..., H] -> same shape/dtype. Statistics in float32 (as HuggingFace).

    plus_one=False: weight * normalize(x).astype(x.dtype)         (Llama / Qwen2 / GLM-4)
    plus_one=True:  (normalize(x) * (1 + weight)).astype(x.dtype)  (Qwen3-Next / Qwen3.5), in float32
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def inv_frequencies(rope: RopeConfig, rotary_dim: int) -> np.ndarray:
    """float32 [rotary_dim // 2] inverse frequencies, llama3 scaling applied when configured."""
    inv = 1.0 / (rope.theta ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim))
    inv = inv.astype(np.float32)
    if rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.scaling_factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.scaling_factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotate x [T, heads, head_dim] at integer positions [T]; the first cfg.rotary_dim dims rotate.

    cos/sin are computed in float32 and cast to x.dtype, then x*cos + rotate(x)*sin in x.dtype (as HuggingFace).
    Half layout pairs (i, i + d/2); interleaved layout (GLM-4) pairs (2i, 2i + 1).
    """
    rot = cfg.rotary_dim
    inv = jnp.asarray(inv_frequencies(cfg.rope, rot))
    angles = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [T, rot/2]
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if cfg.rope.interleaved:
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x_rot.shape)
    else:
        half = rot // 2
        first, second = x_rot[..., :half], x_rot[..., half:]
        rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return jnp.concatenate([rotated, x_pass], axis=-1) if rot < x.shape[-1] else rotated


def swiglu_mlp(p: dict, x: jax.Array, cfg: ModelConfig, live_rows: int | None = None) -> jax.Array:
    """down(silu(gate(x)) * up(x)) with the fused gate_up weight [H, 2I] ([gate | up] along N); live_rows:
    `Run.live_rows`."""
    gate_up = linear(x, p["gate_up"], p.get("gate_up_bias"), live_rows=live_rows)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return row_parallel_linear(jax.nn.silu(gate) * up, p["down"], p.get("down_bias"), cfg, live_rows)


def row_parallel_linear(
    x: jax.Array, w, bias: jax.Array | None, cfg: ModelConfig, live_rows: int | None = None
) -> jax.Array:
    """`linear` of a row-parallel weight (o, down, Gated DeltaNet's out) -> [M, N] in x.dtype. Tensor parallel: x
    [M, K / n] @ the shard's K rows, the float32 partial products summed over the shards (one all-reduce, on the
    same row-tile shape in decode and verify), then the bias added in float32 and one cast, as `linear` does.
    live_rows: `Run.live_rows`."""
    if cfg.tensor_parallel == 1:
        return linear(x, w, bias, live_rows=live_rows)
    y = jax.lax.psum(linear(x, w, out_dtype=jnp.float32, live_rows=live_rows), TP_AXIS)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def embed_tokens(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens int32 [T] -> their embedding rows [T, H]. Tensor parallel: each shard holds vocab_size / n rows of
    the table; the shard holding a token gives its row, the others -0.0 (x + -0.0 == x bit for bit, also for
    x = +-0), summed by one all-reduce: the very rows of the whole table."""
    table = params["embed"]
    if cfg.tensor_parallel == 1:
        return table[tokens]
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(TP_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    found = table[jnp.clip(local, 0, rows - 1)]
    return jax.lax.psum(jnp.where(mine[:, None], found, jnp.asarray(-0.0, table.dtype)), TP_AXIS)


def logits(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden x [T, H] -> float32 logits [T, vocab] (lm_head, or the tied embedding). Tensor parallel:
    each shard's [T, vocab / n] columns, gathered in shard order into the whole row (data movement, no arithmetic),
    so the argmax and the sampler see global vocabulary indices."""
    head = params.get("lm_head")
    out = linear(x, params["embed"].T if head is None else head, out_dtype=jnp.float32)
    return out if cfg.tensor_parallel == 1 else jax.lax.all_gather(out, TP_AXIS, axis=1, tiled=True)
