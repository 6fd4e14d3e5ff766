"""The results JSON of a bench run: `Report` (written atomically after every sub-step, with the identity checks'
tally), its `meta` (device, versions, commit, options), the external `REFERENCES` and the `TARGETS`
(docs/performance.md) it is compared with, and `Context`, what every section function gets: the options, the budget, the
report, the compile counter and estimator, and what one section hands to a later one."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import subprocess
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from jspec.engine import compiler_options
from pallas_kernels import get_backend, int4_ws

if TYPE_CHECKING:
    from jspec_bench.options import Options
    from jspec_bench.timing import Budget, CompileCounter, CompileEstimator

SCHEMA = 1

# External references measured on this H200 (docs/performance.md), quoted, not measured by this bench.
REFERENCES = {
    "gpt_fast_int4_g32_llama3_8b_tok_s": 228.8,
    "gpt_fast_bf16_llama3_8b_tok_s": 172.3,
    "hf_transformers_bf16_eager_qwen2.5_7b_tok_s": 16.8,
    "earlier_engine_qwen2.5_14b_decode_ms": 7.9,
}
TARGETS = {  # docs/performance.md, "Targets"
    "decode_roofline_14b": 0.55,
    "verify7_over_decode": 1.25,
    "speedup_at_mean_accepted_3": 2.0,
    "gate_no_hit_vs_greedy": 0.97,
    "greedy_tok_s_llama3_8b": 460.0,
    "sampler_over_decode_step": 0.03,
    "batch16_over_b1": 12.0,
    "batch64_over_b1": 35.0,
    "hybrid_decode_roofline": 0.45,
    "hybrid_verify3_over_decode": 1.05,
    "recurrent_fixed_s": 10e-6,
    "tp2_over_tp1_14b": 0.6,
}


class Report:
    """The results JSON, written atomically after every sub-step (a run cut short keeps what it measured)."""

    def __init__(self, path: str, meta: dict):
        self.path = Path(path)
        self.data = {"schema": SCHEMA, "meta": meta, "sections": {}, "identity": {"ok": True, "checks": 0}}
        self.data["identity"]["failures"] = []
        self.errors = 0

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {"status": "running"})

    def failed(self, entry: dict, label: str, e: BaseException) -> None:
        """A sub-step raised: entry gets status "error" and the traceback's tail, the run an error (a non-zero
        exit), the log one line; the run goes on."""
        entry.update(status="error", error=_error_text(e))
        self.errors += 1
        print(f"  {label}: ERROR {e!r}", flush=True)

    def check_identity(self, ok: bool, what: str) -> bool:
        self.data["identity"]["checks"] += 1
        if not ok:
            self.data["identity"]["ok"] = False
            self.data["identity"]["failures"].append(what)
            print(f"IDENTITY FAILURE: {what}", flush=True)
        return ok

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x)}")


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))[-3000:]


@dataclasses.dataclass
class Context:
    opts: Options
    budget: Budget
    report: Report
    compiles: CompileCounter
    estimator: CompileEstimator
    roofline_Bps: float | None = None
    kept: dict = dataclasses.field(default_factory=dict)  # params kept for a later section: name -> (params, cfg)


def experiment_meta(commit: str, **fields) -> dict:
    """The meta block of an experiment's JSON (benchmarks/experiments/): the commit the caller names, the jax
    version, the device, the date, the process's CUDA_* / XLA_* / NCCL_* / TF_CPP_* environment, the Engine's compiler
    options (`jspec.compiler_options()`), then the experiment's own fields."""
    return {
        "commit": commit,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("CUDA_", "XLA_", "NCCL_", "TF_CPP_"))},
        "compiler_options": compiler_options(),
        **fields,
    }


SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_sample() -> dict:
    """An experiment's record of GPU 0's clocks, power, temperature and throttle reasons now (nvidia-smi), or the
    error."""
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


def bits_digest(tree) -> str:
    """An experiment's fingerprint of a pytree's bits: sha256 of every leaf's bytes, in tree order (first 16 hex
    digits)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def save_experiment(out: dict, path: str, t0: float) -> None:
    """Write an experiment's JSON to path with meta.elapsed_s (seconds since t0, a `time.perf_counter()`)."""
    out["meta"]["elapsed_s"] = time.perf_counter() - t0
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results: {path} ({out['meta']['elapsed_s']:.0f} s)")


def _meta(opts: Options, argv) -> dict:
    dev = jax.devices()[0]
    meta = {
        "mode": "quick" if opts.quick else "full",
        "device": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "kernel_backend": get_backend(),
        "compiler_options": compiler_options(),  # what the Engine compiles with (None off the GPU)
        "commit": opts.commit or _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": list(argv or []),
        "python": platform.python_version(),
        "budget_s": opts.budget_s,
        "lm_head": opts.lm_head,
        "int4_wide_min_steps": opts.int4_wide_min_steps or int4_ws.WIDE_MIN_STEPS,  # `int4_ws.config_for`'s crossover
        "options": dataclasses.asdict(opts),
        "references": REFERENCES,
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    return meta


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
