"""Is the hybrid prefill the same bits in greedy's executable, in MTP's, and in every process?

DESIGN.md's rule 10 keeps prefill outside the contract's bit-equality because greedy and speculation share it. They
share its code, not its executable: the Engine compiles a prefill per setting, and its products and the Gated
DeltaNet's chunked recurrence (`pallas_kernels.recurrent.chunk_gated_delta`: float32 dots, a triangular solve) are
XLA's own, whose cuBLAS algorithms or Triton tilings XLA's autotuner picks by timing when it compiles. Seen on the
H200: the qwen3_next int4 echo case of `mtp_host_chunked.py` left greedy at token 77 in both processes at 92eba15
(92 verify rounds each) and matched it in the three processes since (93, 94 and 94 rounds): what the drafter
proposed changed from process to process.

One process of this script runs that case (a 248-token echo prompt in chunks of 64) and records, as sha256 digests
of the bits: the Loop after greedy's prefill executables and after MTP's (the main model's caches, tokens, hidden
rows; MTP's own state apart), with what XLA's autotuner chose for each of their products; greedy's tokens, MTP's
tokens on the host loop and on the device loop, and MTP's verify rounds; and the same for greedy and host-loop MTP
on the Engine as it was before bf52466 (`PrunedEngine`: unused arguments pruned, the Loop donated), against this
greedy. Run it in several processes, with XLA_FLAGS unset and with --xla_gpu_autotune_level=0, and compare: greedy's
and MTP's `main` digests within a process, and every digest across processes. A process takes ~130 s on the H200
with autotuning off; at d54e0ec two with it on did not end within a 140 s timeout (their compiles autotune).

Runs: experiments/results/prefill_determinism_*_h100.json (benchmarks/README.md's rows); the shipped options (level 0,
cuBLAS) gave the same bits in three of three processes three times on the H100 (eab233c; a1e3072: cublas_rerun_{1,2,3},
41 cuBLASLt calls and no Triton GEMM in each executable; 09f1982: cublas_rerun2_{1,2,3}, the digests of a1e3072).

    for i in 1 2 3; do python3 benchmarks/experiments/prefill_determinism.py --commit SHA --out $OUT/pd_$i.json; done
    python3 benchmarks/experiments/prefill_determinism.py --small --out /tmp/pd_cpu.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/

import numpy as np  # noqa: E402
from mtp_host_chunked import PrunedEngine, cases, prefilled  # noqa: E402

import jspec  # noqa: E402
from jspec.stats import common_prefix  # noqa: E402
from jspec_bench.report import bits_digest, experiment_meta, save_experiment  # noqa: E402

PRODUCT_MARKERS = {"cublas": '"__cublas$gemm"', "cublaslt": '"__cublas$lt$matmul"', "triton_gemm": '"__triton_gemm"'}


def gemm_choices(engine: jspec.Engine) -> dict:
    """Which library runs the products of the Engine's prefill executables, and what XLA's autotuner chose: the
    count of each PRODUCT_MARKERS string in their optimized HLO text (cuBLAS calls, cuBLASLt calls, Triton GEMM
    fusions), and "shape config" of every Triton GEMM fusion (its tiling and split_k) and every cuBLAS call (its
    selected algorithm), sorted. Nothing on the CPU. On the H100 at 653abac (jax 0.11.2) the choices came back
    empty (their pattern matched nothing there); the counts were added after."""
    counts, choices = dict.fromkeys(PRODUCT_MARKERS, 0), []
    for key, executable in engine._executables.items():
        if not key[0].startswith("prefill"):
            continue
        text = executable.as_text()
        for name, marker in PRODUCT_MARKERS.items():
            counts[name] += text.count(marker)
        for line in text.splitlines():
            choice = re.search(r'"triton_gemm_config":(\{[^}]*\})|"selected_algorithm":"?(-?\d+)', line)
            if choice and (shape := re.search(r"= (\S+) ", line)):
                choices.append(f"{key[0]} {shape.group(1)} {choice.group(1) or 'cublas ' + choice.group(2)}")
    return dict(counts=counts, choices=sorted(choices))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    name, cfg, params, kw, prompt, max_new = list(cases(args.small))[1]
    greedy_engine, mtp_engine = jspec.Engine(params, cfg, **kw), jspec.Engine(params, cfg, **kw)
    pruned_engine = PrunedEngine(params, cfg, **kw)  # the Engine before bf52466 (unused arguments pruned)
    mtp = jspec.MTPDrafter()
    out = dict(meta=experiment_meta(args.commit, case=name, prompt_tokens=len(prompt), max_new=max_new, engine=kw))
    out["prefill"] = {}
    for key, engine, settings in (("greedy", greedy_engine, None), ("mtp", mtp_engine, mtp)):
        state = prefilled(engine, engine.settings(drafter=settings), prompt, max_new)[0].state
        out["prefill"][key] = dict(
            main=bits_digest(dataclasses.replace(state, drafter=None)),
            cache=bits_digest(state.cache),
            hidden=bits_digest(state.hidden),
            drafter=bits_digest(state.drafter),
            gemms=gemm_choices(engine),
        )
    save_experiment(out, args.out, t0)  # each part saved as it ends: a timeout keeps what ran
    greedy = greedy_engine.generate(prompt, max_new, eos_id=()).tokens
    out.update(greedy_tokens=greedy, runs={})
    modes = {
        "mtp_host": lambda: mtp_engine.generate(prompt, max_new, drafter=mtp, eos_id=()),
        "mtp_device": lambda: mtp_engine.generate(prompt, max_new, drafter=mtp, eos_id=(), on_device=True),
        "pruned_greedy": lambda: pruned_engine.generate(prompt, max_new, eos_id=()),
        "pruned_mtp_host": lambda: pruned_engine.generate(prompt, max_new, drafter=mtp, eos_id=()),
    }
    for mode, run in modes.items():
        r = run()
        identical = r.tokens == greedy
        out["runs"][mode] = dict(
            identical=identical,
            first_divergence=None if identical else common_prefix(r.tokens, greedy),
            verify_steps=r.stats.verify_steps,
            tokens=bits_digest(np.int32(r.tokens)),
        )
        print(mode, out["runs"][mode], flush=True)
        save_experiment(out, args.out, t0)


if __name__ == "__main__":
    main()
