"""Repository invariants: CI runs exactly the README's test command; the README's main command prints what the README
shows; the CLI parses."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from jspec import cli
from jspec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert match, f"README.md has no {marker} block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = _readme_command("test-command")
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_main_command_runs_jspec_generate_on_the_default_model():
    command = _readme_command("main-command")
    assert "jspec generate" in command and "--checkpoint" not in command


def test_readme_shows_what_the_main_command_prints(capsys):
    """The README's sample output of its main command: the continuation's first lines, and after the rule every line
    of the stats (the bundled model on the CPU is deterministic; only the seconds and tok/s are masked)."""
    command = shlex.split(_readme_command("main-command").split("&&")[-1])
    assert command[0].endswith("jspec") and command[1] == "generate"
    text = (ROOT / "README.md").read_text()
    after = text[text.index("<!-- main-command -->") :]
    sample = re.findall(r"^```[a-z]*\n(.*?)^```", after, re.S | re.M)[1].splitlines()  # the block after the command
    assert cli.main(command[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    elided, rule = sample.index("    …"), sample.index("-" * 72)
    assert printed[:elided] == sample[:elided]

    def masked(line: str) -> str:
        return re.sub(r"\d+\.\d+(?= s\b| tok/s)", "T", line.replace(str(ROOT), "…"))

    assert [masked(line) for line in printed[printed.index("-" * 72) :]] == [masked(x) for x in sample[rule:]]


def test_cli_parses_generate():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--drafter", "none", "--k", "3", "--json"])
    assert args.k == 3 and args.drafter == "none" and args.json and args.gate is None  # None: the drafter decides
    assert build_parser().parse_args(["generate", "--prompt", "x", "--no-gate"]).gate is False


def test_the_repository_fits_the_gpu_machines_working_tree():
    """The tracked files stay under 60 MB (the GPU machine takes at most 64 MiB of working tree), and each bundled
    checkpoint within its budget: the demo 32 MB, the hybrid demo 16 MB (issue 33), the drafter 3 MB."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    sizes = {name.decode(): (ROOT / name.decode()).stat().st_size for name in files if name}
    assert sum(sizes.values()) < 60e6, f"{sum(sizes.values()) / 1e6:.1f} MB tracked"
    for folder, budget in (("demo", 32e6), ("demo_hybrid", 16e6), ("demo_drafter", 3e6)):
        size = sum(v for k, v in sizes.items() if k.startswith(f"checkpoints/{folder}/"))
        assert 0 < size < budget, f"checkpoints/{folder}: {size / 1e6:.1f} MB"
