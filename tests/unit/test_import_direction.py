"""Imports run one way: importing any core module pulls in no sink and no Azure/OpenTelemetry SDK.

Each module is imported in a fresh interpreter, so a module is judged by its own imports, not by
what an earlier test left in sys.modules. The two ``__main__`` shims are left out: importing one
runs the program (each is two lines that import ``forwarder.agent.cli`` / ``forwarder.emulator.cli``,
which are checked here).
"""
from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import forwarder
from tests.conftest import ROOT

FORBIDDEN = ("sinks", "azure", "opentelemetry")

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(forwarder.__path__, "forwarder.") if not m.name.endswith(".__main__")
)

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(n for n in sys.modules if n.split(".")[0] in {forbidden!r})))
"""


def test_every_stage_is_found():
    # Subpackage names only (not dotted paths), so the layout rewrite script leaves this list alone.
    for package in ("agent", "common", "imds", "store", "delivery", "approval", "emulator"):
        assert any(m.startswith(f"forwarder.{package}.") for m in MODULES), package


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_no_sink_or_sdk(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE.format(forbidden=set(FORBIDDEN)), module],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], f"{module} imports a sink or an SDK"


def _imports(path: Path) -> set[str]:
    """Every module a source file names in an import statement (under TYPE_CHECKING and in functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


BELOW_AGENT = ("common", "imds", "store", "delivery", "approval", "emulator")


@pytest.mark.parametrize("stage", BELOW_AGENT)
def test_stages_below_the_agent_import_nothing_from_it(stage: str) -> None:
    """The agent wires the stages together; none of them reaches back up into forwarder.agent."""
    files = sorted((ROOT / "forwarder" / stage).rglob("*.py"))
    assert files
    upward = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f) if n == "forwarder.agent" or n.startswith("forwarder.agent."))
              for f in files}
    assert {f: n for f, n in upward.items() if n} == {}
