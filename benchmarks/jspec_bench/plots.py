"""The plots of a results JSON (`make_plots`, matplotlib): roofline.png (each step kind's read bandwidth as % of the
roofline), step_time.png (GPU runs: where a decode step's time goes, by kernel group), speedup.png (speculative
speedup against mean_accepted, with verify's break-even), batch.png (batched decode tokens/s against B) and tp.png
(tensor-parallel steps against the TP size)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jspec_bench.e2e import E2E_CONFIGS
from jspec_bench.report import TARGETS
from jspec_bench.summary import _step_models
from jspec_bench.timing import KERNEL_GROUPS


def _plot_step_time(plt, models: dict, path: Path) -> bool:
    """Per model, the decode step's wall time split into its GPU kernel groups and the time between kernels, against
    the roofline time of the bytes it reads and the decode target's time (the roofline time / the target fraction).
    False when no model has GPU kernel times (CPU runs)."""
    steps = {n: m["decode"] for n, m in models.items() if m["decode"].get("gpu_kernels")}
    if not steps:
        return False
    parts = [g for g, _ in KERNEL_GROUPS] + ["XLA ops", "between kernels"]
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.7 * len(steps)))
    target = TARGETS["decode_roofline_14b"]
    legend = {}  # label -> the first artist drawn with it
    for y, step in enumerate(steps.values()):
        kernels = step["gpu_kernels"]
        us = dict(kernels["groups_us"], **{"between kernels": max(0.0, step["time_s"] * 1e6 - kernels["kernel_us"])})
        left = 0.0
        for i, part in enumerate(parts):
            width = us.get(part, 0.0) / 1e3
            if width:
                legend.setdefault(part, ax.barh(y, width, left=left, color=f"C{i}"))
                left += width
        ax.text(left, y, f" {left:.2f} ms, {kernels['launches']} launches", va="center", fontsize=8)
        roof = step["roofline_time_s"] * 1e3
        legend.setdefault("roofline time of the bytes read", ax.vlines(roof, y - 0.4, y + 0.4, color="black", lw=2))
        legend.setdefault(
            f"decode target ({target:.0%} of roofline)",
            ax.vlines(roof / target, y - 0.4, y + 0.4, color="red", ls="--", lw=1.5),
        )
    ax.set_xlim(0, 1.25 * max(s["time_s"] for s in steps.values()) * 1e3)
    ax.set_yticks(range(len(steps)), list(steps))
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step")
    ax.set_title("Where a decode step's time goes (GPU kernel time by group, XLA profiler)")
    markers = [label for label in legend if label not in parts]
    labels = markers + [part for part in parts if part in legend]
    ax.legend(
        [legend[label] for label in labels],
        labels,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=4,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_batch(plt, batch: dict, path: Path) -> bool:
    """Batched decode tokens/s against the batch size (log-log): jspec's `generate_batch` greedy, transformers'
    batched generate where the run has it, batched prompt lookup, against B x one sequence's `Engine.generate` (linear
    scaling) and the batch targets (B = 16 >= 12x, B = 64 >= 35x one sequence). False without batch figures."""
    greedy = {int(b): r for b, r in batch.get("greedy", {}).items() if "decode_tok_s" in r}
    one = batch.get("engine_generate", {}).get("decode_tok_s")
    if not greedy or not one:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted(greedy)
    ax.plot(sizes, [b * one for b in sizes], color="gray", ls=":", lw=1, label="B x one sequence (Engine.generate)")
    ax.plot(sizes, [greedy[b]["decode_tok_s"] for b in sizes], "o-", color="C0", label="jspec generate_batch, greedy")
    for b in sizes:
        ratio = greedy[b]["decode_tok_s"] / one
        ax.annotate(f"{ratio:.1f}x", (b, greedy[b]["decode_tok_s"]), textcoords="offset points", xytext=(4, -12),
                    fontsize=8)  # fmt: skip
    peer = [
        (b, greedy[b]["transformers"]["decode_tok_s"])
        for b in sizes
        if "decode_tok_s" in greedy[b].get("transformers", {})
    ]
    if peer:
        ax.plot(*zip(*peer, strict=True), "s-", color="C1", label="transformers batched generate (bf16)")
    lookup = sorted(
        (int(key.split()[0].removeprefix("B=")), r["lookup"]["decode_tok_s"], key.split()[1])
        for key, r in batch.get("lookup", {}).items()
        if "lookup" in r
    )
    for i, k in enumerate(sorted({k for _, _, k in lookup})):
        pts = [(b, v) for b, v, kk in lookup if kk == k]
        ax.plot(*zip(*pts, strict=True), "^", ms=8, color=f"C{2 + i}", label=f"jspec prompt lookup {k}, echo prompts")
    for b, key in ((16, "batch16_over_b1"), (64, "batch64_over_b1")):
        ax.plot(b, TARGETS[key] * one, "rx", ms=9, mew=2, label="targets (12x at 16, 35x at 64)" if b == 16 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(set(sizes) | {b for b, _, _ in lookup})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("batch size B (sequences per step)")
    ax.set_ylabel("decode tokens/s (the batch, prefill excluded)")
    ax.set_title(f"{batch.get('model')}: batched decode, each sequence's tokens its own")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_tp(plt, tp: dict, path: Path) -> bool:
    """Per model of the tp section, its steps (ms) against the TP size: decode and verify, the roofline time of the
    decode step's bytes on the aggregate roofline of its GPUs, the collectives of a step priced alone, and for the
    Qwen2.5-14B shape the TP = 2 target (0.6x its TP = 1 step). False without a measured model."""
    done: dict[str, dict[int, dict]] = {}
    for label, m in tp.get("models", {}).items():
        if m.get("status") == "done":
            name, n = label.rsplit(" tp=", 1)
            done.setdefault(name, {})[int(n)] = m
    if not done:
        return False
    fig, axes = plt.subplots(1, len(done), figsize=(5 * len(done), 4), squeeze=False)
    for ax, (name, by_n) in zip(axes[0], done.items(), strict=True):
        ns = sorted(by_n)
        runs = [by_n[n] for n in ns]
        k = runs[0]["verify"]["k"]
        ax.plot(ns, [1e3 * m["decode"]["time_s"] for m in runs], "o-", color="C0", label="decode step")
        ax.plot(ns, [1e3 * m["verify"]["time_s"] for m in runs], "s-", color="C1", label=f"verify step (k = {k})")
        roof = [1e3 * m["decode"]["bytes"]["total"] / m["roofline_Bps"] for m in runs]
        ax.plot(ns, roof, ":", color="gray", label="decode's bytes at the GPUs' summed roofline")
        collectives = [1e3 * m["collectives"]["step_s"] for m in runs]
        ax.plot(ns, collectives, "^--", color="C2", label="a step's collectives alone")
        if name == "qwen2.5-14b" and 1 in by_n:
            target = 1e3 * TARGETS["tp2_over_tp1_14b"] * by_n[1]["decode"]["time_s"]
            ax.plot(2, target, "rx", ms=9, mew=2, label="target: TP = 2 decode <= 0.6x TP = 1")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("TP size (GPUs)")
        ax.set_ylabel("ms a step")
        exact = all(m["verify"]["bitwise_equal_decode"] for m in runs)
        ax.set_title(
            f"{name}, tensor parallel\nverify rows {'==' if exact else 'DIFFER from'} decode rows", fontsize=10
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def make_plots(data: dict, out_dir: str) -> list[str]:
    """roofline.png: each step kind's achieved read bandwidth as % of the roofline, per model (step time on the bar);
    step_time.png (GPU runs): where each model's decode step time goes (`_plot_step_time`);
    speedup.png: speculative speedup against mean_accepted, with verify(k)'s break-even mean_accepted;
    batch.png: batched decode tokens/s against the batch size (`_plot_batch`);
    tp.png: the tensor-parallel steps against the TP size (`_plot_tp`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    models = {n: m for n, m in _step_models(data).items() if "decode" in m and "roofline_fraction" in m["decode"]}
    if models:
        ks = sorted({int(k) for m in models.values() for k in m["verify"]})
        kinds = [("decode", lambda m: m["decode"])] + [
            (f"verify k={k}", functools.partial(lambda m, k: m["verify"].get(str(k)), k=k)) for k in ks
        ]
        fig, ax = plt.subplots(figsize=(max(7, 2 * len(kinds)), 4.5))
        width = 0.8 / len(models)
        for i, (name, m) in enumerate(models.items()):
            for j, (_, get) in enumerate(kinds):
                step = get(m)
                if not step:
                    continue
                x = j + i * width
                ax.bar(x, 100 * step["roofline_fraction"], width, color=f"C{i}", label=name if j == 0 else None)
                ax.text(
                    x,
                    100 * step["roofline_fraction"],
                    f"{step['time_s'] * 1e3:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.axhline(100 * TARGETS["decode_roofline_14b"], color="red", ls="--", lw=1, label="decode target (55%)")
        ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(kinds))], [k for k, _ in kinds])
        ax.set_ylabel("% of HBM read roofline")
        roof = data["sections"].get("roofline", {}).get("roofline_Bps")
        ax.set_title(f"Step read bandwidth (roofline {roof / 1e12:.2f} TB/s; labels: ms per step)" if roof else "")
        ax.legend(fontsize=8)
        files.append(str(out / "roofline.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
        if _plot_step_time(plt, models, out / "step_time.png"):
            files.append(str(out / "step_time.png"))
    e2e = data["sections"].get("e2e", {})
    variants = {k: v for k, v in e2e.get("variants", {}).items() if "configs" in v}
    if variants:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label in [c[0] for c in E2E_CONFIGS if not c[0].startswith("greedy")]:
            pts = [
                (v["configs"][label]["mean_accepted"], v["configs"][label]["speedup_vs_greedy"])
                for v in variants.values()
                if label in v["configs"]
                and v["configs"][label]["verify_steps"]
                and "speedup_vs_greedy" in v["configs"][label]
            ]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, "o-", label=label)
        ax.axhline(1.0, color="gray", lw=1)
        v7 = models.get(e2e.get("model"), {}).get("verify", {}).get(str(e2e.get("k")))
        if v7:
            be = v7["break_even_mean_accepted"]
            ax.axvline(be, color="red", ls="--", lw=1, label=f"break-even mean_accepted {be:.2f} (verify k={e2e['k']})")
            xs = np.linspace(1, e2e["k"] + 1, 50)
            ax.plot(xs, xs / be, color="red", lw=0.8, alpha=0.6, label="model: mean_accepted x decode/verify")
        ax.set_xlabel("mean_accepted (tokens committed per verify step)")
        ax.set_ylabel("speedup vs greedy (decode tok/s)")
        ax.set_title(f"{e2e.get('model')}: speculative speedup against acceptance")
        ax.legend(fontsize=8)
        files.append(str(out / "speedup.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    if _plot_batch(plt, data["sections"].get("batch", {}), out / "batch.png"):
        files.append(str(out / "batch.png"))
    if _plot_tp(plt, data["sections"].get("tp", {}), out / "tp.png"):
        files.append(str(out / "tp.png"))
    return files
