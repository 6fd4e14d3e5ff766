"""MTP drafting over part of the vocabulary (`jspec.MTPDrafter.over`): what it keeps of the acceptance, what it saves
of a draft's cost.

A draft of an MTP head is one decoder layer plus the lm_head, and at a large vocabulary the lm_head is the larger:
at the Qwen3.5 shape (hidden 4096, vocab 248320, int4) it is 572 MB (codes and scales) against about 0.1 GB for the
layer, read once per drafted token. `MTPDrafter.over(params, ids)` drafts from the ids' rows only (FR-Spec,
arXiv:2502.14856); verify still checks every draft against the whole vocabulary, so the tokens cannot change, only
the acceptance.

Two parts, each saved as it ends:
- demo (any device): the bundled demo-hybrid (trained MTP head) on benchmarks/demo_acceptance.py's edit and free
  prompts, MTP k = 1, 2, 3 over the whole vocabulary and over the N most frequent tokens of the demo's training
  corpus (its train files, counted with its tokenizer; with --rank ids the N lowest ids, as a user without a corpus
  would rank them), and with --prompt-heads over N ids led by each prompt's own tokens (the same N: the same
  executables): mean_accepted, the corpus share of those tokens, identity with greedy.
- shape (a GPU): random int4 weights at a bench shape (--shape qwen3.5), the on-device loop: greedy and MTP k over
  the whole vocabulary and over N tokens, ms per round against greedy's, identical tokens (a random head accepts
  nearly nothing: this part times the round), and the lm_head bytes a draft reads.

    python3 benchmarks/experiments/mtp_vocab.py --out /tmp/mtp_vocab_cpu.json                       # demo, CPU
    python3 benchmarks/experiments/mtp_vocab.py --parts shape --shape qwen3.5 --ks 1,3 --commit SHA --out $OUT/x.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import numpy as np  # noqa: E402
from demo_acceptance import CATEGORIES, load_demo  # noqa: E402

import checkpoints  # noqa: E402
import jspec  # noqa: E402
from checkpoints.train_demo import gather_corpus, python_roots  # noqa: E402
from jspec.drafters.mtp import prompt_first  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params, tree_nbytes  # noqa: E402
from jspec_bench.timing import device_decode_rate  # noqa: E402


def ranked_tokens(tokenizer, vocab_size: int, corpus_mb: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids by falling count, their counts) over the train files of the demo's corpus (the interpreter's
    Python sources, as checkpoints/train_demo.py gathers them), up to corpus_mb MB."""
    corpus = gather_corpus(python_roots(), int(corpus_mb * 1e6))
    counts = np.zeros(vocab_size, np.int64)
    for encoding in tokenizer.encode_batch(corpus.train):
        counts += np.bincount(np.asarray(encoding.ids, np.int64), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")
    return order, counts[order]


def head_bytes(params: dict, drafter: jspec.MTPDrafter) -> int:
    """Bytes of the lm_head a draft of `drafter` reads: the whole head's, or the copy of `MTPDrafter.over`."""
    head = params.get("lm_head", params["embed"]) if drafter.weights is None else drafter.weights["lm_head"]
    return tree_nbytes(head)


def demo_part(args, out: dict, t0: float) -> None:
    params, cfg, tok = load_demo(checkpoints.demo_hybrid_dir())
    order, counts = ranked_tokens(tok, cfg.vocab_size, args.corpus_mb)
    if args.rank == "ids":  # no corpus: the lowest ids (a BPE vocabulary's earliest merges), their corpus counts
        counts = np.bincount(order, weights=counts, minlength=cfg.vocab_size).astype(np.int64)
        order = np.arange(cfg.vocab_size)
    total = counts.sum()
    sizes = [n for n in args.sizes if n < cfg.vocab_size]
    part = out["demo"] = dict(
        vocab_size=cfg.vocab_size,
        rank=args.rank,
        corpus_tokens=int(total),
        corpus_share={str(n): float(counts[:n].sum() / total) for n in sizes},
        max_new=args.max_new,
        runs={},
    )
    drafters = {"whole": jspec.MTPDrafter(), **{str(n): jspec.MTPDrafter.over(params, order[:n]) for n in sizes}}
    part["head_bytes_per_draft"] = {head: head_bytes(params, drafter) for head, drafter in drafters.items()}
    engines = {k: jspec.Engine(params, cfg, max_len=1024, k=k) for k in args.ks}
    part["prompt_heads"] = args.prompt_heads
    pooled = collections.defaultdict(lambda: [0, 0])  # (cat, k, head) -> [accepted, verify rounds]
    for cat, prompts in CATEGORIES.items():
        for name, text in prompts.items():
            ids = tok.encode(text).ids
            if args.prompt_heads:  # per prompt, the same N (the same executables): its tokens, then the frequent
                for n in sizes:
                    drafters[f"{n}+prompt"] = jspec.MTPDrafter.over(params, prompt_first(ids, order, n))
            greedy = engines[args.ks[0]].generate(ids, args.max_new, eos_id=()).tokens
            for k, engine in engines.items():
                for head, drafter in drafters.items():
                    r = engine.generate(ids, args.max_new, eos_id=(), drafter=drafter)
                    row = dict(identical=r.tokens == greedy, mean_accepted=r.stats.mean_accepted)
                    row.update(verify_steps=r.stats.verify_steps, accepted=r.stats.accepted)
                    part["runs"][f"{cat}/{name}/k={k}/{head}"] = row
                    pooled[(cat, k, head)][0] += r.stats.accepted
                    pooled[(cat, k, head)][1] += r.stats.verify_steps
                    print(cat, name, k, head, row, flush=True)
            save_experiment(out, args.out, t0)
    part["mean_accepted"] = {f"{cat}/k={k}/{head}": a / max(v, 1) for (cat, k, head), (a, v) in pooled.items()}
    part["all_identical"] = all(r["identical"] for r in part["runs"].values())
    save_experiment(out, args.out, t0)


def shape_part(args, out: dict, t0: float) -> None:
    cfg = model_config(args.shape, quick=args.quick)
    params = random_int4_params(cfg, seed=0, lm_head_int4=True)
    n = min(args.shape_vocab, cfg.vocab_size // 2)
    part = out["shape"] = dict(
        model=args.shape,
        vocab_size=cfg.vocab_size,
        drafted_tokens=n,
        runs={},
    )
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    max_len = args.prompt_len + args.max_new + 32
    engines = {k: jspec.Engine(params, cfg, max_len=max_len, k=k) for k in args.ks}
    greedy, part["runs"]["greedy"] = device_decode_rate(engines[args.ks[0]], prompt, args.max_new, args.repeats)
    save_experiment(out, args.out, t0)
    drafters = {"whole": jspec.MTPDrafter(), str(n): jspec.MTPDrafter.over(params, np.arange(n))}
    part["head_bytes_per_draft"] = {head: head_bytes(params, drafter) for head, drafter in drafters.items()}
    for k, engine in engines.items():
        for head, drafter in drafters.items():
            tokens, r = device_decode_rate(engine, prompt, args.max_new, args.repeats, drafter=drafter)
            r["identical"] = tokens == greedy
            r["round_vs_decode"] = r["ms_per_round"] / part["runs"]["greedy"]["ms_per_round"]
            part["runs"][f"mtp k={k} {head}"] = r
            print(k, head, r, flush=True)
            save_experiment(out, args.out, t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--parts", default="demo", help="comma list of demo, shape")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--sizes", default="256,512,1024,2048,4096", help="demo: drafted-token counts")
    ap.add_argument("--corpus-mb", type=float, default=20.0)
    ap.add_argument("--prompt-heads", action="store_true", help="demo: also N ids led by each prompt's own tokens")
    ap.add_argument(
        "--rank",
        choices=("corpus", "ids"),
        default="corpus",
        help="demo: the tokens' order: by count in the demo's corpus, or by id (no corpus needed)",
    )
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--shape", default="qwen3.5")
    ap.add_argument("--shape-vocab", type=int, default=32768, help="shape: drafted tokens (the first ids)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="shape: the bench's tiny shrunk shape (CPU smoke)")
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.sizes = [int(n) for n in args.sizes.split(",")]
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    out = dict(meta=experiment_meta(args.commit, argv=sys.argv[1:]))
    if "demo" in parts:
        demo_part(args, out, t0)
    if "shape" in parts:
        shape_part(args, out, t0)


if __name__ == "__main__":
    main()
