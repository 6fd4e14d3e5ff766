"""Execute every notebook top to bottom (nbclient, the local CPU) and check what it printed and plotted.

The notebooks assert their own results (speculative tokens == greedy tokens, the gate trace matches the Engine,
cost ratios are finite); here a run must finish without an error output, print its markers and draw its plots.
"""

from __future__ import annotations

import json
import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")

# notebook -> (markers its outputs must contain, minimum number of figures)
EXPECTED = {
    "01_quickstart.ipynb": (
        [
            "IDENTICAL to greedy (prompt lookup): True",
            "IDENTICAL to greedy (MTP): True",
            "IDENTICAL to greedy (on-device loop): True",
            "mean_accepted",
            "QUICKSTART_OK",
        ],
        1,
    ),
    "02_acceptance.ipynb": (
        [
            "all identical to greedy: True",
            "LIVE_IDENTICAL: True",
            "GATE_IDENTICAL: True",
            "top-1/top-2 logit gap",
            "ACCEPTANCE_OK",
        ],
        3,
    ),
    "03_cost_model.ipynb": (["STEP_COST_SOURCES", "r_k = break-even", "COST_MODEL_OK"], 1),
    "04_batches.ipynb": (
        [
            "NEIGHBOURS_DONT_MATTER: True",
            "BATCH_LOOKUP_IDENTICAL: True",
            "SAMPLED_IN_ANY_BATCH: True",
            "x one sequence",
            "BATCHES_OK",
        ],
        1,
    ),
    "05_hybrid.ipynb": (
        [
            "all identical to greedy: True",
            "LIVE_IDENTICAL: True",
            "STATE_IDENTICAL: True",
            "SAMPLED_IDENTICAL: True",
            "HYBRID_OK",
        ],
        2,
    ),
}


def execute(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": NOTEBOOK_DIR}})
    client.execute()
    return nb


def outputs(nb: nbformat.NotebookNode) -> tuple[str, int, list]:
    """(all printed text, number of PNG figures, error outputs)."""
    text, figures, errors = [], 0, []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type == "error":
                errors.append(f"{out.ename}: {out.evalue}")
            else:
                data = out.get("data", {})
                text.append(data.get("text/plain", ""))
                figures += "image/png" in data
    return "\n".join(text), figures, errors


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_executes(name):
    nb = execute(name)
    text, figures, errors = outputs(nb)
    assert not errors, errors
    markers, min_figures = EXPECTED[name]
    for marker in markers:
        assert marker in text, f"{name}: {marker!r} missing from the outputs"
    assert figures >= min_figures, f"{name}: {figures} figures, expected >= {min_figures}"


def test_cost_model_fails_without_results(tmp_path, monkeypatch):
    """03 reads committed JSON only; with none to read it must stop with a clear error, not plot nothing."""
    monkeypatch.setenv("JSPEC_RESULTS_DIR", str(tmp_path))
    with pytest.raises(CellExecutionError, match="no step-cost JSON"):
        execute("03_cost_model.ipynb")


def test_cost_model_reads_jspec_bench_steps(tmp_path, monkeypatch):
    """The step section of a `jspec bench` results JSON is a whole-step source: r_k = verify / decode."""
    bench = {
        "meta": {"device": "Test GPU", "jax": "0", "commit": "abc"},
        "sections": {"steps": {"models": {"tiny": {"decode": {"time_s": 0.002}, "verify": {"7": {"time_s": 0.0025}}}}}},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    monkeypatch.setenv("JSPEC_RESULTS_DIR", str(tmp_path))
    text, figures, errors = outputs(execute("03_cost_model.ipynb"))
    assert not errors, errors
    assert "STEP_COST_SOURCES: 1 whole-step, 0 int4 matmul, 0 attention" in text
    row = next(line for line in text.splitlines() if line.startswith("bench.json: tiny"))
    assert row.split()[-4:] == ["7", "2.000", "2.500", "1.25"]
    assert figures >= 1 and "COST_MODEL_OK" in text
