"""The `sampling` section: what position-keyed sampling (jspec.Sampler) costs and buys at the e2e model's shape.

1. The sampler alone: `jspec.sampling.choose_rows` on the one row a decode step samples and the k + 1 rows a verify
   samples (float32 logits [rows, V], V = 128256 and 152064, the Llama-3 and Qwen2.5 vocabularies), per processor
   set; jitted, median time per call of chained calls, and under the XLA profiler its GPU kernel time.
2. In the step: the host loop's decode rounds greedy and sampled (no drafter), ms per token, prefill excluded;
   the median of `REPEATS` runs of each, interleaved.
3. End to end with prompt lookup at --sampling-temperature: tok/s against plain sampling with the same seed, and the
   tokens compared. The prompt is the e2e section's echo construction with the sampled continuation S of a filler
   prompt echoed; both prompts end at the same position, so (the model being Markov, attention zeroed) the sample
   after the echo prompt is S again, which prompt lookup finds in the prompt.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import PromptLookup
from jspec.engine import Engine
from jspec.sampling import Sampler, choose_rows
from jspec_bench.e2e import echo_prompt, random_filler
from jspec_bench.report import Context
from jspec_bench.shapes import scale_attention_output
from jspec_bench.steps import _load_model
from jspec_bench.timing import kernel_times, profile

SAMPLERS = {
    "temperature": Sampler(temperature=0.7),
    "top_k 50": Sampler(temperature=0.7, top_k=50),
    "top_p 0.9": Sampler(temperature=0.7, top_p=0.9),
    "min_p 0.05": Sampler(temperature=0.7, min_p=0.05),
    "all + penalty": Sampler(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
}


REPEATS = 3


def sampler_cost(rows: int, vocab: int, sampler: Sampler, calls: int) -> dict:
    """Seconds per `choose_rows` call on random logits [rows, vocab] (and the GPU kernel time of one call)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 4, jnp.float32)
    seen = jnp.asarray(rng.random((rows, vocab)) < 0.01)
    values = sampler.values()
    positions = jnp.arange(100, 100 + rows, dtype=jnp.int32)
    fn = jax.jit(lambda z, p, s: choose_rows(z, p, sampler.mode, values, s if sampler.mode.penalty else None))
    jax.block_until_ready(fn(logits, positions, seen))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(logits, positions, seen)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    result = {"time_s": statistics.median(times), "trials_s": times}
    if jax.default_backend() == "gpu":
        try:
            result["gpu_kernels"] = kernel_times(profile(lambda: jax.block_until_ready(fn(logits, positions, seen))), 1)
        except Exception as e:  # the profiler is an add-on
            result["gpu_kernels"] = {"error": repr(e)}
    return result


def section_sampling(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    calls = 3 if opts.quick else 50
    vocabs = (2048,) if opts.quick else (128256, 152064)
    sec["rows"] = {"decode": 1, "verify": opts.k + 1}  # what a decode step and a verify step sample
    sec["sampler_alone"] = {}
    for vocab in vocabs:
        for label, sampler in SAMPLERS.items():
            r = sec["sampler_alone"][f"{label} V={vocab}"] = {}
            for kind, rows in sec["rows"].items():
                r[kind] = sampler_cost(rows, vocab, sampler, calls)
                kernels = r[kind].get("gpu_kernels", {}).get("kernel_us")
                gpu = f", GPU kernels {kernels:.0f} us" if kernels else ""
                print(
                    f"  sampler {label} V={vocab} ({rows} rows): {r[kind]['time_s'] * 1e6:.0f} us per call{gpu}",
                    flush=True,
                )
    name = opts.e2e_model
    why = ctx.budget.why_not(20.0 if opts.quick else 120.0, "sampling in the step and end to end")
    if why or name not in opts.models:
        sec.update(status="partial", reason=why or f"--models does not include {name}")
        return
    params, cfg, info = _load_model(ctx, name)
    sec.update(model=name, vocab=cfg.vocab_size, **{k: info[k] for k in ("source", "config")})
    params = scale_attention_output(params, opts.o_factor)
    n, plen = opts.new_tokens, opts.prompt_len
    length = 2 * plen + n
    engine = Engine(params, cfg, max_len=length + n + 16, k=opts.k, prepare=opts.prepare_arg)
    rng = np.random.default_rng(opts.seed + 11)
    p, filler = random_filler(rng, cfg.vocab_size, plen, n, length)
    sampler = dataclasses.replace(SAMPLERS["temperature"], temperature=opts.sampling_temperature, seed=opts.seed)
    sec.update(temperature=sampler.temperature, k=opts.k, new_tokens=n, prompt_len=length)

    def run(prompt, **kwargs):
        engine.generate(prompt, n, eos_id=(), **kwargs)  # warm
        result = engine.generate(prompt, n, eos_id=(), **kwargs)
        s = result.stats
        decode_s = s.wall_time_s - s.prefill_time_s
        return result.tokens, {
            "decode_tok_s": (len(result.tokens) - 1) / decode_s,
            "ms_per_token": 1e3 * decode_s / (len(result.tokens) - 1),
            "mean_accepted": s.mean_accepted,
            "verify_steps": s.verify_steps,
        }

    step = sec["in_step"] = {}
    in_step = {"greedy": None, **{label: SAMPLERS[label] for label in ("temperature", "top_k 50", "top_p 0.9")}}
    trials = {label: [] for label in in_step}
    for _ in range(REPEATS):
        for label, s in in_step.items():
            kwargs = {} if s is None else {"sampler": dataclasses.replace(s, seed=opts.seed)}
            trials[label].append(run(filler, **kwargs)[1])
    for label, runs in trials.items():
        ms = statistics.median(r["ms_per_token"] for r in runs)
        step[label] = {
            "ms_per_token": ms,
            "decode_tok_s": 1e3 / ms,
            "trials_ms_per_token": [r["ms_per_token"] for r in runs],
        }
    for label in list(in_step)[1:]:
        step[label]["extra_ms_per_token"] = step[label]["ms_per_token"] - step["greedy"]["ms_per_token"]
        step[label]["extra_fraction"] = step[label]["extra_ms_per_token"] / step["greedy"]["ms_per_token"]
        print(
            f"  decode sampled ({label}): {step[label]['ms_per_token']:.3f} ms/token vs greedy "
            f"{step['greedy']['ms_per_token']:.3f} ({100 * step[label]['extra_fraction']:+.1f}%)",
            flush=True,
        )
    s_tokens, _ = run(filler, sampler=sampler)
    sec["echo"] = {}
    for vname, prompt in (("filler", filler), ("echo", echo_prompt(p, s_tokens, None, rng, cfg.vocab_size, length))):
        plain, plain_stats = run(prompt, sampler=sampler)
        spec, spec_stats = run(prompt, sampler=sampler, drafter=PromptLookup())
        identical = ctx.report.check_identity(spec == plain, f"sampling/{vname}: lookup tokens != plain sampling")
        sec["echo"][vname] = {
            "plain": plain_stats,
            "lookup": spec_stats,
            "identical": identical,
            "speedup": spec_stats["decode_tok_s"] / plain_stats["decode_tok_s"],
            "continuation_is_the_echo": vname == "echo" and plain == s_tokens,
        }
        print(
            f"  sampled T={sampler.temperature} {vname}: lookup {sec['echo'][vname]['speedup']:.2f}x plain sampling "
            f"(mean_accepted {spec_stats['mean_accepted']:.2f}), identical {identical}",
            flush=True,
        )
    engine = None  # noqa: F841  (its prepared weights go before the next section)
    gc.collect()
