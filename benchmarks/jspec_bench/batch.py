"""The `batch` section: `Engine.generate_batch` at the e2e model's shape (Llama-3-8B, int4, random weights).

1. Greedy at batch_size B = 1, 4, 16, 64: B prompts of --prompt-len tokens, --new-tokens each, one batch (no
   refill): decode tokens/s of the batch (its prefills excluded: each fill is timed to completion) and the ratio
   to B = 1. The contract (an identity check): `CHECKED` of the sequences, each run again alone in the same engine
   (the other slots empty), give the same tokens. A fact, not a requirement (docs/design.md rule 9): whether every
   sequence's tokens equal those of the B = 1 engine (`same_as_b1_engine`; a B-slot engine runs other shapes).
   On the GPU, one round's kernel time by group (int4 kernels, attention, XLA ops) against the rows it runs.
2. Prompt lookup at B = 4 and 8 with k = 3 and 7 on the e2e section's echo prompts (each slot its own prompt):
   tokens/s against greedy at the same B, mean_accepted; every sequence's tokens against the engine's greedy
   batch (speculative == greedy, an identity check).
3. With --peer-hf: HuggingFace transformers' batched greedy generate at the same shape and batch sizes (bf16, sdpa,
   a StaticCache; the prompts share one length, so no padding), decode tokens/s as (N + n) minus (N + 1) tokens.
The attention output is scaled as in e2e (--o-factor) so the random model's continuation follows the echo.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from jspec.drafters import PromptLookup
from jspec.engine import Engine
from jspec_bench.e2e import echo_prompt, random_filler
from jspec_bench.peer import _hf_generate
from jspec_bench.report import Context, _error_text
from jspec_bench.shapes import hf_config_dict, scale_attention_output
from jspec_bench.steps import _load_model
from jspec_bench.timing import kernel_times, profile

BATCH_SIZES = (1, 4, 16, 64)
CHECKED = 3  # sequences per batch size run again alone in the same engine
LOOKUP = ((4, 3), (4, 7), (8, 3), (8, 7))  # (batch size, k)


def _decode_rate(result) -> dict:
    s = result.stats
    decode_s = s.wall_time_s - s.prefill_time_s
    return {
        "new_tokens": s.new_tokens,
        "wall_s": s.wall_time_s,
        "prefill_s": s.prefill_time_s,
        "decode_tok_s": s.new_tokens / decode_s,
        "ms_per_round": 1e3 * decode_s / s.rounds if s.rounds else None,  # a batch step, host loop included
        "rounds": s.rounds,
        "slot_occupancy": s.slot_occupancy,
        "mean_accepted": _mean_accepted(result),
    }


def _mean_accepted(result) -> float:
    verify = sum(r.stats.verify_steps for r in result.results)
    accepted = sum(r.stats.accepted for r in result.results)
    return (accepted + verify) / verify if verify else 0.0


def section_batch(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    name = opts.e2e_model
    if name not in opts.models:
        sec.update(status="partial", reason=f"--models does not include {name}")
        return
    params, cfg, info = _load_model(ctx, name)
    params = scale_attention_output(params, opts.o_factor)
    sec.update(model=name, source=info["source"], o_factor=opts.o_factor)
    n, plen = (8, 16) if opts.quick else (opts.new_tokens, opts.prompt_len)
    sizes = (1, 4) if opts.quick else BATCH_SIZES
    lookups = ((2, 3),) if opts.quick else LOOKUP
    length = 2 * plen + n
    max_len = length + n + 16
    rng = np.random.default_rng(opts.seed + 23)
    prompts = [
        random_filler(rng, cfg.vocab_size, plen, n, length) for _ in range(max(sizes + tuple(b for b, _ in lookups)))
    ]
    single = Engine(params, cfg, max_len=max_len, k=7, prepare=opts.prepare_arg)
    alone = {}

    def greedy_alone(i: int, prompt) -> list[int]:
        if i not in alone:
            alone[i] = single.generate(prompt, n, eos_id=()).tokens
        return alone[i]

    sec["greedy"] = {}
    base = None
    for b in sizes:
        why = ctx.budget.why_not(10.0 if opts.quick else 40.0, f"batch greedy B={b}")
        if why:
            sec["greedy"][str(b)] = {"status": "skipped", "reason": why}
            continue
        engine = Engine(params, cfg, max_len=max_len, k=7, prepare=opts.prepare_arg, batch_size=b)
        batch = [prompts[i][1] for i in range(b)]
        engine.generate_batch(batch, n, eos_id=())  # warm: compile
        t0 = time.perf_counter()
        out = engine.generate_batch(batch, n, eos_id=())
        r = sec["greedy"][str(b)] = _decode_rate(out) | {"elapsed_s": time.perf_counter() - t0}
        picks = sorted({0, b // 2, b - 1})[:CHECKED]  # first, middle and last slot
        own = [
            engine.generate_batch([batch[i]], n, eos_id=()).results[0].tokens == out.results[i].tokens for i in picks
        ]
        r["checked_alone_in_engine"] = picks
        r["identical"] = ctx.report.check_identity(all(own), f"batch/greedy B={b}: a sequence differs run alone")
        r["same_as_b1_engine"] = sum(out.results[i].tokens == greedy_alone(i, batch[i]) for i in range(b))
        base = r["decode_tok_s"] if b == 1 else base
        r["vs_b1"] = r["decode_tok_s"] / base if base else None
        try:
            r["round_kernels"] = _round_kernels(engine, batch, n)
        except Exception as e:  # the profiler is an add-on (another tool may hold CUPTI): record why, go on
            r["round_kernels"] = {"error": _error_text(e)}
        print(
            f"  batch greedy B={b}: {r['decode_tok_s']:.0f} tok/s decode"
            + (f" ({r['vs_b1']:.2f}x B=1)" if r["vs_b1"] else "")
            + f", alone in the engine identical: {r['identical']}; tokens of the B=1 engine: "
            f"{r['same_as_b1_engine']}/{b}",
            flush=True,
        )
        ctx.report.save()
        engine = None  # noqa: F841
        gc.collect()
    if opts.peer_hf:
        sec["peer_hf"] = _hf_batches(ctx, name, sizes, prompts, n)
        ctx.report.save()
        for b, r in sec["greedy"].items():
            peer = sec["peer_hf"].get(b, {}).get("decode_tok_s")
            if peer and "decode_tok_s" in r:
                r["vs_transformers"] = r["decode_tok_s"] / peer
    sec["lookup"] = {}
    for b, k in lookups:
        why = ctx.budget.why_not(10.0 if opts.quick else 40.0, f"batch lookup B={b} k={k}")
        if why:
            sec["lookup"][f"B={b} k={k}"] = {"status": "skipped", "reason": why}
            continue
        echoes = [
            echo_prompt(p, greedy_alone(i, filler), None, rng, cfg.vocab_size, length)
            for i, (p, filler) in enumerate(prompts[:b])
        ]
        engine = Engine(params, cfg, max_len=max_len, k=k, prepare=opts.prepare_arg, batch_size=b)
        runs = {}
        for label, drafter in (("greedy", None), ("lookup", PromptLookup())):
            engine.generate_batch(echoes, n, drafter=drafter, eos_id=())  # warm
            runs[label] = engine.generate_batch(echoes, n, drafter=drafter, eos_id=())
        want = [r.tokens for r in runs["greedy"].results]
        same = all(r.tokens == w for r, w in zip(runs["lookup"].results, want, strict=True))
        g, s = _decode_rate(runs["greedy"]), _decode_rate(runs["lookup"])
        sec["lookup"][f"B={b} k={k}"] = {
            "greedy": g,
            "lookup": s,
            "speedup": s["decode_tok_s"] / g["decode_tok_s"],
            "identical": ctx.report.check_identity(same, f"batch/lookup B={b} k={k}: tokens differ from greedy"),
        }
        print(
            f"  batch lookup B={b} k={k}: {s['decode_tok_s']:.0f} tok/s, {s['decode_tok_s'] / g['decode_tok_s']:.2f}x "
            f"batch greedy (mean_accepted {s['mean_accepted']:.2f}), identical {same}",
            flush=True,
        )
        ctx.report.save()
        engine = None  # noqa: F841
        gc.collect()


def _round_kernels(engine: Engine, batch: list, n: int) -> dict | None:
    """GPU kernel time of one greedy batch round by group (`timing.kernel_times`), the prefills cancelled: the
    profile of n new tokens minus that of n // 2, over the rounds between them. None off the GPU."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    runs, rounds = {}, {}
    for tokens in (n // 2, n):

        def run(t=tokens):
            rounds[t] = engine.generate_batch(batch, t, eos_id=()).stats.rounds

        runs[tokens] = (kernel_times(profile(run), 1), rounds[tokens])
    (short, r0), (full, r1) = runs[n // 2], runs[n]
    per = r1 - r0
    groups = {g: round((us - short["groups_us"].get(g, 0.0)) / per, 1) for g, us in full["groups_us"].items()}
    return {
        "rows_per_round": engine.batch_size,
        "kernel_us_per_round": round((full["kernel_us"] - short["kernel_us"]) / per, 1),
        "launches_per_round": round((full["launches"] - short["launches"]) / per, 1),
        "groups_us_per_round": groups,
        "top_kernels_us_whole_run": full["top_kernels_us"],
    }


def _hf_batches(ctx: Context, name: str, sizes, prompts: list, n: int) -> dict:
    """transformers' batched greedy generate (bf16, sdpa, StaticCache) per batch size: decode tokens/s of the batch
    from two runs, n and 1 new tokens (the prefill cancels)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf_config_dict(name, ctx.opts.quick)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(ctx.opts.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "setup": "bf16, sdpa, StaticCache"}
    for b in sizes:
        why = ctx.budget.why_not(5.0 if ctx.opts.quick else 30.0, f"transformers batch B={b}")
        if why:
            out[str(b)] = {"status": "skipped", "reason": why}
            continue
        ids = np.stack([prompts[i][1] for i in range(b)]) % config.vocab_size
        _hf_generate(model, config, ids, 2, None, device)  # warm
        _, one_s = _hf_generate(model, config, ids, 1, None, device)
        _, full_s = _hf_generate(model, config, ids, n, None, device)
        out[str(b)] = {"decode_tok_s": b * (n - 1) / (full_s - one_s), "wall_s": full_s, "first_token_s": one_s}
        print(f"  transformers batch B={b}: {out[str(b)]['decode_tok_s']:.0f} tok/s decode", flush=True)
    return out
