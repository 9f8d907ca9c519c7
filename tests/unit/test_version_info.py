"""`sefwd --version`: the version, the Python and which extras are installed."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib.metadata import PathDistribution
from pathlib import Path

from forwarder.agent.version_info import describe, extras
from tests.conftest import ROOT

METADATA = """Metadata-Version: 2.1
Name: scheduled-events-forwarder
Version: 9.9.9+build.1
Requires-Dist: orjson>=3.9
Requires-Dist: tomli>=2; python_version < "3.11"
Provides-Extra: present
Requires-Dist: orjson>=3.9; extra == "present"
Provides-Extra: absent
Requires-Dist: orjson; extra == "absent"
Requires-Dist: no-such-distribution-sefwd>=1; extra == "absent"
Provides-Extra: all
Requires-Dist: scheduled-events-forwarder[absent,present]; extra == "all"
"""


def test_an_extra_counts_as_installed_only_when_all_it_adds_is(tmp_path: Path) -> None:
    info = tmp_path / "scheduled_events_forwarder-9.9.9+build.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(METADATA)
    assert extras(PathDistribution(info)) == (["present"], ["absent"])  # "all" groups others: not listed


def test_version_names_the_running_python() -> None:
    lines = describe().splitlines()
    assert lines[0].startswith("sefwd 0.")
    assert lines[1] == f"Python {platform.python_version()} ({platform.python_implementation()}) at {sys.executable}"
    done = subprocess.run([sys.executable, "-m", "forwarder", "--version"], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT), env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.splitlines()[1] == lines[1], done.stderr
