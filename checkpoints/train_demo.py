"""Train the bundled demo model: a small Qwen2-style code model with one DeepSeek-V3-style MTP layer (or, with
`--family qwen3_5`, a Qwen3.5-style hybrid: Gated DeltaNet 3 : 1 gated attention, one Qwen3-Next-layout MTP layer).

Pipeline (one command, time-budgeted):
  1. corpus: the Python source files of the running interpreter (its standard library and installed packages),
     de-duplicated, split into train / held-out by a hash of each file's content;
  2. a byte-level BPE tokenizer trained with HuggingFace `tokenizers` (or an existing tokenizer.json);
  3. training of jspec's params layout, with the family's own forward (`jspec.models.dense.forward` or
     `jspec.models.hybrid.forward`, whose Gated DeltaNet runs the chunked form) and the MTP loss of
     `jspec.models.mtp.mtp_forward`, so the trained params are exactly what jspec runs: optax AdamW, linear warmup
     then cosine decay, bfloat16 compute on float32 master weights, `--minutes` of training;
  4. held-out loss and greedy samples (float32 and int4), int4 quantization of every linear
     (`pallas_kernels.quantize`) and its agreement with the float model, `checkpoints.save` of the int4 params
     together with tokenizer.json, metrics.json and MODEL_CARD.md.

    python -m checkpoints.train_demo --out DIR --minutes 4 [--tokenizer tokenizer.json] [--size demo|tiny|hybrid]
        [--family qwen2|qwen3_5] [--float-dtype float32|bfloat16]

The bundled models: `--size demo` (checkpoints/demo) and `--size hybrid --family qwen3_5 --float-dtype bfloat16
--tokenizer checkpoints/demo/tokenizer.json` (checkpoints/demo_hybrid, the same tokenizer).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import site
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np

import checkpoints
from jspec.config import ModelConfig, RopeConfig
from jspec.model import read_tokenizer
from jspec.models import family_module, quantize_linears
from jspec.models.layers import logits as logits_from_hidden
from jspec.models.mtp import init_mtp_params, mtp_forward
from jspec.stats import common_prefix

EOS = "<|endoftext|>"
# Model sizes: hidden, layers, query heads, KV heads, MLP width; a hybrid's Gated DeltaNet (key, value) heads of
# head_dim, by default (KV heads, query heads).
SIZES = {
    "demo": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    # the bundled hybrid (--family qwen3_5 --float-dtype bfloat16): 19.6 M parameters with its MTP layer, 15.6 MB
    # stored; Gated DeltaNet 4 key / 8 value heads (Qwen3.5's 1 : 2), so the in_proj's N (q k v z, then 8 b and 8 a
    # columns) is a multiple of 16, as the Triton row-tile kernels need
    "hybrid": dict(
        hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, intermediate_size=640, linear_heads=(4, 8)
    ),
}
RESIDUAL_OUTPUTS = ("o", "down", "out")  # projections writing into the residual stream (init scaled by depth)
FAMILIES = ("qwen2", "qwen3_5")
STYLES = {"qwen2": "Qwen2-style", "qwen3_5": "Qwen3.5-style hybrid (Gated DeltaNet and gated attention)"}
KEPT_INIT = ("A_log", "dt_bias", "conv")  # Gated DeltaNet parameters kept as the family's init_params draws them
# Seconds --total-minutes keeps for what follows the training loop (quantization, saving, evaluation, samples) on the
# H200: the dense demo's took ~75 s; the hybrid's evaluation took 36 s and its samples, two engines compiling for
# ~40 s each, had not finished 64 s later (benchmarks/results/demo_hybrid_train_h200.log).
POST_TRAINING_RESERVE_S = {"qwen2": 75, "qwen3_5": 180}
# Prompts end mid-line: the tokenizer merges a newline with the next line's indentation ("\n        " is one
# token), so a prompt ending in "\n" is a split the model rarely saw (it tends to answer with end-of-text).
SAMPLE_PROMPTS = (
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    'def read_json(path):\n    """Read a JSON file and return its content."""',
    "for i in range(",
)


# ------------------------------------------------------------------------------------------------------- corpus
@dataclasses.dataclass
class Corpus:
    train: list[str]
    heldout: list[str]
    roots: list[str]
    files_seen: int
    train_bytes: int
    heldout_bytes: int


def python_roots() -> list[str]:
    """The standard library and site-packages directories of the running interpreter (no directory twice)."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    roots: list[str] = []
    for path in candidates:
        path = os.path.realpath(path)
        if os.path.isdir(path) and path not in roots:
            roots.append(path)
    return roots


def list_python_files(roots: list[str], max_file_bytes: int) -> list[str]:
    """Every *.py file under the roots (sorted, realpath, each once), 100 bytes to max_file_bytes in size."""
    found = set()
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.realpath(os.path.join(dirpath, name))
                    try:
                        size = os.path.getsize(path)
                    except OSError:
                        continue
                    if 100 <= size <= max_file_bytes:
                        found.add(path)
    return sorted(found)


def looks_like_source(text: str) -> bool:
    """Reject generated data files: very long lines or a high mean line length."""
    lines = text.splitlines() or [""]
    return max(map(len, lines)) <= 1000 and len(text) / len(lines) <= 100


def gather_corpus(
    roots: list[str], max_bytes: int, *, max_file_bytes: int = 200_000, heldout_permille: int = 10, seed: int = 0
) -> Corpus:
    """Read Python files in a seeded random order until max_bytes; de-duplicate by content; held-out files are
    those whose content hash falls in the first heldout_permille of 1000 buckets."""
    files = list_python_files(roots, max_file_bytes)
    if not files:
        raise FileNotFoundError(f"no Python files under {roots}")
    random.Random(seed).shuffle(files)
    seen, train, heldout = set(), [], []
    total = 0
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest in seen or not looks_like_source(text):
            continue
        seen.add(digest)
        (heldout if int(digest[:8], 16) % 1000 < heldout_permille else train).append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not train or not heldout:
        raise ValueError(f"corpus too small: {len(train)} train / {len(heldout)} held-out files under {roots}")
    return Corpus(train, heldout, roots, len(files), sum(map(len, train)), sum(map(len, heldout)))


# ---------------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenization, no prefix space) with EOS as token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str):
    tok = read_tokenizer(path)
    if tok.token_to_id(EOS) is None:
        raise ValueError(f"{path}: tokenizer has no {EOS!r} token")
    return tok


def encode_texts(tok, texts: list[str]) -> np.ndarray:
    """One uint16 token stream: each text's tokens followed by EOS."""
    if tok.get_vocab_size() > 2**16:
        raise ValueError(f"vocab {tok.get_vocab_size()} does not fit uint16")
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.uint16))
        parts.append(np.asarray([eos], np.uint16))
    return np.concatenate(parts)


# -------------------------------------------------------------------------------------------------------- model
def demo_config(
    vocab_size: int, size: str = "demo", seq_len: int = 512, eos_id: int = 0, family: str = "qwen2"
) -> ModelConfig:
    """qwen2: Qwen2-style config (qkv bias, untied lm_head, GQA) with one DeepSeek-layout MTP layer. qwen3_5: a
    Qwen3.5-style hybrid of the same widths (every 4th layer gated attention, the last one at least; the others
    Gated DeltaNet with the attention's KV heads as key heads and its query heads as value heads, of head_dim),
    partial rotary 0.25, one Qwen3-Next-layout MTP layer."""
    dims = dict(SIZES[size])
    key_heads, value_heads = dims.pop("linear_heads", (dims["num_kv_heads"], dims["num_heads"]))
    head_dim = dims["hidden_size"] // dims["num_heads"]
    common = dict(
        vocab_size=vocab_size,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=seq_len,
        eos_token_ids=(eos_id,),
        num_mtp_layers=1,
        **dims,
    )
    if family == "qwen2":
        return ModelConfig(
            family="qwen2", rope=RopeConfig(theta=10000.0), attention_bias=True, mtp_layout="deepseek", **common
        )
    if family != "qwen3_5":
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    n = dims["num_layers"]
    full = {i for i in range(n) if (i + 1) % 4 == 0} | {n - 1}
    return ModelConfig(
        family="qwen3_5",
        rope=RopeConfig(theta=10000.0, partial_rotary_factor=0.25),
        layer_types=tuple("full_attention" if i in full else "linear_attention" for i in range(n)),
        attn_output_gate=True,
        norm_plus_one=True,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        mtp_layout="qwen3_next",
        **common,
    )


def init_train_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """float32 params in jspec's layout (the family's init_params, + init_mtp_params when cfg has MTP layers),
    re-initialised for training: norms the identity (1, or 0 where the family's norms scale by 1 + w; Gated
    DeltaNet's gated norm 1), biases 0, matrices N(0, 0.02^2), residual output projections N(0, (0.02 / sqrt(2 L))^2),
    Gated DeltaNet's decay, step bias and conv (`KEPT_INIT`) as the family draws them."""
    k_main, k_mtp, k_init = jax.random.split(key, 3)
    params = family_module(cfg).init_params(cfg, k_main)
    if cfg.num_mtp_layers:
        params["mtp"] = init_mtp_params(cfg, k_mtp, num_layers=cfg.num_mtp_layers)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(k_init, len(leaves))
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_layers)

    def init(path, leaf, k):
        name = path[-1].key
        if name in KEPT_INIT:
            return leaf.astype(jnp.float32)
        if name.endswith("norm"):
            identity = 0.0 if cfg.norm_plus_one and name != "gdn_norm" else 1.0
            return jnp.full(leaf.shape, identity, jnp.float32)
        if name.endswith("bias"):
            return jnp.zeros(leaf.shape, jnp.float32)
        std = 0.02 * (depth_scale if name in RESIDUAL_OUTPUTS else 1.0)
        return std * jax.random.normal(k, leaf.shape, jnp.float32)

    return jax.tree_util.tree_unflatten(treedef, [init(p, x, k) for (p, x), k in zip(leaves, keys, strict=True)])


def stored_params(params: dict, float_dtype: str) -> dict:
    """What is saved: every linear int4 (`quantize_linears`, from the float32 weights), every other float leaf
    (embedding, norms, biases, Gated DeltaNet's decay, step bias and conv) in float_dtype. A bfloat16 embedding
    makes the model run bfloat16 activations (the embedding's dtype)."""
    int4 = quantize_linears(params)
    return int4 if float_dtype == "float32" else cast_floats(int4, jnp.dtype(float_dtype))


def count_params(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def cast_floats(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def _xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of float32 logits [..., V] against int targets [...]."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def model_losses(params: dict, cfg: ModelConfig, windows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """windows int32 [B, T + 2] -> (next-token loss, MTP loss), each a float32 mean over B x T.

    Row t: the main model reads tokens 0..t and predicts token t + 1; the MTP layer takes the main model's
    final-normed hidden at t and the token at t + 1 and predicts token t + 2.
    """
    inputs, nexts, after = windows[:, :-2], windows[:, 1:-1], windows[:, 2:]

    def one(tokens, next_tokens):
        hidden = family_module(cfg).forward(params, cfg, tokens)
        return logits_from_hidden(params, cfg, hidden), mtp_forward(params, cfg, hidden, next_tokens)

    main_logits, mtp_logits = jax.vmap(one)(inputs, nexts)
    return _xent(main_logits, nexts), _xent(mtp_logits, after)


# ----------------------------------------------------------------------------------------------------- training
@dataclasses.dataclass(frozen=True)
class TrainSettings:
    batch: int = 64
    seq_len: int = 512
    peak_lr: float = 2e-3
    final_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    aux_weight: float = 0.3  # weight of the second loss (the demo model's MTP loss)
    clip: float = 1.0
    compute_dtype: str = "bfloat16"


def learning_rate(step, total, s: TrainSettings):
    """Linear warmup over s.warmup steps, then cosine from peak_lr down to final_lr_frac * peak_lr at `total`."""
    step = jnp.asarray(step, jnp.float32)
    warm = s.peak_lr * (step + 1) / s.warmup
    frac = jnp.clip((step - s.warmup) / jnp.maximum(total - s.warmup, 1), 0.0, 1.0)
    floor = s.final_lr_frac * s.peak_lr
    cosine = floor + (s.peak_lr - floor) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return jnp.where(step < s.warmup, warm, cosine)


def make_optimizer(s: TrainSettings):
    """AdamW without its own learning rate (the step scales the update by `learning_rate`); decay on matrices."""
    import optax

    return optax.chain(
        optax.clip_by_global_norm(s.clip),
        optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
        optax.add_decayed_weights(s.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
    )


def sample_windows(tokens: jax.Array, key: jax.Array, batch: int, length: int) -> jax.Array:
    """batch random windows int32 [batch, length] of the device token stream (uint16 [N])."""
    starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - length)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(tokens, (s,), (length,)))(starts).astype(jnp.int32)


def make_train_step(losses, s: TrainSettings, tx):
    """losses(params in the compute dtype, windows int32 [B, T + 2]) -> (main, aux) float32 [], minimized as
    main + s.aux_weight * aux -> step(params, opt_state, tokens, key, step, total) -> (params, opt_state, main, aux,
    lr)."""
    import optax

    compute = jnp.dtype(s.compute_dtype)

    def loss_fn(params, windows):
        main, aux = losses(cast_floats(params, compute), windows)
        return main + s.aux_weight * aux, (main, aux)

    def step_fn(params, opt_state, tokens, key, step, total):
        windows = sample_windows(tokens, key, s.batch, s.seq_len + 2)
        grads, (main, aux) = jax.grad(loss_fn, has_aux=True)(params, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        lr = learning_rate(step, total, s)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        return params, opt_state, main, aux, lr

    return step_fn


def heldout_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Consecutive non-overlapping windows int32 [n, seq_len + 2] from the held-out stream."""
    n = min(max_windows, (tokens.size - 2) // seq_len)
    if n < 1:
        raise ValueError(f"held-out stream of {tokens.size} tokens is shorter than one window of {seq_len + 2}")
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 2] for i in range(n)]).astype(np.int32)


def evaluate(params: dict, cfg: ModelConfig, windows: np.ndarray, batch: int) -> dict:
    """Held-out next-token and MTP loss, computed in the params' own activation dtype (their embedding's; params
    may hold Int4Weight)."""
    fn = jax.jit(lambda p, w: model_losses(p, cfg, w))
    main, mtp = [], []
    for i in range(0, len(windows) - batch + 1, batch):
        m, t = fn(params, windows[i : i + batch])
        main.append(float(m))
        mtp.append(float(t))
    return dict(loss=float(np.mean(main)), mtp_loss=float(np.mean(mtp)), windows=len(main) * batch)


def top1_agreement(params_a: dict, params_b: dict, cfg: ModelConfig, windows: np.ndarray) -> float:
    """Fraction of positions whose argmax next token agrees between two param sets (teacher-forced)."""

    @jax.jit
    def argmax_tokens(params, tokens):
        hidden = jax.vmap(lambda t: family_module(cfg).forward(params, cfg, t))(tokens)
        return jnp.argmax(jax.vmap(lambda h: logits_from_hidden(params, cfg, h))(hidden), axis=-1)

    same = total = 0
    for w in windows:
        a = argmax_tokens(params_a, w[None, :-2])
        b = argmax_tokens(params_b, w[None, :-2])
        same += int(jnp.sum(a == b))
        total += a.size
    return same / total


def greedy_samples(params: dict, cfg: ModelConfig, tok, prompts, max_new: int) -> list[dict]:
    """Greedy continuations by jspec's Engine (what `jspec generate` runs)."""
    from jspec import Engine

    engine = Engine(params, cfg, max_len=max(len(tok.encode(p).ids) for p in prompts) + max_new + 1)
    out = []
    for prompt in prompts:
        ids = tok.encode(prompt).ids
        result = engine.generate(ids, max_new, eos_id=list(cfg.eos_token_ids))
        out.append(dict(prompt=prompt, tokens=result.tokens, text=tok.decode(result.tokens)))
    return out


def train(
    params: dict,
    losses,
    s: TrainSettings,
    train_tokens: np.ndarray,
    seconds: float,
    *,
    seed: int = 0,
    max_steps: int | None = None,
    log_every: int = 50,
    log=print,
    names: tuple[str, str] = ("loss", "mtp"),
) -> tuple[dict, dict]:
    """Train params on `losses` (see make_train_step) for about `seconds`, compile included (or exactly
    max_steps): the cosine horizon is set from the step time measured over steps 3..13. `names` label the two losses
    in the log. Returns (float32 params, training record)."""
    tx = make_optimizer(s)
    opt_state = tx.init(params)
    tokens = jax.device_put(train_tokens)
    step_fn = make_train_step(losses, s, tx)
    start = time.perf_counter()  # the budget includes the compile
    compiled = (
        jax.jit(step_fn, donate_argnums=(0, 1))
        .lower(params, opt_state, tokens, jax.random.PRNGKey(0), jnp.int32(0), jnp.int32(1))
        .compile()
    )
    compile_s = time.perf_counter() - start
    log(f"train step compiled in {compile_s:.1f} s")
    key = jax.random.PRNGKey(seed)
    total = max_steps or 10**9
    curve: list[tuple[int, float, float, float]] = []
    calib_from = calib_at = None
    step = 0
    while step < total:
        key, sub = jax.random.split(key)
        params, opt_state, main, mtp, lr = compiled(params, opt_state, tokens, sub, jnp.int32(step), jnp.int32(total))
        step += 1
        if step == 3:  # time steps 3..13 (asynchronous dispatch: block at both ends)
            main.block_until_ready()
            calib_from = time.perf_counter()
        if step == 13 and max_steps is None:
            main.block_until_ready()
            per_step = (time.perf_counter() - calib_from) / 10
            total = max(step + 1, int((seconds - (time.perf_counter() - start)) / per_step) + step)
            log(f"{per_step * 1e3:.1f} ms/step -> {total} steps ({total * s.batch * s.seq_len / 1e6:.1f} M tokens)")
            calib_at = step
        if step == 1 or step % log_every == 0 or step == total:
            m, t, r = float(main), float(mtp), float(lr)
            elapsed = time.perf_counter() - start
            curve.append((step, m, t, r))
            log(f"step {step}/{total}  {names[0]} {m:.3f}  {names[1]} {t:.3f}  lr {r:.2e}  {elapsed:.0f} s")
            if max_steps is None and elapsed > seconds + 15:
                log("time budget exceeded: stopping early")
                break
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start - compile_s
    record = dict(
        steps=step,
        planned_steps=total,
        tokens_trained=step * s.batch * s.seq_len,
        train_seconds=elapsed,
        compile_seconds=compile_s,
        tokens_per_second=step * s.batch * s.seq_len / elapsed,
        calibrated_at_step=calib_at,
        curve=curve,
        settings=dataclasses.asdict(s),
    )
    return params, record


# ------------------------------------------------------------------------------------------------------ outputs
def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def model_card(m: dict) -> str:
    """MODEL_CARD.md text from the metrics dict."""
    cfg, tr, data = m["config"], m["training"], m["data"]
    linears = "qkv, o, gate_up, down, " + ("in_proj, out, " if cfg["layer_types"] else "") + "lm_head, MTP fc"
    mixers = (  # a hybrid's token mixers
        f"layers {', '.join(cfg['layer_types'])} (Gated DeltaNet {cfg['linear_num_key_heads']} key / "
        f"{cfg['linear_num_value_heads']} value heads of {cfg['linear_value_head_dim']}), "
        if cfg["layer_types"]
        else ""
    )
    lines = [
        "# jspec demo model" + (" (hybrid)" if cfg["layer_types"] else ""),
        "",
        f"A small {STYLES[cfg['family']]} code model trained by `python -m checkpoints.train_demo` on the Python",
        "sources of the training machine's interpreter. It exists to exercise jspec end to end (int4 weights, prompt",
        "lookup, MTP drafting); it writes Python-looking code, not correct programs, and greedy decoding of a model",
        "this small soon falls into repetition loops.",
        "",
        "## Config",
        "",
        f"- family `{cfg['family']}`, hidden {cfg['hidden_size']}, {cfg['num_layers']} layers, "
        f"{cfg['num_heads']} query / {cfg['num_kv_heads']} KV heads of {cfg['head_dim']}, "
        f"MLP {cfg['intermediate_size']}, {mixers}"
        f"vocab {cfg['vocab_size']}, untied lm_head, RoPE theta {cfg['rope']['theta']:g}, "
        f"trained context {cfg['max_position_embeddings']}",
        f"- {cfg['num_mtp_layers']} MTP layer ({cfg['mtp_layout']} layout), trained jointly "
        f"(loss weight {tr['settings']['aux_weight']})",
        f"- parameters: {m['params']['main'] / 1e6:.1f} M main model + {m['params']['mtp'] / 1e6:.1f} M MTP "
        f"(embedding {m['params']['embed'] / 1e6:.1f} M)",
        f"- stored: every linear ({linears}) int4 (symmetric, blocks of 32, bf16 "
        f"scales); embedding, norms and biases {m['float_dtype']}. Checkpoint {m['checkpoint_bytes'] / 1e6:.1f} MB",
        "",
        "## Data",
        "",
        f"- {data['train_files']} train / {data['heldout_files']} held-out files ({data['train_bytes'] / 1e6:.0f} MB "
        f"/ {data['heldout_bytes'] / 1e6:.1f} MB), split by content hash, from {', '.join(data['roots'])}",
        f"- byte-level BPE tokenizer (HF tokenizers), vocab {cfg['vocab_size']}, {data['tokenizer']}: "
        f"{data['train_tokens'] / 1e6:.1f} M train tokens, {data['heldout_tokens'] / 1e6:.2f} M held-out tokens",
        "",
        "## Training",
        "",
        f"- {tr['steps']} steps of {tr['settings']['batch']} x {tr['settings']['seq_len']} tokens = "
        f"{tr['tokens_trained'] / 1e6:.0f} M tokens in {tr['train_seconds']:.0f} s on {m['device']} "
        f"({tr['tokens_per_second'] / 1e3:.0f} k tok/s), jax {m['jax_version']}",
        f"- AdamW (b2 0.95, weight decay {tr['settings']['weight_decay']}), peak lr {tr['settings']['peak_lr']}, "
        f"{tr['settings']['warmup']} warmup steps, cosine to {tr['settings']['final_lr_frac']} x peak; "
        f"{tr['settings']['compute_dtype']} compute, float32 master weights",
        "",
        f"## Evaluation (held-out; float32 weights in float32, int4 as stored, in {m['float_dtype']} activations)",
        "",
        "| weights | next-token loss (nats) | MTP loss (token t+2) |",
        "| --- | --- | --- |",
        f"| float32 | {m['heldout']['float']['loss']:.3f} | {m['heldout']['float']['mtp_loss']:.3f} |",
        f"| int4 | {m['heldout']['int4']['loss']:.3f} | {m['heldout']['int4']['mtp_loss']:.3f} |",
        "",
        f"int4 vs float32: teacher-forced argmax agreement {m['int4_agreement']['top1']:.3f} over "
        f"{m['int4_agreement']['top1_windows']} held-out windows; greedy continuations "
        f"({m['int4_agreement']['sample_tokens']} tokens each) share "
        f"{m['int4_agreement']['greedy_common_prefix_mean']:.1f} leading tokens on average, "
        f"{m['int4_agreement']['greedy_position_match']:.3f} of positions equal.",
        "",
        f"## Greedy samples (int4 weights, jspec Engine on {m['samples_device']})",
        "",
    ]
    for sample in m["samples"]["int4"]:
        lines += ["```python", sample["prompt"] + sample["text"], "```", ""]
    return "\n".join(lines)


def run(args) -> dict:
    log = file_logger(args.out)
    t_start = time.perf_counter()
    roots = args.roots or python_roots()
    corpus = gather_corpus(roots, int(args.max_corpus_mb * 1e6), heldout_permille=args.heldout_permille, seed=args.seed)
    log(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files, {corpus.train_bytes / 1e6:.1f} MB")
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        tok = train_tokenizer(corpus.train[: args.tokenizer_files], args.vocab_size)
    log(f"tokenizer: vocab {tok.get_vocab_size()} ({time.perf_counter() - t_start:.0f} s so far)")
    if args.tokenizer_only:
        tok.save(os.path.join(args.out, "tokenizer.json"))
        return {}
    train_tokens = encode_texts(tok, corpus.train)
    heldout_tokens = encode_texts(tok, corpus.heldout)
    log(
        f"tokens: {train_tokens.size / 1e6:.1f} M train, {heldout_tokens.size / 1e6:.2f} M held-out "
        f"({time.perf_counter() - t_start:.0f} s so far)"
    )

    s = TrainSettings(batch=args.batch, seq_len=args.seq_len, peak_lr=args.lr, warmup=args.warmup)
    cfg = demo_config(tok.get_vocab_size(), args.size, args.seq_len, tok.token_to_id(EOS), args.family)
    params = init_train_params(cfg, jax.random.PRNGKey(args.seed))
    n_main = count_params({k: v for k, v in params.items() if k != "mtp"})
    log(f"model: {n_main / 1e6:.2f} M params + {count_params(params['mtp']) / 1e6:.2f} M MTP on {jax.devices()[0]}")
    seconds = training_seconds(args.minutes, args.total_minutes, time.perf_counter() - t_start, args.family)
    params, record = train(
        params,
        lambda p, windows: model_losses(p, cfg, windows),
        s,
        train_tokens,
        seconds,
        seed=args.seed,
        max_steps=args.max_steps,
        log_every=args.log_every,
        log=log,
    )

    int4 = stored_params(params, args.float_dtype)
    ckpt = os.path.join(args.out, "checkpoint")
    checkpoints.save(ckpt, int4, cfg)
    tok.save(os.path.join(ckpt, "tokenizer.json"))
    log(f"saved int4 checkpoint to {ckpt}")

    windows = heldout_windows(heldout_tokens, s.seq_len, args.eval_windows)
    heldout = {
        "float": evaluate(params, cfg, windows, args.eval_batch),
        "int4": evaluate(int4, cfg, windows, args.eval_batch),
    }
    log(
        f"held-out loss: float {heldout['float']['loss']:.3f} (mtp {heldout['float']['mtp_loss']:.3f}), "
        f"int4 {heldout['int4']['loss']:.3f} (mtp {heldout['int4']['mtp_loss']:.3f})"
    )
    samples = {
        "float": greedy_samples(params, cfg, tok, SAMPLE_PROMPTS, args.sample_tokens),
        "int4": greedy_samples(int4, cfg, tok, SAMPLE_PROMPTS, args.sample_tokens),
    }
    prefixes = [common_prefix(a["tokens"], b["tokens"]) for a, b in zip(samples["float"], samples["int4"], strict=True)]
    matches = [
        np.mean([x == y for x, y in zip(a["tokens"], b["tokens"], strict=False)] or [0.0])
        for a, b in zip(samples["float"], samples["int4"], strict=True)
    ]
    agreement = dict(
        top1=top1_agreement(params, int4, cfg, windows[: args.eval_batch]),
        top1_windows=min(len(windows), args.eval_batch),
        greedy_common_prefix_mean=float(np.mean(prefixes)),
        greedy_common_prefix=prefixes,
        greedy_position_match=float(np.mean(matches)),
        sample_tokens=args.sample_tokens,
    )
    log(f"int4 agreement: {agreement}")
    for sample in samples["int4"]:
        log("sample (int4):\n" + sample["prompt"] + sample["text"])

    metrics = dict(
        config=cfg.to_dict(),
        params=dict(main=n_main, mtp=count_params(params["mtp"]), embed=int(params["embed"].size)),
        data=dict(
            roots=corpus.roots,
            files_seen=corpus.files_seen,
            train_files=len(corpus.train),
            heldout_files=len(corpus.heldout),
            train_bytes=corpus.train_bytes,
            heldout_bytes=corpus.heldout_bytes,
            tokenizer=f"from {args.tokenizer}"
            if args.tokenizer
            else f"trained on {min(args.tokenizer_files, len(corpus.train))} train files",
            train_tokens=int(train_tokens.size),
            heldout_tokens=int(heldout_tokens.size),
        ),
        training=record,
        heldout=heldout,
        int4_agreement=agreement,
        samples=samples,
        samples_device=jax.devices()[0].device_kind,
        checkpoint_bytes=dir_bytes(ckpt),
        float_dtype=args.float_dtype,
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        total_seconds=time.perf_counter() - t_start,
    )
    write_outputs(args.out, ckpt, metrics, model_card(metrics), log)
    return metrics


def training_seconds(minutes: float, total_minutes: float | None, elapsed_s: float, family: str) -> float:
    """The training loop's budget: `minutes`, cut so that a run capped at `total_minutes` (None: no cap), elapsed_s
    in already, keeps the family's POST_TRAINING_RESERVE_S for what follows the loop."""
    seconds = minutes * 60
    if total_minutes:
        seconds = min(seconds, total_minutes * 60 - elapsed_s - POST_TRAINING_RESERVE_S[family])
    return seconds


def file_logger(out_dir: str):
    """log(msg): print msg with the time and append it to out_dir/train.log (out_dir is created)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "train.log")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    return log


def write_outputs(out_dir: str, ckpt: str, metrics: dict, card: str, log) -> None:
    """out_dir/metrics.json and ckpt/MODEL_CARD.md (the trainers' last step)."""
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    with open(os.path.join(ckpt, "MODEL_CARD.md"), "w") as f:
        f.write(card)
    log(f"done in {metrics['total_seconds']:.0f} s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m checkpoints.train_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (checkpoint/, metrics.json, train.log)")
    p.add_argument("--minutes", type=float, help="training time budget (the loop only)")
    p.add_argument(
        "--total-minutes", type=float, help="cap on the whole run: training stops early to leave time for the rest"
    )
    p.add_argument("--tokenizer-only", action="store_true", help="train the tokenizer, write tokenizer.json, exit")
    p.add_argument("--size", choices=sorted(SIZES), default="demo")
    p.add_argument("--family", choices=FAMILIES, default="qwen2", help="qwen3_5: the Gated DeltaNet hybrid")
    p.add_argument(
        "--float-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the stored float leaves (embedding, norms, biases); the model runs its embedding's dtype",
    )
    p.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tokenizer-files", type=int, default=4000, help="train files the tokenizer is trained on")
    add_training_flags(p, max_corpus_mb=150.0, lr=2e-3, log_every=50, eval_windows=128)
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=96)
    return p.parse_args(argv)


def add_training_flags(
    p: argparse.ArgumentParser, *, max_corpus_mb: float, lr: float, log_every: int, eval_windows: int
):
    """The corpus, schedule and evaluation flags this trainer shares with `checkpoints.train_drafter`."""
    p.add_argument("--roots", nargs="*", help="directories to read *.py from (default: stdlib + site-packages)")
    p.add_argument("--max-corpus-mb", type=float, default=max_corpus_mb)
    p.add_argument("--heldout-permille", type=int, default=10, help="held-out share of files, per 1000")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-steps", type=int, help="stop after this many steps (tests); default: by --minutes")
    p.add_argument("--log-every", type=int, default=log_every)
    p.add_argument("--eval-windows", type=int, default=eval_windows)
    p.add_argument("--seed", type=int, default=0)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.minutes is None and not args.tokenizer_only:
        sys.exit("--minutes is required (unless --tokenizer-only)")
    if os.path.exists(os.path.join(args.out, "checkpoint")):
        sys.exit(f"{args.out}/checkpoint exists; choose a new --out")
    run(args)


if __name__ == "__main__":
    main()
