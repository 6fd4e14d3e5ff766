"""top-p's mass sums, A/B on the GPU (`jspec.sampling._top_p`). The sampler's reductions must be order-free (rule 8)
so a row's bits do not depend on the rows beside it. First the fact that makes it so: float32 softmax sums of the
same rows, 8 rows at once against each row alone and under a vmap over 3 slots (ulp differences). Then variants of
the mass above each search candidate:

- float: the pass before the fixed point, softmax probabilities summed in float32 (order chosen by XLA per shape:
  not row-count independent; the reference cost);
- limbs: floor(e * 2 ** 2b) as two uint32 limbs reduced together ([R, V, 15, 2]), b = 32 - V.bit_length();
- limbs_apart: the same limbs as two separate [R, V, 15] reductions;
- chunks: `sampling._top_p`, round(e * 2 ** 24) in one uint32 limb summed exactly per chunk of 128 tokens, the
  chunk sums then split in 16-bit halves and summed over the chunks (at 7aff35e this variant floored; the library
  rounds).

Per variant, R = 1 and 8 rows, V = 128256 and 152064: GPU kernel time of one call of temperature + top-p 0.9 (XLA
profiler), and whether its kept set equals the limbs variant's.

    python3 benchmarks/experiments/top_p_mass.py --out $OUT/top_p_mass_h200.json --commit <sha>
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

from jspec import sampling as s  # noqa: E402
from jspec_bench.timing import kernel_times, profile  # noqa: E402


def top_p_float(z, top_p):
    p = jax.nn.softmax(z, axis=-1)
    lo, hi = s._order_key(jnp.zeros(z.shape[0])), s._order_key(jnp.max(p, axis=1))
    limit = jnp.broadcast_to(top_p, lo.shape)
    t = s._smallest_passing(lambda t: jnp.sum(jnp.where(p[:, :, None] > t, p[:, :, None], 0.0), axis=1), limit, lo, hi)
    return jnp.where(p >= t[:, None], z, -jnp.inf)


def _limb_bits(vocab: int) -> int:
    return 32 - vocab.bit_length()  # vocab * 2 ** bits < 2 ** 32: no limb sum overflows


def _limbs(e):
    b = _limb_bits(e.shape[1])
    q = jnp.floor(e * 2.0 ** (2 * b))
    hi = jnp.floor(q * 2.0**-b)
    return jnp.stack([hi, q - hi * 2.0**b], axis=-1).astype(jnp.uint32)  # [R, V, 2]


def _mass(sums, vocab: int):
    return sums[..., 0].astype(jnp.float32) * 2.0 ** _limb_bits(vocab) + sums[..., 1].astype(jnp.float32)


def top_p_limbs(z, top_p):
    e = s._relative(z)
    limbs = _limbs(e)
    vocab = z.shape[1]
    limit = top_p * _mass(jnp.sum(limbs, axis=1, dtype=jnp.uint32), vocab)

    def stat(t):
        hit = (e[:, :, None] > t)[..., None]  # [R, V, W, 1]
        return _mass(jnp.sum(jnp.where(hit, limbs[:, :, None, :], 0), axis=1, dtype=jnp.uint32), vocab)

    zero, one = s._order_key(jnp.zeros(limit.shape)), s._order_key(jnp.ones(limit.shape))
    t = s._smallest_passing(stat, limit, zero, one)
    return jnp.where(e >= t[:, None], z, -jnp.inf)


def top_p_limbs_apart(z, top_p):
    e = s._relative(z)
    limbs = _limbs(e)
    vocab = z.shape[1]
    limit = top_p * _mass(jnp.sum(limbs, axis=1, dtype=jnp.uint32), vocab)

    def stat(t):
        hit = e[:, :, None] > t
        hi = jnp.sum(jnp.where(hit, limbs[:, :, None, 0], 0), axis=1, dtype=jnp.uint32)
        lo = jnp.sum(jnp.where(hit, limbs[:, :, None, 1], 0), axis=1, dtype=jnp.uint32)
        return _mass(jnp.stack([hi, lo], -1), vocab)

    zero, one = s._order_key(jnp.zeros(limit.shape)), s._order_key(jnp.ones(limit.shape))
    t = s._smallest_passing(stat, limit, zero, one)
    return jnp.where(e >= t[:, None], z, -jnp.inf)


VARIANTS = {"float": top_p_float, "limbs": top_p_limbs, "limbs_apart": top_p_limbs_apart, "chunks": s._top_p}


def float_sums_by_rows(vocab: int = 128256) -> dict:
    """ulp differences of float32 softmax sums [R, V] -> [R]: 8 rows at once, and under a vmap over 3 slots of 8,
    each against the row alone ([1, V])."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8, vocab)) * 4, jnp.float32)
    f = jax.jit(lambda z: jnp.sum(jnp.exp(z - jnp.max(z, -1, keepdims=True)), -1))
    alone = np.stack([np.asarray(f(x[1, r : r + 1]))[0] for r in range(8)])

    def ulps(a):
        return (np.asarray(a).view(np.uint32).astype(np.int64) - alone.view(np.uint32).astype(np.int64)).tolist()

    return {"vocab": vocab, "rows_8_vs_alone": ulps(f(x[1])), "vmap_3x8_vs_alone": ulps(jax.jit(jax.vmap(f))(x)[1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit, "cases": {}}
    result["float_sums_by_rows"] = float_sums_by_rows()
    print("float32 softmax sums, ulps against the row alone:", result["float_sums_by_rows"], flush=True)
    for vocab in (128256, 152064):
        for rows in (1, 8):
            logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 4, jnp.float32)
            r = result["cases"][f"V={vocab} rows={rows}"] = {}
            kept = {}
            for name, fn in VARIANTS.items():
                f = jax.jit(lambda z, fn=fn: fn(z / 0.7, jnp.float32(0.9)))
                kept[name] = np.isfinite(np.asarray(f(logits)))
                us = kernel_times(profile(lambda f=f, z=logits: jax.block_until_ready(f(z))), 1)["kernel_us"]
                r[name] = {"kernel_us": us, "kept_equals_limbs": None}
            for name in VARIANTS:
                r[name]["kept_equals_limbs"] = bool(np.array_equal(kept[name], kept["limbs"]))
            print(
                f"V={vocab} rows={rows}: " + ", ".join(f"{n} {v['kernel_us']:.0f} us" for n, v in r.items()), flush=True
            )
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
