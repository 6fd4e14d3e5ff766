"""Does a decode step slow down under sustained load, and does the HBM roofline move with it (issue 33: the Qwen3.5
step's % of the roofline)? device_loop_profile's interleaved trials (2b4cecd) ran every configuration's first trial
2.48-2.53 ms a step and every later one 2.63-2.68, the generation loop and bare decode chains alike.

Here: the XLA read roofline (`jspec_bench.roofline._xla_sum_Bps`, 2 GiB) cold; then the Qwen3.5 decode chain of
`device_loop_profile.chain_walls` (one step a while-loop iteration) timed in back-to-back windows of --window-s for
--load-s seconds, each window with the GPU's SM and memory clocks, power, temperature and active throttle reasons
(`nvidia-smi`, sampled right after the window); then the roofline again, hot, and the chain once more after an idle
--rest-s. A step that slows while the roofline holds is latency-bound work paying a lower SM clock.

    python3 benchmarks/experiments/sustained_load.py --commit SHA --out $OUT/sustained_load_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/: device_loop_profile

import jax  # noqa: E402
from device_loop_profile import chain_walls  # noqa: E402

from jspec_bench.roofline import _xla_sum_Bps  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params  # noqa: E402
from pallas_kernels import get_backend  # noqa: E402
from pallas_kernels.prepare import prepare_params  # noqa: E402

SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_sample() -> dict:
    """The GPU's clocks, power, temperature and throttle reasons now (nvidia-smi), or the error."""
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return dict(zip(SMI_FIELDS.split(","), (v.strip() for v in line.split(",")), strict=True))
    except Exception as e:  # a fact of the machine, not a failure of the run
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--model", default="qwen3.5")
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--iterations", type=int, default=33)
    ap.add_argument("--load-s", type=float, default=60.0)
    ap.add_argument("--window-s", type=float, default=4.0)
    ap.add_argument("--rest-s", type=float, default=20.0)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny shrunk shape, a short load")
    opts = ap.parse_args()
    t0 = time.perf_counter()
    cfg = model_config(opts.model, opts.quick)
    params = prepare_params(random_int4_params(cfg, 0, True), "bfloat16", get_backend())
    wall, trips, _ = chain_walls(params, cfg, opts.context, ["1"], opts.iterations)["1"]
    short = wall(1)

    def per_step() -> float:
        return 1e3 * (wall(trips) - short) / (trips - 1)

    out = {
        "meta": {
            "commit": opts.commit,
            "jax": jax.__version__,
            "device": jax.devices()[0].device_kind,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "model": opts.model,
            "context": opts.context,
        },
        "idle": gpu_sample(),
    }
    n = 2**24 if opts.quick else 2**30  # bf16 elements: 2 GiB on the GPU
    out["roofline_cold_Bps"] = _xla_sum_Bps(n)
    windows = []
    start = time.perf_counter()
    while time.perf_counter() - start < (2 * opts.window_s if opts.quick else opts.load_s):
        w0, steps = time.perf_counter(), []
        while time.perf_counter() - w0 < opts.window_s:
            steps.append(per_step())
        steps.sort()
        windows.append({"t_s": time.perf_counter() - start, "ms_per_step": steps[len(steps) // 2]} | gpu_sample())
        print(f"  {windows[-1]}", flush=True)
    out["windows"] = windows
    out["roofline_hot_Bps"] = _xla_sum_Bps(n)
    time.sleep(opts.rest_s)
    out["after_rest"] = {"ms_per_step": per_step()} | gpu_sample()
    out["meta"]["elapsed_s"] = time.perf_counter() - t0
    print(
        f"roofline cold {out['roofline_cold_Bps'] / 1e12:.3f} TB/s, hot {out['roofline_hot_Bps'] / 1e12:.3f}; "
        f"after {opts.rest_s:.0f} s rest {out['after_rest']['ms_per_step']:.3f} ms a step",
        flush=True,
    )
    with open(opts.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results: {opts.out} ({out['meta']['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
