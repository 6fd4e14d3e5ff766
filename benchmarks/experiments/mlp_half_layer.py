"""Issue 36's baseline: the MLP half of a decoder layer as the decode and verify steps run it today
(`jspec.models.dense.mlp_half`: residual add, RMSNorm, gate_up, SwiGLU, down, residual add) on the 16-row tile both
steps share, at the Llama-3-8B and Qwen2.5-14B shapes with random int4 weights (prepared for the Mosaic GPU kernel
on the GPU, as `jspec.Engine` does). Per half-layer: GPU kernel time (XLA profiler) with the int4 launches and the
XLA fusions apart, launches, HBM bytes (its two weights and its norm), the fraction of the read roofline measured
in the same run, and stage 1's gate (25% less kernel time). Whether row 0's bits depend on the tile's other rows
(they must not: the persistent kernel will be A/B'd against this on that property too).

The stream bound: one launch of today's int4 kernel over a weight [H, 3I] (the half-layer's two weights' count:
H x 2I + I x H), with no dependency inside it. A persistent half-layer streams the same bytes with the same kind
of int4 steps, plus the work this bound leaves out (the norm, the SwiGLU, the handoff between its products): a bound
above the gate says the gate cannot be met without a faster int4 stream.

--layers distinct layers run chained in one executable, as in a step, so no call finds its weights in L2.

    python3 benchmarks/experiments/mlp_half_layer.py --out $OUT/mlp_half_layer_h200.json --commit <sha>
    python3 benchmarks/experiments/mlp_half_layer.py --quick --out /tmp/mlp_half_layer_cpu.json --commit <sha>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from int4_matmul_bench import roofline  # noqa: E402

from jspec.exactness import bits  # noqa: E402
from jspec.models.dense import mlp_half  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params, tree_nbytes  # noqa: E402
from jspec_bench.timing import _median_wall, kernel_times, profile  # noqa: E402
from pallas_kernels import ROW_TILE, get_backend, linear, quantize  # noqa: E402
from pallas_kernels.prepare import prepare_ws  # noqa: E402

MLP_WEIGHTS = ("post_attn_norm", "gate_up", "down")


def half_layers(cfg):
    """jitted (layers, x [ROW_TILE, H], out [ROW_TILE, H]) -> x after every layer's MLP half, in order."""

    def run(layers, x, out):
        for p in layers:
            x = mlp_half(p, cfg, x, out)
        return x

    return jax.jit(run)


def measure(name: str, layers_n: int, calls: int, quick: bool, roof_Bps: float) -> dict:
    # the MLP half reads no embedding: a 32-token vocabulary spares building one of the shape's size
    cfg = dataclasses.replace(model_config(name, quick), num_layers=layers_n, vocab_size=32)
    layers = [{k: p[k] for k in MLP_WEIGHTS} for p in random_int4_params(cfg, 0, lm_head_int4=False)["layers"]]
    if get_backend() == "pallas":
        layers = prepare_ws(layers)
    rng = np.random.default_rng(1)
    x, out = (jnp.asarray(rng.standard_normal((ROW_TILE, cfg.hidden_size)), jnp.bfloat16) for _ in range(2))
    fn = half_layers(cfg)
    y = jax.block_until_ready(fn(layers, x, out))
    other = fn(layers, x.at[1:].set(-x[1:]), out.at[1:].set(out[1:] * 2))  # rows 1.. changed, row 0 not
    kernels = kernel_times(profile(lambda: jax.block_until_ready([fn(layers, x, out) for _ in range(calls)])), calls)
    wall_s = _median_wall(lambda: jax.block_until_ready(fn(layers, x, out)), 5)
    per = {k: v / layers_n for k, v in kernels["groups_us"].items()}
    kernel_us = kernels["kernel_us"] / layers_n
    nbytes = tree_nbytes(layers) / layers_n
    stream_us = stream_bound_us(cfg, calls)
    roof_us = nbytes / roof_Bps * 1e6
    gate_us = 0.75 * kernel_us  # stage 1's gate: 25% less
    result = {
        "shape": {"hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size},
        "layers_chained": layers_n,
        "bytes_per_half_layer": int(nbytes),
        "kernel_us_per_half_layer": kernel_us,
        "groups_us_per_half_layer": per,
        "launches_per_half_layer": kernels["launches"] / layers_n,
        "wall_us_per_half_layer": wall_s * 1e6 / layers_n,
        "roofline_us": roof_us,
        "roofline_fraction": roof_us / kernel_us if kernel_us else None,
        "gate_us": gate_us,
        "gate_roofline_fraction": roof_us / gate_us if kernel_us else None,
        "row0_bits_independent_of_other_rows": bool(np.array_equal(bits(y[0]), bits(other[0]))),
        "stream_bound": {"weight": [cfg.hidden_size, 3 * cfg.intermediate_size], "kernel_us": stream_us},
        "gate_reachable_by_stream": stream_us <= gate_us if kernel_us else None,
        "top_kernels_us": {k: v / layers_n for k, v in kernels.get("top_kernels_us", {}).items()},
    }
    print(
        f"{name}: {kernel_us:.1f} us a half-layer ({', '.join(f'{k} {v:.1f}' for k, v in per.items())}), "
        f"{result['launches_per_half_layer']:.1f} launches, {nbytes / 1e6:.1f} MB, "
        f"{100 * (result['roofline_fraction'] or 0):.0f}% of the roofline; gate {result['gate_us']:.1f} us "
        f"({100 * (result['gate_roofline_fraction'] or 0):.0f}%); one launch over the same bytes {stream_us:.1f} us; "
        f"row 0 exact {result['row0_bits_independent_of_other_rows']}",
        flush=True,
    )
    return result


def stream_bound_us(cfg, calls: int) -> float:
    """GPU kernel time of one int4 product [ROW_TILE, H] @ [H, 3I] (random weights, prepared as an Engine does)."""
    rng = np.random.default_rng(2)
    w = quantize(jnp.asarray(rng.standard_normal((cfg.hidden_size, 3 * cfg.intermediate_size), np.float32)))
    w = prepare_ws(w) if get_backend() == "pallas" else w
    x = jnp.asarray(rng.standard_normal((ROW_TILE, cfg.hidden_size)), jnp.bfloat16)
    fn = jax.jit(linear)
    jax.block_until_ready(fn(x, w))
    return kernel_times(profile(lambda: jax.block_until_ready([fn(x, w) for _ in range(calls)])), calls)["kernel_us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--models", default="llama-3-8b,qwen2.5-14b")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers chained in one executable")
    ap.add_argument("--calls", type=int, default=10, help="profiled calls")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU check of the script)")
    args = ap.parse_args()
    roof = roofline(3)
    result = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "backend": get_backend(),
        "commit": args.commit,
        "rows": ROW_TILE,
        "roofline": roof,
        "models": {},
    }
    for name in args.models.split(","):
        result["models"][name] = measure(name, args.layers, args.calls, args.quick, roof["roofline_Bps"])
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
