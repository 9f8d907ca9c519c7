"""Imports run one way: importing any core module pulls in no sink and no Azure/OpenTelemetry SDK.

Each module is imported in a fresh interpreter, so a module is judged by its own imports, not by
what an earlier test left in sys.modules. The two ``__main__`` shims are left out: importing one
runs the program (each is two lines that import ``forwarder.agent.cli`` / ``forwarder.emulator.cli``,
which are checked here).
"""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

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
