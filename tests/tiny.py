"""Tiny native models and test-only drafters shared by the tests (no HuggingFace needed); which kernels jax traces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig, RopeConfig
from jspec.models import dense

# The Mosaic GPU kernels (int4_ws, attention_ws) are written against the API of jax >= 0.11 (the GPU's); older jax
# cannot trace them.
MOSAIC_GPU_TRACES = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 11)


def tiny_config(family: str = "qwen2", **overrides) -> ModelConfig:
    """A 2-layer config of the given family (hidden 64, 4 query / 2 KV heads of 16, vocab 96)."""
    base = dict(
        family=family,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
    )
    if family == "qwen2":
        base.update(attention_bias=True)
    elif family == "llama":
        base.update(
            rope=RopeConfig(
                theta=500000.0,
                scaling_type="llama3",
                scaling_factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        )
    elif family in ("qwen3_next", "qwen3_5"):  # layers: Gated DeltaNet, gated attention; linear heads 2 k / 8 v
        base.update(
            rope=RopeConfig(partial_rotary_factor=0.25),
            layer_types=("linear_attention", "full_attention"),
            attn_output_gate=True,
            norm_plus_one=True,
            linear_num_key_heads=2,
            linear_num_value_heads=8,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
    elif family == "glm4":
        base.update(attention_bias=True, post_norms=True, rope=RopeConfig(partial_rotary_factor=0.5, interleaved=True))
    base.update(overrides)
    return ModelConfig(**base)


def tiny_params(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0) -> dict:
    return dense.init_params(cfg, jax.random.PRNGKey(seed), dtype, scale=0.1)


@dataclasses.dataclass(frozen=True)
class ScriptDrafter:
    """Test-only drafter proposing the continuation of a fixed token script (prompt + expected output).

    offset=0 proposes the script itself (an oracle when the script is greedy's own output); offset=1 proposes
    (script + 1) % vocab, a token greedy never produces there (always wrong).
    """

    script: tuple[int, ...]
    offset: int = 0
    vocab: int = 96
    k: int | None = None

    def init(self, params, cfg, state, own=None):
        return None

    def prefill(self, params, cfg, state, hidden, start, n_valid, length, own=None):
        return None

    def propose(self, params, cfg, state, k, choose=None, own=None):
        script = jnp.asarray(self.script + (0,) * (k + 1), jnp.int32)
        draft = jax.lax.dynamic_slice(script, (state.position + 1,), (k,))
        draft = (draft + self.offset) % self.vocab
        n_valid = jnp.clip(len(self.script) - state.position - 1, 0, k).astype(jnp.int32)
        return None, draft, n_valid
