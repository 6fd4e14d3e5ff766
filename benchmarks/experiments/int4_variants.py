"""Kernel-design sweep for the row-tile int4 matmul (issue 4): alternative Pallas-Triton formulations of the same
product, each checked for row-exactness (row r bit-identical for M = 1, 5, 16) and timed at M = 16 against the
module's kernel, on the shapes where the current kernel is furthest from the roofline. Used to choose the kernel
that `pallas_kernels.int4_matmul` ships; results: benchmarks/experiments/results/int4_variants_h200.json.

Variants (all pad rows to 16, split K the same way, combine partials in a fixed order outside):
  module     `int4_matmul.rows_matmul` as shipped: 3-D byte tile [BN, G, 16], dequantized, reshaped to [BN, G*16].
  flat       2-D byte tile [BN, W] (no reshape), per-element scales gathered to [BN, W] by pointer, jnp dequant:
             bf16(128 + q) by OR-ing 0x4300, minus (128 + z) (exact), times the scale (one bf16 rounding): the
             module's formula, so the same bits are expected.
  postscale  per 32-k block: the exact integers (q - z) as bf16 dotted with x (K = 16 dots, f32), then scaled by
             the block's scale in f32: no per-weight multiply, no scale broadcast; a different (more accurate)
             rounding than the module's formula, still row-exact.
Run on the GPU:  python3 benchmarks/experiments/int4_variants.py --out $OUT/int4_variants_h200.json --commit SHA
CPU check:       python benchmarks/experiments/int4_variants.py --smoke --out /tmp/v.json
Profile one:     ncu ... python3 benchmarks/experiments/int4_variants.py --profile NAME   (one call at 14B gate_up)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from benchmarks import int4_matmul_bench as ib  # noqa: E402
from pallas_kernels import int4_matmul as im  # noqa: E402
from pallas_kernels.backend import ROW_TILE  # noqa: E402
from pallas_kernels.int4 import BLOCK, Int4Weight  # noqa: E402

HALF = BLOCK // 2
SHAPES = {"7b/qkv": (3584, 4608), "7b/down": (18944, 3584), "14b/gate_up": (5120, 27648)}


def _bf16_codes(p, shift):
    """uint8 bytes -> bf16 128 + nibble (exact), by OR-ing the nibble into the mantissa of 128.0."""
    q = ((p >> shift) & 0xF).astype(jnp.uint16) if shift else (p & 0xF).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(q | jnp.uint16(0x4300), jnp.bfloat16)


def flat_kernel(x_ref, p_ref, s_ref, o_ref, *, block_n, width, steps, tokens_m):
    """x_ref [2, 16, K/2]; p_ref [N, K/2] uint8; s_ref [N, K/32] bf16; o_ref [S, 16, N] f32. tokens_m: the
    16 tokens on the dot's M side (acc [16, BN] = x @ W^T) instead of the weights (acc [BN, 16] = W @ x^T)."""
    i, split = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_n, block_n)
    row_idx = jax.lax.broadcasted_iota(jnp.int32, (block_n, width), 0) + i * block_n
    col_grp = jax.lax.broadcasted_iota(jnp.int32, (block_n, width), 1) // HALF

    def step(j, acc):
        c0 = (split * steps + j) * width
        p = p_ref[rows, pl.ds(c0, width)]
        s = s_ref[row_idx, col_grp + c0 // HALF]
        for shift, xi in ((0, 0), (4, 1)):
            w = (_bf16_codes(p, shift) - jnp.bfloat16(136.0)) * s
            xt = x_ref[xi, :, pl.ds(c0, width)]
            acc = acc + (im._dot_nt(xt, w) if tokens_m else im._dot_nt(w, xt))
        return acc

    shape = (ROW_TILE, block_n) if tokens_m else (block_n, ROW_TILE)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
    o_ref[split, :, rows] = acc if tokens_m else acc.T


def postscale_kernel(x_ref, p_ref, s_ref, o_ref, *, block_n, groups, steps):
    """As flat_kernel, but per 32-k block: dot of the exact (q - 8) with x, then times the block scale (f32)."""
    i, split = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_n, block_n)

    def step(j, acc):
        for g in range(groups):
            blk = (split * steps + j) * groups + g
            p = p_ref[rows, pl.ds(blk * HALF, HALF)]  # [BN, 16]
            part = None
            for shift, xi in ((0, 0), (4, 1)):
                w = _bf16_codes(p, shift) - jnp.bfloat16(136.0)
                d = im._dot_nt(w, x_ref[xi, :, pl.ds(blk * HALF, HALF)])
                part = d if part is None else part + d
            s = s_ref[rows, pl.ds(blk, 1)].astype(jnp.float32)  # [BN, 1]
            acc = acc + part * s
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_n, ROW_TILE), jnp.float32))
    o_ref[split, :, rows] = acc.T


def variant_op(kind, block_n=64, block_k=256, split_k=None, num_warps=4, num_stages=3, interpret=False):
    """rows_matmul-shaped op (x [M, K] bf16, Int4Weight) -> f32 [M, N] for a variant kernel."""

    def op(x, w: Int4Weight):
        m, k = x.shape
        n = w.shape[1]
        xp = jnp.pad(x, ((0, ROW_TILE - m), (0, 0)))
        steps_total = k // block_k
        s = split_k or _split(k, n, block_n, block_k, interpret)
        steps = steps_total // s
        if kind in ("flat", "flatxw"):
            kern = functools.partial(
                flat_kernel, block_n=block_n, width=block_k // 2, steps=steps, tokens_m=kind == "flatxw"
            )
        else:
            kern = functools.partial(postscale_kernel, block_n=block_n, groups=block_k // BLOCK, steps=steps)
        triton = (num_warps, num_stages)
        args = (im._split_even_odd(xp), w.packed, w.scales)
        return split_k_call(kern, n, block_n, s, args, m, interpret=interpret, triton=triton, name=f"int4_{kind}")

    return op


def split_k_call(kern, n, block_n, split, args, m, *, interpret, triton, name):
    """Run a partials kernel on grid (N / block_n, split) -> [split, 16, N] float32, combine the partials in the
    module's fixed order, then the barrier and the slice to m rows. triton: (num_warps, num_stages)."""
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=triton[0], num_stages=triton[1])
    parts = pl.pallas_call(
        kern,
        grid=(n // block_n, split),
        out_shape=jax.ShapeDtypeStruct((split, ROW_TILE, n), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name=name,
    )(*args)
    return jax.lax.optimization_barrier(im._combine(parts))[:m]


def module_op(cfg=None, interpret=False):
    return lambda x, w: im.rows_matmul(x, w, interpret=interpret, config=cfg)


def variants(interpret: bool) -> dict:
    v = {"module": module_op(interpret=interpret)}
    grid = {
        "flat": [(64, 256, 4, 3), (64, 256, 4, 4), (128, 256, 8, 3), (32, 256, 4, 3)],
        "postscale": [(64, 256, 4, 3), (64, 256, 4, 4), (128, 256, 8, 3), (32, 256, 4, 3)],
        "flatxw": [(64, 256, 4, 3), (128, 256, 4, 3)],
    }
    for kind, configs in grid.items():
        for bn, bk, nw, ns in configs:
            v[f"{kind}_{bn}_{bk}_w{nw}_s{ns}"] = variant_op(kind, bn, bk, None, nw, ns, interpret)
    for bn, bk, nw, ns in [(32, 256, 4, 3), (128, 256, 8, 3)]:
        cfg = im.Config(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        v[f"module_{bn}_{bk}_w{nw}_s{ns}"] = lambda x, w, cfg=cfg: im.rows_matmul(
            x, w, interpret=interpret, config=_with_split(cfg, x, w, interpret)
        )
    return v


def _with_split(cfg, x, w, interpret):
    k, n = w.shape
    return dataclasses.replace(cfg, split_k=_split(k, n, cfg.block_n, cfg.block_k, interpret))


def _split(k: int, n: int, block_n: int, block_k: int, interpret: bool) -> int:
    """The split-K factor the module would pick for these tiles (1 in interpret mode)."""
    return 1 if interpret else im.pick_split(n // block_n, k // block_k)


def check_and_time(name, op, weights, x16, ref_bits, repeats) -> dict:
    r = {}
    try:
        r.update(ib.exactness(op, x16, weights[0], (1, 5)))
        y16 = np.asarray(op(x16, weights[0]))
        r["bits_equal_module"] = bool(np.array_equal(y16.view(np.uint32), ref_bits))
        r["max_abs_diff_module"] = float(np.max(np.abs(y16 - ref_bits.view(np.float32))))
        r["m16_s"] = ib.time_calls(op, x16, weights, repeats)
        r["m1_s"] = ib.time_calls(op, x16[:1], weights, repeats)
    except Exception as e:
        r["error"] = "".join(traceback.format_exception_only(e))[-1500:]
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", help="comma list of variant names")
    ap.add_argument("--profile", help="run one call of this variant at 14b/gate_up (for ncu) and exit")
    args = ap.parse_args()
    interpret = args.smoke
    if interpret:
        ib.INTERPRET, ib.TARGET_BYTES = True, 1 << 16
        SHAPES.clear()
        SHAPES.update({"tiny": (512, 128)})
    ops = variants(interpret)
    if args.only:
        ops = {k: v for k, v in ops.items() if k in args.only.split(",")}
    key = jax.random.key(0)
    if args.profile:
        k, n = SHAPES["14b/gate_up"]
        w = ib.random_weights(key, k, n, 1)[0]
        x = jax.random.normal(key, (16, k), jnp.float32).astype(jnp.bfloat16)
        f = jax.jit(ops[args.profile])
        for _ in range(3):
            jax.block_until_ready(f(x, w))
        return
    t0 = time.time()
    dev = jax.devices()[0]
    meta = {"jax": jax.__version__, "device": dev.device_kind, "commit": args.commit}
    roof = ib.roofline(3)
    print(f"roofline {roof['roofline_Bps'] / 1e12:.2f} TB/s", flush=True)
    results = {}
    for shape, (k, n) in SHAPES.items():
        nbytes = ib.int4_bytes(k, n)
        weights = ib.random_weights(key, k, n, ib.n_copies(nbytes))
        x16 = jax.random.normal(jax.random.fold_in(key, 7), (16, k), jnp.float32).astype(jnp.bfloat16)
        ref_bits = np.asarray(ops["module"](x16, weights[0]) if "module" in ops else module_op()(x16, weights[0]))
        ref_bits = ref_bits.view(np.uint32)
        res = {"K": k, "N": n, "bytes": nbytes, "variants": {}}
        for name, op in ops.items():
            r = check_and_time(name, op, weights, x16, ref_bits, args.repeats)
            if "m16_s" in r:
                r["m16_frac_roofline"] = nbytes / r["m16_s"] / roof["roofline_Bps"]
                r["m1_frac_roofline"] = nbytes / r["m1_s"] / roof["roofline_Bps"]
                print(
                    f"{shape:12s} {name:30s} exact={r['row_exact']!s:5s} same_bits={r['bits_equal_module']!s:5s} "
                    f"M16 {r['m16_s'] * 1e6:8.1f}us {100 * r['m16_frac_roofline']:5.1f}%  "
                    f"M1 {r['m1_s'] * 1e6:8.1f}us {100 * r['m1_frac_roofline']:5.1f}%",
                    flush=True,
                )
            else:
                print(f"{shape:12s} {name:30s} ERROR {r['error'].splitlines()[-1][:200]}", flush=True)
            res["variants"][name] = r
        results[shape] = res
        del weights
        if args.out:
            report = {"meta": meta, "roofline": roof, "results": results, "elapsed_s": time.time() - t0}
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
