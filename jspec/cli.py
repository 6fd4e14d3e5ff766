"""The `jspec` command line: generate, convert, inspect, bench (also `python -m jspec ...`).

A user error (a bad option, a missing or broken checkpoint, a request that does not fit) prints one line on stderr
and exits with status 2, before anything slow runs where it can be known before; `--debug` shows the traceback
instead. Exit status 1: --compare-greedy found the speculative tokens differ from those of the same run without a
drafter (greedy, or the same sampler and seed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pallas_kernels import ROW_TILE

DRAFTERS = ("none", "prompt-lookup", "mtp", "draft-model")
USER_ERRORS = (ValueError, TypeError, OSError, MemoryError, ImportError)


class CliError(Exception):
    """A user error found by the CLI itself (the message is the whole line)."""


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line ("jspec generate: --k: ...") and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(lo: int = 1, hi: int | None = None):
    """argparse type: an int in lo..hi."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def read_prompt_ids(text: str, vocab_size: int) -> list[int]:
    """--prompt-ids' token ids: integers separated by commas or white space, each in [0, vocab_size)."""
    from jspec.checks import token_ids

    words = text.replace(",", " ").split()
    bad = next((w for w in words if not w.lstrip("-").isdecimal()), None)
    if bad is not None:
        raise CliError(f"--prompt-ids: expected integers separated by commas or spaces, got {bad!r}")
    return token_ids([int(w) for w in words], "--prompt-ids", vocab_size).tolist()


def read_prompt(args) -> str:
    """The prompt's text: the positional PROMPT, --prompt or --prompt-file's contents (argparse lets one through)."""
    for text in (args.prompt_text, args.prompt):
        if text is not None:
            return text
    path = Path(args.prompt_file)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise CliError(f"--prompt-file {path}: {e.strerror or e}") from None


SAMPLING_FLAGS = ("top_k", "top_p", "min_p", "repetition_penalty")


def _sampler(args):
    """A jspec.Sampler from the sampling flags (None: --temperature 0, greedy)."""
    import jspec

    if not args.temperature:
        given = [f"--{f.replace('_', '-')}" for f in (*SAMPLING_FLAGS, "seed") if getattr(args, f) is not None]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise CliError(f"{', '.join(given)} {verb} --temperature > 0 (temperature 0 is greedy decoding)")
        return None
    values = {f: getattr(args, f) for f in SAMPLING_FLAGS if getattr(args, f) is not None}
    return jspec.Sampler(temperature=args.temperature, seed=args.seed or 0, **values)


def _draft_checkpoint(args, path: str) -> str | None:
    """The draft model's checkpoint for --drafter draft-model: --draft-checkpoint, or the bundled demo drafter for
    the demo model."""
    from jspec.model import checkpoints_package, resolve_checkpoint

    if args.drafter != "draft-model":
        if args.draft_checkpoint:
            raise CliError("--draft-checkpoint is the draft model of --drafter draft-model")
        return None
    if args.draft_checkpoint:
        return args.draft_checkpoint
    if path != resolve_checkpoint(None):
        raise CliError("--drafter draft-model needs --draft-checkpoint (a bundled drafter exists for the demo model)")
    return checkpoints_package().drafter_dir()


def _drafter(args, draft_path: str | None, model, prompt: list[int]):
    import numpy as np

    import jspec
    from jspec.drafters.mtp import prompt_first

    if args.drafter == "draft-model":
        return jspec.DraftModel.load(draft_path)
    if args.mtp_vocab:  # the prompt's tokens, then the lowest ids: a BPE vocabulary's earliest merges
        ids = prompt_first(prompt, np.arange(model.cfg.vocab_size), args.mtp_vocab)
        return jspec.MTPDrafter.over(model.params, ids)
    return {"none": None, "prompt-lookup": jspec.PromptLookup(), "mtp": jspec.MTPDrafter()}[args.drafter]


def _plan(args, path: str):
    """Everything about a generate request that can be known before the weights load: (cfg, tokenizer or None,
    prompt ids, the prompt as shown, max_len). Raises for a request that cannot run."""
    from jspec.memory import check_fits, tree_bytes
    from jspec.model import checkpoint_config, read_tokenizer
    from jspec.state import init_state

    cfg = checkpoint_config(path)
    if args.drafter == "mtp" and not cfg.num_mtp_layers:
        raise CliError(f"--drafter mtp needs a checkpoint with an MTP head; {path} has none")
    if args.mtp_vocab and args.drafter != "mtp":
        raise CliError("--mtp-vocab is the token count of --drafter mtp's drafts")
    if args.mtp_vocab and args.mtp_vocab >= cfg.vocab_size:
        raise CliError(
            f"--mtp-vocab {args.mtp_vocab} is not below the vocabulary's {cfg.vocab_size} tokens (leave it out to "
            "draft from all of them)"
        )
    file = Path(path) / "tokenizer.json"
    tokenizer = read_tokenizer(file) if file.exists() else None
    if args.prompt_ids is not None:  # shown as its text where the checkpoint has a tokenizer, else as the ids
        prompt = read_prompt_ids(args.prompt_ids, cfg.vocab_size)
        shown = tokenizer.decode(prompt) if tokenizer is not None else " ".join(map(str, prompt)) + " ->"
    elif tokenizer is None:
        raise CliError(f"no tokenizer.json in {path} to turn text into tokens: give the prompt as --prompt-ids")
    else:
        shown = read_prompt(args)
        prompt = tokenizer.encode(shown).ids
        if not prompt:
            raise CliError("the prompt encodes to zero tokens")
    max_len = args.max_len or len(prompt) + args.max_new_tokens
    if len(prompt) + args.max_new_tokens > max_len:
        raise CliError(
            f"prompt of {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} = "
            f"{len(prompt) + args.max_new_tokens} exceeds --max-len {max_len}"
        )
    import jax

    dtype = args.dtype or "float32"  # the cache in float32 is the larger of the two: a bound for either
    state = jax.eval_shape(lambda: init_state(cfg, max_len, dtype))
    check_fits({"KV cache and token history": tree_bytes(state)}, f"--max-len {max_len}", "lower --max-new-tokens")
    return cfg, tokenizer, prompt, shown, max_len


def use_compile_cache(where: str | None) -> str | None:
    """Turn on jax's persistent compilation cache in `where` (None: $JSPEC_COMPILE_CACHE, else the directory jax was
    given, if any; "off": none) -> the directory used. A run then loads the executables an earlier run with the same
    jax, device, model shapes and settings compiled instead of compiling them again (an engine of the demo-hybrid
    compiles for ~40 s on the H200). A cached executable is the compiled program itself: the tokens are the same.
    Not on by default: loading the Mosaic GPU kernels' executables from the cache is not yet checked on a GPU."""
    import jax

    path = where or os.environ.get("JSPEC_COMPILE_CACHE")
    if path is None:
        return jax.config.jax_compilation_cache_dir
    if path == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # what compiles slower than it loads
    return path


def cmd_generate(args) -> int:
    import jspec
    from jspec.model import checkpoint_kind, resolve_checkpoint

    cache = use_compile_cache(args.compile_cache)
    path = resolve_checkpoint(args.checkpoint)
    hf = checkpoint_kind(path) == "hf"
    if not hf and (args.quantize or args.dtype):
        raise CliError("--dtype and --quantize apply to HuggingFace checkpoints; this one is already converted")
    sampler = _sampler(args)
    draft_path = _draft_checkpoint(args, path)
    _, tokenizer, prompt, text, max_len = _plan(args, path)
    model = jspec.load(path, dtype=args.dtype, quantize=args.quantize) if hf else jspec.load(path)
    engine = model.engine(max_len, args.k)
    if len(prompt) > 4 * engine.prefill_chunk and not args.json:
        print(f"prefilling {len(prompt)} prompt tokens...", file=sys.stderr, flush=True)
    gated = args.drafter == "prompt-lookup" if args.gate is None else args.gate  # default: prompt lookup only
    run = dict(
        max_new_tokens=args.max_new_tokens,
        gate=jspec.HitDensityGate() if gated else None,
        eos_id=() if args.ignore_eos else model.eos_ids,
        on_device=args.on_device,
        sampler=sampler,
    )
    drafter = _drafter(args, draft_path, model, prompt)
    engine.settings(drafter=drafter, gate=run["gate"], sampler=sampler)  # a draft model's vocabulary, before output
    out = {
        "checkpoint": path,
        "prompt_tokens": len(prompt),
        "drafter": args.drafter,
        "mtp_vocab": args.mtp_vocab,
        "k": args.k,
        "compile_cache": cache,
    }
    if draft_path:
        out["draft_checkpoint"] = draft_path
    if args.compare_greedy:  # time warmed runs: compile and run each once first
        t0 = time.perf_counter()
        engine.generate(prompt, drafter=drafter, **run)
        engine.generate(prompt, **dict(run, gate=None))
        out["warmup_s_with_compile"] = time.perf_counter() - t0
    streaming = not args.json and not args.on_device
    if streaming:
        print(text, end="", flush=True)
    t0 = time.perf_counter()
    pieces = model.stream(prompt, drafter=drafter, k=args.k, max_len=max_len, **run)
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            result = done.value
            break
        if streaming:
            print(piece, end="", flush=True)
    first_call_s = time.perf_counter() - t0
    out.update(text=result.text, tokens=result.tokens, stats=result.stats.to_dict())
    if not args.compare_greedy:
        out["first_call_s_with_compile"] = first_call_s
    else:
        greedy = engine.generate(prompt, **dict(run, gate=None))
        out["greedy_identical"] = greedy.tokens == result.tokens
        out["greedy_stats"] = greedy.stats.to_dict()
        out["speedup_vs_greedy"] = result.stats.tokens_per_s / max(greedy.stats.tokens_per_s, 1e-9)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if out.get("greedy_identical", True) else 1
    if not streaming:
        print(text + result.text, end="")
    if tokenizer is None:  # no text to show: the new tokens' ids
        print(" " + " ".join(map(str, result.tokens)), end="")
    print("\n" + "-" * 72)
    timing = (
        f"warm-up (compile + one run of each) {out['warmup_s_with_compile']:.2f} s"
        if args.compare_greedy
        else f"compile (or load) + first run {first_call_s:.2f} s"
    )
    over = f" over {args.mtp_vocab} tokens" if args.mtp_vocab else ""
    print(f"{path}  drafter={args.drafter}{over} k={args.k}  {timing}")
    print(result.stats.summary())
    if args.compare_greedy:
        same = "yes" if out["greedy_identical"] else "NO"
        print(
            f"identical to {'plain sampling' if run['sampler'] else 'greedy'}: {same}   without the drafter "
            f"{out['greedy_stats']['tokens_per_s']:.1f} tok/s, "
            f"speedup {out['speedup_vs_greedy']:.2f}x (warmed runs)"
        )
    return 0 if out.get("greedy_identical", True) else 1


def cmd_convert(args) -> int:
    import jspec
    from jspec.model import checkpoint_kind

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CliError(f"{out} exists and is not an empty directory; convert writes a new one")
    if checkpoint_kind(args.hf_dir) != "hf":
        raise CliError(f"{args.hf_dir} is already a jspec checkpoint (jspec.json inside): nothing to convert")
    params, cfg = jspec.load_hf(args.hf_dir, dtype=args.dtype, quantize=args.quantize)
    jspec.save(out, params, cfg)
    tokenizer = Path(args.hf_dir) / "tokenizer.json"
    if tokenizer.exists():
        (out / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    print(f"converted {args.hf_dir} -> {out} ({cfg.family}, {args.dtype}, quantize={args.quantize})")
    return 0


def cmd_inspect(args) -> int:
    import jax

    import jspec
    from jspec.model import checkpoint_kind, resolve_checkpoint
    from pallas_kernels import Int4Weight

    if args.path is not None and args.checkpoint is not None and args.path != args.checkpoint:
        raise CliError(f"two checkpoints given: {args.path!r} and --checkpoint {args.checkpoint!r}")
    path = resolve_checkpoint(args.path or args.checkpoint)
    model = jspec.load(path)
    leaves = jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, Int4Weight))
    n_int4 = sum(int(w.shape[0]) * int(w.shape[1]) for w in leaves if isinstance(w, Int4Weight))
    n_dense = sum(int(x.size) for x in leaves if not isinstance(x, Int4Weight))
    info = {
        "checkpoint": path,
        "format": _checkpoint_format(path, checkpoint_kind(path)),
        "config": model.cfg.to_dict(),
        "int4_params": n_int4,
        "dense_params": n_dense,
        "bytes": int(sum(w.nbytes for w in leaves)),
    }
    print(json.dumps(info, indent=2))
    return 0


def _checkpoint_format(path: str, kind: str) -> str:
    """What inspect says of a checkpoint it has loaded: its format and what the load checked."""
    if kind == "hf":
        return "HuggingFace safetensors: no checksums (floating-point tensors checked finite)"
    version = json.loads((Path(path) / "jspec.json").read_text())["version"]
    checked = "every array matched its CRC-32" if version >= 2 else "no checksums (saved before v2): not checked"
    return f"jspec-params v{version}: {checked}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jspec", description="byte-exact speculative decoding of int4 LLMs")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="generate text (default: the bundled demo model)")
    g.add_argument(
        "--checkpoint",
        "--model",
        dest="checkpoint",
        help="jspec checkpoint or HuggingFace dir, or a bundled model: 'demo' (the default) or 'demo-hybrid'",
    )
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument(
        "prompt_text", nargs="?", metavar="PROMPT", help="the prompt (or --prompt, --prompt-file, --prompt-ids)"
    )
    text.add_argument("--prompt", help="the prompt, also where it starts with '-'")
    text.add_argument("--prompt-file")
    text.add_argument(
        "--prompt-ids",
        metavar="IDS",
        help="the prompt as token ids, separated by commas or spaces (for a checkpoint without tokenizer.json; the "
        "new tokens print as ids then)",
    )
    g.add_argument("--drafter", choices=DRAFTERS, default="prompt-lookup")
    g.add_argument(
        "--draft-checkpoint", help="the draft model of --drafter draft-model (default: the demo model's bundled one)"
    )
    g.add_argument(
        "--mtp-vocab",
        type=positive(),
        metavar="N",
        help="--drafter mtp drafts from N tokens only: the prompt's, then the lowest ids (a BPE vocabulary's "
        "earliest merges); a draft reads N rows of the lm_head, not all; verify checks the whole vocabulary, so the "
        "tokens do not change",
    )
    g.add_argument("--k", type=positive(1, ROW_TILE - 1), default=4, help=f"draft tokens per verify step "
                   f"(1..{ROW_TILE - 1})")  # fmt: skip
    g.add_argument("--max-new-tokens", type=positive(), default=128)
    g.add_argument("--max-len", type=positive(2), help="cache length (default: prompt + max-new-tokens)")
    g.add_argument(
        "--gate",
        action=argparse.BooleanOptionalAction,
        help="hit-density gate (default: on for prompt-lookup, whose drafts cost nothing; off for the drafters that "
        "run a model, which would pay for drafts the gate does not verify)",
    )
    g.add_argument("--on-device", action="store_true", help="run the whole loop on device")
    g.add_argument(
        "--compare-greedy",
        action="store_true",
        help="also run without the drafter (greedy, or the same sampler and seed); report identity and speedup",
    )
    s = g.add_argument_group("sampling (default: greedy)")
    s.add_argument("--temperature", type=float, default=0.0, help="> 0: sample (same seed, same tokens)")
    s.add_argument("--top-k", type=int)
    s.add_argument("--top-p", type=float)
    s.add_argument("--min-p", type=float)
    s.add_argument("--repetition-penalty", type=float)
    s.add_argument("--seed", type=int, help="the sampling noise's seed (default 0)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="for HuggingFace checkpoints")
    g.add_argument("--quantize", choices=["int4"], help="quantize a HuggingFace checkpoint on load")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled executables in DIR for later runs to load (default: $JSPEC_COMPILE_CACHE if set; "
        "'off': none)",
    )
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="HuggingFace safetensors dir -> jspec (orbax) checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    c.add_argument("--quantize", choices=["int4"])
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print a checkpoint's config and sizes")
    what = "checkpoint dir, or 'demo' (the default) or 'demo-hybrid'"
    i.add_argument("path", nargs="?", metavar="CHECKPOINT", help=what)
    i.add_argument("--checkpoint", "--model", dest="checkpoint", help=f"{what} (the same as CHECKPOINT)")
    i.set_defaults(func=cmd_inspect)

    # Listed for --help only: `main` hands `jspec bench ...` to jspec_bench.main verbatim.
    sub.add_parser("bench", help="step costs and speedups (see `jspec bench --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if argv[:1] == ["bench"]:  # argparse's REMAINDER does not take options: hand them to the bench verbatim
        import jspec_bench

        return jspec_bench.main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error, printed already (2)
        return e.code
    try:
        return args.func(args)
    except (CliError, *USER_ERRORS) as e:
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"jspec {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
