"""Where a generated token's time goes on the on-device loop (issue 33: the Qwen3.5 text shape's decode at >= 45% of
the roofline; its greedy on-device loop runs 2.67 ms a token where its decode step's kernels take 2.49 ms).

For each model in --models (random int4, prepared as the Engine prepares them): greedy generations of 1 and of
--new-tokens tokens after a --prompt-len prompt, on the device loop (`Engine.generate(on_device=True)`) and on the
host loop, each timed (median of --repeats) and profiled once. Per token, from the difference of the two lengths
(the prefill and the first token cancel): the wall, the GPU kernel time and launches (`timing.kernel_times`), the
stream's idle time between kernels, and the largest gaps named by the kernels on either side, so a loop's own
overhead (the while loop's predicate, the argmax, the round's bookkeeping) shows apart from the decode step's.
Chains (--chains): the decode step, its argmax and `commit` in a bare `lax.while_loop` whose body runs U steps,
at the top level, nested in a `lax.cond` or with its state made inside the executable, timed as the loop is
(iterations T minus 1), their trials interleaved with the greedy device loop's (--trials): what a step costs inside
a CUDA graph's conditional node without the generation loop's bookkeeping, whether the conditional's per-iteration
cost shows (if it does, U = 2 runs a step faster), and whether nesting the loop in a conditional or making the state
inside the executable (as `generate_on_device` does both) costs.

The decode step alone (`jspec_bench.steps.lower_steps`, 3 chained calls at the prompt's context) is profiled in the
same run, for its kernels beside the loop's.

Inside a CUDA graph's conditional node (the shipped options graph the while loop: WHILE, CONDITIONAL) the profiler
records no kernel, so the loop's kernels show as one idle gap after `set_while_condition`; the variant
"host_while" compiles the on-device executable without WHILE and CONDITIONAL graphs, so the host drives the loop
(a predicate copied back per round) and every kernel of a round is recorded. --hlo-dir: the on-device executables'
optimized HLO, gzipped (it names no command buffer: XLA forms them from the thunks after the HLO passes; the runs at
c6a1893 and 8d186d4 counted computations named command_buffer* and found none).

Runs (Qwen3.5 text shape, 320-token random prompts, 64 tokens; experiments/results/):
- device_loop_profile_h200.json (c6a1893, with Llama-3-8B): the device loop 2.698 ms a token (Llama-3-8B 2.531),
  its kernels invisible to the profiler inside the conditional node.
- device_loop_profile_qwen35_h200.json (8d186d4): host_while 2.711 ms a token, 438 launches and 2496 us of kernels
  a token (the step alone 431 launches, ~2.50 ms); the shipped device loop 2.682.
- device_loop_chains_qwen35_h200.json (0ba94c4, not interleaved): chains of 1 / 2 / 4 steps an iteration 2.481 /
  2.642 / 2.644 ms a step, the device loop 2.673.
- device_loop_interleaved_qwen35_h200.json (2b4cecd): first trials 2.532 / 2.475 / 2.483 (1, 1-nested, 2), the
  generation 2.688; every later trial of every chain 2.62-2.69, the generation 2.65-2.68: neither the
  conditional's per-iteration cost nor the nesting shows; after the first round of trials the chains ran as slowly as
  the generation (on another machine start the chain alone held 2.49-2.51 for a minute: sustained_load.py).

    python3 benchmarks/experiments/device_loop_profile.py --commit SHA --out $OUT/device_loop_profile_h200.json
    python3 benchmarks/experiments/device_loop_profile.py --quick --out /tmp/device_loop_profile_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from xla_options import NO_GRAPHS  # noqa: E402

from jspec import engine as engine_module  # noqa: E402
from jspec.engine import Engine, compiler_options  # noqa: E402
from jspec.state import init_state  # noqa: E402
from jspec.steps import commit, decode_step  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402
from jspec_bench.shapes import copy_tree, model_config, random_int4_params, random_state, step_bytes  # noqa: E402
from jspec_bench.steps import lower_steps  # noqa: E402
from jspec_bench.timing import kernel_times, profile, stream_events  # noqa: E402
from pallas_kernels import ROW_TILE  # noqa: E402

SHIPPED = dict(engine_module.GPU_COMPILER_OPTIONS)


def without_command_buffers(*kinds: str) -> dict:
    """The shipped options with the command-buffer kinds `kinds` (e.g. "WHILE") left out of
    xla_gpu_enable_command_buffer: their ops run outside the graphs, launched from the host."""
    shipped = SHIPPED["xla_gpu_enable_command_buffer"].split(",")
    if unknown := set(kinds) - set(shipped):
        raise ValueError(f"command-buffer kinds {sorted(unknown)} are not among the shipped {shipped}")
    return SHIPPED | {"xla_gpu_enable_command_buffer": ",".join(k for k in shipped if k not in kinds)}


VARIANTS = {"shipped": SHIPPED, "host_while": without_command_buffers("WHILE", "CONDITIONAL")}

# XLA options, added to the shipped ones, on the prefill's dynamic-slice copy fusions (24 a 128-position chunk at the
# Qwen3.5 shape). As shipped the pass that makes them async is off (XLA's dynamic_slice_copy_fusion_async_wrapper.h:
# jspec.engine.GPU_COMPILER_OPTIONS), so they run on the main stream. "async_dsf": that pass on again, the copies
# async on 4 more streams as shipped before f4c1acc (sustained_load.py's thunk runs); with it on, "no_dsf": the
# dynamic-slice fusions off (the copies stay async), "dsf_verify": their offset checks on (which keeps them on the
# main stream). An empty xla_disable_hlo_passes clears the list.
ASYNC_COPIES = {"xla_disable_hlo_passes": ""}
DYNAMIC_SLICE_OPTIONS = {
    "async_dsf": ASYNC_COPIES,
    "no_dsf": ASYNC_COPIES | {"xla_gpu_enable_dynamic_slice_fusion": False},
    "dsf_verify": ASYNC_COPIES | {"xla_gpu_experimental_dynamic_slice_fusion_verify_offsets": True},
}

TOP_GAPS = 12  # the (kernel before, kernel after) pairs reported, by their idle time


def stream_gaps(prof) -> collections.Counter:
    """{(kernel before, kernel after): idle microseconds} over the GPU planes' stream lines of a profile."""
    gaps: collections.Counter = collections.Counter()
    for events in stream_events(prof):
        for prev, event in itertools.pairwise(events):
            if event.start_ns > prev.end_ns:
                gaps[(prev.name[:60], event.name[:60])] += (event.start_ns - prev.end_ns) / 1e3
    return gaps


def generation_wall(engine: Engine, prompt: np.ndarray, on_device: bool = True):
    """wall(tokens) -> seconds of one greedy generation of `tokens` new tokens after prompt, on the device loop or
    the host loop."""

    def wall(tokens: int) -> float:
        t0 = time.perf_counter()
        engine.generate(prompt, tokens, eos_id=(), on_device=on_device)
        return time.perf_counter() - t0

    return wall


def measure(engine: Engine, prompt: np.ndarray, n: int, on_device: bool, repeats: int) -> dict:
    """Per token over n - 1 tokens: the wall (median of repeats), the GPU kernels and the stream's gaps."""

    run = generation_wall(engine, prompt, on_device)
    run(n)  # compile, warm
    run(1)
    wall = statistics.median(run(n) - run(1) for _ in range(repeats)) / (n - 1)
    out = {"ms_per_token": 1e3 * wall, "tok_s": 1 / wall}
    return out | (token_kernels(run, n) or {})


def token_kernels(wall, n: int) -> dict | None:
    """A generation's GPU kernels per token, from a timer wall(tokens): a profile of wall(n) minus one of wall(1),
    over n - 1 (the prefill and the first token cancel): kernel us, launches, stream idle us, by group, the costliest
    kernels and the stream's largest gaps (`kernel_times`, `stream_gaps`); None off the GPU."""
    if jax.default_backend() != "gpu":
        return None
    long, short = profile(lambda: wall(n)), profile(lambda: wall(1))
    k_long, k_short = kernel_times(long, 1), kernel_times(short, 1)
    per = lambda key: (k_long[key] - k_short[key]) / (n - 1)  # noqa: E731
    g_long, g_short = stream_gaps(long), stream_gaps(short)
    g_long.subtract(g_short)
    return {
        "kernel_us_per_token": per("kernel_us"),
        "launches_per_token": per("launches"),
        "idle_us_per_token": per("idle_us"),
        "groups_us_per_token": {
            g: (us - k_short["groups_us"].get(g, 0.0)) / (n - 1) for g, us in k_long["groups_us"].items()
        },
        "top_kernels_us_per_token": {
            name: (us - k_short["top_kernels_us"].get(name, 0.0)) / (n - 1)
            for name, us in k_long["top_kernels_us"].items()
        },
        "gaps_us_per_token": {
            f"{a} -> {b}": round(us / (n - 1), 2) for (a, b), us in g_long.most_common(TOP_GAPS) if us > 0
        },
    }


def step_profiler(params: dict, cfg, context: int, calls: int = 3, state=None):
    """profile() -> the decode step's GPU kernels per call (`kernel_times`) over `calls` chained calls on `state`
    (default: a random one at `context`), compiled once (None off the GPU)."""
    if jax.default_backend() != "gpu":
        return None
    if state is None:
        state = random_state(cfg, context + 2 * ROW_TILE, context, jnp.bfloat16, 1)
    decode = lower_steps(params, cfg, state, {})["decode"].compile(compiler_options=compiler_options())

    def run():
        s = copy_tree(state)
        for _ in range(calls):
            s, logits = decode(params, s)
        logits.block_until_ready()

    run()
    return lambda: kernel_times(profile(run), calls)


def bare_step(params: dict, cfg, state):
    """One step of the bare decode chain: decode_step, its argmax committed (no round's bookkeeping)."""
    state, logits = decode_step(params, cfg, state)
    return commit(state, jnp.zeros((), jnp.int32), jnp.argmax(logits).astype(jnp.int32))


def chain_walls(params: dict, cfg, context: int, chains: list[str], iterations: int, state=None) -> dict:
    """{label: wall(trips) -> seconds} of decode chains (module docstring): "U" runs U steps a while-loop iteration,
    "U-nested" the same while loop inside a `lax.cond` (as `generate_on_device` nests its loop in the request
    check), "U-internal" with its state made inside the executable (zeros at `context`, as `generate_on_device` makes
    its own) rather than passed in, "U-nographs" compiled without command buffers (the host launches every kernel).
    Each call runs on a copy of `state` (default: a random state at `context` with room for the iterations; a given
    one must have that room itself)."""
    walls = {}
    for label in chains:
        unroll, nested, internal = int(label.split("-")[0]), label.endswith("-nested"), label.endswith("-internal")
        options = compiler_options()
        if options and label.endswith("-nographs"):
            options |= NO_GRAPHS
        max_len = context + iterations * unroll + 2 * ROW_TILE
        base = random_state(cfg, max_len, context, jnp.bfloat16, 1) if state is None else state

        def chain(params, state, trips, unroll=unroll, nested=nested, internal=internal, max_len=max_len):
            if internal:
                state = dataclasses.replace(init_state(cfg, max_len, jnp.bfloat16), position=jnp.asarray(context))

            def body(carry):
                state, i = carry
                for _ in range(unroll):
                    state = bare_step(params, cfg, state)
                return state, i + 1

            def run(state):
                return jax.lax.while_loop(lambda c: c[1] < trips, body, (state, jnp.zeros((), jnp.int32)))[0]

            return jax.lax.cond(trips > 0, run, lambda s: s, state) if nested else run(state)

        run_chain = jax.jit(chain, donate_argnums=1).lower(params, base, 1).compile(options)

        def wall(trips: int, base=base, run_chain=run_chain) -> float:
            state = copy_tree(base)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            run_chain(params, state, trips).position.block_until_ready()
            return time.perf_counter() - t0

        wall(iterations), wall(1)
        walls[label] = (wall, iterations, unroll)
    return walls


def interleaved(walls: dict, trials: int) -> dict:
    """{label: {"ms_per_step": median, "trials_ms": [...]}}: every label's (wall(T) - wall(1)) / ((T - 1) U), the
    labels taken in turn in each of `trials` rounds (so a drift of the machine touches them alike)."""
    times = {label: [] for label in walls}
    for _ in range(trials):
        for label, (wall, trips, unroll) in walls.items():
            times[label].append(1e3 * (wall(trips) - wall(1)) / ((trips - 1) * unroll))
    return {label: {"ms_per_step": statistics.median(t), "trials_ms": t} for label, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--models", default="qwen3.5")
    ap.add_argument("--new-tokens", type=int, default=65)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="shipped,host_while", help=f"of {list(VARIANTS)}")
    ap.add_argument("--hlo-dir", default=None)
    ap.add_argument(
        "--chains",
        default="1,1-nested,2",
        help="decode chains (U, U-nested, U-internal) timed beside the device loop, interleaved; empty: none",
    )
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--chain-iterations", type=int, default=33)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny shrunk shape")
    opts = ap.parse_args()
    t0 = time.perf_counter()
    out = {
        "meta": experiment_meta(opts.commit, new_tokens=opts.new_tokens, prompt_len=opts.prompt_len),
        "models": {},
    }
    n = 9 if opts.quick else opts.new_tokens
    for name in opts.models.split(","):
        cfg = model_config(name, opts.quick)
        params = random_int4_params(cfg, 0, True)
        max_len = opts.prompt_len + n + 16
        engine = Engine(params, cfg, max_len=max_len, k=1, prefill_chunk=128)
        prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (opts.prompt_len,)).astype(np.int32)
        res = out["models"][name] = {}
        state = dataclasses.replace(init_state(cfg, max_len, engine.dtype), position=opts.prompt_len + n // 2)
        res["bytes_per_token"] = step_bytes(engine.params, cfg, state, 1)  # at the middle token's context
        step = step_profiler(engine.params, cfg, opts.prompt_len + n // 2)
        res["decode_step_alone"] = step and step()
        iterations = 3 if opts.quick else opts.chain_iterations
        walls = chain_walls(engine.params, cfg, opts.prompt_len, [c for c in opts.chains.split(",") if c], iterations)

        generation = generation_wall(engine, prompt)
        walls["generate_on_device"] = (generation, n, 1)
        generation(n), generation(1)
        res["interleaved"] = interleaved(walls, opts.trials)
        for label, r in res["interleaved"].items():
            print(f"  {label}: {r['ms_per_step']:.3f} ms a step ({', '.join(f'{t:.3f}' for t in r['trials_ms'])})")
        for variant in [v for v in opts.variants.split(",") if v]:
            engine_module.GPU_COMPILER_OPTIONS = VARIANTS[variant]
            if variant != "shipped":
                engine = Engine(params, cfg, max_len=max_len, k=1, prefill_chunk=128)
            loops = (("device_loop", True), ("host_loop", False)) if variant == "shipped" else (("device_loop", True),)
            for label, on_device in loops:
                key = label if variant == "shipped" else f"{label}_{variant}"
                res[key] = r = measure(engine, prompt, n, on_device, opts.repeats)
                print(
                    f"{name} {key}: {r['ms_per_token']:.3f} ms a token ({r['tok_s']:.1f} tok/s)"
                    + (
                        f"; kernels {r['kernel_us_per_token']:.1f} us in {r['launches_per_token']:.1f} launches, "
                        f"idle {r['idle_us_per_token']:.1f} us"
                        if "kernel_us_per_token" in r
                        else ""
                    ),
                    flush=True,
                )
            if opts.hlo_dir:
                device_exec = next(ex for k, ex in engine._executables.items() if k[0] == "device")
                os.makedirs(opts.hlo_dir, exist_ok=True)
                with gzip.open(os.path.join(opts.hlo_dir, f"device_loop_{name}_{variant}.hlo.gz"), "wt") as f:
                    f.write(device_exec.as_text())
            del engine
        engine_module.GPU_COMPILER_OPTIONS = SHIPPED
        del params
    save_experiment(out, opts.out, t0)


if __name__ == "__main__":
    main()
