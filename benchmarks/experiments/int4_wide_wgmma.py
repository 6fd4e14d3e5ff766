"""A/B of `int4_ws.Config.wide_wgmma` on the GPU: a launch of T row tiles issuing one wgmma of N = 16 T per k chunk
(one accumulator) against T wgmmas of N = 16 (one accumulator per tile). Llama-3-8B int4 shapes (qkv, o, gate_up,
down, lm_head), R = 16 .. 128 rows through `int4_ws.tiles_matmul` (launches of up to `launch_tiles` tiles): GPU
kernel time of each product (XLA profiler), and whether the two give the same bits (and equal each tile computed
alone by `rows_matmul`).

    python3 benchmarks/experiments/int4_wide_wgmma.py --out $OUT/int4_wide_wgmma_h200.json --commit <sha>
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


def product(wide: bool):
    """jitted x [R, K] bf16, Int4Codes -> float32 [R, N] through `tiles_matmul` with the shape's Config, wide or not."""

    def f(x, c):
        return int4_ws.tiles_matmul(x, c, config=dataclasses.replace(int4_ws.config_for(*c.shape), wide_wgmma=wide))

    return jax.jit(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--rows", default="16,32,64,128")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = {
        name: int4_ws.prepare_codes(quantize(rng.standard_normal((k, n)).astype(np.float32)))
        for name, (k, n) in {**SHAPES, "lm_head": LM_HEAD}.items()
    }
    fns = {"per_tile": product(False), "wide": product(True)}
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
        r["same_bits"] = {n: bool(np.array_equal(bits(outs["wide"][n]), bits(outs["per_tile"][n]))) for n in weights}
        r["wide_equals_tiles_alone"] = {n: bool(np.array_equal(bits(outs["wide"][n]), bits(alone[n]))) for n in weights}
        r["ratio_layer"] = r["wide"]["layer_us"] / r["per_tile"]["layer_us"]
        r["ratio_lm_head"] = r["wide"]["kernel_us"]["lm_head"] / r["per_tile"]["kernel_us"]["lm_head"]
        print(
            f"rows={rows}: layer {r['per_tile']['layer_us']:.0f} -> {r['wide']['layer_us']:.0f} us "
            f"({r['ratio_layer']:.3f}x), lm_head {r['ratio_lm_head']:.3f}x, same bits {all(r['same_bits'].values())}, "
            f"= tiles alone {all(r['wide_equals_tiles_alone'].values())}",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
