"""MTP heads and MTPDrafter: the forward against an independent torch reference, checkpoint import of both layouts,
the drafter's KV-cached steps against the full-sequence forward, and speculative == plain greedy."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
import jspec
from jspec.accept import greedy_accept
from jspec.loop import LoopSettings, eos_array, prefill_round
from jspec.models import dense, family_module
from jspec.models.layers import Run
from jspec.models.mtp import init_mtp_params, mtp_forward, mtp_layer
from jspec.state import init_state
from jspec.steps import finish_prefill, prefill_chunk, write_prompt
from pallas_kernels import Int4Weight, dequantize, quantize
from tests.conftest import TINY_HF_CONFIGS, build_tiny_hf_model, randomize_
from tests.tiny import tiny_config, tiny_params

MAX_LEN = 64
LINEARS = ("qkv", "o", "gate_up", "down")


# ----------------------------------------------------------------------------------- torch reference + checkpoints
def _mtp_modules(main, num_layers: int, seed: int):
    """Random torch MTP layers (enorm, hnorm, eh_proj, mtp_block = the family's decoder layer, post_norm) built by
    transformers' MtpModel for `main`; embedding and head stay the main model's."""
    from transformers.modeling_layers import MtpModel

    main.config.num_mtp_layers = num_layers
    main.config.mtp_layer_types = ["full_attention"] * num_layers
    modules = MtpModel(main, num_layers).float().eval()
    randomize_(modules.layers, seed)
    return modules


def reference_mtp_logits(main, layer, hidden: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
    """The MTP forward as published (DeepSeek-V3 report 2.2; vLLM deepseek_mtp / qwen3_next_mtp), in torch:
    logits[t] = lm_head(final_norm(block(eh_proj([enorm(embed(next_tokens[t])); hnorm(hidden[t])]), pos t)))."""
    import torch

    t = hidden.shape[0]
    with torch.no_grad():
        h = torch.from_numpy(np.asarray(hidden, np.float32))[None]
        emb = main.model.embed_tokens(torch.from_numpy(np.asarray(next_tokens, np.int64))[None])
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = layer.mtp_block(x, attention_mask=mask, position_ids=pos, position_embeddings=main.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        return main.lm_head(layer.post_norm(x))[0].numpy()


def _hf_name(layout: str, base: int, i: int, name: str) -> str:
    """MtpModel layer tensor name -> the checkpoint name of `layout` (MTP layer i, main model of `base` layers)."""
    if layout == "qwen3_next":
        shared = {
            "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
            "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
            "eh_proj.weight": "mtp.fc.weight",
            "post_norm.weight": "mtp.norm.weight",
        }
        return shared.get(name) or name.replace("mtp_block.", f"mtp.layers.{i}.")
    pre = f"model.layers.{base + i}"
    if name == "post_norm.weight":
        return f"{pre}.shared_head.norm.weight"
    return f"{pre}.{name.replace('mtp_block.', '')}"


def write_mtp_checkpoint(
    variant: str, out_dir, layout: str, num_layers: int, *, declare: int | None = None, edit=None, seed: int = 0
):
    """A tiny HF checkpoint of `variant` with random MTP layers in `layout` added to its safetensors.

    declare: the MTP layer count written into config.json (None: no key). edit(tensors) may alter the tensors.
    Returns (main torch model, MtpModel with the MTP layers)."""
    from safetensors.torch import load_file, save_file

    main = build_tiny_hf_model(variant, out_dir, seed=seed)
    modules = _mtp_modules(main, num_layers, seed + 1)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    base = main.config.num_hidden_layers
    for i, layer in enumerate(modules.layers):
        for name, value in layer.state_dict().items():
            tensors[_hf_name(layout, base, i, name)] = value.detach().clone().contiguous()
    if edit is not None:
        edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    if declare is not None:
        config_path = os.path.join(out_dir, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        key = "mtp_num_hidden_layers" if layout == "qwen3_next" else "num_nextn_predict_layers"
        config[key] = declare
        with open(config_path, "w") as f:
            json.dump(config, f)
    return main, modules


def _main_hidden(main, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return main.model(torch.from_numpy(ids.astype(np.int64))[None]).last_hidden_state[0].numpy()


# (variant, layout, MTP layers, config key written)
CHECKPOINT_CASES = [
    ("qwen2", "deepseek", 2, 2),
    ("llama", "deepseek", 1, None),  # no config key: the count comes from the tensor names
    ("qwen3_next", "qwen3_next", 1, None),  # Qwen3-Next's config.json carries no MTP count
    ("qwen3_5", "qwen3_next", 1, 1),  # Qwen3.5: mtp_num_hidden_layers
]


@pytest.mark.parametrize("variant,layout,num_layers,declare", CHECKPOINT_CASES)
def test_mtp_forward_matches_reference(tmp_path, variant, layout, num_layers, declare):
    main, modules = write_mtp_checkpoint(variant, tmp_path, layout, num_layers, declare=declare)
    params, cfg = checkpoints.load_hf(tmp_path)
    assert (cfg.num_mtp_layers, cfg.mtp_layout) == (num_layers, layout)
    assert len(params["mtp"]) == num_layers
    vocab = TINY_HF_CONFIGS[variant][1]["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, size=40)
    hidden = _main_hidden(main, ids)
    rng = np.random.default_rng(1)
    for i in range(num_layers):
        # Layer 0 reads the main model's hidden; deeper layers are checked on an arbitrary hidden input.
        h = hidden[:-1] if i == 0 else rng.normal(size=hidden[:-1].shape).astype(np.float32)
        expected = reference_mtp_logits(main, modules.layers[i], h, ids[1:])
        got = np.asarray(mtp_forward(params, cfg, jnp.asarray(h), jnp.asarray(ids[1:]), layer_index=i))
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=2e-4)
        assert np.mean(got.argmax(-1) == expected.argmax(-1)) == 1.0


def test_reference_agrees_with_transformers_mtp_model(tmp_path):
    """Cross-check of the small reference against transformers' own MtpModel on the same weights."""
    import torch

    main, modules = write_mtp_checkpoint("qwen2", tmp_path, "deepseek", 1)
    ids = np.random.default_rng(2).integers(0, 384, size=24)
    hidden = _main_hidden(main, ids)
    with torch.no_grad():
        out = modules.forward_layer(
            0,
            torch.from_numpy(hidden[:-1])[None],
            torch.arange(23)[None],
            None,
            input_ids=torch.from_numpy(ids[1:])[None],
        )
        expected = main.lm_head(out)[0].numpy()
    np.testing.assert_allclose(reference_mtp_logits(main, modules.layers[0], hidden[:-1], ids[1:]), expected, atol=1e-5)


def test_load_int4_quantizes_fc_and_layer(tmp_path):
    """quantize="int4" applies to the MTP fc and the MTP decoder layer's linears: each is exactly the int4
    quantization of the float import."""
    write_mtp_checkpoint("qwen2", tmp_path, "deepseek", 1, declare=1)
    dense_params, _ = checkpoints.load_hf(tmp_path)
    params, cfg = checkpoints.load_hf(tmp_path, quantize="int4")
    head, dense_head = params["mtp"][0], dense_params["mtp"][0]
    pairs = [(head["fc"], dense_head["fc"])] + [(head["layer"][n], dense_head["layer"][n]) for n in LINEARS]
    for w, w_dense in pairs:
        assert isinstance(w, Int4Weight)
        assert np.array_equal(np.asarray(dequantize(w)), np.asarray(dequantize(quantize(w_dense))))
    h = jax.random.normal(jax.random.PRNGKey(0), (20, cfg.hidden_size))
    tokens = jnp.arange(20, dtype=jnp.int32)
    got, want = mtp_forward(params, cfg, h, tokens), mtp_forward(dense_params, cfg, h, tokens)
    assert float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want**2))) < 0.3  # int4 noise on a tiny model


def test_shared_head_copy_must_equal_lm_head(tmp_path):
    def copy_head(tensors):
        tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()

    write_mtp_checkpoint("qwen2", tmp_path / "same", "deepseek", 1, declare=1, edit=copy_head)
    params, cfg = checkpoints.load_hf(tmp_path / "same")
    assert cfg.num_mtp_layers == 1 and "lm_head" in params

    def other_head(tensors):
        tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"] * 2

    write_mtp_checkpoint("qwen2", tmp_path / "other", "deepseek", 1, declare=1, edit=other_head)
    with pytest.raises(checkpoints.CheckpointError, match=r"model\.layers\.2\.shared_head\.head\.weight differs"):
        checkpoints.load_hf(tmp_path / "other")


def test_checkpoint_errors_name_the_tensor(tmp_path):
    # Config declares 2 MTP layers, the checkpoint has 1.
    write_mtp_checkpoint("qwen2", tmp_path / "short", "deepseek", 1, declare=2)
    with pytest.raises(checkpoints.CheckpointError, match=r"model\.layers\.3\.enorm\.weight"):
        checkpoints.load_hf(tmp_path / "short")

    def bad_shape(tensors):
        tensors["model.layers.2.eh_proj.weight"] = tensors["model.layers.2.eh_proj.weight"][:, :64].contiguous()

    write_mtp_checkpoint("qwen2", tmp_path / "shape", "deepseek", 1, declare=1, edit=bad_shape)
    with pytest.raises(checkpoints.CheckpointError, match=r"model\.layers\.2\.eh_proj\.weight.*shape"):
        checkpoints.load_hf(tmp_path / "shape")

    def drop_norm(tensors):
        del tensors["mtp.norm.weight"]

    write_mtp_checkpoint("qwen3_next", tmp_path / "q3n", "qwen3_next", 1, edit=drop_norm)
    with pytest.raises(checkpoints.CheckpointError, match=r"mtp\.norm\.weight"):
        checkpoints.load_hf(tmp_path / "q3n")


def test_stripped_mtp_weights_load_without_mtp(tmp_path):
    def strip(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            del tensors[name]

    write_mtp_checkpoint("qwen2", tmp_path, "deepseek", 1, declare=1, edit=strip)
    with pytest.warns(UserWarning, match="no MTP tensors"):
        params, cfg = checkpoints.load_hf(tmp_path)
    assert cfg.num_mtp_layers == 0 and "mtp" not in params
    with pytest.raises(ValueError, match="MTPDrafter needs the model's MTP head"):
        jspec.generate(params, cfg, [1, 2, 3], 4, drafter=jspec.MTPDrafter())


# ------------------------------------------------------------------------------------------- native tiny models
@functools.cache
def mtp_model(family: str = "qwen2", num_layers: int = 1, dtype: str = "float32"):
    cfg = dataclasses.replace(tiny_config(family), num_mtp_layers=num_layers, mtp_layout="deepseek")
    params = tiny_params(cfg, jnp.dtype(dtype), seed=1)
    params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(7), jnp.dtype(dtype), num_layers)
    return params, cfg


@functools.cache
def mtp_engine(family: str = "qwen2", num_layers: int = 1, k: int = 3, dtype: str = "float32") -> jspec.Engine:
    params, cfg = mtp_model(family, num_layers, dtype)
    return jspec.Engine(params, cfg, max_len=MAX_LEN, k=k)


@functools.cache
def greedy(family: str, num_layers: int, dtype: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    return mtp_engine(family, num_layers, 1, dtype).generate(list(prompt), max_new).tokens


@pytest.mark.parametrize(
    "family,num_layers,k,dtype,on_device",
    [
        ("qwen2", 1, 3, "float32", False),  # k > layers: chains the layer
        ("qwen2", 1, 3, "float32", True),
        ("llama", 2, 1, "bfloat16", False),  # k < layers: the first layer only (k > 2 layers: the steps test)
    ],
)
def test_mtp_speculative_equals_greedy(family, num_layers, k, dtype, on_device):
    """Random MTP heads (drafts mostly rejected), no gate: the rounds verify; output == plain greedy."""
    eng = mtp_engine(family, num_layers, k, dtype)
    for prompt in ([3], [5, 17, 3, 42, 8, 8, 9, 1, 77, 30, 2, 11, 4]):  # 1 token: layer-1 rows roll out of the tile
        expected = greedy(family, num_layers, dtype, tuple(prompt), 30)
        result = eng.generate(prompt, 30, drafter=jspec.MTPDrafter(), on_device=on_device)
        assert result.tokens == expected
        assert result.stats.verify_steps >= result.stats.steps - 1  # the last round may lack room to draft


def test_drafter_steps_match_full_forward():
    """Commit greedy tokens through verify steps of varying acceptance (0..k accepted, so the drafter processes
    1..k+1 new rows per round) and check the drafter against the full-sequence MTP forward: draft[0] at each
    round, and every MTP layer's KV cache rows at real positions at the end."""
    num_layers = 2  # layer 0 as with one layer, plus the lagged real rows of a deeper layer
    params, cfg = mtp_model("qwen2", num_layers)
    k, prompt, max_new = 4, [5, 17, 3, 42, 8, 8, 9], 40
    truth = np.asarray(prompt + greedy("qwen2", num_layers, "float32", tuple(prompt), max_new), np.int32)
    drafter = jspec.MTPDrafter()

    @jax.jit
    def start(padded, length):  # the prompt as one chunk: its hidden rows are the full forward's
        state = write_prompt(init_state(cfg, MAX_LEN, jnp.float32), padded)
        state = dataclasses.replace(state, drafter=drafter.init(params, cfg, state))
        state, hidden = prefill_chunk(params, cfg, state, 0, length, padded.shape[0])
        state = dataclasses.replace(state, drafter=drafter.prefill(params, cfg, state, hidden, 0, length, length))
        state, _ = finish_prefill(params, cfg, state, length)
        return propose(state), hidden

    def propose(state):  # -> (state holding the drafter's new state, draft, n_valid)
        mine, draft, n_valid = drafter.propose(params, cfg, state, k)
        return dataclasses.replace(state, drafter=mine), draft, n_valid

    @jax.jit
    def round_(state, draft):
        state, logits = jspec.verify_step(params, cfg, state, draft)
        n_acc, token = greedy_accept(draft, logits, jnp.asarray(k, jnp.int32))
        state = jspec.commit(state, n_acc, token)
        return propose(state), n_acc

    padded = np.zeros((16,), np.int32)
    padded[: len(prompt)] = prompt
    (state, draft, _), prompt_hidden = start(padded, len(prompt))
    rng = np.random.default_rng(0)
    hidden = np.zeros((MAX_LEN, cfg.hidden_size), np.float32)
    hidden[: len(prompt)] = np.asarray(prompt_hidden[: len(prompt)])
    drafts = {}  # last committed position -> draft[0]
    while int(state.position) + k + 1 < len(truth):
        p, slot = int(state.position) - 1, int(state.slot)
        hidden[p - slot : p + 1] = np.asarray(state.hidden[: slot + 1])
        drafts[p] = int(draft[0])
        wrong = int(rng.integers(0, k + 1))  # first wrong draft token (k: all right)
        forced = truth[p + 2 : p + 2 + k].copy()
        forced[wrong:] = (forced[wrong:] + 1) % cfg.vocab_size
        (state, draft, _), n_acc = round_(state, jnp.asarray(forced))
        assert int(n_acc) == wrong
    p = int(state.position) - 1
    hidden[p - int(state.slot) : p + 1] = np.asarray(state.hidden[: int(state.slot) + 1])
    t = p + 1  # real positions 0..p for layer 0

    # draft[0] == argmax of the full forward at that position (where the reference has a clear top token).
    ref = np.asarray(mtp_forward(params, cfg, jnp.asarray(hidden[:t]), jnp.asarray(truth[1 : t + 1])))
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = [q for q in drafts if top2[q, 1] - top2[q, 0] > 1e-3]
    assert len(clear) >= 0.9 * len(drafts) > 10
    assert all(drafts[q] == int(ref[q].argmax()) for q in clear)

    # KV caches: layer i's rows at real positions 0..p-i equal the prefill-path forward over the whole sequence.
    chain = jnp.asarray(hidden[:t])
    for i in range(num_layers):
        cache = state.drafter["cache"][i]
        empty = jnp.zeros_like(cache)
        tokens = jnp.asarray(truth[i + 1 : t + i + 1])
        chain, _, full = mtp_layer(params, cfg, chain, tokens, empty, Run.prefill(0, t), i)
        np.testing.assert_allclose(np.asarray(cache[: t - i]), np.asarray(full[: t - i]), atol=2e-5, rtol=1e-4)


@functools.cache
def trained_head_model():
    """(params with an MTP head trained on the model's own greedy continuations, cfg, prompts, sequences int32
    [3, 47]): MTP loss only, the main model frozen."""
    import optax

    params, cfg = mtp_model("qwen2", 1)
    prompts = [[5, 17, 3, 42, 8, 8, 9], [60, 2, 2, 71, 33, 1, 50], [11, 90, 4, 4, 4, 18, 52]]
    seqs = jnp.asarray([p + greedy("qwen2", 1, "float32", tuple(p), 40) for p in prompts], jnp.int32)
    hidden = jax.jit(jax.vmap(lambda s: dense.forward(params, cfg, s)))(seqs)

    def loss_fn(head):
        logits = jax.vmap(lambda h, s: mtp_forward({**params, "mtp": head}, cfg, h[:-2], s[1:-1]))(hidden, seqs)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), seqs[:, 2:, None], axis=-1))

    opt = optax.adam(1e-2)

    @jax.jit
    def train_step(head, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(head)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(head, updates), opt_state, loss

    head = params["mtp"]
    opt_state = opt.init(head)
    for _ in range(60):
        head, opt_state, loss = train_step(head, opt_state)
    assert float(loss) < 0.2
    return {**params, "mtp": head}, cfg, prompts, np.asarray(seqs)


def test_trained_mtp_head_is_accepted():
    """An MTP head trained on the model's own greedy continuations gets its drafts accepted (a wiring error would
    make them random: ~1/96 acceptance); output stays plain greedy."""
    params, cfg, prompts, seqs = trained_head_model()
    eng = jspec.Engine(params, cfg, max_len=MAX_LEN, k=2)
    gate = jspec.HitDensityGate(window=4, min_hits=2)
    for prompt, seq in zip(prompts, seqs, strict=True):
        for gated, on_device in ((False, False), (True, True)):
            result = eng.generate(
                prompt, 40, drafter=jspec.MTPDrafter(), gate=gate if gated else None, on_device=on_device
            )
            assert result.tokens == list(seq[len(prompt) :])
            assert result.stats.mean_accepted > 1.5, result.stats.mean_accepted


def test_a_drafter_over_some_tokens_drafts_only_them():
    """MTPDrafter.over(params, ids): over the whole vocabulary (in any order) it drafts what MTPDrafter drafts; over
    the tokens the continuations use it keeps the trained head's acceptance; over the others nothing it drafts is
    accepted. Every output is plain greedy's, and plain sampling's under a Sampler (coupled drafting)."""
    params, cfg, prompts, seqs = trained_head_model()
    eng = jspec.Engine(params, cfg, max_len=MAX_LEN, k=2)
    used = np.unique(seqs)
    unused = np.setdiff1d(np.arange(cfg.vocab_size), used)
    drafters = {
        "whole": jspec.MTPDrafter(),
        "permuted": jspec.MTPDrafter.over(params, np.random.default_rng(0).permutation(cfg.vocab_size)),
        "used": jspec.MTPDrafter.over(params, used[::-1]),
        "unused": jspec.MTPDrafter.over(params, unused),
    }
    assert drafters["used"] != drafters["whole"] and drafters["permuted"] != drafters["whole"]
    assert drafters["used"] == jspec.MTPDrafter.over(params, unused[: used.size])  # same shapes: same executables
    for prompt, seq in zip(prompts, seqs, strict=True):
        runs = {name: eng.generate(prompt, 40, drafter=d) for name, d in drafters.items()}
        assert all(r.tokens == list(seq[len(prompt) :]) for r in runs.values())
        accepted = {name: r.stats.per_position_acceptance for name, r in runs.items()}
        assert accepted["permuted"] == accepted["whole"]
        assert runs["used"].stats.mean_accepted > 1.5 and runs["unused"].stats.accepted == 0
    sampler = jspec.Sampler(temperature=0.8, seed=5)
    plain = eng.generate(prompts[0], 40, sampler=sampler).tokens
    for on_device in (False, True):
        out = eng.generate(prompts[0], 40, sampler=sampler, drafter=drafters["used"], on_device=on_device)
        assert out.tokens == plain and out.stats.verify_steps > 0


def test_a_drafter_over_tokens_takes_their_head_rows():
    """The copied head is the lm_head's columns of those tokens: an int4 lm_head's codes and scales, a dense one's
    columns, a tied embedding's rows; `prompt_first` puts the prompt's tokens first; bad token ids are refused."""
    from jspec.drafters.mtp import _head_rows, prompt_first
    from jspec.models import quantize_linears

    params, cfg = mtp_model("qwen2", 1)
    ids = jnp.asarray([7, 3, 90, 0], jnp.int32)
    for case in (params, quantize_linears(params), {n: v for n, v in params.items() if n != "lm_head"}):
        head = case.get("lm_head", case["embed"].T)
        want = dequantize(head, jnp.float32) if isinstance(head, Int4Weight) else head
        rows = _head_rows(case, ids)
        got = dequantize(rows, jnp.float32) if isinstance(rows, Int4Weight) else rows
        assert np.array_equal(np.asarray(got), np.asarray(want)[:, np.asarray(ids)])
    assert prompt_first([5, 5, 9, 2], np.arange(96), 6).tolist() == [5, 2, 9, 0, 1, 3]  # most repeated first
    assert prompt_first([5, 5, 9, 2], np.arange(96), 2).tolist() == [5, 2]
    with pytest.raises(ValueError, match="give 2 distinct tokens, not 3"):
        prompt_first([1], [1, 4], 3)
    for bad, message in (
        ([], "token_ids is empty"),
        ([1, 96], "token_ids: token id 96 at index 1 is out of range for vocab_size 96"),
        ([2, 2], "repeat an id"),
    ):
        with pytest.raises(ValueError, match=message):
            jspec.MTPDrafter.over(params, np.asarray(bad, np.int64))


def test_mtp_drafter_bad_input():
    params, cfg = mtp_model("qwen2", 1)
    with pytest.raises(ValueError, match="MTPDrafter k must be"):
        jspec.MTPDrafter(k=16)
    plain = {n: v for n, v in params.items() if n != "mtp"}
    with pytest.raises(ValueError, match="MTPDrafter needs the model's MTP head"):
        jspec.generate(plain, cfg, [1, 2, 3], 4, drafter=jspec.MTPDrafter())
    with pytest.raises(ValueError, match="mtp_layout"):
        mtp_forward(params, dataclasses.replace(cfg, mtp_layout=None), jnp.zeros((4, 64)), jnp.zeros((4,), jnp.int32))
    two = mtp_model("qwen2", 2)
    with pytest.raises(ValueError, match="k \\+ layers"):
        jspec.generate(*two, [1, 2, 3], 20, drafter=jspec.MTPDrafter(), k=15)


def test_mtp_drafter_names_a_missing_or_misshaped_tensor():
    """Hybrid target (Qwen3-Next layout): an MTP head built by hand with a tensor missing, mis-shaped or extra is
    refused when the drafter traces, naming that tensor."""
    model_type, kwargs = TINY_HF_CONFIGS["qwen3_next"]
    cfg = jspec.ModelConfig.from_hf(dict(kwargs, model_type=model_type, mtp_num_hidden_layers=1))
    params = family_module(cfg).init_params(cfg, jax.random.PRNGKey(3), jnp.float32)
    head = init_mtp_params(cfg, jax.random.PRNGKey(4), jnp.float32)[0]
    cases = {
        "params\\['mtp'\\]\\[0\\]\\['fc'\\] is missing": {k: v for k, v in head.items() if k != "fc"},
        "\\['layer'\\]\\['o'\\] has shape": dict(head, layer=dict(head["layer"], o=head["layer"]["o"][:, :-1])),
        "\\['bias'\\] is not a tensor": dict(head, bias=jnp.zeros(3)),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            jspec.generate(dict(params, mtp=[bad]), cfg, [1, 2, 3], 4, drafter=jspec.MTPDrafter(), k=2)


def test_hybrid_mtp_speculative_equals_greedy():
    """Qwen3-Next layout on a tiny qwen3_next model with a random MTP head: speculative == plain greedy."""
    model_type, kwargs = TINY_HF_CONFIGS["qwen3_next"]
    cfg = jspec.ModelConfig.from_hf(dict(kwargs, model_type=model_type, mtp_num_hidden_layers=1))
    assert (cfg.num_mtp_layers, cfg.mtp_layout) == (1, "qwen3_next")
    params = family_module(cfg).init_params(cfg, jax.random.PRNGKey(3), jnp.float32)
    params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(4), jnp.float32)
    eng = jspec.Engine(params, cfg, max_len=MAX_LEN, k=3)
    prompt = [5, 17, 3, 42, 8, 8, 9, 1, 77, 30]
    expected = eng.generate(prompt, 30).tokens
    result = eng.generate(prompt, 30, drafter=jspec.MTPDrafter())
    assert result.tokens == expected
    assert result.stats.verify_steps > 0


def test_chunked_prefill_fills_the_mtp_caches_as_one_chunk():
    """A 30-token prompt in chunks of 8 (the last padded) leaves every MTP layer's cache and the carry its first
    round reads as a one-chunk prefill does (float32 rounding), and MTP speculation still gives greedy's tokens."""
    params, cfg = mtp_model("qwen2", 2)
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 30).astype(np.int32)
    loops = []
    for chunk in (8, 32):
        settings = LoopSettings(max_len=MAX_LEN, k=3, drafter=jspec.MTPDrafter(), prefill_chunk=chunk)
        run = jax.jit(lambda p, x, s=settings: prefill_round(p, cfg, s, x, jnp.int32(30), 10, eos_array((), cfg)))
        loops.append(run(params, np.pad(prompt, (0, 2))))
    chunked, whole = (loop.state.drafter for loop in loops)
    for a, b in zip(chunked["cache"], whole["cache"], strict=True):
        np.testing.assert_allclose(np.asarray(a[:32]), np.asarray(b[:32]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked["carry"]), np.asarray(whole["carry"]), rtol=1e-5, atol=1e-5)
    engine = jspec.Engine(params, cfg, max_len=MAX_LEN, k=3, prefill_chunk=8)
    expected = greedy("qwen2", 2, "float32", tuple(prompt.tolist()), 20)
    assert engine.generate(prompt.tolist(), 20, drafter=jspec.MTPDrafter()).tokens == expected


def donated_aliases(executable) -> list[tuple[int, int]]:
    """(output leaf, parameter) of each buffer the compiled executable donates, from its HLO module's header."""
    header = executable.as_text().split("\n", 1)[0]
    return [(int(out), int(param)) for out, param in re.findall(r"\{(\d+)\}: \((\d+), \{\}, \w+-alias\)", header)]


def test_every_donated_loop_leaf_aliases_its_own_output():
    """Each executable that takes the Loop (or the batch) donated hands every leaf's buffer to that same leaf's
    output. With unused arguments pruned (jax.jit's keep_unused=False) JAX paired donated buffers with other outputs
    of the same shape, crossing the first round's int32 scalars; on the H200 that executable returned a wrong n_out
    after a chunked prefill (docs/exactness.md, the host-loop MTP fault; Engine._compile)."""
    params, cfg = mtp_model("qwen2", 2)
    engine = jspec.Engine(params, cfg, max_len=MAX_LEN, k=3, prefill_chunk=8, batch_size=2)
    prompt = list(range(1, 31))
    engine.generate(prompt, 8, drafter=jspec.MTPDrafter())
    engine.generate_batch([prompt, prompt[:5]], 4, drafter=jspec.MTPDrafter())
    n_weights = len(jax.tree.leaves(engine._weights(jspec.MTPDrafter())))
    donating = {"prefill8", "first", "decode", "verify", "batch-fill", "batch-rounds"}
    assert donating <= {key[0] for key in engine._executables}
    for key, executable in engine._executables.items():
        if key[0] not in donating:
            continue
        loop = executable.out_info[0] if key[0] == "batch-rounds" else executable.out_info  # (batch, occupancy)
        n_leaves = len(jax.tree.leaves(loop))
        expected = [(i, n_weights + i) for i in range(n_leaves)]
        assert donated_aliases(executable) == expected, key[0]
