"""Hybrid Gated-DeltaNet families: qwen3_next (dense configs) and qwen3_5 (text). Layers follow cfg.layer_types:
"linear_attention" (Gated DeltaNet) or "full_attention" (gated attention); each is followed by a SwiGLU MLP. Every
RMSNorm is (1 + w) except the gated norm inside Gated DeltaNet (plain w).

Params (a plain dict pytree; every linear weight is dense [K, N] or an int4 `Int4Weight`):
  embed [V, H]; final_norm [H]; lm_head [H, V] (absent when tied and not quantized)
  every layer: input_norm [H], post_attn_norm [H], gate_up [H, 2I] ([gate | up]), down [I, H]
  full attention: qkv [H, 2 Hq D + 2 Hkv D] = [q_proj | k_proj | v_proj] with q_proj's per-head layout kept
             (head h: query in columns 2hD..2hD+D-1, output gate in the next D), qkv_bias, q_norm [D], k_norm [D],
             o [Hq D, H], o_bias
  Gated DeltaNet: in_proj [H, 2 Kd + 2 Vd + 2 nv] = [q | k | v | z | b | a] (Kd = nk dk, Vd = nv dv; q/k/v are
             the conv channels), conv [W, 2 Kd + Vd] (tap W-1 = current input), A_log [nv], dt_bias [nv]
             (float32 from an import, the bundled demo-hybrid's bf16; `gdn_gates` computes in float32 either way),
             gdn_norm [dv], out [Vd, H]
Cache, one entry per layer: full attention kv [S, Hkv, 2, D] (keys, values) in the activation dtype; Gated DeltaNet
  {"conv": [R + W-2, 2 Kd + Vd] activation dtype, "ssm": float32 [R, nv, dk, dv]} with R = ROW_TILE candidate slots:
  slot `state.slot` holds the committed state (its conv window: conv rows slot .. slot + W-2); a row-tile step
  advances `rows` positions from it and leaves the post-state after row i in slot i (conv: the window ++ the tile's
  inputs, less the first row), so `commit` rolls back by selecting; each prefill chunk continues from slot 0 and
  leaves its final state there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models.dense import cached_attention, kv_cache
from jspec.models.layers import (
    FORWARD,
    PREFILL,
    STEP,
    Run,
    apply_rope,
    embed_tokens,
    rms_norm,
    row_parallel_linear,
    swiglu_mlp,
)
from pallas_kernels import ROW_TILE, linear
from pallas_kernels.recurrent import (
    causal_conv,
    chunk_gated_delta,
    conv_window,
    gdn_columns,
    gdn_gates,
    gdn_query_key,
    gdn_rows,
    stored_values,
)

FULL, LINEAR = "full_attention", "linear_attention"


def _norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, plus_one=True)


def _dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(Kd, Vd, conv channels) of a Gated DeltaNet layer."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


def _mlp_block(p: dict, cfg: ModelConfig, x: jax.Array, live_rows: int | None) -> jax.Array:
    return x + swiglu_mlp(p, _norm(x, p["post_attn_norm"], cfg), cfg, live_rows)


def init_cache(cfg: ModelConfig, length: int, dtype) -> tuple:
    _, _, conv_dim = _dims(cfg)
    ssm_shape = (ROW_TILE, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return tuple(
        kv_cache(cfg, length, dtype)
        if kind == FULL
        else dict(
            conv=jnp.zeros((ROW_TILE + cfg.linear_conv_kernel_dim - 2, conv_dim), dtype),
            ssm=jnp.zeros(ssm_shape, jnp.float32),
        )
        for kind in cfg.layer_types
    )


def candidate_state(layer: dict, slot) -> dict:
    """A Gated DeltaNet layer's cache (`init_cache`) at candidate `slot` (int or int32 []): {"conv": its window
    [W-1, C], "ssm": float32 [nv, dk, dv]}."""
    width = layer["conv"].shape[0] - layer["ssm"].shape[0] + 2
    return dict(conv=conv_window(layer["conv"], slot, width), ssm=layer["ssm"][slot])


def with_committed_state(layer: dict, state: dict) -> dict:
    """The layer's cache with candidate slot 0, where the next step starts, set to `state` (a `candidate_state`)."""
    conv = jax.lax.dynamic_update_slice_in_dim(layer["conv"], state["conv"], 0, axis=0)
    return dict(conv=conv, ssm=layer["ssm"].at[0].set(state["ssm"]))


def attention_layer(p: dict, cfg: ModelConfig, x: jax.Array, positions: jax.Array, cache, run: Run):
    """Gated-attention decoder layer (+ MLP) on the residual stream x [T, H] -> (x, cache); cache and run as in
    `jspec.models.dense.cached_attention`."""
    t, hq, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = linear(_norm(x, p["input_norm"], cfg), p["qkv"], p.get("qkv_bias"), live_rows=run.live_rows)
    q_gate, k, v = jnp.split(qkv, [2 * cfg.q_size, 2 * cfg.q_size + cfg.kv_size], axis=-1)
    q, gate = jnp.split(q_gate.reshape(t, hq, 2 * d), 2, axis=-1)
    q = apply_rope(_norm(q, p["q_norm"], cfg), positions, cfg)
    k = apply_rope(_norm(k.reshape(t, hkv, d), p["k_norm"], cfg), positions, cfg)
    out, cache = cached_attention(cfg, q, k, v.reshape(t, hkv, d), cache, run)
    out = out.reshape(t, cfg.q_size) * jax.nn.sigmoid(gate.reshape(t, cfg.q_size))
    out = row_parallel_linear(out, p["o"], p.get("o_bias"), cfg, run.live_rows)
    return _mlp_block(p, cfg, x + out, run.live_rows), cache


def _gated_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w * normalize(x) gated by silu(z), per head: x, z [..., dv] in the activation dtype (as transformers)."""
    return (rms_norm(x, weight, eps).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def gated_deltanet(p: dict, cfg: ModelConfig, h: jax.Array, cache, run: Run):
    """Gated DeltaNet token mixer on normed h [T, H] -> ([T, H], cache).

    forward: from a zero state, no cache. prefill: from the committed state (candidate slot 0; zero before the
    first chunk), the rows from run.n_valid on masked (g = 0, beta = 0 leave the state alone), the state after the
    last real row left in slot 0. step: `gdn_rows` from candidate run.slot, every post-state kept.
    """
    t, dtype = h.shape[0], h.dtype
    nk, nv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    _, value_dim, conv_dim = _dims(cfg)
    width = cfg.linear_conv_kernel_dim
    proj = linear(h, p["in_proj"], live_rows=run.live_rows)  # [T, conv_dim + value_dim + 2 nv]: mixed | z | b | a
    mixed, z, b, a = jnp.split(proj, [conv_dim, conv_dim + value_dim, conv_dim + value_dim + nv], -1)
    if run.kind == FORWARD:
        window, state = jnp.zeros((width - 1, conv_dim), dtype), None
    elif run.kind == PREFILL:
        window, state = conv_window(cache["conv"], 0, width), cache["ssm"][0]
    else:
        window, state = conv_window(cache["conv"], run.slot, width), None
    conv, seq = causal_conv(window, mixed, p["conv"])
    conv = stored_values(conv, dtype)
    if run.kind == STEP:
        f32 = jnp.float32
        # the conv's outputs, the gates and the conv's inputs as the cache keeps them: the kernel writes the cache
        inputs = jnp.concatenate([conv, b.astype(f32), a.astype(f32), stored_values(mixed, dtype)], axis=-1)
        # a batch slot's tile may have fewer rows than the candidates (jspec.batch): pad it
        inputs = jnp.pad(inputs, ((0, cache["ssm"].shape[0] - t), (0, 0)))
        # Every row's window, valid or not: candidate slot i's is rows i .. i + W - 2 of the new conv cache (no window
        # is copied out; commit selects by slot), so nothing around the conv depends on the row count
        # (docs/design.md, rule 7).
        cache, out = gdn_rows(cache, run.slot, inputs, p["A_log"], p["dt_bias"], run.rows, key_heads=nk)
        out = out[:t]
    else:
        q, k, v = gdn_columns(conv, nk, dk, dv)
        q, k = gdn_query_key(q, k)
        q, k = (jnp.repeat(x, nv // nk, axis=1) for x in (q, k))
        g, beta = gdn_gates(a, b, p["A_log"], p["dt_bias"])
        if run.kind == PREFILL:
            real = (jnp.arange(t) < run.n_valid)[:, None]
            g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
        out, state = chunk_gated_delta(q, k, v, g, beta, state=state)
        if run.kind == PREFILL:
            window = conv_window(seq, run.n_valid, width)
            conv_cache = jax.lax.dynamic_update_slice_in_dim(cache["conv"], window, 0, axis=0)
            cache = dict(conv=conv_cache, ssm=cache["ssm"].at[0].set(state))
    out = _gated_norm(out.astype(dtype), z.reshape(t, nv, dv), p["gdn_norm"], cfg.rms_norm_eps)
    return row_parallel_linear(out.reshape(t, value_dim), p["out"], None, cfg, run.live_rows), cache


def linear_attention_layer(p: dict, cfg: ModelConfig, x: jax.Array, cache, run: Run):
    """Gated DeltaNet decoder layer (+ MLP) on the residual stream x [T, H] -> (x, cache)."""
    out, cache = gated_deltanet(p, cfg, _norm(x, p["input_norm"], cfg), cache, run)
    return _mlp_block(p, cfg, x + out, run.live_rows), cache


def _layers(params: dict, cfg: ModelConfig, tokens: jax.Array, cache, run: Run):
    """Embed tokens [T] at run.positions(T), every layer, final norm -> (hidden [T, H], cache)."""
    positions = run.positions(tokens.shape[0])
    x = embed_tokens(params, cfg, tokens)
    new_cache = []
    for i, (kind, p) in enumerate(zip(cfg.layer_types, params["layers"], strict=True)):
        layer_cache = None if cache is None else cache[i]
        if kind == FULL:
            x, layer_cache = attention_layer(p, cfg, x, positions, layer_cache, run)
        else:
            x, layer_cache = linear_attention_layer(p, cfg, x, layer_cache, run)
        new_cache.append(layer_cache)
    x = _norm(x, params["final_norm"], cfg)
    return x, None if cache is None else tuple(new_cache)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Full causal forward of tokens [T] from a zero recurrent state, no cache -> final-normed hidden [T, H]."""
    return _layers(params, cfg, tokens, None, Run.forward())[0]


def prefill_chunk(params: dict, cfg: ModelConfig, tokens: jax.Array, cache, start, n_valid):
    """One prompt chunk tokens [C] at positions start..start+C-1, the first n_valid real -> (hidden [C, H], cache).
    The recurrent layers carry their state from the previous chunk (slot 0) to the next."""
    return _layers(params, cfg, tokens, cache, Run.prefill(start, n_valid))


def step(params: dict, cfg: ModelConfig, tokens: jax.Array, cache, start, slot, rows: int, one_split: bool = False):
    """One row tile tokens [ROW_TILE] at positions start.., `rows` valid (static), advancing every recurrent layer
    from candidate `slot` (int32 []) -> (hidden [ROW_TILE, H], cache with the post-state after row i in slot i).
    one_split: `Run.step`'s."""
    return _layers(params, cfg, tokens, cache, Run.step(start, rows, slot, one_split))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.05) -> dict:
    """Random params in the layout above (tests and benchmarks; real weights come from `checkpoints`).

    (1 + w) norm weights are small noise around 0; A_log = log U(0.02, 0.5) so the recurrent state keeps a
    memory of tens of positions.
    """
    if len(cfg.layer_types) != cfg.num_layers or set(cfg.layer_types) - {FULL, LINEAR}:
        raise ValueError(f"hybrid layer_types must list {FULL!r} / {LINEAR!r} for each of {cfg.num_layers} layers")
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim, value_dim, conv_dim = _dims(cfg)
    qkv_n = 2 * cfg.q_size + 2 * cfg.kv_size
    keys = iter(jax.random.split(key, 16 * cfg.num_layers + 4))

    def rand(*shape, dt=dtype):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    layers = []
    for kind in cfg.layer_types:
        p = dict(input_norm=rand(h), post_attn_norm=rand(h), gate_up=rand(h, 2 * inter), down=rand(inter, h))
        if kind == FULL:
            p.update(qkv=rand(h, qkv_n), q_norm=rand(d), k_norm=rand(d), o=rand(cfg.q_size, h))
            if cfg.attention_bias:
                p["qkv_bias"] = rand(qkv_n)
            if cfg.o_bias:
                p["o_bias"] = rand(h)
        else:
            a = jax.random.uniform(next(keys), (nv,), jnp.float32, 0.02, 0.5)
            p.update(
                in_proj=rand(h, conv_dim + value_dim + 2 * nv),
                conv=(rand(cfg.linear_conv_kernel_dim, conv_dim, dt=jnp.float32) * 10).astype(dtype),
                A_log=jnp.log(a),
                dt_bias=rand(nv, dt=jnp.float32),
                gdn_norm=(1.0 + rand(dv, dt=jnp.float32)).astype(dtype),
                out=rand(value_dim, h),
            )
        layers.append(p)
    params = dict(embed=rand(cfg.vocab_size, h) * 20, layers=layers, final_norm=rand(h))
    if not cfg.tie_word_embeddings:
        params["lm_head"] = rand(h, cfg.vocab_size)
    return params
