"""The recurrent kernel's cost per row (issue 33: verify(3) <= 1.05x decode at the hybrid shapes, where each verify row
costs ~1.8 us per Gated DeltaNet layer, ~130 us over Qwen3.5's 24 layers at k = 3): `pallas_kernels.recurrent.gdn_rows`
alone (`jspec_bench.hybrid.recurrent_cost`: donated candidate states, GPU kernel time at 1 .. 4 rows, fixed cost and
cost per row from a line through them) under variants of its launch and of its step arithmetic:

- warps: Triton warps per program (`recurrent.NUM_WARPS`);
- block_v: value columns per program (`recurrent.STATE_BLOCK_BYTES` set so the ROW_TILE-row block holds block_v
  columns): fewer columns, more programs, less work on each row's sequential chain;
- step: "sequential" is `recurrent.gdn_step` as shipped (decay, S^T k, update, then S'^T q: two dependent
  reductions per row); "parallel" reads both reductions off the decayed state, out = S_d^T q + (k . q) delta, so a
  row's chain holds one reduction (other bits than "sequential"; decode and verify would still share them).

Each variant also reports whether its outputs and post-states are the shipped variant's bits (a fact: the shipped
kernel's bits are not a contract, decode == verify rows is, and `recurrent_cost` checks that per variant).
"shipped" is the module's setting when the script runs.

Runs: experiments/results/recurrent_variants_qwen35_h200.json and recurrent_variants_27b_h200.json (438b524, shipped
4 warps over 8 columns): at Qwen3.5 one warp over 16 columns cost 0.93 us a row (shipped 1.83), 2.7 us a one-row call
(4.2); "parallel" moved nothing (within 0.1 us of "sequential" in every launch). Adopted: 1 warp, 16 columns.

    python3 benchmarks/experiments/recurrent_variants.py --commit SHA --out $OUT/recurrent_variants_h200.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.exactness import bits  # noqa: E402
from jspec_bench.hybrid import recurrent_args, recurrent_cost  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402
from jspec_bench.shapes import model_config  # noqa: E402
from pallas_kernels import ROW_TILE, recurrent  # noqa: E402

SETTINGS = ("NUM_WARPS", "BLOCK_V", "STATE_BLOCK_BYTES", "gdn_step")  # what `configure` sets in `recurrent`
SHIPPED = {name: getattr(recurrent, name) for name in SETTINGS}  # the module's own, restored after each model


def parallel_step(state, q, k, v, g, beta):
    """`recurrent.gdn_step` with both reductions over the decayed state: out = S_d^T q + (k . q) delta."""
    state = state * jnp.exp(g)
    kv = jnp.sum(state * k[:, None], axis=0)
    sq = jnp.sum(state * q[:, None], axis=0)
    delta = (v - kv) * beta
    return state + k[:, None] * delta[None, :], sq + jnp.sum(k * q) * delta


STEPS = {"sequential": recurrent.gdn_step, "parallel": parallel_step}


def configure(warps: int, block_v: int, step: str, dk: int) -> None:
    recurrent.NUM_WARPS = warps
    recurrent.BLOCK_V = block_v
    recurrent.STATE_BLOCK_BYTES = ROW_TILE * dk * block_v * 4
    recurrent.gdn_step = STEPS[step]


def restore() -> None:
    for name, value in SHIPPED.items():
        setattr(recurrent, name, value)


def outputs(cfg) -> tuple[np.ndarray, ...]:
    """gdn_rows over 4 rows of one random layer: (post-states, conv cache, outputs) as uint32 bits."""
    cache, inputs = recurrent_args(cfg, 1)
    fn = jax.jit(functools.partial(recurrent.gdn_rows, rows=4, key_heads=cfg.linear_num_key_heads))
    c, o = fn(cache, jnp.zeros((), jnp.int32), *inputs)
    return np.asarray(bits(c["ssm"][:4])), np.asarray(bits(c["conv"])), np.asarray(bits(o[:4]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--models", default="qwen3.5,hybrid-27b")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--block-v", default="4,8,16")
    ap.add_argument("--steps", default="sequential,parallel")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, interpret mode")
    opts = ap.parse_args()
    t0 = time.perf_counter()
    out = {
        "meta": experiment_meta(opts.commit, row_tile=ROW_TILE, calls=opts.calls),
        "models": {},
    }
    grid = list(
        itertools.product(
            (int(w) for w in opts.warps.split(",")),
            (int(b) for b in opts.block_v.split(",")),
            opts.steps.split(","),
        )
    )
    for name in opts.models.split(","):
        cfg = model_config(name, opts.quick)
        dk = cfg.linear_key_head_dim
        block_v = recurrent.state_block_columns(ROW_TILE, dk, cfg.linear_value_head_dim)
        shipped = (SHIPPED["NUM_WARPS"], block_v, "sequential")
        res = out["models"][name] = {
            "shipped": dict(zip(("warps", "block_v", "step"), shipped, strict=True)),
            "variants": {},
        }
        reference = None
        for warps, block_v, step in [shipped] + [v for v in grid if v != shipped]:
            key = f"warps={warps} block_v={block_v} step={step}"
            if time.perf_counter() - t0 > opts.budget_s:
                res["variants"][key] = {"status": "skipped: budget"}
                continue
            configure(warps, block_v, step, dk)
            try:
                r = recurrent_cost(cfg, 3 if opts.quick else opts.calls)
                got = outputs(cfg)
                reference = got if (warps, block_v, step) == shipped else reference
                r["same_bits_as_shipped"] = reference is not None and all(
                    np.array_equal(a, b) for a, b in zip(got, reference, strict=True)
                )
                r["status"] = "done"
            except Exception as e:  # a variant that does not compile (shared memory) is a result too
                r = {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                traceback.print_exc()
            res["variants"][key] = r
            if r["status"] == "done":
                print(
                    f"{name} {key}: fixed {r['fixed_s'] * 1e6:.2f} us, per row {r['per_row_s'] * 1e6:.2f} us, "
                    + ", ".join(f"{k} rows {v * 1e6:.1f}" for k, v in r["seconds"].items())
                    + f"; rows identical {r['rows_bit_identical']}, shipped bits {r['same_bits_as_shipped']}",
                    flush=True,
                )
            else:
                print(f"{name} {key}: {r['status']}", flush=True)
            jax.clear_caches()
        restore()
    save_experiment(out, opts.out, t0)


if __name__ == "__main__":
    main()
