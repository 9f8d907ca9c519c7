"""The agent and its sinks stay mypy-clean (house style)."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_mypy_clean():
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "forwarder", "sinks"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
