"""The `prefill` section: long prompts through the chunked prefill, and speculation on one.

Per model (`--prefill-models`, full depth, random int4) and prompt length (`--prefill-lengths`): time to first
token (the host loop's `generate(prompt, 1)`: start, every chunk, the first token; median of `--repeats`, after one
untimed call), prefill tokens/s, the useful FLOPs (2 x the linear weights' parameters per token, and the causal
attention's 4 x T^2 / 2 x heads x head_dim per attention layer) per second against the bf16 matmul peak measured in
the same run (a large `jnp.dot`), and the device's peak memory. A chunk-size sweep at one length (`--prefill-chunks`)
justifies the Engine's default. With --peer-hf, HuggingFace transformers (bf16, sdpa attention) prefills the same
prompts (one forward with the cache, logits of the last position only). Then speculation on a long prompt
(`--long-prompt`, an echo prompt whose continuation repeats part of it): greedy and prompt lookup decode tok/s at
that context, tokens identical.
"""

from __future__ import annotations

import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import PromptLookup
from jspec.engine import Engine
from jspec.models import LINEAR_WEIGHTS
from jspec_bench.e2e import echo_prompt, pad_prompt
from jspec_bench.report import Context
from jspec_bench.shapes import hf_config_dict, scale_attention_output
from jspec_bench.steps import _load_model


def matmul_peak_flops(n: int) -> float:
    """bf16 FLOP/s of a jitted [n, n] @ [n, n] (float32 accumulation), median of 5 trials of 4 chained calls."""
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(f(a))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x = a
        for _ in range(4):
            x = f(x)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - t0) / 4)
    return 2 * n**3 / statistics.median(times)


def linear_params(params: dict) -> int:
    """Parameters of every matrix the model multiplies a token's activations by (lm_head once: prefill computes
    the logits of the last position only, so it is left out)."""
    total = 0

    def visit(node, name=None):
        nonlocal total
        if isinstance(node, dict):
            for key, value in node.items():
                visit(value, key)
        elif isinstance(node, list | tuple):
            for value in node:
                visit(value, name)
        elif name in LINEAR_WEIGHTS and name != "lm_head":
            shape = node.shape
            total += int(shape[0]) * int(shape[1])

    visit({k: v for k, v in params.items() if k != "mtp"})
    return total


def prefill_flops(params: dict, cfg, length: int) -> float:
    attention = 4 * length * length / 2 * cfg.num_heads * cfg.head_dim * len(cfg.attention_layers)
    return 2.0 * linear_params(params) * length + attention


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None  # since the start


def _ttft(engine: Engine, prompt: np.ndarray, repeats: int) -> dict:
    engine.generate(prompt, 1, eos_id=())  # compile, warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate(prompt, 1, eos_id=())
        times.append(time.perf_counter() - t0)
    return {"ttft_s": statistics.median(times), "trials_s": times}


def section_prefill(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    sec["bf16_peak_flops"] = peak = matmul_peak_flops(256 if opts.quick else 8192)
    print(f"  bf16 matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    sec["models"] = {}
    rng = np.random.default_rng(opts.seed + 7)
    for name in opts.prefill_models:
        why = ctx.budget.why_not(30.0 if opts.quick else 120.0, f"prefill {name}")
        if why:
            sec["models"][name] = {"status": "skipped", "reason": why}
            continue
        entry = sec["models"][name] = {"status": "running"}
        try:
            params, cfg, info = _load_model(ctx, name)
            entry.update(info)
            max_len = max(opts.prefill_lengths) + opts.new_tokens + 16
            engine = Engine(params, cfg, max_len=max_len, k=opts.k, prepare=opts.prepare_arg)
            entry.update(max_len=max_len, prefill_chunk=engine.prefill_chunk, lengths={})
            for length in opts.prefill_lengths:
                prompt = rng.integers(0, cfg.vocab_size, length).astype(np.int32)
                r = _ttft(engine, prompt, opts.repeats)
                flops = prefill_flops(params, cfg, length)
                r.update(
                    tokens_per_s=length / r["ttft_s"],
                    flops=flops,
                    flops_per_s=flops / r["ttft_s"],
                    peak_fraction=flops / r["ttft_s"] / peak,
                    peak_device_bytes=peak_bytes(),
                )
                entry["lengths"][str(length)] = r
                print(
                    f"  prefill {name} {length} tokens: TTFT {r['ttft_s'] * 1e3:.1f} ms, "
                    f"{r['flops_per_s'] / 1e12:.0f} TFLOP/s ({100 * r['peak_fraction']:.0f}% of the bf16 peak)",
                    flush=True,
                )
                ctx.report.save()
            if name == opts.prefill_models[0] and opts.prefill_chunks:
                entry["chunk_sweep"] = _chunk_sweep(ctx, params, cfg, max_len, rng)
            del engine
            if name == opts.prefill_models[0] and opts.long_prompt:
                entry["long_prompt_speculation"] = _long_prompt(ctx, params, cfg, rng)
            if opts.peer_hf:
                entry["peer"] = _hf_prefill(ctx, name, rng)
            entry["status"] = "done"
        except Exception as e:
            ctx.report.failed(entry, f"prefill {name}", e)
        finally:
            params = None
            gc.collect()
        ctx.report.save()


def _chunk_sweep(ctx: Context, params, cfg, max_len: int, rng) -> dict:
    """TTFT at one length for each chunk size (one Engine each), to justify the default."""
    length = ctx.opts.chunk_sweep_length
    prompt = rng.integers(0, cfg.vocab_size, length).astype(np.int32)
    out = {"length": length, "chunks": {}}
    for chunk in ctx.opts.prefill_chunks:
        engine = Engine(params, cfg, max_len=max_len, k=ctx.opts.k, prepare=ctx.opts.prepare_arg, prefill_chunk=chunk)
        out["chunks"][str(chunk)] = _ttft(engine, prompt, ctx.opts.repeats)
        print(f"  chunk {chunk}: TTFT {out['chunks'][str(chunk)]['ttft_s'] * 1e3:.1f} ms at {length}", flush=True)
        del engine
        gc.collect()
    return out


def _long_prompt(ctx: Context, params, cfg, rng) -> dict:
    """Greedy and prompt lookup on a long echo prompt (the e2e section's construction at --long-prompt tokens):
    decode tok/s at that context (prefill excluded), the speedup, tokens identical."""
    opts = ctx.opts
    n = opts.new_tokens
    length = opts.long_prompt
    markov = scale_attention_output(params, opts.o_factor)
    engine = Engine(markov, cfg, max_len=length + n + 16, k=opts.k, prepare=opts.prepare_arg)
    p = rng.integers(0, cfg.vocab_size, opts.prompt_len).astype(np.int32)
    filler = pad_prompt(p, length, rng, cfg.vocab_size)
    g = engine.generate(filler, n, eos_id=()).tokens  # greedy's continuation G of P
    prompt = echo_prompt(p, g, None, rng, cfg.vocab_size, length)
    out = {"prompt_len": len(prompt), "new_tokens": n, "k": opts.k, "o_factor": opts.o_factor}
    runs = {}
    for label, kwargs in (("greedy", {}), ("lookup", {"drafter": PromptLookup()})):
        engine.generate(prompt, n, eos_id=(), **kwargs)  # warm
        result = engine.generate(prompt, n, eos_id=(), **kwargs)
        s = result.stats
        decode_s = s.wall_time_s - s.prefill_time_s
        runs[label] = result.tokens
        out[label] = {
            "wall_s": s.wall_time_s,
            "prefill_s": s.prefill_time_s,
            "decode_tok_s": (len(result.tokens) - 1) / decode_s,
            "ms_per_token": 1e3 * decode_s / (len(result.tokens) - 1),
            "mean_accepted": s.mean_accepted,
            "verify_steps": s.verify_steps,
        }
    out["identical"] = runs["lookup"] == runs["greedy"]
    out["speedup"] = out["lookup"]["decode_tok_s"] / out["greedy"]["decode_tok_s"]
    ctx.report.check_identity(out["identical"], f"prefill/long prompt {length}: lookup tokens != greedy")
    print(
        f"  {length}-token echo prompt: greedy {out['greedy']['ms_per_token']:.2f} ms/token, lookup "
        f"{out['speedup']:.2f}x (mean_accepted {out['lookup']['mean_accepted']:.2f}), identical {out['identical']}",
        flush=True,
    )
    return out


def _hf_prefill(ctx: Context, name: str, rng) -> dict:
    """transformers at the same shape (bf16, sdpa, random weights): one forward over the prompt with the cache,
    logits of the last position only; TTFT median of --repeats after one warm-up, and torch's peak memory."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf_config_dict(name, ctx.opts.quick)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "attention": "sdpa", "lengths": {}}
    try:
        for length in ctx.opts.prefill_lengths:
            ids = torch.as_tensor(rng.integers(0, config.vocab_size, (1, length)), device=device)

            def forward(ids=ids):
                with torch.no_grad():
                    model(ids, use_cache=True, logits_to_keep=1)
                if device == "cuda":
                    torch.cuda.synchronize()

            forward()
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(ctx.opts.repeats):
                t0 = time.perf_counter()
                forward()
                times.append(time.perf_counter() - t0)
            ttft = statistics.median(times)
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
            out["lengths"][str(length)] = {"ttft_s": ttft, "tokens_per_s": length / ttft, "peak_device_bytes": peak}
            print(f"  peer prefill {name} {length}: TTFT {ttft * 1e3:.1f} ms", flush=True)
    finally:
        model = None  # noqa: F841  (the weights go before the next model's)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out
