"""Real acceptance with the bundled demo model: prompt lookup, MTP and draft-model drafting on code-editing prompts
(rewrite / rename / add a parameter: the answer repeats the prompt, so lookup should hit) and on free continuation
(where it should not).

For every prompt and drafter: mean_accepted, acceptance per draft position, tok/s against plain greedy, and the
exactness check (speculative tokens == greedy tokens) on every run; the script exits non-zero if any run differs.
Also the measured cost of a decode step and a verify step (host loop), which notebooks/03_cost_model.ipynb reads.

With --temperatures, the same sampled (jspec.Sampler, --seeds seeds per prompt): each drafter's tokens against
plain sampling with the same seed, and MTP drafting coupled to the position-keyed noise (the default) against the
head's argmax (MTPDrafter(coupled=False)).

    python benchmarks/demo_acceptance.py --out benchmarks/results/demo_acceptance_cpu.json [--commit SHA]
    python benchmarks/demo_acceptance.py --temperatures 0.3,0.7,1.0 --out benchmarks/results/demo_sampling_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import checkpoints  # noqa: E402
import jspec  # noqa: E402
from jspec.model import read_tokenizer  # noqa: E402
from pallas_kernels import get_backend  # noqa: E402

# Code-editing prompts: code, a comment asking for an edit, and the start of the edited version. A model that has
# learnt to copy continues with the (edited) rest, which prompt lookup finds in the prompt. Prompts end mid-line:
# the tokenizer merges a newline with the next line's indentation, so a prompt ending in "\n" is an unusual split.
EDIT_PROMPTS = {
    "rename_variable": """def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


# Same function, with `items` renamed to `products`.
def compute_total(products, tax_rate):
    subtotal = 0
    for item in products:""",
    "add_parameter": '''def read_lines(path, strip=True):
    """Return the lines of a text file."""
    with open(path) as f:
        lines = f.readlines()
    if strip:
        lines = [line.strip() for line in lines]
    return lines


# Version 2: add an `encoding` parameter.
def read_lines(path, strip=True, encoding="utf-8"):
    """Return the lines of a text file."""
    with open(path, encoding=encoding) as f:''',
    "rewrite_method": """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        if key in self.counts:
            self.counts[key] += 1
        else:
            self.counts[key] = 1

    def get(self, key):
        if key in self.counts:
            return self.counts[key]
        return 0


class SafeCounter(Counter):
    def __init__(self):
        self.counts = {}

    def add(self, key):""",
    "rename_function": """def parse_args(argv):
    parser = argparse.ArgumentParser(description="Process some files.")
    parser.add_argument("paths", nargs="+", help="input files")
    parser.add_argument("--output", default="out.txt", help="output file")
    parser.add_argument("--verbose", action="store_true", help="print progress")
    return parser.parse_args(argv)


# Renamed: parse_args -> parse_command_line.
def parse_command_line(argv):
    parser = argparse.ArgumentParser(description="Process some files.")""",
    "similar_test": """def test_add_positive(self):
    calc = Calculator()
    result = calc.add(2, 3)
    self.assertEqual(result, 5)
    self.assertIsInstance(result, int)


def test_add_negative(self):
    calc = Calculator()""",
}
FREE_PROMPTS = {
    "main_function": "import os\nimport sys\n\n\ndef main():",
    "class_definition": "class LRUCache:\n    def __init__(self, capacity):",
    "module_docstring": '"""Utilities for reading configuration files."""\n\nimport json\n\n\ndef load_config(path):',
}
CATEGORIES = {"edit": EDIT_PROMPTS, "free": FREE_PROMPTS}
NOTES = (
    "Greedy tokens of every speculative run are compared with the greedy run of the same prompt (identical). "
    "Timings: host loop, after a warm-up generation; tokens_per_s includes prefill. per_position_acceptance is "
    "SpecStats' (a position no verify step of that run reached reads 0.0); summary values are means over prompts, "
    "summary mean_accepted is pooled over verify steps. step_cost: host-loop time per decode step (greedy runs), "
    "per verify step (ungated prompt lookup and MTP runs, drafting included) for each k, and per draft-model round "
    "(its verify step and its k draft-model steps)."
)


def load_demo(ckpt_dir: str):
    """(params, cfg, tokenizer) of a jspec checkpoint directory holding tokenizer.json."""
    params, cfg = checkpoints.load(ckpt_dir)
    return params, cfg, read_tokenizer(os.path.join(ckpt_dir, "tokenizer.json"))


def drafter_configs(
    lookup_k: int, mtp_ks: list[int], with_mtp: bool, sampling: bool = False, draft_model=None, draft_k: int = 4
) -> dict:
    """name -> (k, drafter, gate); MTP rows at each of mtp_ks ("mtp", or "mtp_k<k>" for several); draft_model: a
    jspec.DraftModel (None: no draft-model row)."""
    configs = {
        "prompt_lookup": (lookup_k, jspec.PromptLookup(), None),
        "prompt_lookup_gated": (lookup_k, jspec.PromptLookup(), jspec.HitDensityGate()),
    }
    for mtp_k in mtp_ks if with_mtp else ():
        suffix = f"_k{mtp_k}" if len(mtp_ks) > 1 else ""
        configs["mtp" + suffix] = (mtp_k, jspec.MTPDrafter(), None)
        if sampling:
            configs["mtp_argmax" + suffix] = (mtp_k, jspec.MTPDrafter(coupled=False), None)
    if draft_model is not None:
        configs["draft_model"] = (draft_k, draft_model, None)
    return configs


def timed(engine: jspec.Engine, ids: list[int], max_new: int, **kwargs) -> jspec.GenerationResult:
    """Generate once to compile (2 tokens), then the timed generation."""
    engine.generate(ids, 2, **kwargs)
    return engine.generate(ids, max_new, **kwargs)


def run_prompt(engines: dict, configs: dict, ids: list[int], max_new: int, on_device: bool, sampler=None) -> list:
    """Greedy (or plain sampling with `sampler`), then every drafter config, on one prompt; each run compared token
    for token with it (the on-device runs too)."""
    base = engines[min(engines)]
    greedy = timed(base, ids, max_new, sampler=sampler)
    greedy_device = timed(base, ids, max_new, on_device=True, sampler=sampler) if on_device else None
    rows = []
    for name, (k, drafter, gate) in configs.items():
        spec = timed(engines[k], ids, max_new, drafter=drafter, gate=gate, sampler=sampler)
        s = spec.stats
        row = dict(
            drafter=name,
            k=k,
            identical=spec.tokens == greedy.tokens,
            new_tokens=s.new_tokens,
            mean_accepted=s.mean_accepted,
            acceptance_rate=s.acceptance_rate,
            per_position_acceptance=s.per_position_acceptance,
            per_position_reached=s.per_position_reached,
            verify_steps=s.verify_steps,
            decode_steps=s.decode_steps,
            gate_engaged=s.gate_engaged,
            would_hits=s.would_hits,
            tokens_per_s=s.tokens_per_s,
            greedy_tokens_per_s=greedy.stats.tokens_per_s,
            speedup=s.tokens_per_s / greedy.stats.tokens_per_s,
            decode_time_s=s.decode_time_s,
            verify_time_s=s.verify_time_s,
            greedy_decode_time_s=greedy.stats.decode_time_s,
            greedy_decode_steps=greedy.stats.decode_steps,
        )
        if on_device:
            device = timed(engines[k], ids, max_new, drafter=drafter, gate=gate, on_device=True, sampler=sampler)
            row["identical"] = row["identical"] and device.tokens == greedy.tokens == greedy_device.tokens
            row["on_device_tokens_per_s"] = device.stats.tokens_per_s
            row["on_device_greedy_tokens_per_s"] = greedy_device.stats.tokens_per_s
            row["on_device_speedup"] = device.stats.tokens_per_s / greedy_device.stats.tokens_per_s
        rows.append(row)
    return rows


def pooled_acceptance(rows: list[dict], i: int) -> float | None:
    """Acceptance at draft position i over all rows' verify steps that reached it (None if none did)."""
    reached = sum(r["per_position_reached"][i] for r in rows)
    accepted = sum(
        r["per_position_acceptance"][i] * r["per_position_reached"][i] for r in rows if r["per_position_reached"][i]
    )
    return accepted / reached if reached else None


def rounded(values: list[float | None]) -> list[float | None]:
    return [None if a is None else round(a, 2) for a in values]


def summarize(runs: list[dict]) -> dict:
    """category -> drafter -> means over prompts (per-position acceptance pooled over the verify steps that
    reached each position; None where none did)."""
    out: dict = {}
    for cat in CATEGORIES:
        out[cat] = {}
        for name in sorted({r["drafter"] for r in runs}):
            rows = [r for r in runs if r["category"] == cat and r["drafter"] == name]
            if not rows:
                continue
            k = rows[0]["k"]
            per_pos = [pooled_acceptance(rows, i) for i in range(k)]
            verify = sum(r["verify_steps"] for r in rows)
            out[cat][name] = dict(
                k=k,
                prompts=len(rows),
                identical=all(r["identical"] for r in rows),
                mean_accepted=(sum(r["mean_accepted"] * r["verify_steps"] for r in rows) / verify) if verify else 0.0,
                acceptance_rate=float(np.mean([r["acceptance_rate"] for r in rows])),
                per_position_acceptance=per_pos,
                tokens_per_s=float(np.mean([r["tokens_per_s"] for r in rows])),
                greedy_tokens_per_s=float(np.mean([r["greedy_tokens_per_s"] for r in rows])),
                speedup=float(np.mean([r["speedup"] for r in rows])),
                verify_fraction=verify / max(1, sum(r["verify_steps"] + r["decode_steps"] for r in rows)),
            )
            if "on_device_speedup" in rows[0]:
                out[cat][name]["on_device_speedup"] = float(np.mean([r["on_device_speedup"] for r in rows]))
    return out


def step_costs(runs: list[dict]) -> dict:
    """Measured host-loop step times: decode (from the greedy runs), verify per k (ungated runs of the drafters that
    run no model of their own: prompt lookup, MTP) and a draft-model round per k (its verify step with its k
    draft-model steps)."""
    greedy_steps = sum(r["greedy_decode_steps"] for r in runs)
    decode_ms = 1e3 * sum(r["greedy_decode_time_s"] for r in runs) / greedy_steps

    def per_step(keep) -> dict:
        out = {}
        for k in sorted({r["k"] for r in runs}):
            rows = [r for r in runs if r["k"] == k and r["verify_steps"] and keep(r["drafter"])]
            steps = sum(r["verify_steps"] for r in rows)
            if steps:
                out[str(k)] = 1e3 * sum(r["verify_time_s"] for r in rows) / steps
        return out

    return dict(
        decode_ms=decode_ms,
        verify_ms=per_step(lambda d: d not in ("prompt_lookup_gated", "draft_model")),
        draft_model_round_ms=per_step(lambda d: d == "draft_model"),
        source="host loop (SpecStats decode/verify time per step)",
    )


def derived(runs: list[dict], temperatures: list) -> dict:
    """The fields a results file derives from its runs: summary (greedy) or sampling (per temperature), step_cost."""
    greedy = temperatures == [None]
    return dict(
        summary=summarize(runs) if greedy else None,
        sampling=None
        if greedy
        else {str(t): summarize([r for r in runs if r["temperature"] == t]) for t in temperatures},
        step_cost=step_costs(runs),
    )


def restat(path: str) -> None:
    """Recompute a results file's derived fields (`derived`) from its recorded runs, in place."""
    with open(path) as f:
        result = json.load(f)
    runs = result["runs"]
    temperatures = list(dict.fromkeys(r["temperature"] for r in runs))  # in the order they ran
    result.update(derived(runs, temperatures))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"rewrote the summary and step costs of {path} from its {len(runs)} runs: {result['step_cost']}")


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON output path")
    p.add_argument("--restat", metavar="RESULTS.json", help="recompute a results file's summary and step costs, exit")
    p.add_argument("--commit", help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--checkpoint", help="jspec checkpoint dir with tokenizer.json (default: the bundled demo)")
    p.add_argument("--k", type=int, default=7, help="draft length for prompt lookup")
    p.add_argument("--mtp-k", default="2", help="draft length for MTP; a comma list runs each (e.g. 1,2,3)")
    p.add_argument("--draft-k", type=int, default=4, help="draft length for the draft model")
    p.add_argument(
        "--draft-checkpoint", help="draft model (default: the bundled demo drafter with the demo model; 'none': skip)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--on-device", choices=("auto", "yes", "no"), default="auto", help="also time generate_on_device")
    p.add_argument("--prompts", nargs="*", help="only these prompt names")
    p.add_argument("--temperatures", help="comma list: sample at these temperatures instead of greedy decoding")
    p.add_argument("--seeds", type=int, default=3, help="seeds per prompt and temperature (with --temperatures)")
    args = p.parse_args(argv)
    if args.restat:
        restat(args.restat)
        return 0
    if not args.out:
        p.error("--out is required (unless --restat)")
    temperatures = [float(t) for t in args.temperatures.split(",")] if args.temperatures else [None]

    ckpt = args.checkpoint or checkpoints.demo_dir()
    params, cfg, tok = load_demo(ckpt)
    on_device = args.on_device == "yes" or (args.on_device == "auto" and jax.default_backend() == "gpu")
    with_mtp = cfg.num_mtp_layers > 0
    draft_path = args.draft_checkpoint or (None if args.checkpoint else checkpoints.drafter_dir())
    draft_model = jspec.DraftModel.load(draft_path) if draft_path not in (None, "none") else None
    sampling = args.temperatures is not None
    mtp_ks = [int(k) for k in args.mtp_k.split(",")]
    configs = drafter_configs(args.k, mtp_ks, with_mtp, sampling, draft_model, args.draft_k)
    engines = {k: jspec.Engine(params, cfg, max_len=args.max_len, k=k) for k in {c[0] for c in configs.values()}}
    load_before = os.getloadavg()[0]
    runs = []
    for temperature in temperatures:
        for cat, prompts in CATEGORIES.items():
            for name, text in prompts.items():
                if args.prompts and name not in args.prompts:
                    continue
                ids = tok.encode(text).ids
                t0 = time.perf_counter()
                for seed in range(args.seeds) if temperature else [None]:
                    sampler = jspec.Sampler(temperature=temperature, seed=seed) if temperature else None
                    for row in run_prompt(engines, configs, ids, args.max_new_tokens, on_device, sampler):
                        runs.append(dict(category=cat, prompt=name, prompt_tokens=len(ids), temperature=temperature,
                                         seed=seed, **row))  # fmt: skip
                        print(
                            f"T={temperature} seed={seed} {cat:5s} {name:18s} {row['drafter']:20s} k={row['k']} "
                            f"identical={row['identical']} mean_accepted={row['mean_accepted']:.2f} per_pos="
                            f"{rounded(row['per_position_acceptance'])} "
                            f"tok/s={row['tokens_per_s']:.1f} (greedy {row['greedy_tokens_per_s']:.1f})",
                            flush=True,
                        )
                print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if not runs:
        raise SystemExit(f"no prompt selected by --prompts {args.prompts}")
    device = jax.devices()[0]
    result = dict(
        benchmark="demo_acceptance",
        device=str(device),
        device_kind=device.device_kind,
        platform=jax.default_backend(),
        kernel_backend=get_backend(),
        cpu_count=os.cpu_count(),
        host_load_1min=dict(start=load_before, end=os.getloadavg()[0]),
        jax_version=jax.__version__,
        commit=args.commit or git_commit(),
        checkpoint=os.path.relpath(ckpt, ROOT) if ckpt.startswith(ROOT) else ckpt,
        draft_checkpoint=None if draft_model is None else os.path.relpath(draft_path, ROOT),
        draft_model=None if draft_model is None else dict(draft_model.cfg.to_dict()),
        model=dict(cfg.to_dict()),
        max_new_tokens=args.max_new_tokens,
        max_len=args.max_len,
        all_identical=all(r["identical"] for r in runs),
        notes=NOTES,
        **derived(runs, temperatures),
        runs=runs,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    summaries = {"greedy": result["summary"]} if result["summary"] else result["sampling"]
    for label, summary in summaries.items():
        for cat, by_drafter in summary.items():
            for name, s in by_drafter.items():
                print(
                    f"{label:6s} {cat:5s} {name:20s} mean_accepted {s['mean_accepted']:.2f}  per position "
                    f"{rounded(s['per_position_acceptance'])}  speedup {s['speedup']:.2f}x  "
                    f"identical {s['identical']}"
                )
    print(f"step cost: {result['step_cost']}")
    print(f"wrote {args.out}")
    if not result["all_identical"]:
        bad = [(r["prompt"], r["drafter"]) for r in runs if not r["identical"]]
        print(f"SPECULATIVE OUTPUT DIFFERS FROM GREEDY: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
