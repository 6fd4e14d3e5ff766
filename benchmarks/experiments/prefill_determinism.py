"""Is the hybrid prefill the same bits in greedy's executable, in MTP's, and in every process?

DESIGN.md's rule 10 keeps prefill outside the contract's bit-equality because greedy and speculation share it. They
share its code, not its executable: the Engine compiles a prefill per setting, and the Gated DeltaNet's chunked
recurrence (`pallas_kernels.recurrent.chunk_gated_delta`) runs XLA's own float32 dots and triangular solve, whose
cuBLAS algorithms XLA's autotuner picks by timing when it compiles. Seen on the H200: the qwen3_next int4 echo case of
`mtp_host_chunked.py` left greedy at token 77 in both processes at 92eba15 (92 verify rounds each) and matched it in
the three processes since (93, 94 and 94 rounds): what the drafter proposed changed from process to process.

One process of this script runs that case (a 248-token echo prompt in chunks of 64) and records, as sha256 digests
of the bits: the Loop after greedy's prefill executables and after MTP's (the main model's caches, tokens, hidden
rows; MTP's own state apart), greedy's tokens, MTP's tokens on the host loop and on the device loop, and MTP's
verify rounds; and the same for greedy and host-loop MTP on the Engine as it was before bf52466 (`PrunedEngine`:
unused arguments pruned, the Loop donated), against this greedy. Run it in several processes (with XLA_FLAGS unset
and with --xla_gpu_autotune_level=0, say) and compare the digests across the JSONs.

    for i in 1 2 3; do python3 benchmarks/experiments/prefill_determinism.py --commit SHA --out $OUT/pd_$i.json; done
    python3 benchmarks/experiments/prefill_determinism.py --small --out /tmp/pd_cpu.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mtp_host_chunked import PrunedEngine, cases  # noqa: E402

import jspec  # noqa: E402
from jspec.engine import prefill_plan  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402


def digest(tree) -> str:
    """sha256 of every leaf's bytes, in tree order (first 16 hex digits)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def prefilled(engine: jspec.Engine, settings, prompt: list[int]):
    """The Loop after the Engine's own start and prefill executables (as `Engine._host_loop` runs them)."""
    request = engine.request(prompt, 96, ())
    weights = engine._checked_weights(settings)
    start = engine._start_exec(settings, weights)
    loop = start(weights, *request.loop_args(engine.max_len))
    for size, count in prefill_plan(len(prompt), settings.prefill_chunk):
        loop = engine._loop_exec(f"prefill{size}", settings, weights, start.out_info)(weights, loop, np.int32(count))
    return loop


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    name, cfg, params, kw, prompt, max_new = list(cases(args.small))[1]
    greedy_engine, mtp_engine = jspec.Engine(params, cfg, **kw), jspec.Engine(params, cfg, **kw)
    mtp = jspec.MTPDrafter()
    loops = {
        "greedy": prefilled(greedy_engine, greedy_engine.settings(), prompt),
        "mtp": prefilled(mtp_engine, mtp_engine.settings(drafter=mtp), prompt),
    }
    greedy = greedy_engine.generate(prompt, max_new, eos_id=())
    host = mtp_engine.generate(prompt, max_new, drafter=mtp, eos_id=())
    device = mtp_engine.generate(prompt, max_new, drafter=mtp, eos_id=(), on_device=True)
    pruned_engine = PrunedEngine(params, cfg, **kw)  # the Engine before bf52466 (unused arguments pruned)
    pruned = pruned_engine.generate(prompt, max_new, eos_id=())
    pruned_mtp = pruned_engine.generate(prompt, max_new, drafter=mtp, eos_id=())
    runs = (("mtp_host", host), ("mtp_device", device), ("pruned_greedy", pruned), ("pruned_mtp_host", pruned_mtp))
    out = dict(
        meta=experiment_meta(args.commit, case=name, prompt_tokens=len(prompt), max_new=max_new, engine=kw),
        prefill={
            key: dict(
                main=digest(dataclasses.replace(loop.state, drafter=None)),
                cache=digest(loop.state.cache),
                hidden=digest(loop.state.hidden),
                drafter=digest(loop.state.drafter),
            )
            for key, loop in loops.items()
        },
        tokens=dict(greedy=digest(np.int32(greedy.tokens)), mtp_host=digest(np.int32(host.tokens))),
        identical={mode: r.tokens == greedy.tokens for mode, r in runs},
        first_divergence={
            mode: next((i for i, (a, b) in enumerate(zip(r.tokens, greedy.tokens, strict=True)) if a != b), None)
            for mode, r in runs
        },
        verify_steps={mode: r.stats.verify_steps for mode, r in runs},
        greedy_tokens=greedy.tokens,
    )
    print(out["prefill"], out["identical"], out["first_divergence"], out["verify_steps"], flush=True)
    save_experiment(out, args.out, t0)


if __name__ == "__main__":
    main()
