"""The threshold search's kernel configurations on the H200: top-p's search over a [16, V] probability tile.

For each `pallas_kernels.threshold.Config` (block, steps, num_warps) and the XLA reference: median seconds per call
of chained calls and, under the XLA profiler, the GPU kernel time; every configuration's thresholds compared bit
for bit with the default's (the configuration changes the partial-sum order, so equality is reported, not
assumed). Run on the GPU from the repository root:

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/experiments/threshold_sweep.py --out $OUT/x.json --commit SHA
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec_bench.timing import kernel_times, profile
from pallas_kernels import ROW_TILE, threshold


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    p = jax.nn.softmax(jnp.asarray(rng.standard_normal((ROW_TILE, args.vocab)) * 4 / 0.7, jnp.float32), axis=-1)
    limit = jnp.full((ROW_TILE,), 0.9, jnp.float32)
    lo = threshold.order_key(jnp.zeros((ROW_TILE,), jnp.float32))
    hi = threshold.order_key(jnp.max(p, axis=1))
    configs = [None] + [
        threshold.Config(block=b, steps=s, num_warps=w)
        for b, s, w in itertools.product((512, 1024, 2048), (1, 2, 4), (4, 8, 16))
    ]
    results, default = [], None
    for cfg in configs:
        backend = "reference" if cfg is None else "pallas"
        fn = jax.jit(
            lambda x, cfg=cfg, backend=backend: threshold.smallest_passing(
                x, limit, lo, hi, weighted=True, strict=True, backend=backend, config=cfg
            )
        )
        out = jax.block_until_ready(fn(p))
        default = out if cfg == threshold.Config() else default
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                out = fn(p)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / 50)
        kernels = kernel_times(profile(lambda fn=fn: jax.block_until_ready(fn(p))), 1)
        row = {
            "config": "reference" if cfg is None else dataclasses.asdict(cfg),
            "time_us": 1e6 * statistics.median(times),
            "kernel_us": kernels["kernel_us"],
            "launches": kernels["launches"],
            "thresholds": np.asarray(out).view(np.uint32).tolist(),
        }
        results.append(row)
        print(row["config"], f"{row['time_us']:.1f} us, kernels {row['kernel_us']} us in {row['launches']}", flush=True)
    for row in results:
        row["equal_to_default"] = row.pop("thresholds") == np.asarray(default).view(np.uint32).tolist()
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "commit": args.commit, "vocab": args.vocab}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
