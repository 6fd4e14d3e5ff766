"""H200 benchmark of the row-tile int4 matmul (issue 4): bandwidth vs the HBM read roofline, exactness across M.

Run from the repo root on the GPU machine:
    python3 benchmarks/int4_matmul_bench.py --out $OUT/int4_matmul_h200.json --commit <git rev-parse HEAD>

For each linear shape of Qwen2.5-7B and Qwen2.5-14B (qkv, o, gate_up, down, lm_head) and M in (1, 8, 16) it times
  - `rows_matmul` (the Pallas kernel as the model calls it: pad to 16 rows, kernel, fixed-order combine, slice),
  - the naive jnp dequantize-then-dot, XLA's bf16 dot on pre-dequantized weights,
  - torch's int4 kernel `torch.ops.aten._weight_int4pack_mm` (group 32), the peer,
and reports effective bandwidth = (packed + scale bytes) / time against the roofline measured in the same run: the
best of torch `x.sum()` and XLA `jnp.sum` over a 2 GB bf16 tensor. Row-exactness (row r bit-identical for every
M in 1..16) is checked on the GPU for every shape. On the shapes `prepare_ws` hands to it (every shape here)
the warp-specialized Mosaic GPU kernel (`pallas_kernels.int4_ws`, on its prepared Int4Codes) is timed and checked
too. Timing: each measured executable runs the op on R distinct weight copies back to back (R * bytes >= 128 MB,
twice the 60 MB L2, R <= 8); executables are dispatched 10 at a time and blocked on once, so host overhead stays
hidden; per-call time is the median over repeats of (batch time / 10 / R).
On the GPU the int4 kernels' own time per call (XLA profiler events) is reported next to it (`m{M}_kernel_s`):
inside a model's step the segment sum fuses into the next op, so the kernel alone is what a step pays.
torch is timed the same way through a CUDA graph of R calls. The naive dequantize-then-dot is timed at M=1 only.
`--sweep` times alternative tile configurations of the kernel at M=16 (used to pick the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec_bench.timing import kernel_times, profile, torch_median  # noqa: E402
from pallas_kernels import int4_matmul, int4_ws  # noqa: E402
from pallas_kernels.int4 import BLOCK, Int4Weight, dequantize  # noqa: E402

SHAPES = {  # name: (K, N) of x[M, K] @ W[K, N]
    "qwen2.5-7b": {
        "qkv": (3584, 4608),
        "o": (3584, 3584),
        "gate_up": (3584, 37888),
        "down": (18944, 3584),
        "lm_head": (3584, 152064),
    },
    "qwen2.5-14b": {
        "qkv": (5120, 7168),
        "o": (5120, 5120),
        "gate_up": (5120, 27648),
        "down": (13824, 5120),
        "lm_head": (5120, 152064),
    },
}
MS = (1, 8, 16)
TARGET_BYTES = 128 << 20  # weight copies per timed executable: at least 2x the 60 MB L2 ...
MAX_COPIES = 8  # ... but at most 8 call sites


def wall(fn, repeats: int) -> float:
    """Median wall seconds of fn() (which must block) over repeats, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def jax_time(f, *args, repeats: int, batch: int = 10) -> float:
    """Median seconds of one f(*args) on the device: `batch` calls are dispatched back to back (JAX dispatch is
    asynchronous, so the host overhead of a call hides behind the device work of the previous one) and blocked on
    once; the batch time / batch is taken `repeats` times."""

    def run():
        out = None
        for _ in range(batch):
            out = f(*args)
        jax.block_until_ready(out)

    return wall(run, repeats) / batch


def roofline(repeats: int) -> dict:
    """HBM read bandwidth (bytes/s) of torch `sum` and XLA `jnp.sum` over a 2 GB bf16 array."""
    out = {}
    n = (1 << 30) if not INTERPRET else (1 << 20)
    a = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    out["xla_sum_Bps"] = 2 * n / jax_time(f, a, repeats=repeats)
    del a
    try:
        import torch

        t = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        out["torch_sum_Bps"] = 2 * n / torch_median(lambda t=t: t.sum(), repeats)
        del t
        torch.cuda.empty_cache()
    except Exception as e:  # torch is the peer, not the product: report and go on
        out["torch_error"] = repr(e)
    out["roofline_Bps"] = max(v for k, v in out.items() if k.endswith("_Bps"))
    return out


def random_weights(key, k: int, n: int, copies: int) -> list[Int4Weight]:
    """Random symmetric int4 weights (uniform codes, scales ~ 1e-2) made on the device."""
    out = []
    for i in range(copies):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        packed = jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = (jax.random.uniform(k2, (n, k // BLOCK), jnp.float32, 0.5, 1.5) * 1e-2).astype(jnp.bfloat16)
        out.append(Int4Weight(packed, scales))
    return out


def int4_bytes(k: int, n: int) -> int:
    return n * k // 2 + 2 * n * k // BLOCK


def time_calls(op, x, weights, repeats: int, kernel: bool = False):
    """Per-call seconds of op(x, w) over the weight copies, all in one executable. kernel=True: (those seconds,
    the seconds of the int4 kernels alone per call, from the XLA profiler: None off the GPU), which leave out
    what the standalone op adds around the kernel (the pad of x to 16 rows, the segment sum, the slice to M)."""
    f = jax.jit(lambda x, ws: [op(x, w) for w in ws])
    seconds = jax_time(f, x, weights, repeats=repeats) / len(weights)
    if not kernel:
        return seconds
    if jax.default_backend() != "gpu":
        return seconds, None
    calls = 3
    try:
        groups = kernel_times(profile(lambda: jax.block_until_ready([f(x, weights) for _ in range(calls)])), calls)
    except Exception as e:  # the profiler is an add-on (another tool may hold CUPTI): say so, keep the timing
        print(f"  profiler failed, no kernel-alone time: {e!r}"[:300], flush=True)
        return seconds, None
    int4_us = sum(us for name, us in groups["groups_us"].items() if name.startswith("int4"))
    return seconds, int4_us / 1e6 / len(weights)


def exactness(op, x16, w, ms=tuple(range(1, 17))) -> dict:
    """Row r of op(x[:m]) vs row r of op(x[:16]), bitwise, for each m in ms (one executable)."""
    f = jax.jit(lambda x, w: [op(x[:m], w) for m in (*ms, 16)])
    ys = [np.asarray(y) for y in f(x16, w)]
    full = ys[-1]
    bad = [m for m, y in zip(ms, ys, strict=False) if not np.array_equal(y.view(np.uint32), full[:m].view(np.uint32))]
    return {"row_exact": not bad, "checked_m": list(ms), "inexact_m": bad}


INTERPRET = False  # --smoke: CPU interpret mode on tiny shapes, to check this script without a GPU


def kernel_op(cfg):
    return lambda x, w: int4_matmul.rows_matmul(x, w, interpret=INTERPRET, config=cfg)


def naive_op(x, w):
    return jnp.dot(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)


def dense_op(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def torch_int4(x16: np.ndarray, w: Int4Weight, k: int, n: int, copies: int, repeats: int) -> dict:
    """torch `_weight_int4pack_mm` (group 32, inner k tiles 8): per-call time at each M and its max abs error
    against our dequantize-then-dot in float32."""
    import torch

    packed = torch.from_numpy(np.asarray(w.packed)).cuda()
    swapped = ((packed & 0xF) << 4) | (packed >> 4)  # torch: even k in the high nibble
    wt = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
    scales = torch.from_numpy(np.asarray(w.scales.astype(jnp.float32))).cuda().to(torch.bfloat16)
    sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()  # [K/32, N, 2]: w=(q-8)*s+0
    weights = [wt] + [wt.clone() for _ in range(copies - 1)]
    szs = [sz] + [sz.clone() for _ in range(copies - 1)]
    xt = torch.from_numpy(np.asarray(x16, np.float32)).cuda().to(torch.bfloat16)
    ref = np.asarray(naive_op(jnp.asarray(x16, jnp.bfloat16), w))
    got = torch.ops.aten._weight_int4pack_mm(xt, wt, 32, sz).float().cpu().numpy()
    out = {"max_abs_err_vs_ours": float(np.max(np.abs(got - ref))), "ref_max_abs": float(np.max(np.abs(ref)))}
    for m in MS:
        xm = xt[:m].contiguous()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for wi, si in zip(weights, szs, strict=True):
                torch.ops.aten._weight_int4pack_mm(xm, wi, 32, si)
        out[f"m{m}_s"] = torch_median(g.replay, repeats) / copies
    del weights, szs, g
    torch.cuda.empty_cache()
    return out


def n_copies(nbytes: int) -> int:
    return int(min(MAX_COPIES, max(2, -(-TARGET_BYTES // nbytes))))


def bench_shape(key, k, n, variants: dict, sweep: dict, repeats: int, peers: bool) -> dict:
    """Time (and check) the kernel variants at each M, sweep configs at M=16 only, and the peers. `variants` maps
    a name to (op, the M values of its exactness check, the one-time weight preparation the op takes)."""
    nbytes = int4_bytes(k, n)
    copies = n_copies(nbytes)
    weights = random_weights(key, k, n, copies)
    x16 = jax.random.normal(jax.random.fold_in(key, 999), (16, k), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(naive_op(x16, weights[0]))
    res = {"K": k, "N": n, "bytes": nbytes, "copies": copies, "variants": {}}
    outputs = {}
    ops = {**{name: op for name, (op, _, _) in variants.items()}, **sweep}
    for name, op in ops.items():
        r = {}
        try:
            ws = [variants[name][2](w) for w in weights] if name in variants else weights
            if name in variants:
                r.update(exactness(op, x16, ws[0], variants[name][1]))
            y = np.asarray(op(x16, ws[0]))
            outputs[name] = y
            r["max_abs_err_vs_naive"] = float(np.max(np.abs(y - ref)))
            for m in MS if name in variants else (16,):
                r[f"m{m}_s"], r[f"m{m}_kernel_s"] = time_calls(op, x16[:m], ws, repeats, kernel=True)
            del ws
        except Exception as e:
            r["error"] = "".join(traceback.format_exception_only(e))[-2000:]
        res["variants"][name] = r
    for name, y in outputs.items():  # inline-PTX dequantization vs the jnp formula: same bits expected
        if name.endswith("_jnpdq") and name[: -len("_jnpdq")] in outputs:
            fast = outputs[name[: -len("_jnpdq")]]
            same = np.array_equal(y.view(np.uint32), fast.view(np.uint32))
            res["variants"][name]["bits_equal_fast_dequant"] = bool(same)
    ref_scale = float(np.max(np.abs(ref)))
    res["ref_max_abs"] = ref_scale
    if peers:
        res["naive_jnp"] = {"m1_s": time_calls(naive_op, x16[:1], weights[:2], repeats)}  # ~4%: M=1 only
        dense = [dequantize(w, jnp.bfloat16) for w in weights[: min(copies, n_copies(2 * k * n))]]
        res["xla_bf16_dot"] = {f"m{m}_s": time_calls(dense_op, x16[:m], dense, repeats) for m in (1, 16)}
        del dense
        try:
            res["torch_int4"] = torch_int4(np.asarray(x16.astype(jnp.float32)), weights[0], k, n, copies, repeats)
        except Exception as e:
            res["torch_int4"] = {"error": "".join(traceback.format_exception_only(e))[-2000:]}
    del weights
    return res


def summarize(results: dict, roof: float) -> list[str]:
    lines = [f"{'shape':24s} {'variant':28s} {'exact':5s} " + " ".join(f"{'M=' + str(m):>16s}" for m in MS)]
    for shape, r in results.items():
        nb = r["bytes"]
        rows = dict(r["variants"])
        for peer in ("torch_int4", "naive_jnp", "xla_bf16_dot"):
            if peer in r:
                rows[peer] = r[peer]
        for name, v in rows.items():
            if "error" in v:
                lines.append(f"{shape:24s} {name:28s} ERROR {v['error'].splitlines()[-1][:120]}")
                continue
            ex = {True: "yes", False: "NO"}.get(v.get("row_exact"), "-")
            for label, suffix in ((name, "_s"), (name + " (kernel alone)", "_kernel_s")):
                times = [v.get(f"m{m}{suffix}") for m in MS]
                if any(times):
                    cells = [f"{t * 1e6:7.1f}us {100 * nb / t / roof:5.1f}%" if t else " " * 16 for t in times]
                    lines.append(f"{shape:24s} {label:28s} {ex:5s} " + " ".join(cells))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time alternative tile configs on a few shapes")
    ap.add_argument("--shapes", default="all", help="comma list like qwen2.5-7b/qkv, or 'all'")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: interpret mode, tiny shapes")
    ap.add_argument("--no-mosaic", action="store_true", help="leave the Mosaic GPU kernel out of the sweep")
    args = ap.parse_args()
    if args.smoke:
        global INTERPRET, TARGET_BYTES
        INTERPRET, TARGET_BYTES = True, 1 << 17
        args.no_mosaic = True
        SHAPES.clear()
        SHAPES["tiny"] = {"a": (256, 128), "b": (96, 64)}
    t0 = time.time()
    dev = jax.devices()[0]
    meta = {"jax": jax.__version__, "device": dev.device_kind, "commit": args.commit, "platform": dev.platform}
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        pass
    roof = roofline(args.repeats)
    print("roofline", {k: (f"{v / 1e12:.2f} TB/s" if k.endswith("Bps") else v) for k, v in roof.items()}, flush=True)
    shapes = [(m, s, kn) for m, d in SHAPES.items() for s, kn in d.items()]
    if args.shapes != "all":
        want = set(args.shapes.split(","))
        shapes = [x for x in shapes if f"{x[0]}/{x[1]}" in want]
    results = {}
    key = jax.random.key(0)
    for model, lin, (k, n) in shapes:
        variants = {"pallas_auto": (kernel_op(None), tuple(range(1, 17)), lambda w: w)}
        if not args.no_mosaic and int4_ws.fits(k, n):  # what prepare_ws hands to it
            variants["mosaic_ws"] = (int4_ws.rows_matmul, (1, 2, 5, 8, 12), int4_ws.prepare_codes)
        configs = sweep_configs(k, n) if args.sweep else []
        sweep = {config_name(c): kernel_op(c) for c in configs}
        name = f"{model}/{lin}"
        results[name] = bench_shape(key, k, n, variants, sweep, args.repeats, not args.no_peers)
        print("\n".join(summarize({name: results[name]}, roof["roofline_Bps"])[1:]), flush=True)
        print(f"  [{time.time() - t0:.0f}s]", flush=True)
        report = {"meta": meta, "roofline": roof, "results": results, "elapsed_s": time.time() - t0}
        with open(args.out, "w") as f:  # after every shape, so a run cut short still leaves its numbers
            json.dump(report, f, indent=1)
    print("\n".join(summarize(results, roof["roofline_Bps"])))


def sweep_configs(k: int, n: int) -> list:
    """Alternative kernels and tiles for the sweep (those that fit the shape); split-K as `pick_split` picks it."""
    C = int4_matmul.Config
    cands = [
        C(block_n=32, block_k=256, num_warps=4, num_stages=3),
        C(block_n=64, block_k=128, num_warps=4, num_stages=4),
        C(block_n=32, block_k=256, num_warps=2, num_stages=4),
    ]
    out = []
    for c in cands:
        if n % c.block_n or k % c.block_k:
            continue
        split = int4_matmul.pick_split(n // c.block_n, k // c.block_k)
        out.append(dataclasses.replace(c, split_k=split))
    return out


def config_name(cfg) -> str:
    return f"triton_bn{cfg.block_n}_bk{cfg.block_k}_s{cfg.split_k}_w{cfg.num_warps}_st{cfg.num_stages}" + (
        "" if cfg.fast_dequant else "_jnpdq"
    )


if __name__ == "__main__":
    main()
