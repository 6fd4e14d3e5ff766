"""The decode/verify attention of a batch's slots under `jax.vmap` (jspec.batch) on the GPU: the default (at B x Hkv
> SMs one persistent grid over the batch, `attention_ws.batch_split_partials`; else a grid of
`attention_ws.ctas_per_head` CTAs per slot and KV head) against the grid of one CTA per slot and KV head (the default
before the batch grid), the grid one call alone gets, and the batch grid with a 2- and 3-deep ring; and the combine
with one program per two tile rows against one per two of the call's M rows. Llama-3-8B attention (32 / 8 heads of
128, bf16), the batch bench's cache (max_len 400: 512 positions), every slot at its own start in 320..383, M = 1
(decode) and M = 8 (verify, k = 7): GPU kernel time per layer (XLA profiler), the KV bytes it reads against the
time, and whether every variant gives the default's bits (each also against slot 0 alone). Two variants take
another partition, so other bits by design: `split512` (splits of 512 positions from 0: one split per slot-head at
these contexts, where the default's 128-position near splits give three, each stored and combined) and `block_k128`
(128-position blocks, a 2-deep ring): what a batch engine would gain from a partition of its own.

    python3 benchmarks/experiments/attention_batch.py --out $OUT/attention_batch_grid_h200.json --commit <sha>
"""

from __future__ import annotations

import argparse
import functools
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
from pallas_kernels import ROW_TILE, attention_kernel, attention_ws  # noqa: E402

HQ, HKV, D, S_LEN = 32, 8, 128, 512  # the batch bench's cache: max_len 400 -> 512 positions (CACHE_MULTIPLE)
CALLS = 20  # calls per profile
SPLITS = attention_kernel.Splits(attention_kernel.NEAR_SPLIT, attention_kernel.SPLIT, attention_kernel.NEAR_UNTIL)


def batched(m: int, **kw):
    """jitted vmap over slots of `attention_kernel.attention` (qs [B, m, Hq, D], kvs [B, S, Hkv, 2, D], starts [B])."""
    return jax.jit(jax.vmap(lambda q, kv, t: attention_kernel.attention(q, kv, t, scale=D**-0.5, **kw)))


def kernel_us(fn, *args) -> dict:
    """GPU kernel time of one fn(*args) call by kernel group, averaged over CALLS calls."""

    def run():
        for _ in range(CALLS):
            out = fn(*args)
        jax.block_until_ready(out)

    return kernel_times(profile(run), CALLS)


def combine_variants(qs, kvs, starts, m: int) -> dict:
    """The combine alone on the batch's partials under vmap: out_rows ROW_TILE (one program per 2 tile rows, as
    before) against the call's ceil(m / 2) * 2 rows; kernel us and whether the first m rows agree in bits."""
    per_head = attention_ws.head_rows(HQ // HKV)
    rows = attention_kernel.COMBINE_ROWS

    def parts(q, kv, t):
        q = jnp.pad(q, ((0, ROW_TILE - m), (0, 0), (0, 0)))
        arr = jnp.stack([t, jnp.int32(m)])
        ring = attention_ws.stages(attention_ws.BLOCK_K, D)
        return arr, attention_ws.split_partials(
            q, kv, arr, scale=D**-0.5, splits=SPLITS, block_k=attention_ws.BLOCK_K, ring=ring
        )

    arrs, p = jax.jit(jax.vmap(parts))(qs, kvs, starts)
    kw = dict(q_heads=HQ, head_rows=per_head, chunk_rows=attention_ws.WG_ROWS, splits=SPLITS, interpret=False)
    kw.update(rows=rows, chunk=attention_kernel.COMBINE_CHUNK, warps=attention_kernel.COMBINE_WARPS)
    kw.update(stages=attention_kernel.COMBINE_STAGES)
    out = {}
    results = {}
    for label, out_rows in (("tile_rows", ROW_TILE), ("call_rows", -(-m // rows) * rows)):
        fn = jax.jit(jax.vmap(functools.partial(attention_kernel.combine, out_rows=out_rows, **kw)))
        results[label] = np.asarray(fn(arrs, *p))[:, :m]
        out[label] = kernel_us(fn, arrs, *p)["kernel_us"]
    out["same_bits"] = bool(np.array_equal(bits(results["tile_rows"]), bits(results["call_rows"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--batches", default="16,32,64,128")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    chunks = -(-ROW_TILE // attention_ws.head_rows(HQ // HKV))
    n_split = SPLITS.count(S_LEN)
    per_slot_ctas = attention_ws.ctas_per_head(HKV, chunks, n_split)
    result = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "commit": args.commit,
        "shape": dict(hq=HQ, hkv=HKV, head_dim=D, max_len=S_LEN, dtype="bfloat16"),
        "per_slot_ctas": per_slot_ctas,
        "batches": {},
    }
    for b in map(int, args.batches.split(",")):
        for m in (1, 8):
            starts = jnp.asarray(rng.integers(320, 384, b), jnp.int32)
            qs = jnp.asarray(rng.standard_normal((b, m, HQ, D)), jnp.bfloat16)
            kvs = jnp.asarray(rng.standard_normal((b, S_LEN, HKV, 2, D)), jnp.bfloat16)
            # positions 0 .. start + m - 1 of each slot, rounded up to the blocks the kernel reads
            block = attention_ws.BLOCK_K
            kv_bytes = sum(-(-(int(t) + m) // block) * block * HKV * 2 * D * 2 for t in np.asarray(starts))
            slot_ctas = attention_ws.ctas_per_head(HKV, chunks, n_split, b)
            r = result["batches"][f"B{b}_M{m}"] = {
                "kv_bytes": kv_bytes,
                "batch_grid": attention_ws.batch_grid(b, HKV, D),
                "batch_grid_ctas": attention_ws.batch_ctas(b * HKV),
                "slot_grid_ctas": slot_ctas,
                "variants": {},
            }
            variants = {
                "default": {},
                f"slot_grid_ctas{slot_ctas}": dict(ctas=slot_ctas),
                "per_slot_grid": dict(ctas=per_slot_ctas),
                **(
                    {"default_ring2": dict(num_stages=2), "default_ring3": dict(num_stages=3)}
                    if r["batch_grid"]
                    else {}
                ),
                # other partitions (other bits): one split of 512 positions where the near splits hold 128 (the
                # short splits fill the GPU for one sequence; a batch has slot-heads enough), blocks of 128
                "split512": dict(split=512, far_split=512),
                "block_k128": dict(block_k=128, num_stages=2),
            }
            outs = {}
            for label, kw in variants.items():
                fn = batched(m, interpret=False, mosaic=True, **kw)
                try:
                    outs[label] = np.asarray(fn(qs, kvs, starts))
                except Exception as e:  # a variant that does not compile is recorded, the others still run
                    r["variants"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                t = kernel_us(fn, qs, kvs, starts)
                r["variants"][label] = {
                    "kernel_us": t["kernel_us"],
                    "top_kernels_us": t["top_kernels_us"],
                    "kv_tb_s": kv_bytes / t["kernel_us"] / 1e6,
                }
            alone = np.asarray(attention_kernel.attention(qs[0], kvs[0], starts[0], scale=D**-0.5, interpret=False))
            r["same_bits_as_default"] = {
                label: bool(np.array_equal(bits(o), bits(outs["default"]))) for label, o in outs.items()
            }
            r["slot0_equals_alone"] = bool(np.array_equal(bits(outs["default"][0]), bits(alone)))
            r["combine"] = combine_variants(qs, kvs, starts, m)
            us = {k: v.get("kernel_us", "error") for k, v in r["variants"].items()}
            print(f"B={b} M={m}: {us}, combine {r['combine']}, bits {r['same_bits_as_default']}", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
