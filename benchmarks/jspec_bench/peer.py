"""The peer section (`--peer-hf`): HuggingFace transformers, bf16 eager, at the peer shape (Qwen2.5-7B by default):
greedy (timed with a static cache) and `prompt_lookup_num_tokens` on the end-to-end section's echo prompts, tok/s,
and whether its prompt-lookup output equals its own greedy output on the same (dynamic) cache."""

from __future__ import annotations

import time

import numpy as np

from jspec.stats import common_prefix
from jspec_bench.e2e import acyclic_continuation, echo_prompt, random_filler
from jspec_bench.report import Context
from jspec_bench.shapes import hf_config_dict


def section_peer(ctx: Context, sec: dict) -> None:
    """HF transformers at the peer shape: bf16 eager; greedy (static cache) vs prompt_lookup_num_tokens.

    First with the random weights as initialized (the echo prompt makes its prompt lookup verify, with attention
    fully in play: does its speculative output equal its greedy output?), then with the attention output
    projection scaled by --o-factor like jspec's end-to-end model (acceptance set by the echo prompts)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    opts = ctx.opts
    name = opts.peer_model
    why = ctx.budget.why_not(5.0 if opts.quick else 60.0, "peer")
    if why:
        sec.update(status="skipped", reason=why)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sec.update(model=name, device=device, transformers=transformers.__version__, torch=torch.__version__)
    sec["setup"] = (
        "bf16, attn_implementation=eager, greedy (do_sample=False), random weights; greedy timed with a StaticCache; "
        "prompt lookup with the default dynamic cache (transformers refuses assisted generation with static caches), "
        "its output compared with greedy on the same dynamic cache"
    )
    hf = hf_config_dict(name, opts.quick)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    t0 = time.perf_counter()
    torch.manual_seed(opts.seed)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with torch.device(device):  # weights are created (and randomly initialized) on the device
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **{dtype_kw: torch.bfloat16})
    model.eval()
    _sync(device)
    sec["init_s"] = time.perf_counter() - t0
    n, k = opts.peer_new_tokens, opts.k
    rng = np.random.default_rng(opts.seed + 4)
    length = 2 * opts.prompt_len + 2 * n  # every prompt, as in the e2e section
    p, filler = random_filler(rng, config.vocab_size, opts.prompt_len, n, length)

    def generate(ids: np.ndarray, new: int, lookup: bool, static: bool = True):
        return _hf_generate(model, config, ids, new, k if lookup else None, device, static)

    def echo_variants(prefix: str, periods: tuple) -> None:
        first = (p, filler, generate(filler, n, False)[0])
        q, _, g, sec[prefix + "continuation_attempts"] = acyclic_continuation(
            lambda prompt: generate(prompt, n, False)[0],
            first,
            lambda: random_filler(rng, config.vocab_size, opts.prompt_len, n, length),
        )
        for period in periods:
            vname = prefix + ("full" if period is None else f"insert{period}")
            prompt = echo_prompt(q, g, period, rng, config.vocab_size, length)
            greedy, greedy_s = generate(prompt, n, False)
            greedy_dynamic, _ = generate(prompt, n, False, static=False)
            lookup, lookup_s = generate(prompt, n, True)
            sec["variants"][vname] = {
                "prompt_len": len(prompt),
                "greedy_tok_s": len(greedy) / greedy_s,
                "lookup_tok_s": len(lookup) / lookup_s,
                "speedup": greedy_s / lookup_s * len(lookup) / max(len(greedy), 1),
                "lookup_equals_greedy": lookup == greedy_dynamic,  # same (dynamic) cache on both sides
                "first_difference": common_prefix(lookup, greedy_dynamic) if lookup != greedy_dynamic else None,
                "greedy_static_equals_dynamic": greedy == greedy_dynamic,
                "greedy_repeats_echo": common_prefix(greedy, g) / n,
            }
            print(f"  peer {vname}: {sec['variants'][vname]}", flush=True)
            ctx.report.save()

    threads = torch.get_num_threads()
    if device == "cpu":  # quick mode's tiny model: torch's thread pool only adds overhead (20x here)
        torch.set_num_threads(1)
    try:
        generate(filler[:32], 4, False)  # warm-up
        generate(filler[:32], 4, True)
        sec.update(k=k, new_tokens=n, o_factor=opts.o_factor, variants={})
        echo_variants("as-initialized/", (None,))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(opts.o_factor)
        echo_variants("", (None, 1))
    finally:
        torch.set_num_threads(threads)


def _hf_generate(
    model, config, ids: np.ndarray, new: int, lookup: int | None, device: str, static: bool = True, cache_len=None
):
    """(new tokens list, seconds) of model.generate; greedy with a StaticCache when `static` (of cache_len
    positions, default what the run needs: transformers compiles the forward for each cache length, so runs to be
    timed against each other share one), else (and always for prompt lookup) the default dynamic cache. ids [L], or
    [B, L] for a batch of prompts of one length (then a list of B token lists)."""
    import warnings

    import torch
    from transformers import StaticCache

    x = torch.as_tensor((ids if ids.ndim == 2 else ids[None]).astype(np.int64), device=device)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if lookup:  # assisted generation refuses static caches (transformers 5.17): the default dynamic cache
        kwargs["prompt_lookup_num_tokens"] = lookup
    elif static:  # `past_key_values`: the name every release takes (5.24 deprecates it for `cache`; 5.17 rejects that)
        kwargs["past_key_values"] = StaticCache(config=config, max_cache_len=cache_len or x.shape[1] + new + 1)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        out = model.generate(x, **kwargs)
    _sync(device)
    tokens = out[:, x.shape[1] :].tolist()
    return (tokens if ids.ndim == 2 else tokens[0]), time.perf_counter() - t0


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
