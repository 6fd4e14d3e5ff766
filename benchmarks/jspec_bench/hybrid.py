"""The `hybrid` section: Qwen3.5-style hybrids (3 Gated DeltaNet : 1 gated attention layers, one MTP layer) at full
depth, random int4 weights (`shapes.HYBRID_MODELS`: transformers' Qwen3.5 text shape, 9.0B parameters, and a typed-in
27B-class shape, 26.9B; the configs are in the JSON).

1. Steps, each model in --models: decode_step and verify_step(k), k = 1, 2, 3, at --context (`steps.measure_steps`:
   time, bytes, % of the roofline, verify / decode, GPU kernel groups, verify rows == decode rows bitwise; the
   dense sections' `--ks` do not apply).
2. The recurrent kernel (`pallas_kernels.recurrent.gdn_rows`) alone on one layer's candidate states (donated, as
   in a step): time per call at 1 .. 4 rows (its GPU kernel time on the GPU, else the wall of chained calls), its
   fixed cost (the intercept of a line through those times) and the state bytes it reads per row; on the GPU also
   the same from inside the measured steps (their kernel group over their Gated DeltaNet layers).
3. End to end on the on-device loop, the last model measured: greedy, prompt lookup (k = 3) on an echo prompt, and
   the random MTP head drafting k = 1, 2, 3 (its acceptance says nothing, its cost does), all compiled first, the
   engines concurrently (at the 27B-class shape an on-device executable compiles for minutes; `warmup_s`): greedy
   on the engine of the smallest k (its tokens are every engine's), so no engine compiles more than two, and every
   engine prefills in chunks of `E2E_PREFILL_CHUNK` positions (an on-device executable holds a copy of the model
   for each chunk shape; the prefill is not what this part times); then
   decode tok/s as (n minus 1) new tokens over the wall of n minus that of 1 (--hybrid-e2e-only: this part alone,
   without 1 and 2); tokens against greedy (an identity check); an MTP round's cost
   (head + verify) against a decode step, and the speedup that round predicts at the trained demo-hybrid's measured
   acceptance (`DEMO_ACCEPTANCE`: mean_accepted / round_vs_decode, per prompt category). The token mixers' outputs
   are scaled as in e2e (--o-factor), so the random model follows the echo.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import MTPDrafter, PromptLookup
from jspec.engine import Engine
from jspec.exactness import bits
from jspec.models import hybrid
from jspec_bench.e2e import E2E_COMPILE_WEIGHT, echo_prompt, random_filler
from jspec_bench.report import Context
from jspec_bench.shapes import HYBRID_MODELS, model_config, scale_attention_output
from jspec_bench.steps import _load_model, _steps_for_models
from jspec_bench.timing import device_decode_rate, kernel_times, profile, run_parallel
from pallas_kernels import ROW_TILE
from pallas_kernels.recurrent import gdn_rows

KS = (1, 2, 3)  # verify draft lengths and MTP k (the workload's drafts are short)
LOOKUP_K = 3
E2E_PREFILL_CHUNK = 128  # one chunk shape (`jspec.steps.chunk_sizes`): one prefill copy of the model per executable
ASSUMED_DECODE_BPS = 2e12  # --hybrid-e2e-only: the budget's decode step, weight bytes at this rate (H200: ~47%)
# The trained demo-hybrid's MTP acceptance (benchmarks/demo_acceptance.py, all nine prompts): what a trained head
# accepts, where the random 27B-class head accepts nothing.
DEMO_ACCEPTANCE = os.path.join(os.path.dirname(__file__), "..", "results", "demo_hybrid_acceptance_cpu.json")


def section_hybrid(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    names = [n for n in HYBRID_MODELS if n in opts.models]
    ks = (LOOKUP_K,) if opts.quick else KS  # quick: one verify and one MTP engine (compiles dominate on a CPU)
    sec["ks"] = list(ks)
    last = names[-1] if names else None
    if not opts.hybrid_steps:  # the end-to-end part alone
        sec["steps"] = "skipped (--hybrid-e2e-only)"
        if last is not None:
            params, cfg, info = _load_model(ctx, last)
            decode_s = info["param_bytes"] / ASSUMED_DECODE_BPS
            sec["e2e"] = {"model": last, "status": "running", "budget_decode_s": decode_s}
            end_to_end(ctx, sec["e2e"], last, params, cfg, ks, decode_s)
        return
    _steps_for_models(ctx, sec, names, ks, keep=last)
    done = [n for n in names if sec["models"][n].get("status") == "done"]
    for name in done:
        cfg = model_config(name, opts.quick)
        r = sec["models"][name]["recurrent"] = recurrent_cost(cfg, 3 if opts.quick else 50)
        r["in_step"] = in_step_recurrent(sec["models"][name], cfg)
        print(f"  {name} recurrent kernel: {_recurrent_line(r)}", flush=True)
        ctx.report.save()
    if last not in done:
        ctx.kept.pop(last, None)
        return
    sec["e2e"] = {"model": last, "status": "running"}
    params, cfg, _ = _load_model(ctx, last)  # the steps' params, kept (taken out of ctx.kept)
    end_to_end(ctx, sec["e2e"], last, params, cfg, ks, sec["models"][last]["decode"]["time_s"])
    params = None
    gc.collect()


def recurrent_args(cfg, seed: int) -> tuple[dict, tuple]:
    """Random `gdn_rows` arguments for one Gated DeltaNet layer of cfg: (its cache {"conv", "ssm"}, as
    `hybrid.init_cache` lays it out, random; (inputs, a_log, dt_bias)), inputs float32 [ROW_TILE, 2 C + 2 h]: the
    conv's outputs, the gates b | a, then the conv's inputs (bfloat16 values, as a step gives them)."""
    rng = np.random.default_rng(seed)
    h = cfg.linear_num_value_heads
    layer = hybrid.init_cache(dataclasses.replace(cfg, layer_types=("linear_attention",)), 1, jnp.bfloat16)[0]
    cache = {name: jnp.asarray(rng.normal(size=x.shape), x.dtype) for name, x in layer.items()}
    channels = layer["conv"].shape[1]
    raw = rng.normal(size=(ROW_TILE, channels)).astype(jnp.bfloat16).astype(np.float32)
    inputs = np.concatenate([rng.normal(size=(ROW_TILE, channels + 2 * h)).astype(np.float32), raw], axis=1)
    a_log = jnp.asarray(np.log(rng.uniform(1, 16, h)).astype(np.float32))
    return cache, (jnp.asarray(inputs), a_log, jnp.ones(h, jnp.float32))


def recurrent_cost(cfg, calls: int) -> dict:
    """`gdn_rows` alone on one layer's ROW_TILE candidate states and conv cache, donated and chained as in a step (an
    undonated call makes XLA copy all ROW_TILE states first: on the H200 that copy was 15-25 us of a ~20-28 us
    call): seconds per call at 1 .. 4 rows (on the GPU the kernel's own time, XLA profiler; else the wall of chained
    calls), the fixed cost (intercept of the least-squares line over rows), state bytes per row, and row invariance
    (one call over 4 rows == 4 chained one-row calls, bits of the output and of the state each leaves in slot 0)."""
    nk = cfg.linear_num_key_heads
    cache0, inputs = recurrent_args(cfg, 0)
    state_bytes = int(cache0["ssm"][0].nbytes)
    rows_in = inputs[0]
    slot = jnp.zeros((), jnp.int32)  # a traced argument, as DecodeState.slot in the steps
    step = functools.partial(gdn_rows, key_heads=nk)
    fns = {rows: jax.jit(functools.partial(step, rows=rows), donate_argnums=0) for rows in (1, 2, 3, 4)}
    on_gpu = jax.default_backend() == "gpu"
    source = "GPU kernel time of jspec_gdn_rows (XLA profiler), best of 3" if on_gpu else "wall of chained calls"
    out = {"state_bytes_per_row": state_bytes, "seconds": {}, "source": source, "donated": True}

    def fresh():
        return jax.tree.map(jnp.copy, cache0)

    def chain(fn, cache, n):
        for _ in range(n):
            cache, res = fn(cache, slot, *inputs)
        return jax.block_until_ready((cache, res))[0]

    for rows, fn in fns.items():
        cache = chain(fn, fresh(), 2)  # compile, warm
        if on_gpu:

            def run(fn=fn):
                nonlocal cache  # donated: each call's cache feeds the next
                cache = chain(fn, cache, calls)

            us = [kernel_times(profile(run), calls)["groups_us"]["recurrent"] for _ in range(3)]
            out["seconds"][str(rows)] = 1e-6 * min(us)
        else:
            t0 = time.perf_counter()
            cache = chain(fn, cache, calls)
            out["seconds"][str(rows)] = (time.perf_counter() - t0) / calls
    rows = np.arange(1, 5)
    slope, intercept = np.polyfit(rows, [out["seconds"][str(r)] for r in rows], 1)
    out.update(fixed_s=float(intercept), per_row_s=float(slope))
    out["per_row_Bps"] = out["state_bytes_per_row"] / slope if slope > 0 else None
    all_cache, all_out = fns[4](fresh(), slot, *inputs)
    c, same = fresh(), True
    for i in range(4):
        c, o = fns[1](c, slot, jnp.roll(rows_in, -i, axis=0), *inputs[1:])
        same &= np.array_equal(bits(o[0]), bits(all_out[i]))
        for name, x in hybrid.candidate_state(c, 0).items():
            same &= np.array_equal(bits(x), bits(hybrid.candidate_state(all_cache, i)[name]))
    out["rows_bit_identical"] = bool(same)
    return out


def in_step_recurrent(model: dict, cfg) -> dict | None:
    """The recurrent kernel's time per call inside the measured steps (decode: 1 row, verify k: k + 1 rows), from
    their GPU kernel groups over the step's Gated DeltaNet layers, and the fixed cost of a line through them; None
    without GPU profiles."""
    calls = sum(kind == "linear_attention" for kind in cfg.layer_types)
    steps = {1: model.get("decode", {})} | {int(k) + 1: v for k, v in model.get("verify", {}).items()}
    us = {r: s["gpu_kernels"]["groups_us"].get("recurrent") for r, s in steps.items() if "gpu_kernels" in s}
    us = {r: t for r, t in us.items() if t is not None}
    if len(us) < 2 or not calls:
        return None
    rows = sorted(us)
    slope, intercept = np.polyfit(rows, [us[r] / calls for r in rows], 1)
    return {
        "seconds": {str(r): 1e-6 * us[r] / calls for r in rows},
        "calls_per_step": calls,
        "fixed_s": 1e-6 * float(intercept),
        "per_row_s": 1e-6 * float(slope),
        "source": "the steps' GPU kernel group 'recurrent' over their Gated DeltaNet layers",
    }


def _recurrent_line(r: dict) -> str:
    def fit(r):
        times = ", ".join(f"{rows} rows {s * 1e6:.1f} us" for rows, s in r["seconds"].items())
        return f"{times}; fixed {r['fixed_s'] * 1e6:.1f} us, per row {r['per_row_s'] * 1e6:.1f} us"

    step = f"; in the steps: {fit(r['in_step'])}" if r.get("in_step") else ""
    return f"alone: {fit(r)}{step}; rows bit-identical {r['rows_bit_identical']}"


def predicted_speedup(k: int, round_vs_decode: float) -> dict:
    """{category: speedup} of MTP k over greedy at the demo-hybrid's measured mean_accepted (tokens a round) and
    this round's cost: mean_accepted / round_vs_decode; with the acceptance file and commit it comes from."""
    with open(DEMO_ACCEPTANCE) as f:
        acceptance = json.load(f)
    summary = acceptance["summary"]
    return {
        "source": f"benchmarks/results/{os.path.basename(DEMO_ACCEPTANCE)} at {acceptance['commit']}",
        **{cat: summary[cat][f"mtp_k{k}"]["mean_accepted"] / round_vs_decode for cat in ("edit", "free")},
    }


def _e2e_sizes(opts) -> tuple[int, int, int]:
    """(repeats, new tokens, filler prompt length) of `end_to_end`'s runs."""
    return (1, 8, 16) if opts.quick else (3, opts.new_tokens, opts.prompt_len)


def _configs(ks: tuple[int, ...]) -> dict:
    """{label: (the engine's k, drafter)} of `end_to_end`: greedy (on the engine of the smallest k: greedy tokens
    do not depend on an engine's k, and the engine of LOOKUP_K already runs lookup and MTP), prompt lookup and MTP
    at each k."""
    return {
        "greedy": (min(ks), None),
        f"lookup k={LOOKUP_K}": (LOOKUP_K, PromptLookup()),
        **{f"mtp k={k}": (k, MTPDrafter()) for k in ks},
    }


def _e2e_estimate(ctx: Context, cfg, decode_s: float, ks: tuple[int, ...]) -> float:
    """Seconds `end_to_end` takes: its on-device compiles (as the steps' compiles so far predict, weighted like
    e2e's on-device engines; one thread per engine, +30% for contention) and, per configuration, 2 x repeats + 3
    generations of its new tokens (the warm-up ones included, each timed pair's one-token run counted at full
    length: a margin) at about the decode step's time."""
    repeats, n, _ = _e2e_sizes(ctx.opts)
    configs = _configs(ks)
    compile_s = ctx.estimator.estimate(cfg.num_layers, E2E_COMPILE_WEIGHT[True])
    per_engine = collections.Counter(k for k, _ in configs.values())  # configurations compiled by each engine
    waves = -(-len(per_engine) // min(ctx.opts.compile_threads, len(per_engine)))
    return 1.3 * compile_s * max(per_engine.values()) * waves + len(configs) * (2 * repeats + 3) * n * decode_s


def end_to_end(ctx: Context, e2e: dict, name: str, params: dict, cfg, ks: tuple[int, ...], decode_s: float) -> None:
    """Greedy, prompt lookup and MTP on the on-device loop into e2e (decode_s: the decode step's time, for the
    budget). Every configuration compiles first, the engines concurrently (one thread each, its configurations in
    turn: `warmup_s` holds each one's compile and first run), then each is timed."""
    opts = ctx.opts
    repeats, n, plen = _e2e_sizes(opts)
    params = scale_attention_output(params, opts.o_factor)
    length = 2 * plen + n
    rng = np.random.default_rng(opts.seed + 29)
    p, filler = random_filler(rng, cfg.vocab_size, plen, n, length)
    configs = _configs(ks)
    e2e.update(
        new_tokens=n, prompt_len=length, o_factor=opts.o_factor, loop="on device", prefill_chunk=E2E_PREFILL_CHUNK
    )
    why = ctx.budget.why_not(_e2e_estimate(ctx, cfg, decode_s, ks), f"hybrid e2e of {name}")
    if why:
        e2e.update(status="skipped", reason=why)
        return
    ks_of_engines = {k for k, _ in configs.values()}  # one engine per draft length
    engines = {
        k: Engine(params, cfg, max_len=length + n + 16, k=k, prepare=opts.prepare_arg, prefill_chunk=E2E_PREFILL_CHUNK)
        for k in ks_of_engines
    }

    def warm(k: int) -> dict:  # compile and run once each configuration of engine k (the filler prompt's shape)
        out = {}
        for label, (ek, drafter) in configs.items():
            if ek == k:
                t0 = time.perf_counter()
                engines[k].generate(filler, n, eos_id=(), on_device=True, drafter=drafter)
                out[label] = time.perf_counter() - t0
                print(f"  hybrid {name} {label}: compiled and run once in {out[label]:.0f} s", flush=True)
        return out

    try:
        t0 = time.perf_counter()
        warmed = run_parallel({str(k): functools.partial(warm, k) for k in engines}, opts.compile_threads)
        e2e["warmup_s"] = {label: s for seconds, _ in warmed.values() for label, s in seconds.items()}
        print(
            f"  hybrid {name}: {len(configs)} configurations compiled in {time.perf_counter() - t0:.0f} s", flush=True
        )
        ctx.report.save()
        plain = engines[configs["greedy"][0]]
        greedy, e2e["greedy"] = device_decode_rate(plain, filler, n, repeats)
        echo = echo_prompt(p, greedy, None, rng, cfg.vocab_size, length)
        want, e2e["greedy_echo"] = device_decode_rate(plain, echo, n, repeats)
        for label, (k, drafter) in configs.items():
            if label == "greedy":
                continue
            prompt, expected = (echo, want) if label.startswith("lookup") else (filler, greedy)
            tokens, r = device_decode_rate(engines[k], prompt, n, repeats, drafter=drafter)
            r["identical"] = ctx.report.check_identity(tokens == expected, f"hybrid/{label}: tokens != greedy")
            r["speedup"] = r["decode_tok_s"] / (e2e["greedy_echo" if prompt is echo else "greedy"]["decode_tok_s"])
            if label.startswith("mtp"):
                r["round_vs_decode"] = r["ms_per_round"] / e2e["greedy"]["ms_per_round"]
                r["predicted_speedup_at_demo_acceptance"] = predicted_speedup(k, r["round_vs_decode"])
            e2e[label] = r
            print(
                f"  hybrid {name} {label}: {r['decode_tok_s']:.1f} tok/s ({r['speedup']:.2f}x greedy), mean_accepted "
                f"{r['mean_accepted']:.2f}, identical {r['identical']}",
                flush=True,
            )
            ctx.report.save()
        e2e["status"] = "done"
    except Exception as e:
        ctx.report.failed(e2e, "hybrid e2e", e)
    finally:
        engines.clear()
