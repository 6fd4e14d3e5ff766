"""One Mosaic GPU int4 kernel config at one shape, in its own process: `int4_layouts.measure` (row-exactness, error
against the naive dequantize-then-dot, the M = 1 time) and the wall time with the compile. The cheap way to compare
kernel configs on the H200 (a compile is ~3 s; int4_layouts.py took minutes per shape). Results:
benchmarks/results/int4_serialization_h200.json.

Run on the GPU, one process per config (each appends one JSON line to --out):
    python3 benchmarks/int4_probe.py --config '{"wg_rows": 128, "chunks": 2}' --shape 3584,37888 --commit SHA \\
        --out $OUT/int4_probe_h200.jsonl
With MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR the kernel's ptxas report (and PTX) lands in DIR: a line
"(C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized" means the wgmma ran one at a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import int4_matmul_bench as ib  # noqa: E402
from benchmarks.int4_layouts import measure  # noqa: E402
from pallas_kernels import int4_ws  # noqa: E402

ROOFLINE_BPS = 4.2e12  # the H200's HBM read roofline as measured by the other benchmarks (m1_frac_roofline's unit)


def probe(config: dict, k: int, n: int) -> dict:
    """`int4_layouts.measure` of `int4_ws.rows_matmul` with Config(**config) on random int4 weights [K, N] at M = 1;
    wall_s includes the compile."""
    key = jax.random.key(0)
    native = ib.random_weights(key, k, n, ib.n_copies(ib.int4_bytes(k, n)))
    x16 = jax.random.normal(key, (16, k), jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(ib.naive_op(x16, native[0]))
    op = functools.partial(int4_ws.rows_matmul, config=int4_ws.Config(**config))
    codes = [int4_ws.prepare_codes(w) for w in native]
    start = time.perf_counter()
    result = measure(op, codes, x16, ref, ib.int4_bytes(k, n), ROOFLINE_BPS, (1,))
    return {"config": config, "K": k, "N": n, "wall_s": round(time.perf_counter() - start, 1), **result}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="{}", help="int4_ws.Config keyword arguments as JSON")
    ap.add_argument("--shape", default="3584,37888", help="K,N (default: Qwen2.5-7B gate_up)")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", required=True, help="JSON-lines file to append to")
    args = ap.parse_args()
    k, n = (int(v) for v in args.shape.split(","))
    result = probe(json.loads(args.config), k, n)
    result.update(commit=args.commit, jax=jax.__version__, device=jax.devices()[0].device_kind)
    print(json.dumps(result), flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
