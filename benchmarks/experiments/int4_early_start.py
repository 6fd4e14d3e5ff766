"""Does starting the int4 kernel early shorten the decode step (issue 33)? `int4_ws.Config.early_start`: the kernel
is launched with CUDA's programmatic stream serialization, so its CTAs start as the kernel before them finishes, ask
L2 for the weights of their first ring of steps and wait for that kernel (`griddepcontrol.wait`) before reading x.
The Qwen3.5 step runs 129 int4 launches, most of them 4-12 pipeline steps a CTA, whose ramp (the first weight tiles'
DRAM latency) and launch gap this would hide.

For each model in --models (random int4, prepared as the Engine prepares them), each variant (early_start off, on,
and "wait": on with its L2 prefetch a no-op) compiled in this process: the decode step's logits (3 chained calls)
and cache bits, which must be equal between the variants; the step's kernels profiled per call
(`device_loop_profile.step_profiler`); bare decode chains (`device_loop_profile.chain_walls`: "1" with the shipped
graphs, "1-nographs" launched from the host), every variant's trials interleaved (`interleaved`); then (unless --no-
generate) one Engine per variant, their greedy on-device generations of --new-tokens tokens interleaved, ms a token
from the difference of two lengths, the tokens compared. The chains run first: a process's first generation slows
every later step (sustained_load.py).

    python3 benchmarks/experiments/int4_early_start.py --commit SHA --out $OUT/int4_early_start_h200.json
    python3 benchmarks/experiments/int4_early_start.py --quick --out /tmp/int4_early_start_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/: device_loop_profile

import jax  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_loop_profile import chain_walls, generation_wall, interleaved, step_profiler  # noqa: E402

from jspec.engine import Engine, compiler_options  # noqa: E402
from jspec.exactness import bits  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402
from jspec_bench.roofline import _xla_sum_Bps  # noqa: E402
from jspec_bench.shapes import copy_tree, model_config, random_int4_params, random_state, step_bytes  # noqa: E402
from jspec_bench.steps import lower_steps  # noqa: E402
from pallas_kernels import ROW_TILE, int4_ws, matmul  # noqa: E402

VARIANTS = {"off": False, "on": True, "wait": True}  # "wait": early_start with its L2 prefetch a no-op
ROOFLINE_ELEMENTS = 1 << 30  # 2 GiB of bf16 read by `jnp.sum`, as sustained_load.py's "roofline"


@contextlib.contextmanager
def no_prefetch():
    """`plgpu.async_prefetch` a no-op (the kernel looks it up when traced): early_start's wait alone."""
    shipped = plgpu.async_prefetch
    plgpu.async_prefetch = lambda ref: None
    try:
        yield
    finally:
        plgpu.async_prefetch = shipped


@contextlib.contextmanager
def early_start(on: bool, traced: list):
    """Every int4 product traced inside takes `int4_ws.config_for`'s Config with early_start = on; each one's
    Config is appended to `traced`. JAX's trace caches are cleared first: a function traced under the other value
    (the row-tile product's custom_vmap, a step) would otherwise be reused with its products (the run of fb1a83e
    traced none under the second value)."""
    jax.clear_caches()
    matmul._row_tiles_under.cache_clear()
    shipped = int4_ws.config_for

    def config_for(k: int, n: int) -> int4_ws.Config:
        traced.append(dataclasses.replace(shipped(k, n), early_start=on))
        return traced[-1]

    int4_ws.config_for = config_for
    try:
        yield
    finally:
        int4_ws.config_for = shipped


def decode_bits(params: dict, cfg, context: int) -> list[np.ndarray]:
    """The uint views of 3 chained decode steps' logits and the final cache at `context` (one compile)."""
    state = random_state(cfg, context + 4 * ROW_TILE, context, jnp.bfloat16, 1)
    decode = lower_steps(params, cfg, state, {})["decode"].compile(compiler_options=compiler_options())
    s, out = copy_tree(state), []
    for _ in range(3):
        s, logits = decode(params, s)
        out.append(bits(np.asarray(logits)))
    return out + [bits(np.asarray(leaf)) for leaf in jax.tree.leaves(s.cache)]


def run_model(name: str, opts) -> dict:
    cfg = model_config(name, opts.quick)
    params = random_int4_params(cfg, 0, True)
    max_len = opts.prompt_len + opts.new_tokens + 2 * ROW_TILE
    engines = {v: Engine(params, cfg, max_len=max_len, k=1, prefill_chunk=128) for v in VARIANTS}
    prepared = engines[
        "off"
    ].params  # the same weights in every variant: the Config is read when the products are traced
    res = {"config": dataclasses.asdict(cfg), "context": opts.prompt_len, "variants": {}}
    state = random_state(cfg, max_len, opts.prompt_len, jnp.bfloat16, 1)
    res["bytes_per_step"] = step_bytes(prepared, cfg, state, 1)
    walls, step_bits = {}, {}
    traced = {variant: [] for variant in VARIANTS}
    for variant, on in VARIANTS.items():
        with early_start(on, traced[variant]), no_prefetch() if variant == "wait" else contextlib.nullcontext():
            step_bits[variant] = decode_bits(prepared, cfg, opts.prompt_len)
            profiler = step_profiler(prepared, cfg, opts.prompt_len)
            res["variants"][variant] = {"step_kernels": profiler and profiler()}
            chains = chain_walls(prepared, cfg, opts.prompt_len, opts.chains.split(","), opts.iterations)
        walls.update({f"{variant}:{label}": wall for label, wall in chains.items()})
    res["decode_bits_equal"] = all(
        np.array_equal(a, b) for bits_ in step_bits.values() for a, b in zip(step_bits["off"], bits_, strict=True)
    )
    res["chains"] = interleaved(walls, opts.trials)
    if not opts.no_generate:
        prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (opts.prompt_len,)).astype(np.int32)
        gens, tokens = {}, {}
        for variant, on in VARIANTS.items():
            wait_only = no_prefetch() if variant == "wait" else contextlib.nullcontext()
            with early_start(on, traced[variant]), wait_only:  # the Engine compiles at its first generation
                tokens[variant] = engines[variant].generate(prompt, opts.new_tokens, eos_id=(), on_device=True).tokens
            wall = generation_wall(engines[variant], prompt)
            wall(1)
            gens[f"{variant}:generate"] = (wall, opts.new_tokens, 1)
        res["generations"] = interleaved(gens, opts.trials)
        res["tokens_equal"] = all(t == tokens["off"] for t in tokens.values())
    for variant, configs in traced.items():  # products traced with each early_start value (none off the GPU)
        res["variants"][variant]["int4_traced"] = {
            str(on): sum(c.early_start == on for c in configs) for on in (False, True)
        }
    for label, r in {**res["chains"], **res.get("generations", {})}.items():
        print(f"  {name} {label}: {r['ms_per_step']:.3f} ms ({', '.join(f'{t:.3f}' for t in r['trials_ms'])})")
    print(f"  {name} decode bits equal: {res['decode_bits_equal']}, tokens equal: {res.get('tokens_equal')}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--models", default="qwen3.5")
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--new-tokens", type=int, default=65)
    ap.add_argument("--chains", default="1,1-nographs", help="`chain_walls` labels")
    ap.add_argument("--iterations", type=int, default=33)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny shrunk shape")
    opts = ap.parse_args()
    if opts.quick:
        opts.prompt_len, opts.new_tokens, opts.iterations, opts.trials = 20, 9, 3, 2
    t0 = time.perf_counter()
    out = {"meta": experiment_meta(opts.commit, models=opts.models, prompt_len=opts.prompt_len), "models": {}}
    if jax.default_backend() == "gpu":
        out["roofline_Bps"] = _xla_sum_Bps(ROOFLINE_ELEMENTS)
    for name in opts.models.split(","):
        out["models"][name] = run_model(name, opts)
        if "roofline_Bps" in out:
            for r in out["models"][name]["chains"].values():
                step_s = r["ms_per_step"] / 1e3
                r["roofline_pct"] = 100 * out["models"][name]["bytes_per_step"]["total"] / out["roofline_Bps"] / step_s
    save_experiment(out, opts.out, t0)


if __name__ == "__main__":
    main()
