"""What a results JSON is summed up as: `evaluate_targets` (the targets of docs/performance.md met or not, from
the measured figures) and `readme_table` (the README's markdown: step costs, end to end, peer, targets, identity)."""

from __future__ import annotations

import statistics

from jspec_bench.e2e import E2E_CONFIGS, _num
from jspec_bench.report import REFERENCES, TARGETS
from jspec_bench.shapes import STEP_MODELS


def evaluate_targets(data: dict) -> list[dict]:
    """The targets (docs/performance.md) from the measured figures: met True/False, or None when not measured in
    this run. A quick run (tiny CPU shapes) claims nothing: every target is None, "not evaluated", its value still
    recorded."""
    secs = data.get("sections", {})
    steps = secs.get("steps", {}).get("models", {})
    quick = data.get("meta", {}).get("mode") == "quick"
    out = []

    def add(name, target, value, met, detail):
        if quick:
            met, detail = None, "not evaluated: a quick run's tiny CPU shapes say nothing about the H200 targets"
        unit = (
            "fraction"
            if "roofline" in name or "of a decode step" in name
            else "tok/s"
            if "tok/s" in name
            else "count"
            if "recompiles" in name
            else "s"
            if "fixed cost" in name
            else "x"
        )
        out.append({"name": name, "target": target, "value": value, "unit": unit, "met": met, "detail": detail})

    d14 = steps.get("qwen2.5-14b", {}).get("decode")
    frac = d14.get("roofline_fraction") if d14 else None
    add(
        "decode step >= 55% of roofline (Qwen2.5-14B shape)",
        TARGETS["decode_roofline_14b"],
        frac,
        None if frac is None else frac >= TARGETS["decode_roofline_14b"],
        f"{d14['time_s'] * 1e3:.3f} ms" if d14 else "not measured",
    )
    for model in STEP_MODELS:
        v7 = steps.get(model, {}).get("verify", {}).get("7")
        ratio = v7.get("ratio_vs_decode") if v7 else None
        add(
            f"verify(k=7) <= 1.25x decode, bit-exact ({model})",
            TARGETS["verify7_over_decode"],
            ratio,
            None if ratio is None else bool(ratio <= TARGETS["verify7_over_decode"] and v7["bitwise_equal_decode"]),
            "not measured" if v7 is None else f"bitwise equal: {v7['bitwise_equal_decode']}",
        )
    e2e = secs.get("e2e", {})
    variants = {k: v for k, v in e2e.get("variants", {}).items() if "configs" in v}
    for loop in ("host", "device"):
        best = _at_mean_accepted(variants, f"lookup/{loop}", 3.0)
        add(
            f"speculative >= 2x greedy at mean_accepted 3 ({loop} loop, gate off)",
            TARGETS["speedup_at_mean_accepted_3"],
            best[1] if best else None,
            None if best is None else best[1] >= TARGETS["speedup_at_mean_accepted_3"],
            "no run with mean_accepted in [2.5, 3.5]" if best is None else f"{best[0]}, mean_accepted {best[2]:.2f}",
        )
    miss = variants.get("insert1", {}).get("configs", {})
    for loop in ("host", "device"):
        c = miss.get(f"lookup+gate/{loop}")
        value = c.get("speedup_vs_greedy") if c else None
        add(
            f"gate on, nothing hits: >= 0.97x greedy ({loop} loop)",
            TARGETS["gate_no_hit_vs_greedy"],
            value,
            None if value is None else value >= TARGETS["gate_no_hit_vs_greedy"],
            "not measured" if c is None else f"insert1 prompt (every draft misses): verify steps {c['verify_steps']}",
        )
    greedy = {}  # loop -> median over the prompts of greedy decode tok/s
    if e2e.get("model") == "llama-3-8b":
        for loop in ("host", "device"):
            rates = [
                v["configs"][f"greedy/{loop}"]["decode_tok_s"]
                for v in variants.values()
                if v["configs"].get(f"greedy/{loop}", {}).get("decode_tok_s")
            ]
            if rates:
                greedy[loop] = statistics.median(rates)
    best_loop = max(greedy, key=greedy.get) if greedy else None
    gpt_fast = REFERENCES["gpt_fast_int4_g32_llama3_8b_tok_s"]
    add(
        "greedy int4 >= 460 tok/s (Llama-3-8B shape; 2x gpt-fast's 228.8)",
        TARGETS["greedy_tok_s_llama3_8b"],
        greedy.get(best_loop),
        None if best_loop is None else greedy[best_loop] >= TARGETS["greedy_tok_s_llama3_8b"],
        "not measured"
        if best_loop is None
        else f"{best_loop} loop (median over prompts), {greedy[best_loop] / gpt_fast:.2f}x gpt-fast int4 "
        "(external reference, docs/performance.md)",
    )
    sampling = secs.get("sampling", {})
    in_step = {label: r["extra_fraction"] for label, r in sampling.get("in_step", {}).items() if "extra_fraction" in r}
    worst = max(in_step, key=in_step.get) if in_step else None
    alone = sampling.get("sampler_alone", {}).get(f"{worst} V={sampling.get('vocab')}", {})
    add(
        "the sampler costs < 3% of a decode step" + (f" ({sampling['model']})" if "model" in sampling else ""),
        TARGETS["sampler_over_decode_step"],
        None if worst is None else in_step[worst],
        None if worst is None else in_step[worst] < TARGETS["sampler_over_decode_step"],
        "not measured"
        if worst is None
        else f"the costliest processor in the step, {worst}: sampled decode rounds against greedy ones"
        + "".join(
            f"; alone {r['time_s'] * 1e6:.0f} us a call on {sampling['rows'][kind]} rows" for kind, r in alone.items()
        ),
    )
    batch = secs.get("batch", {}).get("greedy", {})
    for size in (16, 64):
        r = batch.get(str(size), {})
        # B = 1 is the faster of the batch engine's B = 1 and Engine.generate's one sequence (runs before
        # `vs_engine_generate` existed: the batch engine's alone; runs without B = 1: Engine.generate's alone)
        readings = {
            label: r[key]
            for key, label in (("vs_b1", "the batch engine's B=1"), ("vs_engine_generate", "Engine.generate"))
            if r.get(key) is not None
        }
        ratio = min(readings.values()) if readings else None
        target = TARGETS[f"batch{size}_over_b1"]
        add(
            f"batch B={size} greedy decode >= {target:.0f}x B=1 (the faster single sequence), each its own tokens",
            target,
            ratio,
            None if ratio is None else bool(ratio >= target and r["identical"]),
            "not measured"
            if ratio is None
            else f"{r['decode_tok_s']:.0f} tok/s decode, {r['ms_per_round']:.2f} ms a round; "
            + ", ".join(f"{x:.2f}x {label}" for label, x in readings.items())
            + f"; alone in the engine identical: {r['identical']}",
        )
    _hybrid_targets(secs.get("hybrid", {}).get("models", {}), add)
    scaling = secs.get("tp", {}).get("scaling", {}).get("qwen2.5-14b", {}).get("tp=2 / tp=1")
    add(
        "tensor parallel: TP=2 decode step <= 0.6x TP=1 (Qwen2.5-14B shape)",
        TARGETS["tp2_over_tp1_14b"],
        scaling,
        None if scaling is None else scaling <= TARGETS["tp2_over_tp1_14b"],
        "not measured (needs 2 GPUs)" if scaling is None else "both on the mesh path, in one run",
    )
    recompiles = e2e.get("compiles_after_warmup")
    add(
        "zero recompiles after warm-up (e2e engines)",
        0,
        recompiles,
        None if recompiles is None else recompiles == 0,
        f"executables per engine: {e2e.get('num_compiles')}" if recompiles is not None else "not measured",
    )
    return out


def _hybrid_targets(models: dict, add) -> None:
    """The hybrid section's three targets, each at the worst of the models it measured (named in the detail)."""
    done = {name: m for name, m in models.items() if m.get("status") == "done"}
    decode = {n: m["decode"].get("roofline_fraction") for n, m in done.items() if "decode" in m}
    decode = {n: f for n, f in decode.items() if f is not None}
    worst = min(decode, key=decode.get) if decode else None
    add(
        "hybrid decode >= 45% of the roofline (full depth)",
        TARGETS["hybrid_decode_roofline"],
        decode.get(worst),
        None if worst is None else decode[worst] >= TARGETS["hybrid_decode_roofline"],
        "not measured" if worst is None else f"{worst}: {done[worst]['decode']['time_s'] * 1e3:.3f} ms a step",
    )
    ratios = {n: m["verify"]["3"] for n, m in done.items() if "3" in m.get("verify", {})}
    worst = max(ratios, key=lambda n: ratios[n]["ratio_vs_decode"]) if ratios else None
    v = ratios.get(worst, {})
    add(
        "hybrid verify(k=3) <= 1.05x decode, bit-exact",
        TARGETS["hybrid_verify3_over_decode"],
        v.get("ratio_vs_decode"),
        None
        if worst is None
        else bool(v["ratio_vs_decode"] <= TARGETS["hybrid_verify3_over_decode"] and v["bitwise_equal_decode"]),
        "not measured"
        if worst is None
        else f"{worst}: bitwise {'equal' if v['bitwise_equal_decode'] else 'DIFFERENT'}",
    )
    fits = {  # (model, "alone" or "in the steps") -> that measurement of the kernel's fixed cost
        (n, where): r
        for n, m in done.items()
        if "recurrent" in m
        for where, r in (("alone", m["recurrent"]), ("in the steps", m["recurrent"].get("in_step")))
        if r
    }
    worst = max(fits, key=lambda key: fits[key]["fixed_s"]) if fits else None
    add(
        "recurrent kernel fixed cost per call < 10 us",
        TARGETS["recurrent_fixed_s"],
        fits[worst]["fixed_s"] if worst else None,
        None if worst is None else fits[worst]["fixed_s"] < TARGETS["recurrent_fixed_s"],
        "not measured"
        if worst is None
        else f"the worst of {len(fits)} fits, {worst[0]} {worst[1]}: {fits[worst]['source']}",
    )


def _at_mean_accepted(variants: dict, label: str, target: float):
    """(prompt, speedup, mean_accepted) of configuration `label`'s run closest to `target` mean_accepted (+-0.5)."""
    best = None
    for vname, v in variants.items():
        c = v["configs"].get(label)
        if not c or not c["verify_steps"] or "speedup_vs_greedy" not in c:
            continue
        gap = abs(c["mean_accepted"] - target)
        if gap <= 0.5 and (best is None or gap < best[3]):
            best = (f"{vname} prompt", c["speedup_vs_greedy"], c["mean_accepted"], gap)
    return best


def readme_table(data: dict) -> str:
    """Markdown for the README, generated from a results JSON."""
    meta = data["meta"]
    lines = []
    if meta.get("mode") == "quick":
        lines.append("> **QUICK MODE** (CPU, tiny shrunk shapes): a harness check, not performance figures.\n")
    roof = data["sections"].get("roofline", {})
    roof_text = f"{roof['roofline_Bps'] / 1e12:.2f} TB/s ({roof['best']})" if "roofline_Bps" in roof else "n/a"
    lines.append(
        f"Measured on {meta.get('device')} — jax {meta.get('jax')}, kernels `{meta.get('kernel_backend')}`, "
        f"commit `{str(meta.get('commit'))[:12]}`, {meta.get('date')}. HBM read roofline: {roof_text}. "
        f"Random int4 weights (lm_head {meta.get('lm_head')}), batch 1."
    )
    lines += ["", "**Step cost** (context " + str(_first(data, "context")) + " tokens)", ""]
    ks = sorted({int(k) for m in _step_models(data).values() for k in m.get("verify", {})})
    head = "| model | decode ms | % roofline | " + " | ".join(f"verify k={k} ms (x decode)" for k in ks)
    lines += [head + " | bit-exact |", "|" + "---|" * (4 + len(ks))]
    for name, m in _step_models(data).items():
        if "decode" not in m:
            lines.append(f"| {name} | {m.get('status')}: {str(m.get('reason') or m.get('error', ''))[:60]} |")
            continue
        cells = [f"{m['decode']['time_s'] * 1e3:.2f}", _pct_cell(m["decode"])]
        for k in ks:
            v = m["verify"].get(str(k))
            cells.append(f"{v['time_s'] * 1e3:.2f} ({v['ratio_vs_decode']:.2f}x)" if v else "")
        exact = all(v["bitwise_equal_decode"] for v in m["verify"].values())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
    e2e = data["sections"].get("e2e", {})
    variants = {k: v for k, v in e2e.get("variants", {}).items() if "configs" in v}
    if variants:
        labels = [c[0] for c in E2E_CONFIGS if any(c[0] in v["configs"] for v in variants.values())]
        spec = [lb for lb in labels if not lb.startswith("greedy")]
        lines += [
            "",
            f"**End to end** ({e2e['model']} shape, attention output zeroed so the random model is Markov and the "
            f"echo prompts set the acceptance; k={e2e['k']}, {e2e['new_tokens']} new tokens; greedy: decode tok/s, "
            "prefill excluded; speculative: speedup vs greedy on the same loop, mean_accepted in brackets)",
            "",
            "| prompt | echo fraction | "
            + " | ".join(f"{lb} tok/s" for lb in labels if lb.startswith("greedy"))
            + " | "
            + " | ".join(spec)
            + " | identical |",
            "|" + "---|" * (3 + len(labels)),
        ]
        for vname, v in variants.items():
            c = v["configs"]
            greedy_cells = [_num(c.get(lb, {}).get("decode_tok_s"), ".0f") for lb in labels if lb.startswith("greedy")]
            spec_cells = [_spec_cell(c.get(lb, {})) for lb in spec]
            same = all(x["identical_to_greedy"] for x in c.values())
            lines.append(
                f"| {vname} | {v['echo_fraction']:.2f} | "
                + " | ".join(greedy_cells + spec_cells)
                + f" | {'yes' if same else 'NO'} |"
            )
    peer = data["sections"].get("peer", {})
    if peer.get("variants"):
        lines += [
            "",
            f"**Peer**: HuggingFace transformers {peer.get('transformers')} ({peer['setup']}), "
            f"{peer['model']}, {peer['new_tokens']} new tokens",
            "",
        ]
        lines += ["| prompt | greedy tok/s | prompt lookup tok/s | lookup output == its greedy |", "|---|---|---|---|"]
        for vname, v in peer["variants"].items():
            lines.append(
                f"| {vname} | {v['greedy_tok_s']:.1f} | {v['lookup_tok_s']:.1f} | "
                f"{'yes' if v['lookup_equals_greedy'] else 'no'} |"
            )
        ours = _step_models(data).get(peer["model"], {}).get("decode")
        if ours:
            lines.append(
                f"\njspec at the same shape (int4): decode step {ours['time_s'] * 1e3:.2f} ms, i.e. at most "
                f"{1 / ours['time_s']:.0f} tok/s greedy (step cost only; see the steps table)."
            )
    ref = REFERENCES
    if meta.get("mode") != "quick":  # a smoke run on tiny CPU shapes sets nothing beside the H200's figures
        lines += [
            "",
            "External references on this H200 (docs/performance.md; not measured here): gpt-fast Llama-3-8B shape "
            "int4 g32 "
            f"{ref['gpt_fast_int4_g32_llama3_8b_tok_s']} tok/s, bf16 {ref['gpt_fast_bf16_llama3_8b_tok_s']} tok/s.",
        ]
    lines += ["", "**Targets**", "", "| target | value | met | detail |", "|---|---|---|---|"]
    for t in data.get("targets", []):
        value = _target_value(t["value"], t["unit"])
        met = {True: "yes", False: "**no**", None: "not evaluated" if meta.get("mode") == "quick" else "not measured"}[
            t["met"]
        ]
        lines.append(f"| {t['name']} | {value} | {met} | {t['detail']} |")
    ident = data.get("identity", {})
    lines.append("")
    lines.append(
        f"Identity: {'all' if ident.get('ok') else 'NOT all'} {ident.get('checks', 0)} checks passed "
        "(speculative tokens == greedy tokens; verify rows == decode rows, bitwise)."
    )
    return "\n".join(lines)


def _spec_cell(c: dict) -> str:
    if "speedup_vs_greedy" not in c:
        return ""
    accepted = f"{c['mean_accepted']:.2f}" if c["verify_steps"] else "no verify"
    return f"{c['speedup_vs_greedy']:.2f}x ({accepted})"


def _target_value(value, unit: str) -> str:
    if value is None:
        return "n/a"
    return {
        "fraction": f"{100 * value:.1f}%",
        "tok/s": f"{value:.0f} tok/s",
        "count": str(value),
        "s": f"{value * 1e6:.1f} us",
    }.get(unit, f"{value:.2f}x")


def _step_models(data: dict) -> dict:
    out = {}
    for sec in ("steps", "other_steps"):
        out.update(data["sections"].get(sec, {}).get("models", {}))
    return out


def _first(data: dict, key: str):
    for m in _step_models(data).values():
        if key in m:
            return m[key]
    return "n/a"


def _pct_cell(r: dict) -> str:
    return f"{100 * r['roofline_fraction']:.1f}%" if "roofline_fraction" in r else "n/a"
