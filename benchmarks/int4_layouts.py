"""Kernel study for the row-tile int4 matmul (issue 4): two kernels on *prepared* weight layouts, each checked for
row-exactness (row r bit-identical for M = 1, 3, 8 vs 16) and timed at M = 1 and 16 against the shipped kernel.
Results: benchmarks/results/int4_layouts_h200.json; findings: benchmarks/KERNEL_NOTES.md ("Prepared layouts").

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
ws (Pallas Mosaic GPU, warp-specialized)  weights prepared once as signed int4 codes (bytes XOR 0x88, so each
    nibble is q - 8) in natural k order: no even/odd split of x. One TMA warpgroup streams [2 * wg_rows, tile_k]
    code tiles, [2 * wg_rows, tile_k / 32] scales and [16, tile_k] x tiles through a `stages`-deep ring; two
    consumer warpgroups each convert wg_rows rows to bf16 with Mosaic's int4 upcast, multiply by the broadcast
    group scales (one bf16 rounding: the int4.py formula) and issue wgmma with the tokens on N = 16. `relayout`:
    `cast` loads in the int4 upcast layout and relayouts to the wgmma layout, `direct` loads in the wgmma layout.
    `wait=1` leaves one wgmma in flight across steps (the pipeline then delays each slot's release one step);
    `uneven` splits K into near-equal parts when the step count has no good divisor (7B down: 74 steps).
    GPU only (no interpret mode); every call site compiles separately (~0.6 s each).

Run on the GPU:  python3 benchmarks/int4_layouts.py --out $OUT/int4_layouts_h200.json --commit SHA
CPU check:       python benchmarks/int4_layouts.py --smoke   (kmajor variants in interpret mode, tiny shape)
Profile one:     ncu --kernel-name regex:int4 ... python3 benchmarks/int4_layouts.py --profile NAME   (14B gate_up)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from benchmarks import int4_matmul_bench as ib  # noqa: E402
from benchmarks.int4_variants import split_k_call  # noqa: E402
from pallas_kernels import int4_matmul as im  # noqa: E402
from pallas_kernels.backend import ROW_TILE  # noqa: E402
from pallas_kernels.int4 import BLOCK, Int4Weight  # noqa: E402

SHAPES = {
    "7b/qkv": (3584, 4608),
    "14b/o": (5120, 5120),
    "7b/gate_up": (3584, 37888),
    "7b/down": (18944, 3584),
    "14b/gate_up": (5120, 27648),
    "7b/lm_head": (3584, 152064),
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


def ws_weights(w: Int4Weight):
    """-> (codes int4 [N, K] holding q - 8, scales bf16 [N, K/32]). XLA packs int4 low nibble first, the same k
    order as the native bytes; XOR 0x88 turns each unsigned code q into the two's-complement nibble of q - 8."""
    n, half = w.packed.shape
    signed = jax.lax.bitcast_convert_type(w.packed ^ jnp.uint8(0x88), jnp.int4)  # [N, K/2, 2]
    return signed.reshape(n, 2 * half), w.scales


def ws_matmul(x, wt, *, tile_k=256, stages=4, split=1, wg_rows=64, relayout="cast", wait=0, uneven=False):
    """x [M <= 16, K] bf16 @ W -> float32 [M, N] with wt = ws_weights(w) (see the module doc)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    codes, scales = wt
    m, k = x.shape
    n = codes.shape[0]
    xp = jnp.pad(x, ((0, ROW_TILE - m), (0, 0)))
    cta_rows = 2 * wg_rows
    groups = tile_k // BLOCK
    steps_total = k // tile_k
    if k % tile_k or n % cta_rows or not (uneven or steps_total % split == 0):
        raise ValueError(f"ws_matmul: tile_k={tile_k}, rows={cta_rows}, split={split} do not fit K={k}, N={n}")
    steps = -(-steps_total // split)
    code_swizzle, x_swizzle = min(128, tile_k // 2), min(128, tile_k * 2)
    code_tf = (plgpu.TilingTransform((8, code_swizzle * 2)), plgpu.SwizzleTransform(code_swizzle))
    x_tf = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(x_gmem, c_gmem, s_gmem, o_gmem, o_smem):
        ni, si, wg = jax.lax.axis_index("n"), jax.lax.axis_index("s"), jax.lax.axis_index("wg")
        rows = pl.ds(wg * wg_rows, wg_rows)
        lo = si * steps_total // split
        count = (si + 1) * steps_total // split - lo

        def kstep(j):  # a short split re-loads its last tile and skips the product (uneven only)
            return lo + jnp.minimum(j, count - 1)

        def body(idx, c_smem, s_smem, x_smem, acc_ref):
            if relayout == "cast":
                q = plgpu.layout_cast(
                    plgpu.load(c_smem.at[rows], layout=plgpu.Layout.WGMMA_UPCAST_4X), plgpu.Layout.WGMMA
                )
            else:
                q = plgpu.load(c_smem.at[rows], layout=plgpu.Layout.WGMMA)
            w = q.astype(jnp.bfloat16)
            parts = []
            for g in range(groups):
                sg = jax.lax.broadcast_in_dim(plgpu.load(s_smem.at[rows, g], layout=row_layout), (wg_rows, BLOCK), [0])
                parts.append(w[:, g * BLOCK : (g + 1) * BLOCK] * sg)
            wd = jnp.concatenate(parts, axis=1) if groups > 1 else parts[0]
            if uneven:

                @pl.when(idx[0] < count)
                def _():
                    plgpu.wgmma(acc_ref, wd, x_smem.T)

            else:
                plgpu.wgmma(acc_ref, wd, x_smem.T)
            plgpu.wgmma_wait(wait)
            return acc_ref

        def compute_context(eval_pipeline):
            def acc_scope(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                o_smem[wg] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[si, pl.ds(ni * cta_rows + wg * wg_rows, wg_rows)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(acc_scope, plgpu.ACC((wg_rows, ROW_TILE), jnp.float32))

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_rows, tile_k), lambda j: (ni, kstep(j)), transforms=code_tf, delay_release=wait),
                plgpu.BlockSpec((cta_rows, groups), lambda j: (ni, kstep(j)), delay_release=wait),
                plgpu.BlockSpec((ROW_TILE, tile_k), lambda j: (0, kstep(j)), transforms=x_tf, delay_release=wait),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )(c_gmem, s_gmem, x_gmem)

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((split, n, ROW_TILE), jnp.float32),
        grid=(n // cta_rows, split),
        grid_names=("n", "s"),
        num_threads=3,
        thread_name="wg",
        scratch_types=dict(o_smem=plgpu.SMEM((2, wg_rows, ROW_TILE), jnp.float32)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(xp, codes, scales)
    return jax.lax.optimization_barrier(im._combine(jnp.swapaxes(out, 1, 2)))[:m]


def ws_op(k: int, n: int, **cfg):
    """ws_matmul with split-K chosen from the shape (uneven: ~264 programs; else the module's pick_split)."""
    rows, steps = 2 * cfg.get("wg_rows", 64), k // cfg.get("tile_k", 256)
    if cfg.get("uneven"):
        split = max(1, min(steps // 2, -(-264 // (n // rows))))
    else:
        split = im.pick_split(n // rows, steps)
    return functools.partial(ws_matmul, split=split, **cfg)


KMAJOR = [  # (mode, block_n, groups, warps, stages, prefetch)
    *[(mode, bn, g, w, s, False) for mode in ("eo", "asm", "dup") for bn, g, w, s in
      [(128, 1, 4, 4), (256, 1, 4, 4), (128, 2, 4, 3), (256, 2, 8, 3), (128, 4, 4, 3), (256, 1, 8, 6), (64, 4, 4, 3)]],
    *[(mode, bn, g, w, s, True) for mode in ("eo", "asm", "dup") for bn, g, w, s in [(128, 2, 4, 1), (256, 1, 4, 2)]],
]  # fmt: skip
WS = {
    "ws_cast_s4": dict(stages=4),
    "ws_cast_s6": dict(stages=6),
    "ws_cast_s4_r128": dict(stages=4, wg_rows=128),
    "ws_direct_s4": dict(stages=4, relayout="direct"),
    "ws_direct_s4_wait1": dict(stages=4, relayout="direct", wait=1),
    "ws_direct_s4_wait1_r128": dict(stages=4, relayout="direct", wait=1, wg_rows=128),
    "ws_direct_s4_wait1_uneven": dict(stages=4, relayout="direct", wait=1, uneven=True),
    "ws_direct_s6_uneven": dict(stages=6, relayout="direct", uneven=True),
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
            out[name] = (ws_op(k, n, **cfg), ws_weights)
    return out


def measure(op, weights, x16, ref, nbytes, roof) -> dict:
    r = {}
    try:
        y = np.asarray(jax.jit(op)(x16, weights[0]))
        r["max_abs_vs_naive"] = float(np.max(np.abs(y - ref)))
        r.update(ib.exactness(op, x16, weights[0], (1, 3, 8)))
        for m in (16, 1):
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
        nbytes = ib.int4_bytes(k, n)
        native = ib.random_weights(key, k, n, ib.n_copies(nbytes))
        x16 = jax.random.normal(jax.random.fold_in(key, 7), (16, k), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(ib.naive_op(x16, native[0]))
        res = report["results"][shape] = {"K": k, "N": n, "bytes": nbytes, "variants": {}}
        for name, (op, prep) in variants(k, n).items():
            if args.only and name != "module" and name not in args.only.split(","):
                continue
            r = res["variants"][name] = measure(op, [prep(w) for w in native], x16, ref, nbytes, roof)
            if "error" in r:
                print(f"{shape:12s} {name:34s} ERROR {r['error'].splitlines()[-1][:300]}", flush=True)
            else:
                print(
                    f"{shape:12s} {name:34s} exact={r['row_exact']!s:5s} "
                    f"M16 {r['m16_s'] * 1e6:8.1f}us {100 * r['m16_frac_roofline']:5.1f}%  "
                    f"M1 {r['m1_s'] * 1e6:8.1f}us {100 * r['m1_frac_roofline']:5.1f}%",
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
