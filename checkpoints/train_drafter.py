"""Distill the bundled drafter: a much smaller model of the demo model's tokenizer, trained to predict the demo
model's own next-token distribution (what a draft must match to be accepted).

Pipeline (one command, time-budgeted), reusing `checkpoints.train_demo`'s corpus, optimizer and training loop:
  1. the teacher: the demo checkpoint's int4 params, dequantized once to bfloat16 (the distribution jspec's int4
     engine decodes from, up to rounding);
  2. the student: a Qwen2-style model (DRAFTER_SIZES), tied embeddings, trained on the KL divergence from the
     teacher's softmax on windows of the same Python-source corpus (the true next token's cross-entropy logged);
  3. held-out: KL, cross-entropy and the teacher-forced top-1 agreement with the teacher (the chance a draft token
     at a known prefix is the teacher's greedy token); int4 linears and bfloat16 embedding and norms, stored with
     `checkpoints.save` together with metrics.json and MODEL_CARD.md.

    python -m checkpoints.train_drafter --out DIR --minutes 4 [--teacher CHECKPOINT] [--size drafter|tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import checkpoints
from checkpoints import train_demo
from jspec.config import ModelConfig, RopeConfig
from jspec.models import dense, quantize_linears
from jspec.models.layers import logits as logits_from_hidden
from pallas_kernels import Int4Weight, dequantize

DRAFTER_SIZES = {  # hidden, layers, query heads, KV heads, MLP width
    "drafter": dict(hidden_size=128, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=512),
    "tiny": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
}
MAX_BUNDLED_BYTES = 4 * 2**20  # the bundled drafter's budget (issue 34)


def drafter_config(teacher: ModelConfig, size: str = "drafter") -> ModelConfig:
    """A Qwen2-style config of the teacher's vocabulary, EOS and trained context; tied embeddings, no MTP."""
    dims = DRAFTER_SIZES[size]
    return ModelConfig(
        family="qwen2",
        vocab_size=teacher.vocab_size,
        head_dim=dims["hidden_size"] // dims["num_heads"],
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=teacher.max_position_embeddings,
        eos_token_ids=teacher.eos_token_ids,
        **dims,
    )


def dense_teacher(params, dtype=jnp.bfloat16):
    """The teacher's params with every Int4Weight dequantized to `dtype` (plain matmuls inside the training jit),
    the MTP head dropped."""
    params = {key: value for key, value in params.items() if key != "mtp"}
    is_int4 = lambda x: isinstance(x, Int4Weight)  # noqa: E731
    return jax.tree.map(lambda w: dequantize(w, dtype) if is_int4(w) else w.astype(dtype), params, is_leaf=is_int4)


def distill_losses(student_cfg: ModelConfig, teacher: dict, teacher_cfg: ModelConfig):
    """(student params, windows int32 [B, T + 2]) -> (KL(teacher || student), cross-entropy of the true next
    token), float32 means over B x T positions."""

    def losses(params, windows):
        inputs, nexts = windows[:, :-2], windows[:, 1:-1]

        def one(tokens, next_tokens):
            target = logits_from_hidden(teacher, teacher_cfg, dense.forward(teacher, teacher_cfg, tokens))
            mine = logits_from_hidden(params, student_cfg, dense.forward(params, student_cfg, tokens))
            p = jax.nn.softmax(jax.lax.stop_gradient(target), axis=-1)
            log_q = jax.nn.log_softmax(mine, axis=-1)
            kl = jnp.sum(p * (jnp.log(jnp.maximum(p, 1e-30)) - log_q), axis=-1)
            ce = -jnp.take_along_axis(log_q, next_tokens[:, None], axis=-1)[:, 0]
            return jnp.mean(kl), jnp.mean(ce)

        kl, ce = jax.vmap(one)(inputs, nexts)
        return jnp.mean(kl), jnp.mean(ce)

    return losses


def agreement(student: dict, student_cfg: ModelConfig, teacher: dict, teacher_cfg: ModelConfig, windows) -> dict:
    """Held-out KL, cross-entropy and teacher-forced top-1 agreement (student argmax == teacher argmax), float32
    compute; student params may hold Int4Weight."""
    losses = distill_losses(student_cfg, teacher, teacher_cfg)

    @jax.jit
    def measure(params, w):
        kl, ce = losses(params, w)
        top = lambda p, c, t: jnp.argmax(logits_from_hidden(p, c, dense.forward(p, c, t)), -1)  # noqa: E731
        same = jax.vmap(lambda t: top(params, student_cfg, t) == top(teacher, teacher_cfg, t))(w[:, :-2])
        return kl, ce, jnp.mean(same)

    kls, ces, tops = zip(*(map(float, measure(student, w[None])) for w in windows), strict=True)
    return dict(kl=float(np.mean(kls)), ce=float(np.mean(ces)), top1=float(np.mean(tops)), windows=len(windows))


def stored_params(params: dict) -> dict:
    """What is bundled: every linear int4 (`quantize_linears`; tied embeddings have no lm_head), every other float
    leaf bfloat16 (the drafter runs bfloat16 activations: its embedding's dtype)."""
    floats = train_demo.cast_floats(params, jnp.bfloat16)
    return quantize_linears(floats)


def model_card(m: dict) -> str:
    cfg, tr, held = m["config"], m["training"], m["heldout"]
    return "\n".join(
        [
            "# jspec demo drafter",
            "",
            "A small Qwen2-style model distilled by `python -m checkpoints.train_drafter` from the bundled demo model",
            "(`checkpoints/demo`, same tokenizer) on the KL divergence from the demo model's next-token distribution.",
            "It drafts for the demo model: `jspec generate --drafter draft-model` or",
            "`jspec.DraftModel.load(checkpoints.drafter_dir())`. Its drafts never change the output.",
            "",
            f"- family `{cfg['family']}`, hidden {cfg['hidden_size']}, {cfg['num_layers']} layers, {cfg['num_heads']}"
            f" query / {cfg['num_kv_heads']} KV heads of {cfg['head_dim']}, MLP {cfg['intermediate_size']}, vocab "
            f"{cfg['vocab_size']}, tied embeddings; {m['params'] / 1e6:.2f} M parameters "
            f"(embedding {m['embed_params'] / 1e6:.2f} M)",
            "- stored: linears int4 (symmetric, blocks of 32), embedding and norms bfloat16; "
            f"checkpoint {m['checkpoint_bytes'] / 1e6:.2f} MB",
            f"- {tr['steps']} steps of {tr['settings']['batch']} x {tr['settings']['seq_len']} tokens "
            f"({tr['tokens_trained'] / 1e6:.0f} M tokens) in {tr['train_seconds']:.0f} s on {m['device']}, "
            f"jax {m['jax_version']}",
            "",
            "| held-out (teacher: the demo model) | KL from the teacher (nats) | next-token loss | top-1 == teacher |",
            "| --- | --- | --- | --- |",
            *(
                f"| {name} | {held[name]['kl']:.3f} | {held[name]['ce']:.3f} | {held[name]['top1']:.3f} |"
                for name in ("float", "stored")
            ),
            "",
        ]
    )


def run(args) -> dict:
    log = train_demo.file_logger(args.out)
    t_start = time.perf_counter()
    teacher_dir = args.teacher or checkpoints.demo_dir()
    teacher_int4, teacher_cfg = checkpoints.load(teacher_dir)
    teacher = dense_teacher(teacher_int4)
    tok = train_demo.load_tokenizer(os.path.join(teacher_dir, "tokenizer.json"))
    roots = args.roots or train_demo.python_roots()
    corpus = train_demo.gather_corpus(
        roots, int(args.max_corpus_mb * 1e6), heldout_permille=args.heldout_permille, seed=args.seed
    )
    train_tokens = train_demo.encode_texts(tok, corpus.train)
    heldout_tokens = train_demo.encode_texts(tok, corpus.heldout)
    log(f"corpus: {train_tokens.size / 1e6:.1f} M train / {heldout_tokens.size / 1e6:.2f} M held-out tokens")

    cfg = drafter_config(teacher_cfg, args.size)
    params = train_demo.init_train_params(cfg, jax.random.PRNGKey(args.seed))
    n_params = train_demo.count_params(params)
    log(f"student: {n_params / 1e6:.2f} M params on {jax.devices()[0]}")
    s = train_demo.TrainSettings(
        batch=args.batch, seq_len=args.seq_len, peak_lr=args.lr, warmup=args.warmup, aux_weight=0.0
    )
    params, record = train_demo.train(
        params,
        distill_losses(cfg, teacher, teacher_cfg),
        s,
        train_tokens,
        args.minutes * 60,
        seed=args.seed,
        max_steps=args.max_steps,
        log_every=args.log_every,
        log=log,
        names=("kl", "ce"),
    )
    stored = stored_params(params)
    ckpt = os.path.join(args.out, "checkpoint")
    checkpoints.save(ckpt, stored, cfg)
    size = train_demo.dir_bytes(ckpt)
    log(f"saved {ckpt}: {size / 1e6:.2f} MB")
    if size > MAX_BUNDLED_BYTES and args.size == "drafter":
        raise ValueError(f"the drafter checkpoint is {size} bytes, over the {MAX_BUNDLED_BYTES}-byte budget")

    windows = train_demo.heldout_windows(heldout_tokens, s.seq_len, args.eval_windows)
    teacher32 = dense_teacher(teacher_int4, jnp.float32)
    heldout = {
        "float": agreement(params, cfg, teacher32, teacher_cfg, windows),
        "stored": agreement(stored, cfg, teacher32, teacher_cfg, windows),
    }
    log(f"held-out: {heldout}")
    metrics = dict(
        config=cfg.to_dict(),
        teacher=os.path.abspath(teacher_dir),
        params=n_params,
        embed_params=int(params["embed"].size),
        training=record,
        heldout=heldout,
        checkpoint_bytes=size,
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        total_seconds=time.perf_counter() - t_start,
    )
    train_demo.write_outputs(args.out, ckpt, metrics, model_card(metrics), log)
    return metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m checkpoints.train_drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (checkpoint/, metrics.json, train.log)")
    p.add_argument("--minutes", type=float, required=True, help="training time budget (the loop only)")
    p.add_argument("--teacher", help="the target checkpoint (default: the bundled demo model)")
    p.add_argument("--size", choices=sorted(DRAFTER_SIZES), default="drafter")
    train_demo.add_training_flags(p, max_corpus_mb=60.0, lr=3e-3, log_every=100, eval_windows=32)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if os.path.exists(os.path.join(args.out, "checkpoint")):
        sys.exit(f"{args.out}/checkpoint exists; choose a new --out")
    run(args)


if __name__ == "__main__":
    main()
