"""The README's set-up commands stay true: CI runs exactly the README's test command."""
from __future__ import annotations

from tests.conftest import ROOT


def _commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    return [line for line in block if line and not line.startswith("#")]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = _commands()
    assert demo.endswith("sefwd demo") and "pip install" in demo
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci
