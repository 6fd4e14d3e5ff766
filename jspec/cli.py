"""The `jspec` command line: generate, convert, inspect, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _default_checkpoint() -> str:
    import checkpoints

    return str(checkpoints.demo_dir())


def load_model(path: str, dtype: str | None = None, quantize: str | None = None):
    """(params, cfg) from a jspec (orbax) checkpoint dir or a HuggingFace safetensors dir."""
    import checkpoints

    p = Path(path)
    if not p.is_dir():
        raise SystemExit(f"jspec: checkpoint directory {path!r} does not exist")
    if (p / "config.json").exists() and any(p.glob("*.safetensors")):
        return checkpoints.load_hf(p, dtype=dtype or "bfloat16", quantize=quantize)
    if quantize:
        raise SystemExit("jspec: --quantize applies to HuggingFace checkpoints; this one is already converted")
    return checkpoints.load(p)


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.exists():
        raise SystemExit(f"jspec: no tokenizer.json in {path!r} (needed to turn text into tokens)")
    return Tokenizer.from_file(str(file))


def _eos_ids(cfg, tokenizer) -> tuple[int, ...]:
    if cfg.eos_token_ids:
        return tuple(cfg.eos_token_ids)
    for name in ("<|endoftext|>", "</s>", "<eos>"):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return (token,)
    return ()


def _drafter(name: str, k: int):
    import jspec

    if name == "none":
        return None
    if name == "prompt-lookup":
        return jspec.PromptLookup()
    if name == "mtp":
        return jspec.MTPDrafter()
    raise SystemExit(f"jspec: unknown drafter {name!r}")


def cmd_generate(args) -> int:
    import jspec

    path = args.checkpoint or _default_checkpoint()
    if args.prompt is None and args.prompt_file is None:
        raise SystemExit("jspec generate: give --prompt TEXT or --prompt-file FILE")
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    params, cfg = load_model(path, args.dtype, args.quantize)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(text).ids
    if not prompt:
        raise SystemExit("jspec generate: the prompt encodes to zero tokens")
    if args.drafter == "mtp" and not cfg.num_mtp_layers:
        raise SystemExit(f"jspec generate: --drafter mtp needs a checkpoint with an MTP head; {path} has none")
    max_len = args.max_len or len(prompt) + args.max_new_tokens
    engine = jspec.Engine(params, cfg, max_len=max_len, k=args.k)
    gate = jspec.HitDensityGate() if args.gate else None
    eos = None if args.ignore_eos else _eos_ids(cfg, tokenizer)
    run = dict(max_new_tokens=args.max_new_tokens, eos_id=eos or None, on_device=args.on_device)
    progress = not args.json and not args.on_device and args.max_new_tokens >= 64
    t0 = time.perf_counter()
    result = engine.generate(prompt, drafter=_drafter(args.drafter, args.k), gate=gate, progress=progress, **run)
    first_call_s = time.perf_counter() - t0
    out = {
        "checkpoint": path,
        "prompt_tokens": len(prompt),
        "text": tokenizer.decode(result.tokens),
        "tokens": result.tokens,
        "drafter": args.drafter,
        "k": args.k,
        "stats": result.stats.to_dict(),
        "first_call_s_with_compile": first_call_s,
    }
    if args.compare_greedy:
        greedy = engine.generate(prompt, progress=progress, **run)
        out["greedy_identical"] = greedy.tokens == result.tokens
        out["greedy_stats"] = greedy.stats.to_dict()
        out["speedup_vs_greedy"] = result.stats.tokens_per_s / max(greedy.stats.tokens_per_s, 1e-9)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(text + out["text"])
        print("-" * 72)
        print(f"{path}  drafter={args.drafter} k={args.k}  compile+first run {first_call_s:.2f} s")
        print(result.stats.summary())
        if args.compare_greedy:
            same = "yes" if out["greedy_identical"] else "NO"
            print(
                f"identical to greedy: {same}   greedy {out['greedy_stats']['tokens_per_s']:.1f} tok/s, "
                f"speedup {out['speedup_vs_greedy']:.2f}x"
            )
    return 0 if out.get("greedy_identical", True) else 1


def cmd_convert(args) -> int:
    import checkpoints

    params, cfg = checkpoints.load_hf(args.hf_dir, dtype=args.dtype, quantize=args.quantize)
    checkpoints.save(args.out_dir, params, cfg)
    tokenizer = Path(args.hf_dir) / "tokenizer.json"
    if tokenizer.exists():
        Path(args.out_dir, "tokenizer.json").write_bytes(tokenizer.read_bytes())
    print(f"converted {args.hf_dir} -> {args.out_dir} ({cfg.family}, {args.dtype}, quantize={args.quantize})")
    return 0


def cmd_inspect(args) -> int:
    import jax

    from pallas_kernels import Int4Weight

    path = args.checkpoint or _default_checkpoint()
    params, cfg = load_model(path)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Weight))
    n_int4 = sum(int(w.shape[0]) * int(w.shape[1]) for w in leaves if isinstance(w, Int4Weight))
    n_dense = sum(int(x.size) for x in leaves if not isinstance(x, Int4Weight))
    info = {"checkpoint": path, "config": cfg.to_dict(), "int4_params": n_int4, "dense_params": n_dense}
    info["bytes"] = int(sum(w.nbytes for w in leaves))
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description="byte-exact speculative decoding of int4 LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (default: the bundled demo model)")
    g.add_argument("--checkpoint", help="jspec checkpoint or HuggingFace dir (default: bundled demo model)")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--drafter", choices=["none", "prompt-lookup", "mtp"], default="prompt-lookup")
    g.add_argument("--k", type=int, default=4, help="draft tokens per verify step (1..15)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, help="cache length (default: prompt + max-new-tokens)")
    g.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True, help="hit-density gate")
    g.add_argument("--on-device", action="store_true", help="run the whole loop on device")
    g.add_argument("--compare-greedy", action="store_true", help="also run plain greedy; report identity, speedup")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="for HuggingFace checkpoints")
    g.add_argument("--quantize", choices=["int4"], help="quantize a HuggingFace checkpoint on load")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="HuggingFace safetensors dir -> jspec (orbax) checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    c.add_argument("--quantize", choices=["int4"])
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print a checkpoint's config and sizes")
    i.add_argument("--checkpoint")
    i.set_defaults(func=cmd_inspect)

    # Listed for --help only: `main` hands `jspec bench ...` to jspec.bench.main verbatim.
    sub.add_parser("bench", help="step costs and speedups (see `jspec bench --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if argv[:1] == ["bench"]:  # argparse's REMAINDER does not take options: hand them to the bench verbatim
        from jspec import bench

        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
