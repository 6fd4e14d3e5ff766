"""XLA compiler options around the kernels (issue 33: the Qwen3.5 decode step at >= 45% of the roofline, where ~0.7
ms of a ~2.8 ms step is XLA glue in ~400 launch-bound kernels of 1-3 us): one model's decode and verify(k) steps
compiled under variants of `jspec.compiler_options()`, every variant's steps timed in one interleaved run
(`jspec_bench.timing._time_chains`), each with its GPU kernels (count, time, groups) and the bitwise check of its
verify rows against its decode rows (`jspec_bench.steps._bitwise_check`).

Variants (added to the shipped options; a variant XLA does not know fails to compile and is reported so):
- shipped: `jspec.compiler_options()` as the Engine compiles;
- triton_multi_output: xla_gpu_unsupported_enable_triton_multi_output_fusion, so a Triton normalization fusion
  (every RMSNorm of the step) may take the residual add before it as a second root: one launch instead of two;
- heroless: xla_gpu_experimental_enable_triton_heroless_priority_fusion, Triton fusions for the elementwise glue;
- both: the two;
- no_command_buffer: no CUDA graphs (xla_gpu_enable_command_buffer empty): the host's enqueue time per call
  (`dispatch_s`) and the cost of a call right after another executable's (`after_switch_time_s`) with every kernel
  launched one by one, against the shipped graphs (a 27B-class verify call took 6.3-6.6 ms to enqueue at 212230f).

Run: experiments/results/xla_options_qwen35_h200.json (1ce7bae, Qwen3.5 text shape): multi-output fusion changed no
fusion (479 launches, kernels 2.55 against 2.57 ms); heroless fusions made 700 launches and +0.36 ms of kernels (both
variants: 676, +0.34 ms); every variant's verify rows bitwise equal to its decode rows. Neither adopted. Its walls are
0.4-0.9 ms above the kernels: 8 executables interleaved without settle calls (`timing.SETTLE_CALLS`, added after).
Runs: experiments/results/xla_options_command_buffer_qwen35_h200.json and ..._27b_h200.json (745f4b5, shipped against
no_command_buffer): without CUDA graphs the host takes 4.79 ms to enqueue a Qwen3.5 decode call (3.20 with them; 11.9
against 7.8 at 27B), the kernels the same (431 / 855 launches, 2.52 / 6.52 ms): the graphs save host time; closed.

    python3 benchmarks/experiments/xla_options.py --commit SHA --out $OUT/xla_options_qwen35_h200.json
    python3 benchmarks/experiments/xla_options.py --model hybrid-27b --variants shipped,no_command_buffer --out ...
    python3 benchmarks/experiments/xla_options.py --quick --out /tmp/xla_options_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.engine import compiler_options  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402
from jspec_bench.roofline import measure_roofline  # noqa: E402
from jspec_bench.shapes import copy_tree, model_config, random_int4_params, random_state, step_bytes  # noqa: E402
from jspec_bench.steps import _bitwise_check, lower_steps  # noqa: E402
from jspec_bench.timing import _time_chains, run_parallel  # noqa: E402
from pallas_kernels import ROW_TILE, get_backend  # noqa: E402
from pallas_kernels.prepare import prepare_params  # noqa: E402

MULTI_OUTPUT = {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True}
HEROLESS = {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True}
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
VARIANTS = {
    "shipped": {},
    "triton_multi_output": MULTI_OUTPUT,
    "heroless": HEROLESS,
    "both": MULTI_OUTPUT | HEROLESS,
    "no_command_buffer": NO_GRAPHS,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--model", default="qwen3.5")
    ap.add_argument("--variants", default="shipped,triton_multi_output,heroless,both", help=f"of {list(VARIANTS)}")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny shrunk shape")
    opts = ap.parse_args()
    t0 = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    out = {
        "meta": experiment_meta(
            opts.commit, model=opts.model, k=opts.k, context=opts.context, shipped_options=compiler_options()
        ),
        "variants": {},
    }
    roof = None
    if on_gpu:  # the bench's roofline section over 2 GiB
        out["meta"]["roofline"] = measure_roofline(2**31)
        roof = out["meta"]["roofline"]["roofline_Bps"]
    cfg = model_config(opts.model, opts.quick)
    params = random_int4_params(cfg, 0, True)
    params = prepare_params(params, "bfloat16", get_backend())
    base = random_state(cfg, opts.context + 2 * ROW_TILE, opts.context, jnp.bfloat16, 1)
    draft = np.random.default_rng(2).integers(0, cfg.vocab_size, (opts.k,)).astype(np.int32)
    lowered = lower_steps(params, cfg, base, {opts.k: draft})
    options = {name: (compiler_options() or {}) | VARIANTS[name] for name in opts.variants.split(",")}
    tasks = {
        (name, key): functools.partial(low.compile, compiler_options=options[name])
        for name in options
        for key, low in lowered.items()
    }
    try:
        built = run_parallel(tasks, 4)
    except Exception:  # one failed compile fails the batch: compile one by one to say which
        traceback.print_exc()
        built = {}
        for task, compile_ in tasks.items():
            try:
                built[task] = (compile_(), None)
            except Exception as e:  # an option this XLA does not have is a result too
                out["variants"][task[0]] = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
    execs = {}
    for (name, key), (ex, _) in built.items():
        if name not in out["variants"]:
            execs.setdefault(name, {})[key] = ex
    print(f"compiled {len(execs)} variants in {time.perf_counter() - t0:.0f} s", flush=True)
    verify = f"verify{opts.k}"
    chains = {}
    for name, ex in execs.items():
        chains[(name, "decode")] = (ex["decode"], params, copy_tree(base), ())
        chains[(name, verify)] = (ex[verify], params, copy_tree(base), (jnp.asarray(draft),))
    timings = _time_chains(chains, opts.reps, opts.trials, 0.5)
    shipped_decode = timings[("shipped", "decode")].seconds if ("shipped", "decode") in timings else None
    for name, ex in execs.items():
        res = out["variants"][name] = {"options": options[name], "status": "done"}
        for step, rows in (("decode", 1), (verify, opts.k + 1)):
            seconds, times, kernels, after_switch, dispatch = timings[(name, step)]
            read = step_bytes(params, cfg, base, rows)["total"]
            r = res[step] = {"time_s": seconds, "trial_times_s": times, "bytes": read}
            r |= {"after_switch_time_s": after_switch, "dispatch_s": dispatch}
            if roof:
                r["roofline_fraction"] = read / seconds / roof
            if kernels:
                r["gpu_kernels"] = {
                    key: kernels[key] for key in ("kernel_us", "launches", "groups_us") if key in kernels
                }
            if shipped_decode:
                r["vs_shipped_decode"] = seconds / shipped_decode
        res["verify_vs_decode"] = res[verify]["time_s"] / res["decode"]["time_s"]
        res.update(_bitwise_check(params, ex, opts.k, base, draft))
        d, v = res["decode"], res[verify]
        print(
            f"{name}: decode {d['time_s'] * 1e3:.3f} ms"
            + (f" ({100 * d['roofline_fraction']:.1f}% of roofline)" if roof else "")
            + (
                f", {d['gpu_kernels']['launches']} launches {d['gpu_kernels']['kernel_us'] / 1e3:.2f} ms"
                if "gpu_kernels" in d
                else ""
            )
            + f"; verify({opts.k}) {v['time_s'] * 1e3:.3f} ms ({res['verify_vs_decode']:.3f}x); "
            + f"bitwise {'equal' if res['bitwise_equal_decode'] else 'DIFFERENT'}",
            flush=True,
        )
    save_experiment(out, opts.out, t0)


if __name__ == "__main__":
    main()
