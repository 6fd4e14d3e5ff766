"""`jspec bench --quick` (CPU, tiny shapes): the JSON carries every figure, the plots and README table are drawn from
it, the budget skips sections with a reason, and a broken speculative path fails the bench (exit 1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec_bench
from jspec import cli
from jspec.models import dense
from jspec.models.layers import Run
from jspec_bench import hybrid, plots, sections, shapes, steps, timing
from tests.tiny import tiny_config, tiny_params


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = jspec_bench.main(["--quick", "--peer-hf", "--out", str(out / "r.json"), "--plots", str(out / "plots")])
    return rc, json.loads((out / "r.json").read_text()), out


def test_quick_run_passes_and_records_the_run(quick):
    rc, data, _ = quick
    assert rc == 0 and data["ok"]
    meta = data["meta"]
    assert meta["mode"] == "quick" and meta["jax"] == jax.__version__ and meta["kernel_backend"] == "reference"
    assert meta["commit"] and meta["device"] and meta["elapsed_s"] > 0
    statuses = {name: s["status"] for name, s in data["sections"].items()}
    assert statuses == dict.fromkeys(sections.SECTIONS, "done") | {"tp": "skipped"}  # tp: one device here
    assert data["sections"]["tp"]["reason"] == "1 device: tensor parallelism needs 2 or more (issue 38)"
    assert data["identity"]["ok"] and data["identity"]["checks"] > 10 and not data["identity"]["failures"]
    roof = data["sections"]["roofline"]
    assert roof["roofline_Bps"] == max(roof["xla_sum_Bps"], roof["torch_sum_Bps"]) > 0


def test_quick_step_costs(quick):
    _, data, _ = quick
    models = {**data["sections"]["steps"]["models"], **data["sections"]["other_steps"]["models"]}
    assert set(models) == {"llama-3-8b", "glm-4-9b"}
    for m in models.values():
        decode = m["decode"]
        assert decode["time_s"] > 0 and m["compiles_during_timing"] == 0 and m["num_compiles"] >= 2
        b = decode["bytes"]
        assert b["total"] == b["weights"] + b["cache"] and b["state_writes"] == 0  # dense: no recurrent states
        assert b["weights"] > 0 < b["cache"]
        assert decode["roofline_fraction"] == pytest.approx(
            decode["achieved_Bps"] / data["sections"]["roofline"]["roofline_Bps"]
        )
        # CPU: the reference backend's prepared (dequantized) weights, and the weights as loaded for the ratio
        raw = m["decode_unprepared"]
        assert m["prepared"] and raw["prepared_speedup"] == pytest.approx(raw["time_s"] / decode["time_s"])
        assert (
            raw["bytes"]["weights"] < decode["bytes"]["weights"] and raw["bytes"]["cache"] == decode["bytes"]["cache"]
        )
        v = m["verify"]["3"]
        assert v["bitwise_equal_decode"] and v["mismatch_rows"] == [] and v["argmax_equal_rows"] == 4
        assert v["ratio_vs_decode"] == pytest.approx(v["time_s"] / decode["time_s"]) == v["break_even_mean_accepted"]


def test_quick_end_to_end(quick):
    _, data, _ = quick
    e2e = data["sections"]["e2e"]
    assert e2e["prepared"]  # the engines' default on the reference backend
    assert e2e["compiles_after_warmup"] == 0 and e2e["greedy_distinct_fraction"] == 1.0
    assert e2e["num_compiles"] == {  # host loop: start, prefill chunks, first round, decode (+ verify) rounds
        "greedy/host": 4,
        "lookup+gate/host": 5,
        "greedy/device": 1,
        "lookup/device": 1,
        "greedy/host-per-round": 4,
    }
    variants = e2e["variants"]
    assert list(variants) == ["filler", "insert1", "insert3", "full"]
    for v in variants.values():
        assert v["prompt_len"] == e2e["prompt_len"] == 64  # pad + P + G' + P: one length, one prefill executable
        assert v["greedy_repeats_echo"] == 1.0  # the Markov model continues the echo, as designed
        for label, c in v["configs"].items():
            assert c["identical_to_greedy"] and c["tok_s"] > 0
            assert c["decode_tok_s"] is None or c["decode_tok_s"] > 0  # None: prefill >= wall (CPU timing noise)
            assert "speedup_vs_greedy" not in c if label.startswith("greedy") else c["mean_accepted"] >= 0
    # The echo pattern sets the acceptance: every draft misses with period 1, ~3 tokens per verify with period 3.
    lookup = {name: v["configs"]["lookup/device"] for name, v in variants.items()}
    assert lookup["insert1"]["mean_accepted"] == 1.0 and lookup["insert1"]["verify_steps"] > 0
    assert 2.5 <= lookup["insert3"]["mean_accepted"] <= 3.5
    assert lookup["full"]["mean_accepted"] > 6
    assert variants["insert1"]["configs"]["lookup+gate/host"]["verify_steps"] == 0  # the gate never opens


def _check_hybrid_e2e(e2e: dict) -> None:
    """The hybrid section's end-to-end part: every configuration warmed (compiled) first, lookup hits, speculative
    == greedy, the MTP round's cost and the speedup it predicts at the trained demo's acceptance."""
    assert e2e["status"] == "done" and set(e2e["warmup_s"]) == {"greedy", "lookup k=3", "mtp k=3"}
    assert e2e["lookup k=3"]["mean_accepted"] > 1
    assert all(e2e[label]["identical"] for label in ("lookup k=3", "mtp k=3"))
    mtp = e2e["mtp k=3"]
    predicted = mtp["predicted_speedup_at_demo_acceptance"]
    demo = json.loads(Path(hybrid.DEMO_ACCEPTANCE).read_text())["summary"]
    assert "demo_hybrid_acceptance" in predicted["source"]
    for category in ("edit", "free"):  # the demo's mean_accepted over this round's cost (a CPU's timings: any sign)
        want = demo[category]["mtp_k3"]["mean_accepted"]
        assert predicted[category] * mtp["round_vs_decode"] == pytest.approx(want)


def test_describe_kernels_names_a_fusions_shape_kind_and_source_op():
    """A profile's kernel names looked up in the executable's optimized HLO: shape, fusion kind, jax op; names that
    are no instruction of it (a Pallas kernel's, another executable's) are left out."""
    text = jax.jit(lambda x: jnp.tanh(x) * 2 + 1).lower(jnp.ones((8, 128))).compile().as_text()
    fusion = next(line.split(" = ")[0].split("%")[-1] for line in text.splitlines() if "kind=kLoop" in line)
    described = timing.describe_kernels(text, [fusion, "jspec_attention_combine"])
    assert list(described) == [fusion] and described[fusion].startswith("f32[8,128]")
    assert "kLoop: jit(<lambda>)/" in described[fusion]
    renamed = text.replace(f"%{fusion} =", f"%{fusion}.127 =")  # the GPU profiler names it {fusion}_127
    assert timing.describe_kernels(renamed, [f"{fusion}_127"]) == {f"{fusion}_127": described[fusion]}


def test_hybrid_e2e_only_skips_the_steps(tmp_path):
    """--hybrid-e2e-only: the end-to-end part alone (what the 27B-class shape's run needs on one command's time)."""
    out = tmp_path / "r.json"
    rc = jspec_bench.main(
        ["--quick", "--sections", "hybrid", "--models", "qwen3.5", "--hybrid-e2e-only", "--out", str(out)]
    )
    hybrid = json.loads(out.read_text())["sections"]["hybrid"]
    assert rc == 0 and "models" not in hybrid and hybrid["steps"].startswith("skipped")
    assert hybrid["e2e"]["budget_decode_s"] > 0
    _check_hybrid_e2e(hybrid["e2e"])


def test_quick_peer_targets_plots_and_table(quick, capsys):
    _, data, out = quick
    peer = data["sections"]["peer"]
    assert set(peer["variants"]) == {"as-initialized/full", "full", "insert1"}
    for v in peer["variants"].values():
        assert v["greedy_tok_s"] > 0 and v["lookup_tok_s"] > 0 and isinstance(v["lookup_equals_greedy"], bool)
        assert isinstance(v["greedy_static_equals_dynamic"], bool)
    targets = {t["name"]: t for t in data["targets"]}
    assert len(targets) == 16 and all(t["met"] is None for t in targets.values())  # a quick run claims nothing
    sampler = targets["the sampler costs < 3% of a decode step (llama-3-8b)"]
    assert sampler["value"] is not None  # the costliest processor's share of the decode step
    assert data["sections"]["sampling"]["rows"] == {"decode": 1, "verify": 8}  # k + 1 rows in a verify
    batch = data["sections"]["batch"]
    assert all(r["identical"] for r in batch["greedy"].values()) and batch["greedy"]["4"]["vs_b1"] > 0
    for r in batch["greedy"].values():  # one round timed as its own executable; no GPU profile on a CPU
        assert r["round_alone"]["ms"] > 0 and r["round_alone"]["gpu_kernels"] is None
    assert all(r["identical"] and r["lookup"]["mean_accepted"] > 1 for r in batch["lookup"].values())
    hybrid = data["sections"]["hybrid"]
    model = hybrid["models"]["qwen3.5"]
    assert model["status"] == "done" and model["verify"]["3"]["bitwise_equal_decode"]
    assert model["recurrent"]["rows_bit_identical"] and model["recurrent"]["fixed_s"] is not None
    assert model["recurrent"]["in_step"] is None  # no GPU profiles on a CPU
    decode_bytes, verify_bytes = model["decode"]["bytes"], model["verify"]["3"]["bytes"]
    assert 0 < 4 * decode_bytes["state_writes"] == verify_bytes["state_writes"]  # one post-state kept a row
    assert verify_bytes["total"] == sum(verify_bytes[key] for key in ("weights", "cache", "state_writes"))
    _check_hybrid_e2e(hybrid["e2e"])
    assert batch["engine_generate"]["decode_tok_s"] > 0 and batch["greedy"]["1"]["vs_engine_generate"] > 0
    shard = data["sections"]["tp_shard"]["models"]["llama-3-8b tp=2"]
    assert shard["status"] == "done" and shard["verify"]["7"]["bitwise_equal_decode"]
    assert shard["shard_config"]["num_heads"] == 2 and shard["collectives"]["all_reduce"] == 2 * 2 + 1
    assert targets["zero recompiles after warm-up (e2e engines)"]["value"] == 0
    assert all("not evaluated" in t["detail"] for t in targets.values())
    drawn = ("roofline.png", "speedup.png", "batch.png")
    assert sorted(data["plots"]) == sorted(str(out / "plots" / f) for f in drawn)
    assert all((out / "plots" / f).stat().st_size > 1000 for f in drawn)
    assert jspec_bench.main(["--readme-table", str(out / "r.json")]) == 0
    table = capsys.readouterr().out
    for text in (
        "QUICK MODE",
        "**Step cost**",
        "| llama-3-8b |",
        "| glm-4-9b |",
        "**End to end**",
        "| insert3 |",
        "**Peer**",
        "**Targets**",
        "| not evaluated |",
        "Identity: all",
    ):
        assert text in table
    assert "External references" not in table and "| yes |" not in table.split("**Targets**")[1]


def test_budget_skips_sections_with_the_reason(tmp_path):
    assert cli.main(["bench", "--quick", "--budget-s", "0", "--out", str(tmp_path / "r.json")]) == 0  # via the CLI
    data = json.loads((tmp_path / "r.json").read_text())
    for name, sec in data["sections"].items():
        assert sec["status"] == "skipped"
        assert sec["reason"].startswith("budget:") or name == "peer" and "--peer-hf" in sec["reason"]
    assert all(t["met"] is None for t in data["targets"])


def test_int4_wide_min_steps_is_recorded_and_undone(tmp_path):
    """--int4-wide-min-steps N (an A/B of `int4_ws.config_for`'s crossover) holds for the run only and is recorded."""
    from jspec_bench.options import parse_args
    from pallas_kernels import int4_ws

    shipped, other = int4_ws.WIDE_MIN_STEPS, int4_ws.WIDE_MIN_STEPS + 1
    out = tmp_path / "r.json"
    assert jspec_bench.main(["--quick", "--budget-s", "0", "--int4-wide-min-steps", str(other), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["int4_wide_min_steps"] == other and int4_ws.WIDE_MIN_STEPS == shipped
    with pytest.raises(SystemExit, match="--int4-wide-min-steps 0: must be >= 1"):
        parse_args(["--int4-wide-min-steps", "0"])


def test_a_broken_speculative_path_fails_the_bench(tmp_path, monkeypatch):
    """Accepting every draft token (wrong tokens in the output) and perturbing verify's rows 1.. must both be caught."""

    def accept_everything(draft, logits, n_valid=None):
        n = draft.shape[0] if n_valid is None else n_valid
        return jnp.asarray(n, jnp.int32), jnp.argmax(logits[n]).astype(jnp.int32)

    def perturbed_verify(params, cfg, state, draft):
        state, logits = bench_verify(params, cfg, state, draft)
        return state, logits.at[1:].multiply(1.0 + 2.0**-20)

    bench_verify = steps.verify_step
    monkeypatch.setattr(sys.modules["jspec.loop"], "greedy_accept", accept_everything)  # the module, not the function
    monkeypatch.setattr(steps, "verify_step", perturbed_verify)
    args = ["--quick", "--sections", "steps,e2e", "--models", "llama-3-8b", "--e2e-configs", "greedy/host,lookup/host"]
    assert jspec_bench.main([*args, "--out", str(tmp_path / "r.json")]) == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert not data["ok"] and not data["identity"]["ok"]
    verify = data["sections"]["steps"]["models"]["llama-3-8b"]["verify"]["3"]
    assert not verify["bitwise_equal_decode"] and verify["mismatch_rows"] == [1, 2, 3]
    insert1 = data["sections"]["e2e"]["variants"]["insert1"]["configs"]["lookup/host"]
    assert not insert1["identical_to_greedy"]
    failures = data["identity"]["failures"]
    assert any(f.startswith("steps/llama-3-8b") for f in failures)
    assert any(f.startswith("e2e/insert1/lookup/host") for f in failures)


GPU_TRACE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)"
          events { metadata_id: 1 offset_ps: 0 duration_ps: 6000000 }
          events { metadata_id: 2 offset_ps: 7000000 duration_ps: 3000000 }
          events { metadata_id: 3 offset_ps: 11000000 duration_ps: 2000000 }
          events { metadata_id: 1 offset_ps: 13000000 duration_ps: 6000000 } }
  lines { id: 2 name: "XLA Ops" events { metadata_id: 2 offset_ps: 0 duration_ps: 99000000 } }
  event_metadata { key: 1 value { id: 1 name: "int4_ws_streamk_mosaic_gpu_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "loop_add_fusion" } }
  event_metadata { key: 3 value { id: 3 name: "jspec_attention_split" } }
}
planes { id: 2 name: "/host:CPU" lines { id: 1 name: "python" events { metadata_id: 1 duration_ps: 5000000000 } }
         event_metadata { key: 1 value { id: 1 name: "int4_rows_matmul" } } }
"""


def test_kernel_times_sums_the_gpu_stream_kernels_per_call_and_group():
    """Only kernel events on the GPU planes' stream lines count (not the "XLA Ops" line, not host planes); the
    stream's idle time between kernels is summed per call and by the kernel that follows each gap."""
    data = jax.profiler.ProfileData.text_proto_to_serialized_xspace(GPU_TRACE)
    times = timing.kernel_times(jax.profiler.ProfileData.from_serialized_xspace(data), calls=2)
    assert times["kernel_us"] == 8.5 and times["launches"] == 2
    assert times["groups_us"] == {"int4 Mosaic GPU": 6.0, "XLA ops": 1.5, "attention": 1.0}
    assert list(times["top_kernels_us"]) == [
        "int4_ws_streamk_mosaic_gpu_kernel",
        "loop_add_fusion",
        "jspec_attention_split",
    ]
    assert times["idle_us"] == 1.0  # 1 us before the add, 1 us before the attention, none before the last int4
    assert times["idle_before_us"] == {"loop_add_fusion": 0.5, "jspec_attention_split": 0.5}


def test_time_chains_interleaves_the_trials_and_chains_each_state():
    """Each chain warms up once, then trial t runs every chain, in reverse order on odd t: SETTLE_CALLS calls after
    the switch, then the timed ones; each chain's calls feed it its own donated state, and its median is over its
    own trials."""
    calls, seen = [], {"a": [], "b": []}

    def step(name):
        def fn(params, state, extra):
            calls.append(name)
            seen[name].append(int(state))
            return state + params, jnp.asarray(extra)

        return fn

    chains = {"a": (step("a"), 1, jnp.int32(0), (7,)), "b": (step("b"), 10, jnp.int32(100), (8,))}
    out = timing._time_chains(chains, reps=2, trials=3, warmup_s=0.0)
    trial = timing.SETTLE_CALLS + 2  # the calls after a switch, then the timed ones
    assert calls == ["a", "b"] + ["a"] * trial + ["b"] * trial * 2 + ["a"] * trial * 2 + ["b"] * trial
    assert seen == {"a": list(range(1 + 3 * trial)), "b": list(range(100, 110 + 30 * trial, 10))}  # its last state
    for key, r in out.items():
        assert len(r.trial_times) == 3 and r.seconds == sorted(r.trial_times)[1] and r.kernels is None, key
        assert r.after_switch_s > 0 and 0 < r.dispatch_s, key


def test_step_time_plot_is_drawn_from_a_gpu_run(tmp_path):
    """A run with GPU kernel times (the committed H200 bench) gets step_time.png next to the other plots; a CPU run
    (no kernel times, `test_quick_peer_targets_plots_and_table`) does not."""
    data = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/bench_h200.json").read_text())
    files = plots.make_plots(data, str(tmp_path))
    assert sorted(files) == sorted(str(tmp_path / f) for f in ("roofline.png", "step_time.png", "speedup.png"))
    assert (tmp_path / "step_time.png").stat().st_size > 1000


def test_batch_plot_is_drawn_from_a_batch_run(tmp_path):
    """The committed H200 batch run (batch sizes, lookup, no step sections) gets batch.png alone; a run without a
    batch section (bench_h200.json, above) gets none."""
    data = json.loads(
        (Path(__file__).resolve().parents[1] / "benchmarks/results/bench_batch_grid_h200.json").read_text()
    )
    assert plots.make_plots(data, str(tmp_path)) == [str(tmp_path / "batch.png")]
    assert (tmp_path / "batch.png").stat().st_size > 1000


def test_profile_records_what_runs():
    f = jax.jit(lambda x: jnp.sin(x) * 2)
    x = jnp.ones((64,))
    f(x).block_until_ready()
    data = timing.profile(lambda: f(x).block_until_ready())
    assert any(plane.name.startswith("/host") for plane in data.planes)
    assert timing.kernel_times(data, 1)["kernel_us"] == 0  # a CPU run has no GPU kernels


@pytest.mark.parametrize("family", ["qwen2", "glm4"])
def test_scale_attention_output_scales_what_attention_adds(family):
    """With the MLP zeroed, a layer adds only its attention output to the residual stream: scaled params add
    `factor` times that (glm4: through its post-attention norm, which would undo a scaled o)."""
    cfg = tiny_config(family)
    params = tiny_params(cfg)
    params["layers"] = [dict(p, gate_up=jnp.zeros_like(p["gate_up"])) for p in params["layers"]]
    x = params["embed"][jnp.array([3, 7, 11, 5])]
    positions = jnp.arange(4, dtype=jnp.int32)

    def added(p):
        return dense.layer(p["layers"][0], cfg, x, positions, None, Run.forward())[0] - x

    full, scaled = added(params), added(shapes.scale_attention_output(params, 0.25))
    assert float(jnp.max(jnp.abs(full))) > 0.01
    np.testing.assert_allclose(scaled, 0.25 * full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "value,message",
    [("1,x", "--batch-sizes '1,x': expected integers"), ("1,0", "--batch-sizes '1,0': must be >= 1")],
)
def test_bad_batch_sizes_are_refused(value, message):
    from jspec_bench.options import parse_args

    assert parse_args(["--batch-sizes", "16,64"])[0].batch_sizes == (16, 64)
    with pytest.raises(SystemExit, match=message):
        parse_args(["--batch-sizes", value])
