"""The end-to-end section: Engine tok/s at one bench shape (Llama-3-8B by default), greedy against PromptLookup
(gate on and off; host loop and on-device loop), on echo prompts (`echo_prompt`) whose echo pattern sets the
acceptance from ~1 to ~k + 1 tokens per verify, on the Markov random model (`shapes.scale_attention_output`); every
run's tokens are compared with plain greedy's."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

from jspec.drafters import PromptLookup
from jspec.engine import ROUNDS_PER_CALL, Engine
from jspec.gate import HitDensityGate
from jspec.stats import common_prefix
from jspec_bench.report import Context
from jspec_bench.shapes import model_config, scale_attention_output
from jspec_bench.steps import _init_estimate, _load_model
from jspec_bench.timing import run_parallel

E2E_CONFIGS = (  # (label, drafter?, gate?, on_device, host-loop rounds per device call), in priority order
    ("greedy/host", False, False, False, ROUNDS_PER_CALL),
    ("lookup/host", True, False, False, ROUNDS_PER_CALL),
    ("lookup+gate/host", True, True, False, ROUNDS_PER_CALL),
    ("greedy/device", False, False, True, ROUNDS_PER_CALL),
    ("lookup+gate/device", True, True, True, ROUNDS_PER_CALL),
    ("lookup/device", True, False, True, ROUNDS_PER_CALL),
    ("greedy/host-per-round", False, False, False, 1),  # the host loop syncing after every round
)


def echo_prompt(p: np.ndarray, g, period: int | None, rng: np.random.Generator, vocab: int, length: int) -> np.ndarray:
    """pad + P + G' + P, `length` tokens, where G' is greedy's own continuation G of the prompt with one random token
    inserted after every `period` tokens (None: G' = G) and pad is random tokens. Prompt lookup then drafts G' and
    is right up to the next inserted token: ~`period` tokens committed per verify step (period 1: every draft misses;
    None: ~k + 1), with no decode steps between.

    All prompts get the same length so that they share one prefill executable and the last prompt token sits at the
    same row of the prefill matmuls (a GEMM may sum rows of different tiles in different orders); to the Markov model
    the pad changes nothing, and random pad tokens are (almost) never matched by prompt lookup."""
    echoed = []
    for i, token in enumerate(g):
        echoed.append(int(token))
        if period and (i + 1) % period == 0:
            echoed.append(int(rng.integers(0, vocab)))
    return pad_prompt(np.concatenate([p, np.asarray(echoed, np.int64), p]), length, rng, vocab)


def random_filler(rng: np.random.Generator, vocab: int, plen: int, n: int, length: int):
    """(P, pad + P + R + P): a random prompt P of plen tokens and the filler prompt (R: n random tokens)."""
    p = rng.integers(0, vocab, plen).astype(np.int32)
    return p, pad_prompt(np.concatenate([p, rng.integers(0, vocab, n), p]), length, rng, vocab)


def acyclic_continuation(greedy: Callable, first: tuple, new_filler: Callable, attempts: int = 5):
    """(P, filler, G, attempts): the first random prompt (up to `attempts`) whose greedy continuation G repeats no
    token. For the Markov model a repeated token starts a cycle, which prompt lookup would hit without any echo.
    first: (P, filler, G) already generated; greedy(prompt) -> tokens; new_filler() -> (P, filler)."""
    p, filler, g = first
    tried = 1
    while len(set(g)) < len(g) and tried < attempts:
        p, filler = new_filler()
        g = greedy(filler)
        tried += 1
    return p, filler, list(g), tried


def pad_prompt(core: np.ndarray, length: int, rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Random tokens + core, `length` tokens in all (int32)."""
    if len(core) > length:
        raise ValueError(f"prompt of {len(core)} tokens does not fit the common length {length}")
    return np.concatenate([rng.integers(0, vocab, length - len(core)), core]).astype(np.int32)


def section_e2e(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    name = opts.e2e_model
    if name not in opts.models:
        sec.update(status="skipped", reason=f"--models does not include the end-to-end model {name}")
        return
    layers = model_config(name, opts.quick).num_layers
    n, k, plen = opts.new_tokens, opts.k, opts.prompt_len
    decode_s = _measured_decode_s(ctx, name)
    configs = [c for c in E2E_CONFIGS if c[0] in opts.e2e_configs]

    def estimate(cfgs) -> float:
        """init + concurrent compiles (+30% contention) + the first prompt's runs."""
        compiles = sum(ctx.estimator.estimate(layers, E2E_COMPILE_WEIGHT[c[3]]) for c in cfgs)
        runs = len(cfgs) * (opts.repeats + 1) * n * decode_s
        return _init_estimate(ctx, name) + 1.3 * compiles / min(opts.compile_threads, len(cfgs)) + runs

    while len(configs) > 2 and ctx.budget.why_not(estimate(configs), "e2e"):
        sec.setdefault("skipped_configs", []).append({"config": configs.pop()[0], "reason": "budget"})
    why = ctx.budget.why_not(estimate(configs), "e2e (greedy/host, lookup/host)")
    if why:
        ctx.kept.pop(name, None)
        sec.update(status="skipped", reason=why)
        return
    params, cfg, info = _load_model(ctx, name)
    sec.update(model=name, **info)
    params = scale_attention_output(params, opts.o_factor)
    length = 2 * plen + 2 * n  # every prompt: the longest echo prompt (period 1: G' has 2n tokens)
    max_len = length + n
    sec.update(o_factor=opts.o_factor, k=k, new_tokens=n, random_prompt_len=plen, prompt_len=length, max_len=max_len)
    rng = np.random.default_rng(opts.seed + 3)
    p, filler = random_filler(rng, cfg.vocab_size, plen, n, length)
    engines = {c[0]: Engine(params, cfg, max_len=max_len, k=k, prepare=opts.prepare_arg) for c in configs}
    sec["prepared"] = next(iter(engines.values())).prepared
    kwargs = {c[0]: _run_kwargs(c) for c in configs}

    def run(label: str, prompt: np.ndarray):
        return engines[label].generate(prompt, n, **kwargs[label])

    # Compile (concurrently) and run every configuration once on the filler prompt; its greedy output is G.
    before = ctx.compiles.count
    warm = run_parallel({label: functools.partial(run, label, filler) for label in engines}, opts.compile_threads)
    sec["warmup_s"] = {label: seconds for label, (_, seconds) in warm.items()}  # compile + one run
    sec["backend_compiles"] = ctx.compiles.count - before
    sec["num_compiles"] = {label: eng.num_compiles for label, eng in engines.items()}
    print(f"  e2e: {len(engines)} configurations compiled and run once in {max(sec['warmup_s'].values()):.1f} s")
    g = warm["greedy/host"][0].tokens
    for label, (result, _) in warm.items():
        ctx.report.check_identity(result.tokens == g, f"e2e/warm-up/{label}: tokens != greedy")
    p, filler, g, sec["continuation_attempts"] = acyclic_continuation(
        lambda prompt: run("greedy/host", prompt).tokens,
        (p, filler, g),
        lambda: random_filler(rng, cfg.vocab_size, plen, n, length),
    )
    sec["greedy_distinct_fraction"] = len(set(g)) / len(g)  # < 1: G repeats itself, lookup hits without the echo
    variants = [("filler", None, filler)]
    for period in (*opts.insert_periods, None):
        prompt = echo_prompt(p, g, period, rng, cfg.vocab_size, length)
        variants.append(("full" if period is None else f"insert{period}", period, prompt))
    sec["variants"] = {}
    before = ctx.compiles.count
    variant_s = len(configs) * opts.repeats * n * decode_s
    for vname, period, prompt in variants:
        why = ctx.budget.why_not(variant_s, f"e2e prompt {vname}")
        if why:
            sec["variants"][vname] = {"status": "skipped", "reason": why}
            continue
        t0 = time.perf_counter()
        sec["variants"][vname] = _run_variant(ctx, engines, kwargs, vname, period, prompt, g)
        variant_s = time.perf_counter() - t0
        ctx.report.save()
    sec["compiles_after_warmup"] = ctx.compiles.count - before
    sec["engine_compiles_after_warmup"] = {
        label: eng.num_compiles - sec["num_compiles"][label] for label, eng in engines.items()
    }


E2E_COMPILE_WEIGHT = {False: 2.2, True: 4.5}  # host: prefill + decode/verify rounds; device: all in one executable


def _measured_decode_s(ctx: Context, name: str) -> float:
    """The decode step time of `name` measured by the steps section, else a guess (for budget estimates)."""
    entry = ctx.report.data["sections"].get("steps", {}).get("models", {}).get(name, {})
    return entry["decode"]["time_s"] if "decode" in entry else (0.002 if ctx.opts.quick else 0.01)


def _run_kwargs(config: tuple) -> dict:
    _, lookup, gate, on_device, rounds_per_call = config
    return dict(
        drafter=PromptLookup() if lookup else None,
        gate=HitDensityGate() if gate else None,
        on_device=on_device,
        rounds_per_call=rounds_per_call,
    )


def _run_variant(ctx: Context, engines: dict, kwargs: dict, vname: str, period, prompt, g: list[int]) -> dict:
    """Every configuration `repeats` times on one prompt, interleaved; every run's tokens checked against greedy's.

    decode_tok_s excludes prefill: (new tokens - 1) / (wall - prefill). The host loop times its prefill itself; for
    the on-device loop (one executable) prefill is the wall time of the same executable with max_new_tokens=1."""
    runs: dict[str, list] = {label: [] for label in engines}
    prefills: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(ctx.opts.repeats):
        for label, eng in engines.items():
            runs[label].append(eng.generate(prompt, len(g), **kwargs[label]))
            if kwargs[label]["on_device"]:
                prefills[label].append(eng.generate(prompt, 1, **kwargs[label]).stats.wall_time_s)
            else:
                prefills[label].append(runs[label][-1].stats.prefill_time_s)
    greedy = runs["greedy/host"][0].tokens
    out = {
        "prompt_len": len(prompt),
        "prefill_chunks": -(-len(prompt) // engines["greedy/host"].prefill_chunk),
        "insert_period": period,
        "echo_fraction": 0.0 if vname == "filler" else period / (period + 1) if period else 1.0,
        "greedy_repeats_echo": common_prefix(greedy, g) / len(g),  # 1.0: greedy continued with G, as designed
        "configs": {},
    }
    for label, results in runs.items():
        for i, r in enumerate(results):
            ctx.report.check_identity(r.tokens == greedy, f"e2e/{vname}/{label}/run{i}: tokens != greedy")
        wall = statistics.median(r.stats.wall_time_s for r in results)
        prefill = statistics.median(prefills[label])
        s = results[0].stats
        out["configs"][label] = {
            "identical_to_greedy": all(r.tokens == greedy for r in results),
            "tok_s": len(greedy) / wall,
            "decode_tok_s": (len(greedy) - 1) / (wall - prefill) if wall > prefill else None,  # None: timing noise
            "wall_s": [r.stats.wall_time_s for r in results],
            "prefill_s": prefills[label],
            "mean_accepted": s.mean_accepted,
            "acceptance_rate": s.acceptance_rate,
            "verify_steps": s.verify_steps,
            "decode_steps": s.decode_steps,
            "gate_engaged": s.gate_engaged,
            "would_hits": s.would_hits,
        }
    for label, c in out["configs"].items():
        base = out["configs"].get("greedy/" + label.split("/")[1])
        if base and not label.startswith("greedy") and c["decode_tok_s"] and base["decode_tok_s"]:
            c["speedup_vs_greedy"] = c["decode_tok_s"] / base["decode_tok_s"]
    summary = " ".join(_run_summary(label, c) for label, c in out["configs"].items())
    print(f"  e2e {vname}: decode tok/s {summary}", flush=True)
    return out


def _run_summary(label: str, c: dict) -> str:
    if "speedup_vs_greedy" not in c:
        return f"{label} {_num(c['decode_tok_s'], '.0f')}"
    return f"{label} {c['decode_tok_s']:.0f} (x{c['speedup_vs_greedy']:.2f} m={c['mean_accepted']:.2f})"


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)
