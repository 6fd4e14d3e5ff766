"""The demo-model trainer end to end on a tiny CPU run: corpus, tokenizer, training (loss decreases), int4
quantization, checkpoint save/load round trip, samples and model card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from checkpoints import train_demo
from jspec.config import ModelConfig
from jspec.models import dense, hybrid
from pallas_kernels import Int4Weight

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A trainer's process hung in the suite once (2026-12-03, jax 0.10.2): every XLA:CPU thread parked, the main thread
# waiting in CpuPjRtRawLoadedExecutable::Execute for an earlier step that never completed. XLA:CPU's multithreaded
# Eigen pool is known to wedge so (PyAutoLabs/PyAutoFit#1528, #1530: the flag below avoided it there); the tiny
# trainers lose nothing by it. A run takes ~1-2 minutes; TRAINER_TIMEOUT_S bounds a wedge's cost.
TRAINER_ENV = os.environ | {
    "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
}
TRAINER_TIMEOUT_S = 420
STDLIB_MODULES = ("argparse", "json/decoder", "json/encoder", "textwrap", "string", "fractions", "heapq", "bisect")


def train(module: str, argv: list[str]) -> dict:
    """Run a trainer (`python -m checkpoints.<module> argv`) in its own process and return its metrics.json.

    Each trainer runs in a fresh interpreter, so the executables it compiles (a training step, its evaluation, the
    int4 model's) and their memory mappings are freed with it (conftest.free_executables_after_each_module says why
    that matters); a crash there fails the one test with its output."""
    cmd = [sys.executable, "-m", f"checkpoints.{module}", *argv]
    for attempt in (1, 2):
        try:
            run = subprocess.run(
                cmd, capture_output=True, text=True, timeout=TRAINER_TIMEOUT_S, cwd=REPO, env=TRAINER_ENV
            )
            break
        except subprocess.TimeoutExpired as e:  # XLA:CPU's runtime can wedge (see TRAINER_ENV): once more, loudly
            if attempt == 2:
                pytest.fail(f"{' '.join(cmd)} hung twice ({TRAINER_TIMEOUT_S} s); its output:\n{e.stdout}\n{e.stderr}")
            warnings.warn(
                f"{module} hung for {TRAINER_TIMEOUT_S} s (XLA:CPU runtime wedge); running it again", stacklevel=2
            )
    assert run.returncode == 0, f"{' '.join(cmd)} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    out = argv[argv.index("--out") + 1]
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    """A directory with a few standard-library modules (the trainer's corpus)."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in STDLIB_MODULES:
        with open(os.path.join(stdlib, name + ".py"), encoding="utf-8") as f:
            text = f.read()
        (root / (name.replace("/", "_") + ".py")).write_text(text[:20000], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def trained(corpus_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_out")
    argv = ["--out", str(out), "--minutes", "1", "--size", "tiny", "--roots", str(corpus_root)]
    argv += ["--vocab-size", "400", "--batch", "4", "--seq-len", "32", "--lr", "5e-3", "--warmup", "5"]
    argv += ["--max-steps", "60", "--eval-windows", "4", "--eval-batch", "2", "--sample-tokens", "8"]
    argv += ["--heldout-permille", "300"]
    return out, train("train_demo", argv)


def test_loss_decreases(trained):
    _, metrics = trained
    curve = metrics["training"]["curve"]
    assert metrics["training"]["steps"] == 60
    first, last = curve[0], curve[-1]
    assert last[1] < first[1] - 0.5, curve  # next-token loss
    assert last[2] < first[2] - 0.5, curve  # MTP loss
    assert np.isfinite(metrics["heldout"]["int4"]["loss"])
    assert 0.0 <= metrics["int4_agreement"]["top1"] <= 1.0


def test_checkpoint_round_trip(trained):
    out, metrics = trained
    ckpt = os.path.join(out, "checkpoint")
    params, cfg = checkpoints.load(ckpt)
    assert cfg == ModelConfig.from_dict(metrics["config"])
    assert cfg.num_mtp_layers == 1 and len(params["mtp"]) == 1
    for name in ("qkv", "o", "gate_up", "down"):
        assert isinstance(params["layers"][0][name], Int4Weight)
        assert isinstance(params["mtp"][0]["layer"][name], Int4Weight)
    assert isinstance(params["lm_head"], Int4Weight) and isinstance(params["mtp"][0]["fc"], Int4Weight)
    # Saving what was loaded and loading it again is bit-identical.
    again_dir = os.path.join(out, "again")
    checkpoints.save(again_dir, params, cfg)
    again, cfg2 = checkpoints.load(again_dir)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # The greedy samples in metrics.json are what jspec generates from the saved checkpoint.
    tok = train_demo.load_tokenizer(os.path.join(ckpt, "tokenizer.json"))
    sample = metrics["samples"]["int4"][0]
    assert train_demo.greedy_samples(params, cfg, tok, [sample["prompt"]], 8)[0]["tokens"] == sample["tokens"]
    card = open(os.path.join(ckpt, "MODEL_CARD.md")).read()
    assert "held-out" in card and sample["prompt"] in card
    assert json.load(open(os.path.join(out, "metrics.json")))["training"]["steps"] == 60


def test_tokenizer_round_trip(trained):
    out, _ = trained
    tok = train_demo.load_tokenizer(os.path.join(out, "checkpoint", "tokenizer.json"))
    assert tok.get_vocab_size() == 400 and tok.token_to_id(train_demo.EOS) == 0
    text = 'def f(x):\n\treturn x + 1  # héllo → 世界 🙂\n\n    """doc"""\r\n'
    assert tok.decode(tok.encode(text).ids) == text
    stream = train_demo.encode_texts(tok, ["a = 1\n", "b = 2\n"])
    assert stream.dtype == np.uint16 and (stream == 0).sum() == 2 and stream[-1] == 0


def test_train_params_layout():
    cfg = train_demo.demo_config(512, "tiny")
    params = train_demo.init_train_params(cfg, jax.random.PRNGKey(0))
    main = {k: v for k, v in params.items() if k != "mtp"}
    assert jax.tree.structure(main) == jax.tree.structure(dense.init_params(cfg, jax.random.PRNGKey(0)))
    layer = params["layers"][0]
    assert np.all(np.asarray(layer["input_norm"]) == 1) and np.all(np.asarray(layer["qkv_bias"]) == 0)
    assert abs(float(np.std(np.asarray(layer["qkv"]))) - 0.02) < 0.002
    assert train_demo.count_params(params) > train_demo.count_params(main)


def test_hybrid_train_params_layout():
    """--family qwen3_5: the hybrid's own layout; norms scaling by 1 + w start at 0, the gated norm at 1, the decay
    and conv as the family draws them, matrices N(0, 0.02^2)."""
    with pytest.raises(ValueError, match=r"family must be one of \('qwen2', 'qwen3_5'\), got 'llama'"):
        train_demo.demo_config(512, "tiny", family="llama")
    cfg = train_demo.demo_config(512, "tiny", family="qwen3_5")
    assert cfg.layer_types == ("linear_attention", "full_attention") and cfg.mtp_layout == "qwen3_next"
    params = train_demo.init_train_params(cfg, jax.random.PRNGKey(0))
    main = {k: v for k, v in params.items() if k != "mtp"}
    drawn = hybrid.init_params(cfg, jax.random.PRNGKey(0))
    assert jax.tree.structure(main) == jax.tree.structure(drawn)
    linear, attention = params["layers"]
    assert np.all(np.asarray(linear["input_norm"]) == 0) and np.all(np.asarray(attention["q_norm"]) == 0)
    assert np.all(np.asarray(linear["gdn_norm"]) == 1)
    a = np.exp(np.asarray(linear["A_log"]))  # the family's draw, log U(0.02, 0.5), not a matrix's N(0, 0.02^2)
    assert np.all((a > 0.02) & (a < 0.5))
    assert abs(float(np.std(np.asarray(linear["in_proj"]))) - 0.02) < 0.002


def test_the_bundled_hybrid_size_fits_the_budget_and_every_gpu_row_tile_kernel():
    """--size hybrid --float-dtype bfloat16: about 20 M parameters, under 16 MB stored (the repository's budget for
    it), and every linear's N a multiple of 16 (the Triton row-tile kernels' rule, which float weights meet)."""
    cfg = train_demo.demo_config(8192, "hybrid", family="qwen3_5")
    assert cfg.layer_types.count("full_attention") == 2 and cfg.linear_num_value_heads == 8
    floats = jax.eval_shape(lambda: train_demo.init_train_params(cfg, jax.random.PRNGKey(0)))
    stored = jax.eval_shape(
        lambda: train_demo.stored_params(train_demo.init_train_params(cfg, jax.random.PRNGKey(0)), "bfloat16")
    )
    assert 19e6 < train_demo.count_params(floats) < 21e6
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(stored)) < 16e6
    linears = [
        w for w in jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, Int4Weight)) if isinstance(w, Int4Weight)
    ]
    assert linears and all(w.shape[1] % 16 == 0 for w in linears), sorted({w.shape[1] for w in linears})


def test_hybrid_trainer_learns_and_its_checkpoint_drafts_with_its_mtp_head(corpus_root, tmp_path):
    """A tiny Qwen3.5-style hybrid trained jointly with its MTP layer: both losses fall; the int4 checkpoint loads
    as a qwen3_5 model whose MTP head drafts for it with greedy's tokens."""
    import jspec

    argv = [
        "--out",
        str(tmp_path),
        "--minutes",
        "1",
        "--size",
        "tiny",
        "--family",
        "qwen3_5",
        "--float-dtype",
        "bfloat16",
    ]
    argv += ["--roots", str(corpus_root), "--vocab-size", "400", "--batch", "4", "--seq-len", "32", "--lr", "5e-3"]
    argv += ["--warmup", "5", "--max-steps", "40", "--eval-windows", "2", "--eval-batch", "2", "--sample-tokens", "4"]
    argv += ["--heldout-permille", "300"]
    metrics = train("train_demo", argv)
    first, last = metrics["training"]["curve"][0], metrics["training"]["curve"][-1]
    assert last[1] < first[1] - 0.5 and last[2] < first[2] - 0.5, metrics["training"]["curve"]
    params, cfg = checkpoints.load(os.path.join(tmp_path, "checkpoint"))
    assert (
        cfg.family == "qwen3_5" and cfg.num_mtp_layers == 1 and isinstance(params["layers"][0]["in_proj"], Int4Weight)
    )
    floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert set(floats) == {jnp.dtype(jnp.bfloat16)}  # --float-dtype bfloat16: the embedding, norms, scales
    assert metrics["float_dtype"] == "bfloat16"
    card = (tmp_path / "checkpoint" / "MODEL_CARD.md").read_text()
    assert "(hybrid)" in card and "biases bfloat16" in card
    engine = jspec.Engine(params, cfg, max_len=32, k=2)
    prompt = list(range(1, 9))
    out = engine.generate(prompt, 16, drafter=jspec.MTPDrafter(), eos_id=())
    assert out.tokens == engine.generate(prompt, 16, eos_id=()).tokens and out.stats.verify_steps > 0


def test_gather_corpus_dedupes_and_splits(tmp_path):
    distinct = [f"x = {i}\n" * 30 for i in range(10)]
    for i, text in enumerate(distinct):
        (tmp_path / f"m{i}.py").write_text(text)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "copy.py").write_text(distinct[0])  # same content: read once
    (tmp_path / "data.py").write_text("z = [" + "1, " * 1000 + "]\n")  # generated-looking: skipped
    corpus = train_demo.gather_corpus([str(tmp_path)], 10**6, heldout_permille=500, seed=1)
    assert sorted(corpus.train + corpus.heldout) == sorted(distinct)
    assert corpus.train and corpus.heldout and corpus.files_seen == 12
    with pytest.raises(FileNotFoundError, match="no Python files"):
        train_demo.gather_corpus([str(tmp_path / "missing")], 10**6)


def test_drafter_distilled_from_the_demo_trainer_drafts_for_it(trained, corpus_root, tmp_path):
    """checkpoints.train_drafter on the tiny demo model: the KL from the teacher falls, the stored drafter loads as
    a jspec.DraftModel and drafting with it keeps the teacher's greedy tokens."""
    import jspec

    out, _ = trained
    teacher = os.path.join(out, "checkpoint")
    argv = ["--out", str(tmp_path), "--minutes", "1", "--size", "tiny", "--teacher", teacher]
    argv += ["--roots", str(corpus_root), "--heldout-permille", "300", "--batch", "4", "--seq-len", "32"]
    argv += ["--lr", "1e-2", "--warmup", "5", "--max-steps", "40", "--eval-windows", "2"]
    metrics = train("train_drafter", argv)
    curve = metrics["training"]["curve"]
    assert curve[-1][1] < curve[0][1] - 0.5, curve  # KL from the teacher
    assert 0.0 <= metrics["heldout"]["stored"]["top1"] <= 1.0
    drafter = jspec.DraftModel.load(os.path.join(tmp_path, "checkpoint"))
    assert drafter.params["embed"].dtype == np.dtype("bfloat16") and drafter.cfg.tie_word_embeddings
    params, cfg = checkpoints.load(teacher)
    engine = jspec.Engine(params, cfg, max_len=32, k=3)  # the models' trained context
    prompt = list(range(1, 9))
    out = engine.generate(prompt, 24, drafter=drafter, eos_id=())
    assert out.tokens == engine.generate(prompt, 24, eos_id=()).tokens and out.stats.verify_steps > 0


def test_the_time_cap_keeps_each_familys_post_training_reserve():
    """--total-minutes 5.5 with 60 s gone: the dense demo trains 330 - 60 - 75 s, the hybrid 330 - 60 - 180 (its
    two engines' compiles after the loop); --minutes alone is the budget without a cap."""
    assert train_demo.training_seconds(4.4, 5.5, 60.0, "qwen2") == 330 - 60 - 75
    assert train_demo.training_seconds(4.4, 5.5, 60.0, "qwen3_5") == 330 - 60 - 180
    assert train_demo.training_seconds(4.4, None, 60.0, "qwen3_5") == 4.4 * 60
