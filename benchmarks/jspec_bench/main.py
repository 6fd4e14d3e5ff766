"""`main`: run the sections (`jspec_bench.sections`) in priority order within the budget, then evaluate the targets,
draw the plots and print the README table. Exit status: 0; 1 when any identity check failed (speculative tokens
differ from greedy, or verify rows differ from decode rows in any bit); 2 when a section raised (its error is in the
JSON; the other sections still ran). `--readme-table RESULTS.json` prints the README's markdown table;
`--replot RESULTS.json --plots DIR` redraws plots."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import jax

from jspec_bench.options import parse_args
from jspec_bench.plots import make_plots
from jspec_bench.report import Context, Report, _meta
from jspec_bench.sections import SECTION_FUNCS, SECTION_MIN_S
from jspec_bench.summary import evaluate_targets, readme_table
from jspec_bench.timing import Budget, CompileCounter, CompileEstimator
from pallas_kernels import int4_ws


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts, args = parse_args(argv)
    if args.readme_table:
        print(readme_table(json.loads(Path(args.readme_table).read_text())))
        return 0
    if args.replot:
        if not opts.plots:
            raise SystemExit("jspec bench --replot needs --plots DIR")
        for f in make_plots(json.loads(Path(args.replot).read_text()), opts.plots):
            print(f)
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch (roofline, peer)

    budget = Budget(opts.budget_s)
    report = Report(opts.out, _meta(opts, argv))
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    ctx = Context(opts, budget, report, counter, CompileEstimator(0.05 if opts.quick else 0.5))
    sections = [s for s in opts.sections if s != "peer" or opts.peer_hf]
    if "peer" in opts.sections and not opts.peer_hf:
        report.section("peer").update(status="skipped", reason="--peer-hf not given")
    wide_min_steps = int4_ws.WIDE_MIN_STEPS
    if opts.int4_wide_min_steps is not None:  # before anything compiles: `config_for` reads it at trace time
        int4_ws.WIDE_MIN_STEPS = opts.int4_wide_min_steps
    try:
        for name in sections:
            sec = report.section(name)
            why = budget.why_not(SECTION_MIN_S[name] * (0.1 if opts.quick else 1.0), name)
            if why:
                sec.update(status="skipped", reason=why)
                report.save()
                continue
            print(f"[{budget.elapsed():.0f}s] {name}", flush=True)
            t0 = time.perf_counter()
            try:
                SECTION_FUNCS[name](ctx, sec)
                if sec["status"] == "running":
                    sec["status"] = "done"
            except Exception as e:
                report.failed(sec, f"[{name}]", e)
            sec["elapsed_s"] = time.perf_counter() - t0
            gc.collect()
            report.save()
        report.data["targets"] = evaluate_targets(report.data)
        if opts.plots:
            try:
                report.data["plots"] = make_plots(report.data, opts.plots)
            except Exception as e:  # e.g. no matplotlib on the GPU machine: the JSON has every number
                report.data["plots"] = (
                    f"not drawn: {e!r}; run `python -m jspec_bench --replot RESULTS.json --plots DIR`"
                )
    finally:
        int4_ws.WIDE_MIN_STEPS = wide_min_steps
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(counter)
        report.data["meta"]["elapsed_s"] = budget.elapsed()
        report.data["meta"]["backend_compiles"] = counter.count
        report.data["meta"]["backend_compile_s"] = counter.seconds
        report.data["ok"] = report.data["identity"]["ok"] and report.errors == 0
        report.save()
    print(readme_table(report.data))
    print(f"results: {opts.out}  ({budget.elapsed():.0f} s)", flush=True)
    if not report.data["identity"]["ok"]:
        return 1
    return 2 if report.errors else 0
