"""Kernel study for the row-tile int4 matmul (issue 4): two kernels on *prepared* weight layouts, each checked for
row-exactness (row r bit-identical for M = 1, 3, 8 vs 16) and timed at M = 1 and 16 against the shipped kernel.
Result: benchmarks/experiments/results/int4_layouts_h200.json (its run at fd0d63e: the Triton row-tile kernel,
`module`, against the stream-K Mosaic GPU kernel on upcast-order codes, ring 4 and 6; the runs before it are in git
history); findings: docs/kernels.md.

`ncu` of the shipped kernel (14B gate_up, M = 16) showed what caps it near 25% of the roofline: 30% of its
instructions are byte permutes (PRMT) that regroup 16-bit shared-memory loads of the packed bytes into the registers
the inline-PTX dequantization and the wgmma operand want, only ~3 CTAs (12 warps) fit an SM, and the x tile re-read
by every program doubles the L2 traffic (L2 59% busy, DRAM 28%). The two kernels here attack that:

kmajor (Pallas Triton)  weights transposed once to k-major bytes [K/2, N] and scales [K/32, N], so a step loads one
    32-k group as a [16, BN] byte tile and one contiguous scale row [1, BN] (no reshape, no gathered scales); tokens
    sit on the dot's M side (acc [16, BN] += x_even/odd [16, 16] @ W_lo/hi [16, BN]). Modes: `eo` (jnp
    dequantization), `asm` (the shipped inline PTX), `dup` (one [32, BN] tile with every byte row loaded twice and
    the nibble picked by row parity: one K = 32 dot on un-split x). `_pf` = the next tiles are loaded one step ahead
    by hand (loop carry) instead of by Triton's pipeliner.
ws (Pallas Mosaic GPU, warp-specialized: `pallas_kernels.int4_ws`, whose docstring describes it) on
    `Int4Codes` (signed int4 codes, k reordered inside each 32-k block: no even/odd split of x). Options
    (`int4_ws.Config`): ring `stages`, `ctas` and `min_steps` of the stream-K partition, `chunks` (k chunks per
    step, each converted and handed to its own wgmma), `wg_rows`; `divisor` variants instead give one CTA per
    (tile, divisor split of K), the partition measured before stream-K. (Earlier runs, in git
    history, also measured a `cast` relayout, `wait=1` and an `uneven` split; see docs/kernels.md.) GPU only (no
    interpret mode).

Run on the GPU:  python3 benchmarks/experiments/int4_layouts.py --out $OUT/int4_layouts_h200.json --commit SHA
CPU check:       python benchmarks/experiments/int4_layouts.py --smoke   (kmajor variants in interpret mode, tiny shape)
Profile one:     ncu --kernel-name regex:int4 ... python3 benchmarks/experiments/int4_layouts.py --profile NAME
                 (one call at 14B gate_up)
"""

from __future__ import annotations

import argparse
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
from benchmarks.experiments.int4_variants import split_k_call  # noqa: E402
from pallas_kernels import int4_matmul as im  # noqa: E402
from pallas_kernels import int4_ws  # noqa: E402
from pallas_kernels.backend import ROW_TILE  # noqa: E402
from pallas_kernels.int4 import BLOCK, Int4Weight  # noqa: E402

SHAPES = {
    "7b/qkv": (3584, 4608),
    "14b/o": (5120, 5120),
    "7b/gate_up": (3584, 37888),
    "7b/down": (18944, 3584),
    "14b/gate_up": (5120, 27648),
    "7b/lm_head": (3584, 152064),
    "7b/o": (3584, 3584),
    "14b/down": (13824, 5120),
}
INTERPRET = False  # --smoke


def kmajor_weights(w: Int4Weight):
    """-> (packed_t uint8 [K/2, N], scales_t bf16 [K/32, N])."""
    return w.packed.T, w.scales.T


def _codes(p, shift):
    """uint8 bytes -> bf16 128 + nibble (exact), by OR-ing the nibble into the mantissa of 128.0."""
    q = ((p >> shift) & 0xF).astype(jnp.uint16) if shift else (p & 0xF).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(q | jnp.uint16(0x4300), jnp.bfloat16)


def _asm_dequant(p, s, shift):
    """p [R, C] uint8, s [R, C] bf16 -> bf16 (q - 8) * s through the shipped kernel's inline PTX."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.elementwise_inline_asm(
        im._DEQUANT_PTX.format(shift=shift),
        args=[p, s, jnp.full(p.shape, 136.0, jnp.bfloat16)],
        constraints="=r,=r,r,r,r,r,r",
        pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)],
    )[0]


def kmajor_kernel(x_ref, p_ref, s_ref, o_ref, *, block_n, groups, steps, mode, prefetch):
    """x_ref [2, 16, K/2] (even/odd k) or [16, K] (mode dup); p_ref [K/2, N] uint8; s_ref [K/32, N] bf16;
    o_ref [S, 16, N] float32. One program: BN output channels x one K split, `groups` 32-k groups per step."""
    i, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(i * block_n, block_n)
    rows32 = jax.lax.broadcasted_iota(jnp.int32, (32, block_n), 0)
    col_idx = jax.lax.broadcasted_iota(jnp.int32, (32, block_n), 1) + i * block_n
    shift32 = ((rows32 % 2) * 4).astype(jnp.uint8)

    def load(blk):
        s = s_ref[pl.ds(blk, 1), cols]  # [1, BN]
        if mode == "dup":
            return p_ref[blk * 16 + rows32 // 2, col_idx], s  # [32, BN]: byte row k // 2 for each k
        return p_ref[pl.ds(blk * 16, 16), cols], s  # [16, BN]

    def compute(blk, p, s, acc):
        if mode == "dup":
            q = ((p >> shift32) & 0xF).astype(jnp.uint16)
            w = (jax.lax.bitcast_convert_type(q | jnp.uint16(0x4300), jnp.bfloat16) - jnp.bfloat16(136.0)) * s
            return acc + jnp.dot(x_ref[:, pl.ds(blk * BLOCK, BLOCK)], w, preferred_element_type=jnp.float32)
        for shift, xi in ((0, 0), (4, 1)):
            if mode == "asm":
                w = _asm_dequant(p, jnp.broadcast_to(s, p.shape), shift)
            else:
                w = (_codes(p, shift) - jnp.bfloat16(136.0)) * s
            acc = acc + jnp.dot(x_ref[xi, :, pl.ds(blk * 16, 16)], w, preferred_element_type=jnp.float32)
        return acc

    base = split * steps * groups
    zeros = jnp.zeros((ROW_TILE, block_n), jnp.float32)
    if prefetch:

        def step(j, carry):
            acc, tiles = carry
            ahead = []
            for g in range(groups):
                blk = base + j * groups + g
                ahead.append(load(jnp.minimum(blk + groups, base + steps * groups - 1)))
                acc = compute(blk, *tiles[g], acc)
            return acc, tuple(ahead)

        acc, _ = jax.lax.fori_loop(0, steps, step, (zeros, tuple(load(base + g) for g in range(groups))))
    else:

        def step(j, acc):
            for g in range(groups):
                blk = base + j * groups + g
                acc = compute(blk, *load(blk), acc)
            return acc

        acc = jax.lax.fori_loop(0, steps, step, zeros)
    o_ref[split, :, cols] = acc


def kmajor_op(mode, block_n, groups, num_warps, num_stages, prefetch=False):
    """(x [M, K] bf16, kmajor_weights(w)) -> f32 [M, N], rows padded to 16, split-K as the module picks it."""

    def op(x, wt):
        pt, st = wt
        m, k = x.shape
        n = pt.shape[1]
        xp = jnp.pad(x, ((0, ROW_TILE - m), (0, 0)))
        total = k // (BLOCK * groups)
        s = 1 if INTERPRET else im.pick_split(n // block_n, total)
        kern = functools.partial(
            kmajor_kernel, block_n=block_n, groups=groups, steps=total // s, mode=mode, prefetch=prefetch
        )
        args = (xp if mode == "dup" else im._split_even_odd(xp), pt, st)
        triton = (num_warps, num_stages)
        return split_k_call(
            kern, n, block_n, s, args, m, interpret=INTERPRET, triton=triton, name=f"int4_kmajor_{mode}"
        )

    return op


def ws_op(k: int, n: int, divisor: bool = False, **cfg):
    """`pallas_kernels.int4_ws.rows_matmul` with this variant's Config. divisor: instead of the stream-K CTA count,
    one CTA per (tile, divisor split of K) as before the stream-K partition (the Triton kernel's split rule)."""
    config = int4_ws.Config(**cfg)
    if divisor:
        part = int4_ws.partition(k, n, config)
        config = int4_ws.Config(**cfg, ctas=part.tiles * im.pick_split(part.tiles, part.steps), min_steps=1)
    return functools.partial(int4_ws.rows_matmul, config=config)


KMAJOR = [  # (mode, block_n, groups, warps, stages, prefetch)
    *[(mode, bn, g, w, s, False) for mode in ("eo", "asm", "dup") for bn, g, w, s in
      [(128, 1, 4, 4), (256, 1, 4, 4), (128, 2, 4, 3), (256, 2, 8, 3), (128, 4, 4, 3), (256, 1, 8, 6), (64, 4, 4, 3)]],
    *[(mode, bn, g, w, s, True) for mode in ("eo", "asm", "dup") for bn, g, w, s in [(128, 2, 4, 1), (256, 1, 4, 2)]],
]  # fmt: skip
WS = {
    "ws_divisor_s4": dict(divisor=True),
    "ws_streamk_s4": dict(),
    "ws_c2": dict(chunks=2),
    "ws_c4": dict(chunks=4),
    "ws_r128_c2": dict(wg_rows=128, chunks=2),
}


def variants(k: int, n: int) -> dict:
    """name -> (op, prepare) for one shape."""
    out = {"module": (lambda x, w: im.rows_matmul(x, w, interpret=INTERPRET), lambda w: w)}
    for mode, bn, g, nw, ns, pf in KMAJOR:
        if mode == "asm" and INTERPRET:
            continue  # inline PTX: GPU only
        name = f"kmajor_{mode}_{bn}_g{g}_w{nw}_s{ns}" + ("_pf" if pf else "")
        out[name] = (kmajor_op(mode, bn, g, nw, ns, pf), kmajor_weights)
    if not INTERPRET:
        for name, cfg in WS.items():
            out[name] = (ws_op(k, n, **cfg), int4_ws.prepare_codes)
    return out


def measure(op, weights, x16, ref, nbytes, roof, ms=(16, 1)) -> dict:
    """Bits of rows for M = 1, 3, 8 vs 16 and the time per call at each M in ms."""
    r = {}
    try:
        y = np.asarray(jax.jit(op)(x16, weights[0]))
        r["max_abs_vs_naive"] = float(np.max(np.abs(y - ref)))
        r.update(ib.exactness(op, x16, weights[0], (1, 3, 8)))
        for m in ms:
            r[f"m{m}_s"] = ib.time_calls(op, x16[:m], weights, 5)
            r[f"m{m}_frac_roofline"] = nbytes / r[f"m{m}_s"] / roof
    except Exception as e:  # noqa: BLE001 - a variant that does not build is recorded, the study goes on
        r["error"] = "".join(traceback.format_exception_only(e))[-3000:]
    return r


def main():
    global INTERPRET
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", help="comma list of variant names (module is always run)")
    ap.add_argument("--shapes", help=f"comma list of shapes (default all: {','.join(SHAPES)})")
    ap.add_argument("--m1-only", action="store_true", help="time M = 1 only (the kernel is the same for every M)")
    ap.add_argument("--profile", help="run one call of this variant at 14b/gate_up (for ncu) and exit")
    args = ap.parse_args()
    if args.smoke:
        INTERPRET = ib.INTERPRET = True
        SHAPES.clear()
        SHAPES["tiny"] = (512, 256)
    key = jax.random.key(0)
    if args.profile:
        k, n = SHAPES["14b/gate_up"]
        op, prep = variants(k, n)[args.profile]
        w = prep(ib.random_weights(key, k, n, 1)[0])
        x = jax.random.normal(key, (16, k), jnp.float32).astype(jnp.bfloat16)
        for _ in range(3):
            jax.block_until_ready(jax.jit(op)(x, w))
        return
    t0 = time.time()
    report = {"meta": {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit}}
    report["roofline"] = ib.roofline(3)
    roof = report["roofline"]["roofline_Bps"]
    report["results"] = {}
    for shape, (k, n) in SHAPES.items():
        if args.shapes and shape not in args.shapes.split(","):
            continue
        nbytes = ib.int4_bytes(k, n)
        native = ib.random_weights(key, k, n, ib.n_copies(nbytes))
        x16 = jax.random.normal(jax.random.fold_in(key, 7), (16, k), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(ib.naive_op(x16, native[0]))
        res = report["results"][shape] = {"K": k, "N": n, "bytes": nbytes, "variants": {}}
        for name, (op, prep) in variants(k, n).items():
            if args.only and name != "module" and name not in args.only.split(","):
                continue
            r = res["variants"][name] = measure(
                op, [prep(w) for w in native], x16, ref, nbytes, roof, (1,) if args.m1_only else (16, 1)
            )
            if "error" in r:
                print(f"{shape:12s} {name:34s} ERROR {r['error'].splitlines()[-1][:300]}", flush=True)
            else:
                print(
                    f"{shape:12s} {name:34s} exact={r['row_exact']!s:5s} "
                    + "  ".join(
                        f"M{m} {r[f'm{m}_s'] * 1e6:8.1f}us {100 * r[f'm{m}_frac_roofline']:5.1f}%"
                        for m in (16, 1)
                        if f"m{m}_s" in r
                    ),
                    flush=True,
                )
        del native
        if args.out:
            report["elapsed_s"] = time.time() - t0
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
