"""The model shapes the bench times and the random models it builds at them. Weights are random (no downloads):
the family's `init_params` in bf16, every linear weight (and by default the lm_head) quantized to int4 on the
device with `pallas_kernels.quantize`. Values do not change the cost of a step. For the end-to-end section the
attention output projection is scaled by `--o-factor` (default 0: zeroed, `scale_attention_output`), which makes the
random model Markov: its next token is a function of the last token, so an echo prompt makes it repeat its own
continuation and the prompt sets the prompt-lookup acceptance. Attention still runs at full cost (its weights are
runtime values). The steps section uses the unscaled weights, so its bitwise verify-vs-decode check exercises the
attention kernel fully. Also here: the bytes a step reads (`step_bytes`) and a random decode state to time it on."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.models import family_module, hybrid, quantize_linears
from jspec.models.mtp import init_mtp_params
from jspec.state import init_state, physical_length
from pallas_kernels import ROW_TILE, Int4Codes, Int4Halves, Int4Weight, quantize

# transformers' Qwen3_5TextConfig() defaults (the Qwen3.5 text shape, 3 Gated DeltaNet : 1 gated attention, 9.0B
# parameters), with one MTP layer
QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10000000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    mtp_num_hidden_layers=1,
)
# Shapes typed in from the models' HuggingFace config.json files (no downloads).
SHAPES: dict[str, dict] = {
    "qwen2.5-14b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "glm-4-9b": dict(  # GLM-4-9B-0414 (Glm4ForCausalLM)
        model_type="glm4",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=13696,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=True,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(  # the draft_model section's drafter for llama-3-8b (rope scaling left out: shapes only)
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "llama-3-70b": dict(  # the tp section's (issue 38: TP = 2 and 4)
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "qwen3.5": QWEN3_5_TEXT,
    "hybrid-27b": dict(  # a 27B-class Qwen3.5-style hybrid typed in here (no published config copied): hidden 5120,
        # 64 layers 3:1, 24 query / 4 KV heads of 256, 16 key / 48 value linear heads of 128; 26.9B parameters
        QWEN3_5_TEXT,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        linear_num_value_heads=48,
    ),
}
# Quick mode (CPU, CI): every shape shrunk to this size, family features (bias, rope layout, post norms) kept.
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TINY_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_HYBRID = dict(  # a hybrid shrunk: one 3:1 group of layers, small linear heads
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

STEP_MODELS = ("qwen2.5-14b", "llama-3-8b")
OTHER_MODELS = ("qwen2.5-7b", "glm-4-9b", "demo")
HYBRID_MODELS = ("qwen3.5", "hybrid-27b")
TP_MODELS = ("llama-3-70b",)  # besides qwen2.5-14b, the tp section's (jspec_bench.tp.TP_PLAN)
ALL_MODELS = STEP_MODELS + OTHER_MODELS + HYBRID_MODELS + TP_MODELS


def hf_config_dict(name: str, quick: bool) -> dict:
    """The typed-in HF config of a bench shape (quick: shrunk to TINY, family features kept)."""
    hf = dict(SHAPES[name])
    if quick:
        hf.update(TINY, **TINY_HEADS, **(TINY_HYBRID if "linear_num_key_heads" in hf else {}))
    return hf


def model_config(name: str, quick: bool) -> ModelConfig:
    return ModelConfig.from_hf(hf_config_dict(name, quick))


def random_int4_params(cfg: ModelConfig, seed: int, lm_head_int4: bool) -> dict:
    """Random params on the device: the family's `init_params` (bf16, scale 0.02) with every linear weight (and the
    lm_head when lm_head_int4) quantized to int4 by `pallas_kernels.quantize`; a config with MTP layers gets a
    random MTP head (`init_mtp_params`, int4 linears) too.

    Built one layer at a time by jitted functions (a 1-layer config with a 32-token vocab per layer type, a 0-layer
    config for embed / final_norm / lm_head), so only one layer's dense weights exist at a time and the compiles do
    not grow with the depth."""
    key = jax.random.PRNGKey(seed)
    init = family_module(cfg).init_params
    no_layers = dataclasses.replace(cfg, num_layers=0, layer_types=(), num_mtp_layers=0)

    @functools.cache
    def layer_fn(kind: str | None):
        one = dataclasses.replace(
            cfg, num_layers=1, vocab_size=32, layer_types=(kind,) if kind else (), num_mtp_layers=0
        )
        return jax.jit(lambda key: quantize_linears(init(one, key, jnp.bfloat16, scale=0.02)["layers"][0]))

    @jax.jit
    def outer(key):
        p = init(no_layers, key, jnp.bfloat16, scale=0.02)
        if lm_head_int4 and "lm_head" in p:
            p["lm_head"] = quantize(p["lm_head"])
        return p

    params = outer(jax.random.fold_in(key, cfg.num_layers))
    kinds = cfg.layer_types or (None,) * cfg.num_layers
    params["layers"] = [layer_fn(kind)(jax.random.fold_in(key, i)) for i, kind in enumerate(kinds)]
    if cfg.num_mtp_layers:
        mtp = jax.jit(lambda k: quantize_linears(init_mtp_params(cfg, k, jnp.bfloat16, cfg.num_mtp_layers)))
        params["mtp"] = mtp(jax.random.fold_in(key, cfg.num_layers + 1))
    return jax.block_until_ready(params)


def scale_attention_output(params: dict, factor: float) -> dict:
    """Params whose token-mixing sub-blocks (attention; a hybrid's Gated DeltaNet too) add `factor` times their output
    to the residual stream (factor 0: the model is a Markov chain over tokens). Every leaf is shared but the scaled
    one per layer: the output projection, o or out (an int4 weight's scales), or, where a post-attention norm
    follows it (glm4), that norm's weight: the norm would undo a scaled o."""

    def scaled(w):
        if isinstance(w, Int4Weight):
            return dataclasses.replace(w, scales=(w.scales.astype(jnp.float32) * factor).astype(jnp.bfloat16))
        return (w.astype(jnp.float32) * factor).astype(w.dtype)

    def output_of(layer: dict) -> str:
        return next(key for key in ("post_self_attn_norm", "o", "out") if key in layer)

    layers = [dict(layer, **{output_of(layer): scaled(layer[output_of(layer)])}) for layer in params["layers"]]
    return dict(params, layers=layers)


def tree_nbytes(tree) -> int:
    """Bytes of a params tree; int4 weights (native or prepared) count their own `nbytes` (jax counts an int4
    array's elements as whole bytes)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (Int4Weight, Int4Codes, Int4Halves)))
    return int(sum(x.nbytes for x in leaves))


def step_bytes(params: dict, cfg, state, rows: int) -> dict:
    """HBM bytes a step of `rows` rows (1: decode, k + 1: verify) moves: every weight but the embedding table (+ one
    embedding row; the whole table when the lm_head is tied), the KV rows 0..position + ROW_TILE - 1 of every
    attention layer (the row tile's reach, whatever `rows`), and of every recurrent layer the one candidate state
    (recurrent state and conv window) it starts from (read) and the `rows` post-states and conv inputs it keeps
    (`state_writes`); the other candidate slots are not touched. The MTP head is not read by decode/verify."""
    weights = sum(tree_nbytes(v) for key, v in params.items() if key not in ("embed", "mtp"))
    embed = params["embed"]
    weights += embed.nbytes if "lm_head" not in params else cfg.hidden_size * embed.dtype.itemsize

    length = physical_length(state.max_len)
    reach = min(int(state.position) + ROW_TILE, length)
    cache = writes = 0
    for layer in state.cache:
        if isinstance(layer, dict):  # a recurrent layer: the state it starts from, the rows' post-states and inputs
            cache += tree_nbytes(hybrid.candidate_state(layer, 0))
            writes += rows * (
                layer["ssm"].nbytes // layer["ssm"].shape[0] + layer["conv"].nbytes // layer["conv"].shape[0]
            )
        else:
            cache += reach * (layer.nbytes // length)
    return {
        "weights": int(weights),
        "cache": int(cache),
        "state_writes": int(writes),
        "total": int(weights + cache + writes),
    }


def random_state(cfg, max_len: int, position: int, dtype, seed: int):
    """A DecodeState at `position` with a random cache and random tokens (step timing needs no real prefix)."""
    state = init_state(cfg, max_len, dtype)
    leaves, treedef = jax.tree.flatten(state.cache)
    key = jax.random.PRNGKey(seed)
    filled = [
        (0.5 * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for i, x in enumerate(leaves)
    ]
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, state.tokens.shape), jnp.int32)
    return dataclasses.replace(
        state, cache=jax.tree.unflatten(treedef, filled), tokens=tokens, position=jnp.asarray(position, jnp.int32)
    )


def copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)
