"""Multi-token-prediction (MTP) heads: the DeepSeek-V3 / Qwen3-Next next-n predictor layers.

API
  params["mtp"]: list, one dict per MTP layer i:
      embed_norm [H], hidden_norm [H], fc [2H, H] (dense or Int4Weight), layer: the family's attention decoder
      layer params (dense families: the same dict as params["layers"][j]), final_norm [H].
      The token embedding and the lm_head are the main model's (params["embed"], params["lm_head"]): shared.
  init_mtp_params(cfg, key, dtype, num_layers=1) -> that list (random; tests and the demo trainer).
  mtp_layer(params, cfg, hidden [T, H], tokens [T], cache, run, layer_index)
      -> (chain hidden [T, H], final-normed hidden [T, H], cache): the row-level building block; `run`
      (`jspec.models.layers.Run`: the full forward, a prefill chunk or a row-tile step) as for the family's
      `attention_layer`.
  mtp_forward(params, cfg, hidden [T, H], next_tokens [T], layer_index=0) -> float32 logits [T, V]: the full
      causal forward (no cache) of one MTP layer, differentiable. Row t takes `hidden` at position t and
      next_tokens[t] (the token at position t + 1) and predicts the token at position t + 2 (for layer i fed with
      layer i-1's chain hidden and the token at t + i + 1: the token at t + i + 2). Positions are 0..T-1.

One MTP layer at position t (DeepSeek-V3 report, section 2.2; vLLM's deepseek_mtp.py / qwen3_next_mtp.py):
    x = fc(concat(embed_norm(embed(next_token)), hidden_norm(hidden)))       # embedding first, as the weights
    x = decoder_layer(x, position t)                                          # the family's attention layer
    logits = lm_head(final_norm(x))
(The report writes the concatenation hidden-first; vLLM and transformers' MtpLayer, which run the released weights,
put the embedding first.)

`hidden` for layer 0 is the main model's FINAL-NORMED output at position t (what jspec's `run` returns and
DecodeState.hidden holds): vLLM feeds its MTP/EAGLE proposers the target model's returned hidden states, which its
qwen3_next / deepseek_v2 models produce after the final norm. The hidden passed on to the next MTP step (chain
hidden) follows vLLM per layout: "qwen3_next" passes the final-normed output (`mtp.norm` applied), "deepseek"
the decoder-layer output before `shared_head.norm` (as the report's h_i^k; transformers' MtpModel passes the
normed one); it matters only to MTP layers past the first and to chained drafts. vLLM's DeepSeek MTP also zeroes
the embedding at position 0; jspec does not (it is not in the report and only touches the first prompt position).
Norms are (1 + w) RMSNorms on families with cfg.norm_plus_one (Qwen3-Next / Qwen3.5), plain otherwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models import family_module
from jspec.models.layers import Run, embed_tokens, rms_norm
from jspec.models.layers import logits as logits_from_hidden
from pallas_kernels import linear

MTP_LAYOUTS = ("qwen3_next", "deepseek")


def _norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, plus_one=cfg.norm_plus_one)


def mtp_layer(params: dict, cfg: ModelConfig, hidden, tokens, cache, run: Run, layer_index: int = 0):
    """MTP layer `layer_index` on rows (hidden [T, H] at run.positions(T), tokens int32 [T] = the token one
    position ahead of each row) -> (chain hidden [T, H], final-normed hidden [T, H], cache). `run` (forward,
    prefill chunk or row-tile step) as for the family's `attention_layer`."""
    if cfg.mtp_layout not in MTP_LAYOUTS:
        raise ValueError(f"cfg.mtp_layout must be one of {MTP_LAYOUTS} for an MTP head, got {cfg.mtp_layout!r}")
    heads = params.get("mtp") or []
    if not 0 <= layer_index < len(heads):
        raise ValueError(f"MTP layer {layer_index} requested but params carry {len(heads)} MTP layer(s)")
    p = heads[layer_index]
    embedded = _norm(embed_tokens(params, cfg, tokens).astype(hidden.dtype), p["embed_norm"], cfg)
    x = linear(
        jnp.concatenate([embedded, _norm(hidden, p["hidden_norm"], cfg)], axis=-1), p["fc"], live_rows=run.live_rows
    )
    x, cache = family_module(cfg).attention_layer(p["layer"], cfg, x, run.positions(x.shape[0]), cache, run)
    normed = _norm(x, p["final_norm"], cfg)
    return (x if cfg.mtp_layout == "deepseek" else normed), normed, cache


def mtp_forward(params: dict, cfg: ModelConfig, hidden: jax.Array, next_tokens: jax.Array, layer_index: int = 0):
    """Full causal forward of MTP layer `layer_index`: hidden [T, H], next_tokens int32 [T] -> float32 [T, V]."""
    _, normed, _ = mtp_layer(params, cfg, hidden, next_tokens, None, Run.forward(), layer_index)
    return logits_from_hidden(params, cfg, normed)


def init_mtp_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, num_layers: int = 1) -> list[dict]:
    """Random MTP params (the list for params["mtp"]), num_layers layers, in the layout above. The decoder layer
    comes from the family's own `init_params`; norms and fc use the same 0.05-scale normal noise."""
    scale = 0.05
    h = cfg.hidden_size
    # One attention decoder layer of the family, initialised by the family itself.
    layer_cfg = dataclasses.replace(
        cfg, num_layers=1, layer_types=("full_attention",) if cfg.layer_types else (), num_mtp_layers=0
    )
    init_layer = family_module(cfg).init_params
    out = []
    for k in jax.random.split(key, num_layers):
        k_layer, k_fc, k_norm = jax.random.split(k, 3)
        norms = scale * jax.random.normal(k_norm, (3, h), jnp.float32) + (0.0 if cfg.norm_plus_one else 1.0)
        out.append(
            dict(
                embed_norm=norms[0].astype(dtype),
                hidden_norm=norms[1].astype(dtype),
                fc=(scale * jax.random.normal(k_fc, (2 * h, h), jnp.float32)).astype(dtype),
                layer=init_layer(layer_cfg, k_layer, dtype)["layers"][0],
                final_norm=norms[2].astype(dtype),
            )
        )
    return out
