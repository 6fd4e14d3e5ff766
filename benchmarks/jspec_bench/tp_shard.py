"""The `tp_shard` section (tensor parallelism on one GPU): what a TP = n step costs per device, measured where only
one GPU is lent. For each step model in --models and n = TP_SIZES: ONE shard of the TP = n layout
(`jspec.tensor_parallel.shard_config`: heads, KV heads and the intermediate size divided by n; its lm_head the
V / n columns it computes before the all-gather), random int4, its decode and verify(k = 7) steps timed alone on
this GPU (`steps.measure_steps`: time, bytes, % of the roofline, bitwise verify == decode), against the whole
model's decode step (the steps section, when it ran in this report).

The collectives a TP = n step adds are counted and sized, not timed (one GPU): per layer the all-reduces of o and
down ([16, H] float32 each), the embedding's all-reduce ([16, H] of the activation dtype) and the logits' all-gather
([16, V] float32). The predicted TP = n step is the shard's step plus that many collectives at each assumed latency of
COLLECTIVE_US (an assumption, stated as such in the JSON; a multi-GPU run, issue 38, replaces it).
"""

from __future__ import annotations

import dataclasses
import gc

from jspec.tensor_parallel import shard_config
from jspec_bench.report import Context
from jspec_bench.shapes import STEP_MODELS, model_config, random_int4_params
from jspec_bench.steps import measure_steps
from pallas_kernels import ROW_TILE

TP_SIZES = (2,)
COLLECTIVE_US = (5.0, 10.0, 20.0)  # assumed per-collective latencies of the prediction (not measured here)


def local_config(cfg, n: int):
    """The config one device of a TP = n layout runs, as a single-device model: the shard's sizes, its V / n logits
    columns, no collectives (what a shard's kernels cost alone)."""
    return dataclasses.replace(shard_config(cfg, n), tensor_parallel=1, vocab_size=cfg.vocab_size // n)


def collectives(cfg, act_bytes: int) -> dict:
    """The collectives of one TP step of cfg's model (the row tile's shapes): count and bytes."""
    reduce_bytes = ROW_TILE * cfg.hidden_size * 4
    return {
        "all_reduce": 2 * cfg.num_layers + 1,
        "all_reduce_bytes_each": reduce_bytes,
        "embed_all_reduce_bytes": ROW_TILE * cfg.hidden_size * act_bytes,
        "all_gather": 1,
        "all_gather_bytes": ROW_TILE * cfg.vocab_size * 4,
    }


def section_tp_shard(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    sec.update(tp_sizes=list(TP_SIZES), assumed_collective_us=list(COLLECTIVE_US), models={})
    whole = ctx.report.data["sections"].get("steps", {}).get("models", {})
    for name in [n for n in STEP_MODELS if n in opts.models]:
        for n in TP_SIZES:
            label = f"{name} tp={n}"
            why = ctx.budget.why_not(10.0 if opts.quick else 90.0, f"{label} shard steps")
            if why:
                sec["models"][label] = {"status": "skipped", "reason": why}
                continue
            entry = sec["models"][label] = {"status": "running"}
            try:
                cfg = model_config(name, opts.quick)
                local = local_config(cfg, n)
                params = random_int4_params(local, opts.seed, opts.lm_head == "int4")
                act_bytes = params["embed"].dtype.itemsize
                entry.update(shard_config=local.to_dict(), collectives=collectives(cfg, act_bytes))
                measure_steps(ctx, label, params, local, (7,), entry)
                shard_s, count = entry["decode"]["time_s"], entry["collectives"]["all_reduce"] + 1
                entry["predicted_step_s"] = {str(us): shard_s + count * us * 1e-6 for us in COLLECTIVE_US}
                full = whole.get(name, {}).get("decode", {}).get("time_s")
                if full:
                    entry["whole_model_decode_s"] = full
                    entry["shard_over_whole"] = shard_s / full
                print(
                    f"  {label}: a shard's decode {shard_s * 1e3:.3f} ms"
                    + (f" ({entry['shard_over_whole']:.2f}x the whole model's)" if full else "")
                    + f"; {count} collectives a step",
                    flush=True,
                )
                entry["status"] = "done"
            except Exception as e:
                ctx.report.failed(entry, label, e)
            finally:
                params = None
                gc.collect()
            ctx.report.save()
