"""`jspec bench`: what jspec buys on a GPU — step costs against the HBM roofline, end-to-end speedup against
acceptance with byte-identity checked in every run, and the HuggingFace peer side by side (docs/performance.md).

Run it as `jspec bench ...` or `python -m jspec_bench ...`; benchmarks/README.md has the commands, what each section
measures and how, and the committed results. The sections are registered in `jspec_bench.sections`; `main` runs them
within the budget, writes the results JSON (`jspec_bench.report`) and prints the README table.
"""

from jspec_bench.main import main

__all__ = ["main"]
