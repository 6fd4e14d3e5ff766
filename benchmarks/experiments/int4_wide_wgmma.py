"""A/B of how `int4_ws.tiles_matmul` runs R rows (a batch round's) on the GPU, Llama-3-8B int4 shapes (qkv, o,
gate_up, down, lm_head), R = 16 .. 128: GPU kernel time of each product (XLA profiler), and whether every variant
gives the same bits (and each row tile's bits computed alone by `rows_matmul`). Variants (--variants):

- wide: the shipped kernel, a launch of T row tiles issuing one wgmma of N = 16 T per k chunk (`Config.wide_wgmma`);
- per_tile: T wgmmas of N = 16, one accumulator per tile;
- launches_of_3: the shipped kernel with 256-row weight tiles (gate_up, lm_head) taking 3 row tiles a launch, as
  when `int4_ws.ring` planned in 216 KiB of shared memory (64 rows: launches of 3 + 1, their weights read twice);
- chunks4: the shipped kernel in 4 k chunks a pipeline step instead of 2 (the same bits by construction: a chunk's
  conversion overlaps the previous chunk's wgmma, and at N = 64 a wgmma takes 4x the time it takes at N = 16);
- wide_all: 256-row weight tiles for every product that fits them (qkv, o, down too): at 64 rows a pipeline step
  streams a 32 KB x tile beside 16 KB of 128-row codes, twice the codes' bytes, so wider tiles halve the x bytes
  a weight byte costs. Another partition: other bits than the shipped kernel's (reported, not required);
- tile_per_cta: the shipped tiles, one CTA per weight tile (`Config.ctas` = tiles: every tile one segment), so no
  f32 partials are written beyond the product and the combine reads one slot: at 64 rows a layer's stream-K
  partials are ~30 MB written and ~38 MB read beside 109 MB of weights. Fewer CTAs than SMs where N is short
  (qkv 48, o and down 32, gate_up 112 of 132); another partition, other bits.

    python3 benchmarks/experiments/int4_wide_wgmma.py --out $OUT/int4_wide_wgmma_h200.json --commit <sha>
    python3 benchmarks/experiments/int4_wide_wgmma.py --variants wide,launches_of_3 --rows 16,48,64,128 ...
    python3 benchmarks/experiments/int4_wide_wgmma.py --variants wide,chunks4,wide_all,tile_per_cta --rows 16,64,128 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.exactness import bits  # noqa: E402
from jspec_bench.timing import kernel_times, profile  # noqa: E402
from pallas_kernels import int4_ws  # noqa: E402
from pallas_kernels.int4 import quantize  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
LM_HEAD = (4096, 128256)


def product(variant: str):
    """jitted x [R, K] bf16, Int4Codes -> float32 [R, N] through `tiles_matmul` as `variant` runs it."""

    def f(x, c):
        k_stored = c.codes.shape[0] * int4_ws.TILE_K
        cfg = int4_ws.config_for(k_stored, c.codes.shape[1])
        if variant == "per_tile":
            cfg = dataclasses.replace(cfg, wide_wgmma=False)
        if variant == "chunks4":
            cfg = dataclasses.replace(cfg, chunks=4)
        if variant == "tile_per_cta":
            cfg = dataclasses.replace(cfg, ctas=c.codes.shape[1] // cfg.tile_rows)
        if variant == "wide_all":
            wide = dataclasses.replace(int4_ws.Config(), wg_rows=2 * int4_ws.Config().wg_rows)
            cfg = wide if int4_ws.fits(k_stored, c.codes.shape[1], wide) else cfg
        if variant != "launches_of_3":
            return int4_ws.tiles_matmul(x, c, config=cfg)
        shipped = int4_ws.launch_tiles  # read by tiles_matmul while this traces
        int4_ws.launch_tiles = lambda cfg: 3 if cfg.wg_rows == 128 else shipped(cfg)
        try:
            return int4_ws.tiles_matmul(x, c, config=cfg)
        finally:
            int4_ws.launch_tiles = shipped

    return jax.jit(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--variants", default="wide,per_tile", help="the first is the one the others are timed against")
    args = ap.parse_args()
    variants = args.variants.split(",")
    rng = np.random.default_rng(0)
    weights = {
        name: int4_ws.prepare_codes(quantize(rng.standard_normal((k, n)).astype(np.float32)))
        for name, (k, n) in {**SHAPES, "lm_head": LM_HEAD}.items()
    }
    fns = {v: product(v) for v in variants}
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit, "rows": {}}
    for rows in map(int, args.rows.split(",")):
        r = result["rows"][str(rows)] = {}
        xs = {n: jnp.asarray(rng.standard_normal((rows, c.shape[0])), jnp.bfloat16) for n, c in weights.items()}
        outs = {}
        for label, fn in fns.items():
            outs[label] = {n: np.asarray(fn(xs[n], c)) for n, c in weights.items()}
            us = {
                n: kernel_times(profile(lambda x=xs[n], c=c, fn=fn: jax.block_until_ready(fn(x, c))), 1)["kernel_us"]
                for n, c in weights.items()
            }
            r[label] = {"kernel_us": us, "layer_us": sum(v for n, v in us.items() if n != "lm_head")}
        alone = {
            n: np.concatenate([np.asarray(int4_ws.rows_matmul(xs[n][i : i + 16], c)) for i in range(0, rows, 16)])
            for n, c in weights.items()
        }
        base = variants[0]
        r["same_bits"] = {v: all(np.array_equal(bits(outs[v][n]), bits(outs[base][n])) for n in weights) for v in fns}
        r["equals_tiles_alone"] = {n: bool(np.array_equal(bits(outs[base][n]), bits(alone[n]))) for n in weights}
        r["ratio_layer"] = {v: r[v]["layer_us"] / r[base]["layer_us"] for v in fns}
        r["ratio_lm_head"] = {v: r[v]["kernel_us"]["lm_head"] / r[base]["kernel_us"]["lm_head"] for v in fns}
        layers = ", ".join(f"{v} {r[v]['layer_us']:.0f}" for v in fns)
        print(
            f"rows={rows}: a layer's products (us) {layers}; lm_head vs {base} {r['ratio_lm_head']}; same bits "
            f"{all(r['same_bits'].values())}, = tiles alone {all(r['equals_tiles_alone'].values())}",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
