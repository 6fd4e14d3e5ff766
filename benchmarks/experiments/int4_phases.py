"""Where an int4 launch's time goes, phase by phase (GPU only): the Mosaic GPU kernel (`pallas_kernels/int4_ws.py`) at
M = 1 on a few shapes, once timed as shipped (XLA profiler) and once under Mosaic GPU's on-device profiler, which
stamps each consumer warpgroup's regions with the SM's cycle counter (`plgpu.CompilerParams(profile_space=...)`).

The regions are named from outside the kernel, so the shipped code is what runs: this script wraps, for the
profiled trace only, the calls the kernel makes (`pl.run_scoped`: the pipeline's allocations, around the whole
kernel, and the consumer's accumulators, around its loop, both "kernel";
`int4_ws._dequantize`: one scale group's conversion, "convert"; `plgpu.wgmma`: one chunk's issue, "wgmma";
`plgpu.wgmma_wait`: the wait for a step's products, "wait"; `int4_ws._store_transposed`: a segment's partials to
global memory, "store") in `jax.named_scope`s, which the profiler records. Per shape, medians over CTAs and
consumer warpgroups, in cycles: `fill` (the outer "kernel" region's start, near the kernel's own, to the first
conversion, i.e. to the first stage's weights landing in shared memory), each step's `convert`, `wgmma` issue,
`wait`, and the rest of its period (`other`: the wait for the next stage, loads of codes and scales), the `store`s,
the `tail` after the last one to the outer region's end, its `span`; the spread of the CTAs' start times
(globaltimer); and the kernel's time alone (unprofiled) against that span: what the launch costs outside it.

    python3 benchmarks/experiments/int4_phases.py --out $OUT/int4_phases_h100.json --commit <sha> \\
        [--shapes qwen3.5/out,qwen3.5/down,qwen3.5/gate_up,synthetic] [--overrides '[{}, {"wg_rows": 64}]']
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import int4_matmul_bench as bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from int4_ab import SHAPES  # noqa: E402

from jspec_bench.report import experiment_meta, gpu_sample  # noqa: E402
from pallas_kernels import int4_ws  # noqa: E402

REGIONS_PER_STEP = 11  # regions a warpgroup records a pipeline step: 8 conversions, 2 wgmma issues, 1 wait
EXIT = 1 << 31  # the profiler's tag bit of a region's end (jax.experimental.mosaic.gpu.profiler.ProfilerSpec.EXIT)


def scoped(name, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(name):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def profiled(trace_dir: str, raw: list, space: int):
    """The kernel's calls wrapped in named regions, its CompilerParams with the profiler on, and the profiler's
    dump keeping the raw buffer (start time, SM, the (tag, cycle) pairs) in `raw`: all undone on exit."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic.gpu import profiler

    params = plgpu.CompilerParams
    fields = {f for f in getattr(params, "__dataclass_fields__", {})}
    extra = dict(profile_space=space, profile_dir=trace_dir)
    if "profile_bounds_check" in fields:
        extra["profile_bounds_check"] = True
    dump = profiler.ProfilerSpec.dump

    def keep(spec, buffer, f, grid, block):
        raw.append(dict(buffer=np.asarray(buffer).copy(), names=dict(spec.interned_names), grid=grid, block=block))
        try:  # its Perfetto trace, not read here: a failure (a truncated trace) must not fail the launch
            dump(spec, buffer, f, grid=grid, block=block)
        except Exception as e:
            raw[-1]["dump_error"] = repr(e)[:300]

    patches = [
        (plgpu, "CompilerParams", functools.partial(params, **extra)),
        (plgpu, "wgmma", scoped("wgmma", plgpu.wgmma)),
        (plgpu, "wgmma_wait", scoped("wait", plgpu.wgmma_wait)),
        (int4_ws.pl, "run_scoped", scoped("kernel", int4_ws.pl.run_scoped)),
        (int4_ws, "_dequantize", scoped("convert", int4_ws._dequantize)),
        (int4_ws, "_store_transposed", scoped("store", int4_ws._store_transposed)),
        (profiler.ProfilerSpec, "dump", keep),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        jax.clear_caches()
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        jax.clear_caches()


def regions(pairs: np.ndarray, names: dict) -> list[tuple[str, int, int]]:
    """A warpgroup's (tag, cycle) pairs -> [(name, start, end)] in cycles (32-bit counter unwrapped)."""
    by_id = {v: k for k, v in names.items()}
    cycles = np.unwrap(pairs[:, 1].astype(np.int64), period=2**32)
    open_, out = collections.defaultdict(list), []  # a stack per name: "kernel" nests (the pipeline's run_scoped)
    for tag, t in zip(pairs[:, 0].astype(np.int64) & 0xFFFFFFFF, cycles, strict=True):
        name = by_id[int(tag & ~EXIT)]
        if tag & EXIT:
            out.append((name, open_[name].pop(), int(t)))
        else:
            open_[name].append(int(t))
    return sorted(out, key=lambda r: r[1])


def phases(rs: list[tuple[str, int, int]]) -> dict | None:
    """One consumer warpgroup's regions -> its phases in cycles (None if it recorded no step). A step's period runs
    from the previous step's wait end (the first: from its first conversion) to its own wait's end."""
    kernel = [r for r in rs if r[0] == "kernel"]
    waits = [r for r in rs if r[0] == "wait"]
    if not kernel or not waits:
        return None
    k0, k1 = kernel[0][1], kernel[0][2]
    first = min(r[1] for r in rs if r[0] == "convert")
    steps, start = [], first
    for w in waits:
        inside = [r for r in rs if start <= r[1] < w[1] and r[0] in ("convert", "wgmma", "store")]
        took = {name: sum(r[2] - r[1] for r in inside if r[0] == name) for name in ("convert", "wgmma", "store")}
        period = w[2] - start
        steps.append(dict(period=period, **took, wait=w[2] - w[1], other=period - sum(took.values()) - (w[2] - w[1])))
        start = w[2]
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    return dict(
        fill=first - k0,
        steps=len(steps),
        step_median=med,
        stores=sum(r[2] - r[1] for r in rs if r[0] == "store"),
        tail=k1 - max(r[2] for r in rs if r[0] != "kernel"),
        span=k1 - k0,
    )


def analyse(trace: dict) -> dict:
    """The raw profiler buffer of one launch -> per-warpgroup phases, medians over them, CTA start spread (ns)."""
    grid, block = trace["grid"], trace["block"]
    n_blocks = int(np.prod(grid))
    buf = trace["buffer"].reshape(n_blocks, -1).view(np.uint32)
    per_wg = buf.shape[1] // (int(np.prod(block)) // 128)
    buf = buf.reshape(n_blocks, -1, per_wg)
    starts, out = [], []
    for b in range(n_blocks):
        for w in range(buf.shape[1]):
            used = int(buf[b, w, 2])
            if not used:
                continue
            starts.append(int(buf[b, w, 0]))
            ph = phases(regions(buf[b, w, 3 : 3 + used].reshape(-1, 2), trace["names"]))
            if ph is not None:
                out.append(ph)
    flat = [{k: v for k, v in p.items() if k != "step_median"} | p["step_median"] for p in out]
    med = {k: statistics.median(p[k] for p in flat) for k in flat[0]} if flat else {}
    spread = (max(starts) - min(starts)) % 2**32 if starts else None
    return dict(warpgroups=len(out), median_cycles=med, cta_start_spread_ns=spread)


def run_shape(k: int, n: int, repeats: int, trace_dir: str, overrides: dict) -> dict:
    """One shape under `config_for`'s Config with `overrides`: the kernel's time alone over weight copies that defeat
    L2 (XLA profiler), then three profiled launches, each on another copy (the last one's buffer is analysed)."""
    key = jax.random.key(0)
    nbytes = bench.int4_bytes(k, n)
    weights = bench.random_weights(key, k, n, max(3, bench.n_copies(nbytes)))
    codes = [int4_ws.prepare_codes(w) for w in weights]
    x1 = jax.random.normal(jax.random.fold_in(key, 7), (1, k), jnp.float32).astype(jnp.bfloat16)
    cfg = dataclasses.replace(int4_ws.config_for(k, n), **overrides)
    part = int4_ws.partition(k, n, cfg)
    op = functools.partial(int4_ws.rows_matmul, config=cfg, live_rows=1)
    _, kernel_s = bench.time_calls(op, x1, codes, repeats, kernel=True)
    shipped = np.asarray(jax.jit(op)(x1, codes[-1]))
    raw: list = []
    with profiled(trace_dir, raw, REGIONS_PER_STEP * part.per_cta + 16):
        f = jax.jit(op)
        for w in codes[-3:]:  # the last launch's weights were not read by the two before it
            y = np.asarray(jax.block_until_ready(f(x1, w)))
    result = dict(
        K=k,
        N=n,
        bytes=nbytes,
        config=dict(wg_rows=cfg.wg_rows, stages=cfg.stages, ctas=part.ctas, steps_per_cta=part.per_cta),
        kernel_us=None if kernel_s is None else kernel_s * 1e6,
        profiled_bits_equal_unprofiled=bool(np.array_equal(y.view(np.uint32), shipped.view(np.uint32))),
    )
    result.update(analyse(raw[-1]) if raw else {"error": "the profiler wrote no buffer"})
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--shapes", default="qwen3.5/out,qwen3.5/down,qwen3.5/gate_up,synthetic")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--overrides",
        default="[{}]",
        help="JSON list of int4_ws.Config overrides of config_for's choice, one profiled kernel each (int4_ab.py's "
        "--variants override Config() instead)",
    )
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("int4_phases.py profiles the Mosaic GPU kernel: it needs a GPU")
    report = {"meta": experiment_meta(args.commit, doc=__doc__), "results": {}}
    variants = json.loads(args.overrides)
    with tempfile.TemporaryDirectory() as trace_dir:
        for name in args.shapes.split(","):
            for overrides in variants:
                label = json.dumps(overrides)
                try:
                    r = run_shape(*SHAPES[name], args.repeats, trace_dir, overrides)
                except Exception as e:  # one shape's failure (smem, lowering) is recorded, the others still run
                    r = {"error": repr(e)[:2000]}
                r["gpu"] = gpu_sample()  # the SM clock right after the launches turns their cycles into time
                if "median_cycles" in r and "clocks.sm" in r["gpu"]:
                    mhz = float(r["gpu"]["clocks.sm"])
                    r["median_us_at_clock"] = {
                        k: round(v / mhz, 3) for k, v in r["median_cycles"].items() if k != "steps"
                    }
                report["results"].setdefault(name, {})[label] = r
                print(name, label, json.dumps(r), flush=True)
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
