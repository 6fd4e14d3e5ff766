"""Shared test helpers: tiny random HuggingFace models built offline and saved as safetensors checkpoints.

`TINY_HF_CONFIGS` maps a variant name to (model_type, config kwargs); families are added by extending the dict.
`build_tiny_hf_model(variant, out_dir)` builds the model with transformers' `from_config`, randomizes EVERY
parameter (norm weights and biases included), and saves config.json + model.safetensors into out_dir.

The suite compiles the same small programs many times (every Engine of a test compiles its own executables), so it
shares XLA's persistent compilation cache across tests, workers and the subprocesses they start (notebooks, the
CLI): a program compiled once is loaded the next time. A cached executable is the compiled program itself, so no
result depends on it; JSPEC_TEST_JAX_CACHE="" turns it off.
"""

from __future__ import annotations

import gc
import os
import tempfile

import pytest

_cache = os.environ.get("JSPEC_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "jspec-test-jax-cache"))
if _cache:  # before jax is imported, so the environment reaches jax and every process the tests start
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

_DENSE_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# variant -> (HF model_type, config kwargs). Every dim a linear layer reduces over is a multiple of 32 (int4).
TINY_HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen2": ("qwen2", dict(_DENSE_DIMS, vocab_size=384, num_hidden_layers=2, rope_theta=10000.0)),
    "qwen2_tied": (
        "qwen2",
        dict(_DENSE_DIMS, vocab_size=256, num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=True),
    ),
    "llama": ("llama", dict(_DENSE_DIMS, vocab_size=320, num_hidden_layers=3, rope_theta=10000.0)),
    # llama3 rope scaling with a small original context so all three frequency bands (kept, smoothed, scaled)
    # occur among the 8 rotary frequencies of head_dim 16.
    "llama3_rope": (
        "llama",
        dict(
            _DENSE_DIMS,
            vocab_size=320,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "glm4": ("glm4", dict(_DENSE_DIMS, vocab_size=512, num_hidden_layers=2, eos_token_id=2, pad_token_id=0)),
    "glm4_tied": (
        "glm4",
        dict(
            _DENSE_DIMS,
            vocab_size=256,
            num_hidden_layers=2,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
    ),
}

# Hybrid Gated-DeltaNet families: 2 key / 8 value linear heads of 16 (grouped), conv kernel 4 (in_proj N = 336).
_HYBRID_DIMS = dict(
    _DENSE_DIMS,
    vocab_size=256,
    linear_num_key_heads=2,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
TINY_HF_CONFIGS.update(
    {
        # layers: linear, full, linear, full (full_attention_interval 2); dense MLPs only (num_experts 0).
        "qwen3_next": (
            "qwen3_next",
            dict(_HYBRID_DIMS, num_hidden_layers=4, full_attention_interval=2, num_experts=0, rope_theta=10000.0),
        ),
        # layers: linear x3, full (the default interval 4); biased attention projections.
        "qwen3_5": ("qwen3_5_text", dict(_HYBRID_DIMS, num_hidden_layers=4, attention_bias=True)),
    }
)


def hf_config(variant: str, **overrides):
    """The transformers config object of a tiny variant (overrides replace config kwargs)."""
    from transformers import AutoConfig

    model_type, kwargs = TINY_HF_CONFIGS[variant]
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def randomize_(model, seed: int, embed_std: float = 1.0) -> None:
    """Overwrite every parameter in place: norms ~ 1 + 0.2 N(0,1), biases 0.1 N(0,1), embeddings embed_std N(0,1),
    other matrices N(0, 1/fan_in), so activations stay O(1) and logits are well spread; Gated DeltaNet A_log =
    log U(0.02, 0.5) so the recurrent state remembers across the 64-token prefill chunks."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):  # Gated DeltaNet decay rate A = exp(A_log): slow decay, long memory
                value = (0.02 + 0.48 * torch.rand(p.shape, generator=gen)).log()
            elif p.ndim == 1 and "norm" in name:
                value = 1.0 + 0.2 * noise
            elif p.ndim == 1:
                value = 0.1 * noise
            elif "embed" in name:
                value = embed_std * noise
            else:
                value = noise / p.shape[1] ** 0.5
            p.copy_(value.to(p.dtype))


def build_tiny_hf_model(variant: str, out_dir, *, seed: int = 0, max_shard_size=None, **overrides):
    """Build, randomize and save a tiny float32 HF causal LM; returns the (eval-mode) torch model.

    out_dir receives config.json and model.safetensors (sharded with an index when max_shard_size is given).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(variant, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    # Tied: with a unit-scale embedding the logit e_t . e_t = H of the input token dominates and every random model
    # just repeats its input; at 0.15 the layers decide the next token (non-degenerate greedy output).
    randomize_(model, seed, embed_std=0.15 if config.tie_word_embeddings else 1.0)
    if config.tie_word_embeddings:
        model.tie_weights()
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(os.fspath(out_dir), **kwargs)
    return model


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """Session cache of tiny HF models: tiny_hf_model(variant) -> (torch model, checkpoint dir)."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            out = tmp_path_factory.mktemp(f"hf_{variant}")
            cache[variant] = (build_tiny_hf_model(variant, out), out)
        return cache[variant]

    return get


def memory_mappings() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's limit vm.max_map_count) on Linux; None elsewhere."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def free_executables_after_each_module(request):
    """When a module's tests end in this process: its functools caches (engines, greedy runs) emptied, JAX's caches
    cleared, garbage collected, so the executables it compiled are freed.

    Each loaded XLA:CPU executable holds memory mappings for its JIT code (about three a compiled piece) until it is
    freed. Kept for the whole session, an xdist worker's reached 63,668 of Linux's default limit of 65,530
    (vm.max_map_count) by the suite's end; past it mmap fails and XLA:CPU crashes compiling or loading an executable,
    which is how CI lost a worker in the suite's last modules five times. A module ending above 80% of the limit
    fails here with the numbers instead."""
    yield
    import jax

    for value in vars(request.module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()
    usage = memory_mappings()
    if usage is not None and usage[0] > 0.8 * usage[1]:
        pytest.fail(
            f"this process holds {usage[0]} memory mappings after {request.module.__name__}, over 80% of "
            f"vm.max_map_count = {usage[1]}: XLA:CPU crashes when mmap fails; free that module's executables"
        )
