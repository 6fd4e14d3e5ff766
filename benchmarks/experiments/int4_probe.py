"""Same-process comparison of int4 row-tile kernels at one shape, M = 1: Mosaic GPU kernel configs (`int4_ws.Config`
keyword dicts) and the Pallas-Triton kernel ("triton"). The cheap way to compare kernels on the H200 (a Mosaic
compile is ~3 s; int4_layouts.py took minutes per shape). It packages the scratch script behind two studies whose
numbers docs/kernels.md keeps (qkv and o on the Mosaic GPU kernel, the wgmma serialization); their result files
(int4_qkv_o_h200.json, int4_serialization_h200.json) are in git history.

Run on the GPU (appends one JSON line to --out):
    python3 benchmarks/experiments/int4_probe.py --shape 3584,4608 --rounds 2 --commit SHA \\
        --kernels '[{}, {"wg_rows": 128, "chunks": 2}, "triton"]' --out $OUT/int4_probe_h200.jsonl
(`--smoke`: CPU, tiny shape, the Triton kernel in interpret mode only, to check the script.)

Per kernel, once (`int4_layouts.measure`, a kernel that does not build is recorded and left out of the timing):
row-exactness (rows of M = 1, 3, 8 vs M = 16, bitwise) and the largest absolute difference from the naive
dequantize-then-dot; `check_s` includes the compile. Then `--rounds` rounds, each timing every kernel in turn
(single samples swing by up to 30% on this machine, so compare kernels within a round): `full_us` the op as a
model calls it (pad, kernel, segment sum, slice), and for the Mosaic kernel `tile_us` its kernel alone. Timing:
`int4_matmul_bench.time_calls` (weight copies chained in one executable, past the L2; median of 5).
With MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR the Mosaic kernels' ptxas reports land in DIR: a line
"(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized" means the wgmma ran one at a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import int4_matmul_bench as ib  # noqa: E402
from benchmarks.experiments.int4_layouts import measure  # noqa: E402
from pallas_kernels import int4_matmul, int4_ws  # noqa: E402

ROOFLINE_BPS = 4.2e12  # the H200's HBM read roofline as measured by the other benchmarks (frac_4_2's unit)


def kernel(spec, k: int, n: int, native: list, interpret: bool):
    """(name, full op, its weights, kernel-alone op or None) of one --kernels entry."""
    if spec == "triton":
        op = functools.partial(int4_matmul.rows_matmul, interpret=interpret)
        return "triton", op, native, None
    cfg = int4_ws.Config(**spec)
    part = int4_ws.partition(k, n, cfg)

    def tile(x16, w):
        return int4_ws._tile(x16, w.codes, w.scales, cfg=cfg, part=part)

    name = ",".join(f"{key}={value}" for key, value in spec.items()) or "Config()"
    codes = [int4_ws.prepare_codes(w) for w in native]
    return name, functools.partial(int4_ws.rows_matmul, config=cfg), codes, tile


def compare(specs: list, k: int, n: int, rounds: int, interpret: bool) -> dict:
    key = jax.random.key(0)
    native = ib.random_weights(key, k, n, ib.n_copies(ib.int4_bytes(k, n)))
    x16 = jax.random.normal(key, (16, k), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(ib.naive_op(x16, native[0]))
    nbytes = ib.int4_bytes(k, n)
    kernels = [kernel(spec, k, n, native, interpret) for spec in specs]
    results = {}
    for name, op, weights, _ in kernels:
        start = time.perf_counter()
        results[name] = measure(op, weights, x16, ref, nbytes, ROOFLINE_BPS, ms=())  # bits and error, no timing
        results[name].update(check_s=round(time.perf_counter() - start, 1), full_us=[], tile_us=[])
    built = [kern for kern in kernels if "error" not in results[kern[0]]]
    for _ in range(rounds):
        for name, op, weights, tile in built:
            results[name]["full_us"].append(round(ib.time_calls(op, x16[:1], weights, 5) * 1e6, 2))
            if tile is not None:
                results[name]["tile_us"].append(round(ib.time_calls(tile, x16, weights, 5) * 1e6, 2))
    for name, *_ in built:
        r = results[name]
        r["frac_4_2"] = round(nbytes / (min(r["full_us"]) * 1e-6) / ROOFLINE_BPS, 3)
        if r["tile_us"]:
            r["tile_frac_4_2"] = round(nbytes / (min(r["tile_us"]) * 1e-6) / ROOFLINE_BPS, 3)
    return {"K": k, "N": n, "bytes": nbytes, "results": results}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="[{}]", help='JSON list: int4_ws.Config keyword dicts and/or "triton"')
    ap.add_argument("--shape", default="3584,37888", help="K,N (default: Qwen2.5-7B gate_up)")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds (every kernel once per round)")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", required=True, help="JSON-lines file to append to")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, Triton kernel in interpret mode only")
    args = ap.parse_args()
    specs = json.loads(args.kernels)
    k, n = (int(v) for v in args.shape.split(","))
    if args.smoke and specs != ["triton"]:
        raise SystemExit("int4_probe --smoke runs the Triton kernel only: --kernels '[\"triton\"]'")
    result = compare(specs, k, n, args.rounds, interpret=args.smoke)
    result.update(commit=args.commit, jax=jax.__version__, device=jax.devices()[0].device_kind)
    print(json.dumps(result), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
