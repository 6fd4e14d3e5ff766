"""Every Python code block of README.md and docs/*.md runs, in order, one namespace per file, on the CPU with the
bundled demo model, so no snippet rots. The namespace starts with `hf_dir` (a tiny random HuggingFace checkpoint)
and `tmp_dir` (a scratch directory), which docs/api.md's checkpoint examples use."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.conftest import build_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_the_docs_have_python_blocks():
    assert python_blocks(ROOT / "README.md") and python_blocks(ROOT / "docs" / "api.md")


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_doc_python_blocks_run(path, tmp_path):
    build_tiny_hf_model("qwen2", tmp_path / "hf")
    namespace = {"__name__": f"doc_{path.stem}", "hf_dir": str(tmp_path / "hf"), "tmp_dir": str(tmp_path)}
    for i, block in enumerate(python_blocks(path)):
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block, f"{path.name} block {i + 1}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{path.relative_to(ROOT)}, Python block {i + 1} fails: {e!r}\n{block}") from e
