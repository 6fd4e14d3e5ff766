"""One B = 64 decode attention call of the batch grid (`attention_ws.batch_split_partials`, the one-split partition
a B = 64 engine runs, `jspec.batch.one_split`), Llama-3-8B attention (32 / 8 heads of 128, bf16), the batch bench's
cache (512 positions), every slot at its own start in 320..383: a program small enough to run under Nsight Compute,
so the kernel's stall reasons and hot instructions can be read rather than guessed.

    ncu --clock-control none -k regex:jspec_attention_ws_batch --launch-skip 2 --launch-count 1 --set full \
        --import-source yes -o $OUT/attention_batch python3 benchmarks/experiments/attention_batch_ncu.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import attention_kernel  # noqa: E402

HQ, HKV, D, S_LEN, B = 32, 8, 128, 512, 64


def main() -> None:
    rng = np.random.default_rng(0)
    starts = jnp.asarray(rng.integers(320, 384, B), jnp.int32)
    qs = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.bfloat16)
    kvs = jnp.asarray(rng.standard_normal((B, S_LEN, HKV, 2, D)), jnp.bfloat16)
    one_split = dict(split=S_LEN, far_split=None)
    fn = jax.jit(
        jax.vmap(lambda q, kv, t: attention_kernel.attention(q, kv, t, scale=D**-0.5, interpret=False, **one_split))
    )
    for _ in range(3):  # ncu: skip the first two launches, profile the third
        out = fn(qs, kvs, starts)
    jax.block_until_ready(out)
    print("ok", out.shape, flush=True)


if __name__ == "__main__":
    main()
