"""A/B of the Mosaic GPU int4 kernel (`pallas_kernels/int4_ws.py`) against another version of that file, on the
same weights in one process (GPU only): the kernel's own time (XLA profiler) at M = 1 in alternating rounds, and
the output bits.

Run from the repo root on the GPU machine, with the base version copied beside the tree first (the GPU machine
gets the working tree, not the git history):
    git show fbf5cc0:pallas_kernels/int4_ws.py > .gpu/int4_ws_base.py      # here, before the run
    python3 benchmarks/experiments/int4_ab.py --base .gpu/int4_ws_base.py --out $OUT/int4_ab_h200.json --commit <sha> \\
        [--variants '[{}, {"stages": 5}]'] [--rounds 2] [--shapes qwen2.5-14b/gate_up,synthetic]

The base file runs against the working tree's other modules (`pallas_kernels.int4`, `backend`, `int4_matmul`). Each side
prepares its own Int4Codes from the same Int4Weights, so the code layout may differ between them; each variant is a dict
of overrides of `int4_ws.Config()` for the working tree's kernel, and the base runs its own `Config()`: the 128-row
default tile on every shape, not `config_for`'s choice (which gives gate_up and lm_head 256-row tiles in the models;
`{"wg_rows": 128}` is that tile under the stream-K partition). Per shape and variant: kernel microseconds of every round
and the median's ratio to the base's; whether the outputs at the default partition and at 31 and 7 CTAs are bitwise the
base's (expected when a change keeps the arithmetic and the partition); and whether row 0 of an M = 1 call equals row 0
of M = 16 (row-exactness at a glance; tests/test_int4_ws.py checks every M). Shapes: issue 4's
(`int4_matmul_bench.SHAPES`), Llama-3-8B's gate_up and down, the Qwen3.5 text shape's six products, and `synthetic` [K =
256 x 32, N = 128 x 132]: one row tile and 32 pipeline steps per CTA at 132 CTAs; any other as KxN (e.g. 1024x16896: 4
steps per CTA, one tile each, at 132 CTAs).
Its one GPU run, an A/A check (the base a copy of the same file): benchmarks/experiments/results/int4_ab_h200.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: int4_matmul_bench

import int4_matmul_bench as bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import int4_ws  # noqa: E402

SHAPES = {f"{model}/{name}": kn for model, shapes in bench.SHAPES.items() for name, kn in shapes.items()}
SHAPES.update(
    {"llama-3-8b/gate_up": (4096, 28672), "llama-3-8b/down": (14336, 4096), "synthetic": (256 * 32, 128 * 132)}
)
SHAPES.update(  # the Qwen3.5 text shape's products (a Gated DeltaNet layer's in_proj and out; o is out's shape)
    {
        "qwen3.5/in_proj": (4096, 12352),
        "qwen3.5/out": (4096, 4096),
        "qwen3.5/qkv": (4096, 10240),
        "qwen3.5/gate_up": (4096, 24576),
        "qwen3.5/down": (12288, 4096),
        "qwen3.5/lm_head": (4096, 248320),
    }
)
CHECK_CTAS = (None, 31, 7)  # None: the default partition (one CTA per SM)


def load_base(path: str):
    """The int4_ws module in `path`, imported under its own name next to the working tree's."""
    spec = importlib.util.spec_from_file_location("int4_ws_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def output_bits(module, x16, codes, overrides: dict) -> list[np.ndarray]:
    """uint32 views of the M = 16 output at each partition of CHECK_CTAS."""
    outs = []
    for ctas in CHECK_CTAS:
        partition = {} if ctas is None else {"ctas": ctas, "min_steps": 1}
        cfg = module.Config(**{**overrides, **partition})
        outs.append(np.asarray(module.rows_matmul(x16, codes, config=cfg)).view(np.uint32))
    return outs


def run_shape(base, variants: list[dict], k: int, n: int, rounds: int, repeats: int, copies: int | None) -> dict:
    nbytes = bench.int4_bytes(k, n)
    key = jax.random.key(0)
    weights = bench.random_weights(key, k, n, copies or bench.n_copies(nbytes))
    x16 = jax.random.normal(jax.random.fold_in(key, 7), (16, k), jnp.float32).astype(jnp.bfloat16)
    base_codes = [base.prepare_codes(w) for w in weights]
    new_codes = [int4_ws.prepare_codes(w) for w in weights]  # each side reads the layout its own module prepares
    sides = [("base", base, {}, base_codes)] + [(f"variant{i}", int4_ws, v, new_codes) for i, v in enumerate(variants)]
    ops = {label: functools.partial(m.rows_matmul, config=m.Config(**v)) for label, m, v, _ in sides}
    result = {"K": k, "N": n, "bytes": nbytes, "copies": len(weights)}
    base_bits = None
    for label, module, overrides, codes in sides:  # the base first
        bits = output_bits(module, x16, codes[0], overrides)
        base_bits = bits if base_bits is None else base_bits
        result[label] = {
            "config": overrides,
            "kernel_us": [],
            "bits_equal_base": [bool(np.array_equal(a, b)) for a, b in zip(bits, base_bits, strict=True)],
            "row0_exact": bench.exactness(ops[label], x16, codes[0], ms=(1,))["row_exact"],
        }
    for _ in range(rounds):  # alternate the sides within a round, so drift hits all of them alike
        for label, _, _, codes in sides:
            _, kernel_s = bench.time_calls(ops[label], x16[:1], codes, repeats, kernel=True)
            result[label]["kernel_us"].append(kernel_s * 1e6)
    base_us = statistics.median(result["base"]["kernel_us"])
    for label, *_ in sides:
        us = statistics.median(result[label]["kernel_us"])
        result[label].update(median_us=us, vs_base=us / base_us, TBps=nbytes / us / 1e6)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a copy of the int4_ws.py to compare against")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown", help="the working tree's commit (and what differs from it)")
    ap.add_argument("--variants", default="[{}]", help="JSON list of int4_ws.Config overrides for the working tree")
    ap.add_argument("--shapes", default="all", help=f"comma list of {', '.join(SHAPES)}, or KxN; or 'all'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--copies",
        type=int,
        help="weight copies the timing cycles through (default: enough to defeat L2); 1 keeps a weight that fits "
        "in L2 there, so the kernel's consumers, not the memory, set its pace",
    )
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("int4_ab.py times the Mosaic GPU kernel: it needs a GPU (there is no interpret mode)")
    variants = json.loads(args.variants)
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    shapes = SHAPES | {s: tuple(map(int, s.split("x"))) for s in names if re.fullmatch(r"\d+x\d+", s)}
    unknown = [s for s in names if s not in shapes]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    base = load_base(args.base)
    report = {
        "meta": {
            "jax": jax.__version__,
            "device": jax.devices()[0].device_kind,
            "commit": args.commit,
            "base": args.base,
            "variants": variants,
            "rounds": args.rounds,
            "copies": args.copies,
            "doc": __doc__,
        },
        "results": {},
    }
    for name in names:
        r = report["results"][name] = run_shape(base, variants, *shapes[name], args.rounds, args.repeats, args.copies)
        line = "  ".join(
            f"{label} {r[label]['median_us']:7.2f} us ({r[label]['vs_base']:.3f}x, bits {r[label]['bits_equal_base']})"
            for label in r
            if isinstance(r[label], dict)
        )
        print(f"{name:22s} {line}", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
