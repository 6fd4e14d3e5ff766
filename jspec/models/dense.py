"""Dense decoder families: qwen2 (qkv bias), llama (llama3 rope scaling), glm4 (partial interleaved rotary,
post-attention and post-MLP norms). One layer function serves the three ways a model runs (`layers.Run`): the full
forward, a prefill chunk and a row-tile step; `forward`, `prefill_chunk` and `step` are the family's entry points.

Params (a plain dict pytree; every linear weight is dense [K, N] or an int4 `Int4Weight`):
  embed [V, H]; final_norm [H]; lm_head [H, V] (absent when tied and not quantized)
  layers[i]: input_norm [H], qkv [H, (Hq + 2 Hkv) D], qkv_bias, o [Hq D, H], o_bias, post_attn_norm [H],
             gate_up [H, 2I] ([gate | up]), gate_up_bias, down [I, H], down_bias,
             glm4 only: post_self_attn_norm [H], post_mlp_norm [H]
Cache: one kv array per layer, [S, Hkv, 2, D] in the activation dtype (keys at [:, :, 0], values at [:, :, 1]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models.layers import (
    FORWARD,
    PREFILL,
    Run,
    apply_rope,
    embed_tokens,
    rms_norm,
    row_parallel_linear,
    swiglu_mlp,
)
from pallas_kernels import attention, chunk_attention, linear


def kv_cache(cfg: ModelConfig, length: int, dtype) -> jax.Array:
    """An empty attention cache of `length` positions: [length, Hkv, 2, D] (keys, values) in dtype."""
    return jnp.zeros((length, cfg.num_kv_heads, 2, cfg.head_dim), dtype)


def init_cache(cfg: ModelConfig, length: int, dtype) -> tuple:
    return tuple(kv_cache(cfg, length, dtype) for _ in range(cfg.num_layers))


def _project_qkv(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, live_rows: int | None):
    t = x.shape[0]
    qkv = linear(x, p["qkv"], p.get("qkv_bias"), live_rows=live_rows)
    q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    q = apply_rope(q.reshape(t, cfg.num_heads, cfg.head_dim), positions, cfg)
    k = apply_rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), positions, cfg)
    return q, k, v.reshape(t, cfg.num_kv_heads, cfg.head_dim)


def attend(p: dict, cfg: ModelConfig, h: jax.Array, positions: jax.Array, cache, run: Run):
    """Attention sub-block on normed h [T, H] at `positions` -> ([T, Hq*D], cache); how it meets the cache: `run`."""
    q, k, v = _project_qkv(p, cfg, h, positions, run.live_rows)
    out, cache = cached_attention(cfg, q, k, v, cache, run)
    return out.reshape(h.shape[0], cfg.q_size), cache


def cached_attention(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, cache, run: Run):
    """q [T, Hq, D], k/v [T, Hkv, D] (rotated) -> ([T, Hq, D], cache).

    forward: flash attention over the fresh keys (no cache). prefill: write the chunk's rows start..start+T-1
    (rows past the cache are dropped), then flash attention over the cache. step: write the row tile's rows, then
    the row-exact decode / verify kernel, whose first `run.rows` rows attend.
    """
    scale = cfg.head_dim**-0.5
    fresh = jnp.stack([k, v], axis=2)
    if run.kind == FORWARD:
        return chunk_attention(q, fresh, 0, scale=scale), None
    if run.kind == PREFILL:
        cache = write_rows(cache, fresh, run.start)
        return chunk_attention(q, cache, run.start, scale=scale), cache
    cache = jax.lax.dynamic_update_slice(cache, fresh.astype(cache.dtype), (run.start, 0, 0, 0))
    return attention(q, cache, run.start, scale=scale, rows=run.rows, one_split=run.one_split), cache


def write_rows(cache: jax.Array, rows: jax.Array, start) -> jax.Array:
    """cache [S, ...] with rows [T, ...] written at start..start+T-1; rows that fall past S are dropped (a
    dynamic_update_slice would move the whole write back instead)."""
    index = start + jnp.arange(rows.shape[0], dtype=jnp.int32)
    return cache.at[index].set(rows.astype(cache.dtype), mode="drop", indices_are_sorted=True, unique_indices=True)


def layer(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, cache, run: Run):
    """One decoder layer on the residual stream x [T, H] (see `cached_attention` for cache and run)."""
    h, cache = attend(p, cfg, rms_norm(x, p["input_norm"], cfg.rms_norm_eps), positions, cache, run)
    out = row_parallel_linear(h, p["o"], p.get("o_bias"), cfg, run.live_rows)
    if cfg.post_norms:
        out = rms_norm(out, p["post_self_attn_norm"], cfg.rms_norm_eps)
    return mlp_half(p, cfg, x, out, run.live_rows), cache


def mlp_half(p: dict, cfg: ModelConfig, x: jax.Array, out: jax.Array, live_rows: int | None = None) -> jax.Array:
    """The second half of `layer`: the residual stream x [T, H] plus the attention sub-block's out [T, H], then
    RMSNorm, the SwiGLU MLP and the second residual add -> x [T, H]. live_rows: `Run.live_rows`."""
    x = x + out
    h = swiglu_mlp(p, rms_norm(x, p["post_attn_norm"], cfg.rms_norm_eps), cfg, live_rows)
    if cfg.post_norms:
        h = rms_norm(h, p["post_mlp_norm"], cfg.rms_norm_eps)
    return x + h


attention_layer = layer  # the family's attention decoder layer (used by the MTP head, jspec.models.mtp)


def _layers(params: dict, cfg: ModelConfig, tokens: jax.Array, cache, run: Run):
    """Embed tokens [T] at run.positions(T), every layer, final norm -> (hidden [T, H], cache)."""
    positions = run.positions(tokens.shape[0])
    x = embed_tokens(params, cfg, tokens)
    new_cache = []
    for i, p in enumerate(params["layers"]):
        x, layer_cache = layer(p, cfg, x, positions, None if cache is None else cache[i], run)
        new_cache.append(layer_cache)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return x, None if cache is None else tuple(new_cache)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Full causal forward of tokens [T] at positions 0..T-1, no cache -> final-normed hidden [T, H]."""
    return _layers(params, cfg, tokens, None, Run.forward())[0]


def prefill_chunk(params: dict, cfg: ModelConfig, tokens: jax.Array, cache, start, n_valid):
    """One prompt chunk tokens [C] at positions start..start+C-1 -> (hidden [C, H], cache). Its rows from n_valid
    on are padding: they write only cache rows past the prompt, which decode overwrites before any query reads."""
    del n_valid
    return _layers(params, cfg, tokens, cache, Run.prefill(start))


def step(params: dict, cfg: ModelConfig, tokens: jax.Array, cache, start, slot, rows: int, one_split: bool = False):
    """One row tile tokens [ROW_TILE] at positions start.. (`rows` valid, static) -> (hidden [ROW_TILE, H], cache).
    slot (the committed recurrent candidate) matters to recurrent families only; one_split: `Run.step`'s."""
    del slot
    return _layers(params, cfg, tokens, cache, Run.step(start, rows, one_split=one_split))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.05) -> dict:
    """Random params in the layout above (tests and benchmarks; real weights come from `checkpoints`)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv_n = cfg.q_size + 2 * cfg.kv_size
    keys = iter(jax.random.split(key, 16 * cfg.num_layers + 4))

    def rand(*shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm():
        return (1.0 + rand(h).astype(jnp.float32)).astype(dtype)

    layers = []
    for _ in range(cfg.num_layers):
        p = dict(input_norm=norm(), qkv=rand(h, qkv_n), o=rand(cfg.q_size, h), post_attn_norm=norm())
        p.update(gate_up=rand(h, 2 * inter), down=rand(inter, h))
        if cfg.attention_bias:
            p["qkv_bias"] = rand(qkv_n)
        if cfg.o_bias:
            p["o_bias"] = rand(h)
        if cfg.mlp_bias:
            p.update(gate_up_bias=rand(2 * inter), down_bias=rand(h))
        if cfg.post_norms:
            p.update(post_self_attn_norm=norm(), post_mlp_norm=norm())
        layers.append(p)
    params = dict(embed=rand(cfg.vocab_size, h) * 20, layers=layers, final_norm=norm())
    if not cfg.tie_word_embeddings:
        params["lm_head"] = rand(h, cfg.vocab_size)
    return params
