"""The `draft_model` section: what a draft-model round costs at the e2e model's shape (Llama-3-8B by default), with
a Llama-3.2-1B-shaped drafter (`--draft-model`, k = `--draft-k`), both random int4.

A round drafts k tokens (k draft-model steps: the catch-up of 2 rows, then k - 1 one-row steps) and verifies them in
one verify step. With random weights the drafts almost never hit, so every round commits one token and its time is
the round's cost: round_ms / decode_ms is the mean_accepted a drafter needs to break even, and speedup(a) =
a * decode_ms / round_ms the speedup of a drafter that commits a tokens per round (the bundled demo drafter's
acceptance on real text is in demo_acceptance_*.json). Also: the drafter's own greedy decode (ms per token), and the
target drafting for itself (every draft accepted: k + 1 tokens per round), each speculative run's tokens compared
with greedy's. Host loop, prefill excluded (the decode part of the timed generation).
"""

from __future__ import annotations

import gc

import numpy as np

from jspec.drafters import DraftModel
from jspec.engine import Engine
from jspec_bench.e2e import random_filler
from jspec_bench.report import Context
from jspec_bench.steps import _load_model

SPEEDUP_AT = (2.0, 3.0, 4.0)  # tokens committed per round


def _decode_stats(engine: Engine, prompt, n: int, **kwargs) -> tuple[list[int], dict]:
    """Warm, then time one generation of n tokens: (tokens, ms per token and per round of the decode part)."""
    engine.generate(prompt, n, eos_id=(), **kwargs)
    result = engine.generate(prompt, n, eos_id=(), **kwargs)
    s = result.stats
    decode_s = s.wall_time_s - s.prefill_time_s
    rounds = s.decode_steps + s.verify_steps  # the first token comes from prefill, each round commits the rest
    return result.tokens, {
        "ms_per_token": 1e3 * decode_s / (len(result.tokens) - 1),
        "ms_per_round": 1e3 * decode_s / max(rounds, 1),
        "mean_accepted": s.mean_accepted,
        "verify_steps": s.verify_steps,
        "decode_steps": s.decode_steps,
    }


def section_draft_model(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    name, draft_name = opts.e2e_model, opts.draft_model
    why = ctx.budget.why_not(15.0 if opts.quick else 90.0, "draft-model rounds")
    if why or name not in opts.models:
        sec.update(status="partial", reason=why or f"--models does not include {name}")
        return
    params, cfg, info = _load_model(ctx, name)
    draft_params, draft_cfg, draft_info = _load_model(ctx, draft_name)
    sec.update(model=name, draft_model=draft_name, config=info["config"], draft_config=draft_info["config"])
    sec.update(param_bytes=info["param_bytes"], draft_param_bytes=draft_info["param_bytes"])
    k, n = opts.draft_k, opts.new_tokens
    rng = np.random.default_rng(opts.seed + 23)
    _, prompt = random_filler(rng, cfg.vocab_size, opts.prompt_len, n, 2 * opts.prompt_len + n)
    max_len = prompt.size + n + 16
    engine = Engine(params, cfg, max_len=max_len, k=k, prepare=opts.prepare_arg)
    greedy, sec["greedy"] = _decode_stats(engine, prompt, n)
    runs = {"draft_model": DraftModel(draft_params, draft_cfg), "self_draft": DraftModel(params, cfg)}
    for label, drafter in runs.items():
        tokens, stats = _decode_stats(engine, prompt, n, drafter=drafter)
        sec[label] = stats
        stats["identical"] = ctx.report.check_identity(tokens == greedy, f"draft_model/{label}: tokens != greedy")
        stats["round_over_decode"] = stats["ms_per_round"] / sec["greedy"]["ms_per_token"]
        print(
            f"  {label} k={k}: {stats['ms_per_round']:.3f} ms per round = {stats['round_over_decode']:.2f} greedy "
            f"tokens (mean_accepted {stats['mean_accepted']:.2f}), identical {stats['identical']}",
            flush=True,
        )
    rounds = sec["draft_model"]
    sec["break_even_mean_accepted"] = rounds["round_over_decode"]
    sec["speedup_at"] = {str(a): a / rounds["round_over_decode"] for a in SPEEDUP_AT + (float(k + 1),)}
    engine = None  # noqa: F841  (its prepared weights go before the drafter's own engine)
    gc.collect()
    drafter_engine = Engine(draft_params, draft_cfg, max_len=max_len, k=k, prepare=opts.prepare_arg)
    _, sec["drafter_greedy"] = _decode_stats(drafter_engine, prompt, n)
    sec.update(k=k, new_tokens=n, prompt_len=int(prompt.size))
    print(
        f"  drafter {draft_name} greedy {sec['drafter_greedy']['ms_per_token']:.3f} ms/token vs target "
        f"{sec['greedy']['ms_per_token']:.3f}; break-even mean_accepted {sec['break_even_mean_accepted']:.2f}",
        flush=True,
    )
    drafter_engine = None  # noqa: F841
    gc.collect()
