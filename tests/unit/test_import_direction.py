"""Imports run one way: importing any core module pulls in no sink and no Azure/OpenTelemetry SDK.

Each module is imported in a fresh process, so a module is judged by its own imports, not by what
an earlier test left in sys.modules: one interpreter that has imported nothing of ours forks a child per
module (one interpreter start for the whole list instead of one per module). The two ``__main__`` shims are left out: importing one
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
import importlib, json, os, sys, traceback
found = {{}}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child imports one module, says what it pulled in, and exits
        os.close(r)
        try:
            importlib.import_module(name)
            out = {{"imports": sorted(n for n in sys.modules if n.split(".")[0] in {forbidden!r})}}
        except BaseException:
            out = {{"error": traceback.format_exc()[-2000:]}}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as answer:
        data = answer.read()
    os.waitpid(pid, 0)
    found[name] = json.loads(data) if data else {{"error": "the child died without an answer"}}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, dict[str, object]]:
    """What importing each module pulls in, each in its own fresh process."""
    done = subprocess.run([sys.executable, "-c", _PROBE.format(forbidden=set(FORBIDDEN)), *MODULES],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_every_stage_is_found():
    # Subpackage names only (not dotted paths), so the layout rewrite script leaves this list alone.
    for package in ("agent", "common", "imds", "store", "delivery", "approval", "emulator"):
        assert any(m.startswith(f"forwarder.{package}.") for m in MODULES), package


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_no_sink_or_sdk(module: str, imported: dict[str, dict[str, object]]) -> None:
    assert "error" not in imported[module], imported[module]["error"]
    assert imported[module]["imports"] == [], f"{module} imports a sink or an SDK"


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
