"""Bad input and reuse, by class (docs/api.md, "Errors"): every case is refused before compute with a message that
names it, an Engine reused across requests never crashes on their shapes, and nothing that ran before is lost."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
import jspec
from jspec import cli, memory
from jspec.stats import SpecStats
from tests.conftest import build_tiny_hf_model
from tests.tiny import tiny_config, tiny_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 48


@pytest.fixture(scope="module")
def engine():
    cfg = tiny_config("qwen2", eos_token_ids=(7,))
    return jspec.Engine(tiny_params(cfg, seed=2), cfg, max_len=MAX_LEN, k=3, prefill_chunk=16)


# --------------------------------------------------------------------------------- reuse: executables by shape
def test_one_engine_serves_any_eos_ids_with_the_same_executables(engine):
    """EOS ids of any count and type share one fixed-shape array; None means the model's own (cfg.eos_token_ids),
    () none at all."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = engine.generate(prompt, 30, eos_id=()).tokens
    compiles = engine.num_compiles
    for eos in ([free[4], 3], None, np.int64(free[2]), (), [free[6]], free[1]):
        out = engine.generate(prompt, 30, eos_id=eos)
        ids = engine.cfg.eos_token_ids if eos is None else np.atleast_1d(eos).tolist()
        stop = next((i for i, t in enumerate(free) if t in ids), None)
        assert out.tokens == (free if stop is None else free[: stop + 1])
    assert engine.num_compiles == compiles


# ------------------------------------------------------------------------------ refused, not coerced or deep
def _gen(engine, **overrides):
    kwargs = dict(prompt_ids=[1, 2, 3], max_new_tokens=4)
    kwargs.update(overrides)
    return engine.generate(**kwargs)


REFUSED = {
    "2-D prompt": (dict(prompt_ids=[[1, 2], [3, 4]]), ValueError, "one 1-D sequence"),
    "text prompt": (dict(prompt_ids="def f():"), TypeError, "got text"),
    "float ids": (dict(prompt_ids=[1.0, 2.5]), TypeError, "integer token ids"),
    "bool ids": (dict(prompt_ids=[True, False]), TypeError, "integer token ids"),
    "id past the vocabulary": (dict(prompt_ids=[1, 96]), ValueError, "token id 96 at index 1"),
    "float max_new_tokens": (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an integer"),
    "bool max_new_tokens": (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer"),
    "string max_new_tokens": (dict(max_new_tokens="4"), TypeError, "max_new_tokens must be an integer"),
    "zero max_new_tokens": (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    "string drafter": (dict(drafter="prompt-lookup"), TypeError, "drafter must be a Drafter"),
    "drafter class": (dict(drafter=jspec.PromptLookup), TypeError, "drafter must be a Drafter"),
    "string gate": (dict(gate="on"), TypeError, "gate must be a jspec.HitDensityGate"),
    "float eos": (dict(eos_id=2.5), TypeError, "eos_id must be an integer"),
    "negative eos": (dict(eos_id=-1), ValueError, "eos_id must be >= 0"),
    "eos past the vocabulary": (dict(eos_id=[3, 96]), ValueError, "eos_id must be <= 95"),
    "too many eos ids": (dict(eos_id=list(range(9))), ValueError, "at most 8 EOS ids"),
    "float rounds_per_call": (dict(rounds_per_call=1.5), TypeError, "rounds_per_call must be an integer"),
    "string on_device": (dict(on_device="yes"), TypeError, "on_device must be True or False"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_generate_refuses_what_it_would_coerce(engine, case):
    overrides, error, message = REFUSED[case]
    compiles = engine.num_compiles
    with pytest.raises(error, match=message):
        _gen(engine, **overrides)
    assert engine.num_compiles == compiles


CONSTRUCTORS = {
    "Engine k float": (lambda p, c: jspec.Engine(p, c, max_len=32, k=2.5), TypeError, "k must be an integer"),
    "Engine max_len float": (lambda p, c: jspec.Engine(p, c, max_len=32.0), TypeError, "max_len must be an integer"),
    "Engine chunk 0": (lambda p, c: jspec.Engine(p, c, max_len=32, prefill_chunk=0), ValueError, "prefill_chunk"),
    "Engine dtype": (lambda p, c: jspec.Engine(p, c, max_len=32, dtype="float16"), ValueError, "float32 or bf"),
    "Engine params": (lambda p, c: jspec.Engine([p], c, max_len=32), TypeError, "params must be the dict"),
    "Engine cfg": (lambda p, c: jspec.Engine(p, c.to_dict(), max_len=32), TypeError, "cfg must be a jspec.Model"),
    "Engine prepare": (lambda p, c: jspec.Engine(p, c, max_len=32, prepare="yes"), TypeError, "prepare must be"),
    "PromptLookup float": (lambda p, c: jspec.PromptLookup(ngram_max=2.5), TypeError, "ngram_max must be an int"),
    "MTPDrafter k": (lambda p, c: jspec.MTPDrafter(k=3.0), TypeError, "MTPDrafter k must be an integer"),
    "gate window": (lambda p, c: jspec.HitDensityGate(window="8"), TypeError, "window must be an integer"),
    "TieGuard eps": (lambda p, c: jspec.TieGuard(eps="small"), TypeError, "TieGuard eps must be a number"),
    "TieGuard nan": (lambda p, c: jspec.TieGuard(eps=float("nan")), ValueError, "TieGuard eps must be finite"),
    "steps state dtype": (
        lambda p, c: jspec.prefill(p, c, jspec.init_state(c, 32, jnp.bfloat16), jnp.ones((8,), jnp.int32), 8),
        ValueError,
        "the state is bfloat16 but the params compute in float32",
    ),
}


@pytest.mark.parametrize("case", list(CONSTRUCTORS))
def test_constructors_refuse_what_they_would_coerce(engine, case):
    make, error, message = CONSTRUCTORS[case]
    with pytest.raises(error, match=message):
        make(engine.params, engine.cfg)


# --------------------------------------------------------------------------- inside jit: an error code instead
def _on_device(engine):
    settings = engine.settings(jspec.PromptLookup())
    return jax.jit(lambda p, x, n, m: jspec.generate_on_device(p, engine.cfg, x, n, m, settings, ()))


ON_DEVICE = {  # prompt (padded to 12), prompt_len, max_new -> the rule broken
    "length 0": ([1, 2, 3], 0, 4, "prompt_len must be in 1..len"),
    "length past the array": ([1, 2, 3], 13, 4, "prompt_len must be in 1..len"),
    "max_new 0": ([1, 2, 3], 3, 0, "max_new_tokens must be >= 1"),
    "past the cache": ([1, 2, 3], 3, MAX_LEN, r"prompt_len \+ max_new_tokens must be <= max_len \+ 1"),
    "id past the vocabulary": ([1, 200, 3], 3, 4, "every prompt token id must be in"),
    "negative id": ([-4, 2, 3], 3, 4, "every prompt token id must be in"),
}


@pytest.mark.parametrize("case", list(ON_DEVICE))
def test_generate_on_device_returns_an_error_code_the_host_raises_on(engine, case):
    tokens, length, max_new, message = ON_DEVICE[case]
    padded = jnp.zeros((12,), jnp.int32).at[: len(tokens)].set(jnp.asarray(tokens))
    out = jax.device_get(_on_device(engine)(engine.params, padded, length, max_new))
    assert int(out.error) != 0 and int(out.num_tokens) == 0
    with pytest.raises(ValueError, match=message):
        out.raise_if_error()


def test_generate_on_device_valid_request_has_no_error(engine):
    prompt = [3, 1, 4, 1, 5]
    padded = jnp.zeros((12,), jnp.int32).at[:5].set(jnp.asarray(prompt))
    out = jax.device_get(_on_device(engine)(engine.params, padded, 5, 9)).raise_if_error()
    assert list(out.tokens[: int(out.num_tokens)]) == engine.generate(prompt, 9, eos_id=()).tokens
    with pytest.raises(TypeError, match="prompt must be a 1-D integer array"):
        _on_device(engine)(engine.params, padded.astype(jnp.float32), 5, 9)


# ------------------------------------------------------------------------------- memory planned before use
def test_an_engine_that_does_not_fit_raises_with_the_numbers(engine, monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda: (64 << 20, "free in this test"))
    with (
        pytest.raises(
            memory.MemoryBudgetError, match=r"Engine\(max_len=1000000, float32, batch_size=1\) needs .* GiB.*KV cache"
        ),
        pytest.warns(UserWarning, match="max_len 1000000 exceeds the model's max_position_embeddings"),
    ):
        jspec.Engine(engine.params, engine.cfg, max_len=1_000_000)
    jspec.Engine(engine.params, engine.cfg, max_len=1_000)  # a small one still fits


def test_the_text_api_checks_prompts_before_anything_runs():
    """`Model.generate` / `stream` / `generate_batch` take text or token ids; anything else is refused naming the
    prompt (and its index in a batch) before an Engine is built."""
    model = jspec.load()
    vocab = model.cfg.vocab_size
    for call, message in (
        (lambda: model.generate(None, 2), "prompt must be a sequence of token ids, got NoneType"),
        (lambda: model.generate([1, 2.5], 2), "prompt must hold integer token ids"),
        (lambda: list(model.stream([vocab], 2)), f"prompt: token id {vocab} at index 0 is out of range"),
        (lambda: model.generate_batch(["def f():", None], 2), r"prompts\[1\] must be a sequence of token ids"),
        (lambda: model.generate_batch("def f():", 2), "prompts must be a list of texts or token-id lists, got str"),
    ):
        with pytest.raises((TypeError, ValueError), match=message):
            call()
    assert model._engine is None


# ---------------------------------------------------------------------------------- checkpoints and loading
@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load_naming_the_tensor(tmp_path, quantize, bad):
    from safetensors.numpy import load_file, save_file

    build_tiny_hf_model("qwen2", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = bad
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(checkpoints.CheckpointError, match=rf"tensor '{name}' .* 1 non-finite value"):
        jspec.load_hf(tmp_path, quantize=quantize)


@pytest.fixture(scope="module")
def broken_checkpoints(tmp_path_factory):
    """Copies of the demo checkpoint, each broken one way: (dir, the message expected)."""
    root = tmp_path_factory.mktemp("broken")
    cases = {}
    for how in ("deleted", "truncated", "flipped", "reshaped", "index", "metadata"):
        d = root / how
        shutil.copytree(checkpoints.demo_dir(), d)
        data = max((d / "params" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
        if how == "deleted":
            data.unlink()
        elif how == "truncated":
            os.truncate(data, 1000)
        elif how == "flipped":  # four bytes inverted inside the file's length: orbax reads it without complaint
            with open(data, "r+b") as f:
                f.seek(data.stat().st_size // 2)
                word = f.read(4)
                f.seek(-4, os.SEEK_CUR)
                f.write(bytes(b ^ 0xFF for b in word))
        elif how == "index":  # the B+tree node that lists the arrays' data
            next((d / "params" / "d").iterdir()).unlink()
        elif how == "metadata":
            os.truncate(d / "params" / "_METADATA", 5)
        else:
            meta = json.loads((d / "jspec.json").read_text())
            meta["tree"]["dict"]["embed"]["shape"] = [3, 8192, 512]
            (d / "jspec.json").write_text(json.dumps(meta))
        cases[how] = d
    return cases


BROKEN = {
    "deleted": "cannot read array 'params.embed': its data file .* is missing",
    "truncated": r"cannot read array 'params.embed': its data file .* is truncated \(1000 bytes; the data ends at byte",
    "flipped": "array 'params.embed' does not match the CRC-32 that jspec.json lists: the data is damaged",
    "reshaped": "says array 'params.embed' is float32",
    "index": "cannot read the orbax index: its data file .* is missing",
    "metadata": "cannot read the orbax metadata",
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_jspec_checkpoint_names_the_array(broken_checkpoints, how):
    with pytest.raises(checkpoints.CheckpointError, match=BROKEN[how]):
        checkpoints.load(broken_checkpoints[how])


def test_the_data_file_check_walks_a_b_tree_of_several_levels(tmp_path):
    """orbax's checkpoints hold one B+tree leaf; OCDBT stores of many keys or small nodes have interior levels, and
    the check follows them to every value: a data file cut short is found below the root."""
    import tensorstore as ts

    from checkpoints import store

    spec = dict(
        driver="ocdbt", base=f"file://{tmp_path}/", config=dict(max_decoded_node_bytes=256, max_inline_value_bytes=16)
    )
    kv = ts.KvStore.open(spec).result()
    for keys in ([f"a{i:03d}/0" for i in range(64)], ["b/0"]):  # two commits: two data files
        with ts.Transaction() as txn:
            for key in keys:
                kv.with_transaction(txn)[key] = bytes(100)
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()
    assert manifest["versions"][-1]["root_height"] > 0
    store._check_data_files(str(tmp_path))  # whole: passes
    first = max((tmp_path / "d").iterdir(), key=lambda f: f.stat().st_size)  # the 64 values of the first commit
    os.truncate(first, 3000)
    message = r"cannot read (array 'a\d{3}'|the orbax index): .* truncated"
    with pytest.raises(checkpoints.CheckpointError, match=message):
        store._check_data_files(str(tmp_path))


def test_a_broken_checkpoint_prints_its_one_error_and_nothing_after(broken_checkpoints):
    """A restore that fails on one array leaves orbax's reads of the others running on an event loop it has closed:
    their tracebacks used to print after the one-line error, 10-3000 lines of them, some at exit, some at a garbage
    collection long after. `load` checks the data files before any read, so nothing follows the error; in a fresh
    process (the noise is timing-dependent and outlives the call), through the API and through the CLI."""
    script = (
        "import gc, sys, time, checkpoints\n"
        "for d in sys.argv[1:]:\n"
        "    try:\n"
        "        checkpoints.load(d)\n"
        "    except checkpoints.CheckpointError as e:\n"
        "        print(e)\n"
        "gc.collect(); time.sleep(1.0); gc.collect()\n"
    )
    dirs = [str(broken_checkpoints[how]) for how in ("deleted", "truncated", "index", "metadata")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    api = subprocess.run([sys.executable, "-c", script, *dirs], capture_output=True, text=True, timeout=300, env=env)
    assert api.returncode == 0 and api.stderr == "", api.stderr[-2000:]  # orbax's metadata warning dropped too
    assert api.stdout.count("cannot read") == 4, api.stdout
    argv = [sys.executable, "-m", "jspec", "generate", "--checkpoint", dirs[1], "--prompt", "def f():"]
    cli_run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert cli_run.returncode == 2 and cli_run.stderr.count("\n") == 1, cli_run.stderr[-2000:]
    assert "cannot read array 'params.embed'" in cli_run.stderr


# ------------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory, broken_checkpoints):
    root = tmp_path_factory.mktemp("cli")
    config = dict(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4)  # fmt: skip
    dirs = {}
    for name, files in {
        "config_only": {},
        "pickle_only": {"pytorch_model.bin": b""},
        "missing_shard": {"model.safetensors.index.json": b'{"weight_map": {"a": "model-00001.safetensors"}}'},
        "bad_json": {},
    }.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text("{model_type: qwen2" if name == "bad_json" else json.dumps(config))
        for file, data in files.items():
            (d / file).write_bytes(data)
        dirs[name] = d
    (root / "bad_tokenizer").mkdir()  # jspec.json is all a request reads before the tokenizer
    shutil.copy(os.path.join(checkpoints.demo_dir(), "jspec.json"), root / "bad_tokenizer")
    (root / "bad_tokenizer" / "tokenizer.json").write_text("{oops")
    dirs["bad_tokenizer"] = root / "bad_tokenizer"
    build_tiny_hf_model("qwen2", root / "no_mtp")
    dirs["no_mtp"] = root / "no_mtp"
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "full").mkdir()
    (root / "full" / "x").write_text("")
    dirs.update(root=root, truncated=broken_checkpoints["truncated"])
    return dirs


CLI_CASES = {
    "max-new-tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    "max-new-tokens -5": (["--max-new-tokens", "-5"], "--max-new-tokens: must be >= 1, got -5"),
    "k 0": (["--k", "0"], "--k: must be in 1..15, got 0"),
    "k 16": (["--k", "16"], "--k: must be in 1..15, got 16"),
    "k -1": (["--k", "-1"], "--k: must be in 1..15, got -1"),
    "k text": (["--k", "three"], "--k: expected an integer, got 'three'"),
    "two prompts": (["--prompt-file", "x.txt"], "--prompt-file: not allowed with argument --prompt"),
    "positional and --prompt": (["def g():"], "PROMPT: not allowed with argument --prompt"),
    "max-len too short": (["--max-len", "8"], "exceeds --max-len 8"),
    "huge request": (["--max-new-tokens", "100000000000"], "needs .* GiB"),
    "mtp without a head": (["--checkpoint", "{no_mtp}", "--drafter", "mtp"], "needs a checkpoint with an MTP head"),
    "mtp-vocab 0": (["--mtp-vocab", "0"], "--mtp-vocab: must be >= 1, got 0"),
    "mtp-vocab without mtp": (["--mtp-vocab", "64"], "--mtp-vocab is the token count of --drafter mtp's drafts"),
    "mtp-vocab of the whole vocabulary": (
        ["--model", "demo-hybrid", "--drafter", "mtp", "--mtp-vocab", "8192"],
        "--mtp-vocab 8192 is not below the vocabulary's 8192 tokens",
    ),
    "config only": (["--checkpoint", "{config_only}"], "no model.safetensors or model.safetensors.index.json"),
    "pickle only": (["--checkpoint", "{pickle_only}"], "only pickle weights"),
    "missing shard": (["--checkpoint", "{missing_shard}"], "model-00001.safetensors listed in .* does not exist"),
    "not a checkpoint": (["--checkpoint", "{root}"], "neither jspec.json .* nor config.json"),
    "a file, not a checkpoint": (["--checkpoint", "{root}/latin1.txt"], "latin1.txt' is a file, not a directory"),
    "tokenizer not JSON": (["--checkpoint", "{bad_tokenizer}"], "cannot read tokenizer .*bad_tokenizer/tokenizer.json"),
    "config not JSON": (
        ["--checkpoint", "{bad_json}"],
        "cannot read HuggingFace config '.*bad_json/config.json': not JSON",
    ),
    "broken jspec checkpoint": (["--checkpoint", "{truncated}"], "cannot read array 'params.embed'"),
    "quantize a jspec checkpoint": (["--quantize", "int4"], "apply to HuggingFace checkpoints"),
    "draft model, no checkpoint": (
        ["--checkpoint", "{no_mtp}", "--drafter", "draft-model"],
        "needs --draft-checkpoint",
    ),
    "draft checkpoint alone": (["--draft-checkpoint", "{no_mtp}"], "is the draft model of --drafter draft-model"),
    "seed without sampling": (["--seed", "3"], "--seed needs --temperature > 0"),
    "top-p and seed without sampling": (["--top-p", "0.9", "--seed", "3"], "--top-p, --seed need --temperature > 0"),
    "draft model of another tokenizer": (
        ["--drafter", "draft-model", "--draft-checkpoint", "{no_mtp}"],
        "DraftModel: vocabulary of \\d+ tokens against the target's 8192",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_user_errors_are_one_line_with_status_2(bad_dirs, capsys, case):
    extra, message = CLI_CASES[case]
    argv = ["generate", "--prompt", "def f():", *[a.format(**bad_dirs) for a in extra]]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("jspec generate: error: ")
    assert re.search(message, err), err


def test_cli_prompt_is_positional_or_an_option(capsys):
    """`jspec generate "text"` is `jspec generate --prompt "text"`; with none of them (nor --prompt-file,
    --prompt-ids) the error names all four."""
    outs = []
    for argv in (["def add(a, b):"], ["--prompt", "def add(a, b):"]):
        assert cli.main(["generate", *argv, "--max-new-tokens", "6", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["prompt_tokens"] == outs[1]["prompt_tokens"] > 0 and outs[0]["tokens"] == outs[1]["tokens"]
    assert cli.main(["generate", "--max-new-tokens", "6"]) == 2
    assert "one of the arguments PROMPT --prompt --prompt-file --prompt-ids is required" in capsys.readouterr().err


def test_cli_takes_the_prompt_as_token_ids(bad_dirs, capsys):
    """`--prompt-ids` runs what the text's tokens run (the demo model), and runs a checkpoint without tokenizer.json,
    whose text prompt is refused naming the option and whose new tokens print as ids; bad ids are one-line errors."""
    argv = ["generate", "--max-new-tokens", "6", "--json"]
    assert cli.main([*argv, "--prompt", "def add(a, b):"]) == 0
    by_text = json.loads(capsys.readouterr().out)
    ids = jspec.load("demo").encode("def add(a, b):")
    assert cli.main([*argv, "--prompt-ids", ", ".join(map(str, ids))]) == 0
    by_ids = json.loads(capsys.readouterr().out)
    assert by_ids["prompt_tokens"] == len(ids) and by_ids["tokens"] == by_text["tokens"]
    assert by_ids["text"] == by_text["text"] != ""
    no_tokenizer = ["generate", "--checkpoint", str(bad_dirs["no_mtp"]), "--max-new-tokens", "5", "--ignore-eos"]
    assert cli.main([*no_tokenizer, "--prompt", "def"]) == 2
    assert "no tokenizer.json in" in (err := capsys.readouterr().err) and "give the prompt as --prompt-ids" in err
    assert cli.main([*no_tokenizer, "--prompt-ids", "3 1 4 1"]) == 0
    shown = capsys.readouterr().out.splitlines()[0].split()
    assert shown[:5] == ["3", "1", "4", "1", "->"] and len(shown[5:]) == 5 and all(t.isdecimal() for t in shown[5:])
    for ids, message in (
        ("1,x", "--prompt-ids: expected integers separated by commas or spaces, got 'x'"),
        ("1 1000000", "--prompt-ids: token id 1000000 at index 1 is out of range for vocab_size"),
        ("-2", "--prompt-ids: token id -2 at index 0 is out of range"),
        (" , ", "--prompt-ids is empty"),
    ):
        assert cli.main([*no_tokenizer, "--prompt-ids", ids]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, err


def test_cli_prompt_file_errors_name_the_file(bad_dirs, capsys):
    for name, message in (("latin1.txt", "not UTF-8 text"), ("nope.txt", "No such file")):
        path = bad_dirs["root"] / name
        assert cli.main(["generate", "--prompt-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and message in err and err.count("\n") == 1


def test_cli_convert_checks_the_target_first(bad_dirs, capsys):
    assert cli.main(["convert", str(bad_dirs["config_only"]), str(bad_dirs["root"] / "full")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_cli_inspect_reports_the_checkpoint_named_either_way(bad_dirs, capsys, tmp_path):
    """`jspec inspect demo-hybrid` and `--model demo-hybrid` print the same JSON: the format (what the load checked),
    the config and the weight counts; two different checkpoints, or a directory that is none, are one-line errors."""
    build_tiny_hf_model("qwen2", tmp_path)
    assert cli.main(["inspect", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["format"].startswith("HuggingFace safetensors: no checksums")
    assert cli.main(["inspect", "demo-hybrid"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert cli.main(["inspect", "--model", "demo-hybrid"]) == 0
    assert json.loads(capsys.readouterr().out) == info
    assert info["checkpoint"].endswith("demo_hybrid") and info["config"]["family"] == "qwen3_5"
    assert info["format"] == "jspec-params v2: every array matched its CRC-32"
    assert info["int4_params"] > 10**7 and 0 < info["dense_params"] < info["int4_params"] and info["bytes"] > 0
    for argv, message in (
        (["inspect", "demo", "--checkpoint", "demo-hybrid"], "two checkpoints given: 'demo' and --checkpoint"),
        (["inspect", str(bad_dirs["root"])], "neither jspec.json .* nor config.json"),
    ):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("jspec inspect: error: ")
        assert re.search(message, err), err


def test_cli_compare_greedy_times_warmed_runs(capsys):
    """With the bundled draft model (`--drafter draft-model` on the demo model)."""
    argv = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--compare-greedy", "--json"]
    assert cli.main([*argv, "--drafter", "draft-model"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft_checkpoint"].endswith("demo_drafter") and out["stats"]["verify_steps"] > 0
    assert out["greedy_identical"] and out["warmup_s_with_compile"] > 0 and out["speedup_vs_greedy"] > 0
    assert "first_call_s_with_compile" not in out  # the timed runs exclude compilation


def test_cli_generates_with_the_bundled_hybrid_and_its_mtp_head(capsys):
    """`--model demo-hybrid` (an alias of --checkpoint) runs the bundled Gated DeltaNet hybrid; its MTP head drafts
    and the tokens are greedy's, from the whole vocabulary and from 2048 of its 8192 tokens (`--mtp-vocab`);
    `jspec.load("demo-hybrid")` is the same checkpoint."""
    argv = ["generate", "--model", "demo-hybrid", "--prompt", "def add(a, b):", "--max-new-tokens", "12"]
    assert cli.main([*argv, "--drafter", "mtp", "--k", "2", "--compare-greedy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"].endswith("demo_hybrid") and out["stats"]["verify_steps"] > 0
    assert out["greedy_identical"] and out["stats"]["accepted"] > 0
    assert cli.main([*argv, "--drafter", "mtp", "--k", "2", "--mtp-vocab", "2048", "--json"]) == 0
    over = json.loads(capsys.readouterr().out)
    assert over["mtp_vocab"] == 2048 and over["tokens"] == out["tokens"] and over["stats"]["accepted"] > 0
    model = jspec.load("demo-hybrid")
    assert model.cfg.family == "qwen3_5" and model.cfg.num_mtp_layers == 1 and model.path == out["checkpoint"]


def test_cli_reuses_the_executables_an_earlier_run_compiled(tmp_path):
    """`--compile-cache DIR`: a second run with the same settings loads every executable the first one stored in DIR
    (none is written again) and gives the same tokens; `off` keeps none. Run as subprocesses: the cache is jax's
    process-wide configuration. The second run may add entries: jax stores what took over the CLI's 0.5 s to compile,
    and a 2-core machine under load moves a compile across that line (a CI run's second run stored the "first
    round" executable the first run had compiled under it)."""
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "jspec", "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--json"]

    def run(where: str) -> tuple[dict, str]:
        env = dict(os.environ, JAX_LOG_COMPILES="1")  # jax then logs each cache hit with its key
        done = subprocess.run([*argv, "--compile-cache", where], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout), done.stderr

    first, _ = run(str(cache))
    stored = {p.name.removesuffix("-cache"): p.stat().st_mtime_ns for p in cache.iterdir()}
    second, log = run(str(cache))
    assert first["compile_cache"] == second["compile_cache"] == str(cache) and stored
    hits = set(re.findall(r"Persistent compilation cache hit for '[^']*' with key '([^']*)'", log))
    assert set(stored) <= hits, sorted(set(stored) - hits)  # every stored executable loaded
    assert {key: (cache / f"{key}-cache").stat().st_mtime_ns for key in stored} == stored  # none written again
    assert second["tokens"] == first["tokens"]
    assert run("off")[0]["compile_cache"] is None


def test_on_device_stats_print_no_zeros():
    stats = dataclasses.replace(SpecStats(), loop="device", new_tokens=4, wall_time_s=0.5, decode_steps=3)
    text = stats.summary()
    assert "on device" in text and "prefill 0.000" not in text and "(0.000 s)" not in text


# ------------------------------------------------------------------------------- names reachable via jspec
def test_jspec_reaches_exactness_and_checkpoints():
    assert callable(jspec.exactness.verify_rows_match_decode)
    assert jspec.load_hf.__module__ == jspec.save.__module__ == "jspec.model"


def test_a_checkpoints_folder_in_the_working_directory_does_not_shadow(tmp_path):
    (tmp_path / "checkpoints").mkdir()  # a data folder, as ML projects have
    script = "import jspec, checkpoints; assert callable(checkpoints.load_hf); print(len(jspec.load().params))"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},  # jspec as installed (editable: the case that shadowed)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
