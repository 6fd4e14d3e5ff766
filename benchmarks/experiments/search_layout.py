"""The threshold search's pass layout (`jspec.sampling._smallest_passing`), A/B on the GPU: today's pass broadcasts
a row to [R, V, 15] and reduces over V (the 15 candidates the minor axis); the variant here broadcasts to
[15, R, V] and reduces over the minor V axis (XLA's row reduction). Per vocabulary and processor: the GPU kernel
time of one `choose_rows` call on 8 rows (XLA profiler) with each layout, and whether the chosen tokens agree (top-k
counts are exact in any order; top-p mass sums may round differently, so they are reported, not required).

    python3 benchmarks/experiments/search_layout.py --out $OUT/search_layout_h200.json --commit <sha>
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec import sampling  # noqa: E402
from jspec.sampling import Sampler, choose_rows  # noqa: E402
from jspec_bench.timing import kernel_times, profile  # noqa: E402


def smallest_passing_minor_v(x, limit, lo, hi, *, weighted):
    """`sampling._smallest_passing` with each pass as a [15, R, V] row reduction."""
    lo, hi, limit = lo[:, None], hi[:, None], limit[:, None]
    ways = jnp.arange(1, sampling.SEARCH_WAYS, dtype=jnp.uint32)
    for _ in range(sampling.SEARCH_PASSES):
        span = hi - lo
        step = jnp.maximum(span // sampling.SEARCH_WAYS + (span % sampling.SEARCH_WAYS != 0).astype(jnp.uint32), 1)
        cand = jnp.minimum(lo + step * ways, hi)  # [R, 15]
        t = sampling._from_order_key(cand).T[:, :, None]  # [15, R, 1]
        hit = x[None] > t if weighted else x[None] >= t
        stat = jnp.sum(jnp.where(hit, x[None] if weighted else 1.0, 0.0), axis=2).T  # [R, 15]
        ok = stat < limit
        lo, hi = (
            jnp.max(jnp.where(ok, lo, cand), axis=1, keepdims=True),
            jnp.min(jnp.where(ok, cand, hi), axis=1, keepdims=True),
        )
    return sampling._from_order_key(hi[:, 0])


def gpu_us(f, *args) -> float:
    """GPU kernel microseconds of one call f(*args) (XLA profiler)."""
    return kernel_times(profile(lambda: jax.block_until_ready(f(*args))), 1)["kernel_us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args()
    samplers = {"top_k 50": Sampler(temperature=0.7, top_k=50), "top_p 0.9": Sampler(temperature=0.7, top_p=0.9)}
    rng = np.random.default_rng(0)
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit, "rows": 8}
    original = sampling._smallest_passing
    for vocab in (128256, 152064):
        logits = jnp.asarray(rng.standard_normal((8, vocab)) * 4, jnp.float32)
        positions = jnp.arange(100, 108, dtype=jnp.int32)
        for name, s in samplers.items():
            row = {}
            tokens = {}
            for layout, fn in (("[R, V, 15]", original), ("[15, R, V]", smallest_passing_minor_v)):
                sampling._smallest_passing = fn
                try:
                    f = jax.jit(lambda z, p, v, mode=s.mode: choose_rows(z, p, mode, v))
                    tokens[layout] = np.asarray(f(logits, positions, s.values()))
                    row[layout + " kernel_us"] = min(gpu_us(f, logits, positions, s.values()) for _ in range(3))
                finally:
                    sampling._smallest_passing = original
            base = row["[R, V, 15] kernel_us"]
            row["ratio"] = row["[15, R, V] kernel_us"] / base if base else None  # None: no GPU kernels (CPU)
            row["same_tokens"] = bool(np.array_equal(*tokens.values()))
            result[f"{name} V={vocab}"] = row
            print(name, vocab, row, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
