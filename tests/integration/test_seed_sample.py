"""Microsoft's published Python sample, as published but for its URL, against the emulator.

The code is extracted from the seed document at test time (``tests/peers/seed_sample.py``); it is
Python 3 already, so the only difference is the ``metadata_url`` literal. Its interactive
``main()`` is driven the way a user drives it: through standard input ("1" to poll, "2" to exit).
The environment drops proxy variables (``requests`` would honour them; on a VM IMDS is reached
without a proxy), which is configuration of the machine, not of the code.
"""
from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.emulator import Emulator
from tests.peers import seed_sample

FREEZE_ID = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"


def test_the_vendored_copy_is_the_seed_sample_verbatim() -> None:
    if not seed_sample.SEED.is_file():
        pytest.skip(f"the seed document is not here ({seed_sample.SEED}); the vendored copy is used")
    seed = seed_sample.SEED.read_text(encoding="utf-8")
    code = seed_sample.extract(seed)
    assert code == seed_sample.VENDORED.read_text(encoding="utf-8")
    assert seed.count(code) >= 1 and code.startswith("#!/usr/bin/python\nimport json\nimport requests\n")
    compile(code, "seed", "exec")  # valid Python 3 as published: no port needed


def test_only_the_url_differs() -> None:
    code = seed_sample.published()
    changed = seed_sample.with_url(code, "http://127.0.0.1:8169/metadata/scheduledevents")
    diff = [line for line in difflib.unified_diff(code.splitlines(), changed.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert diff == ['-metadata_url ="http://169.254.169.254/metadata/scheduledevents"',
                    '+metadata_url ="http://127.0.0.1:8169/metadata/scheduledevents"']


def test_seed_sample_sees_the_freeze_and_its_approval_starts_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with Emulator(scenario="live-migration-freeze") as emu:  # real rate limit: the sample polls once a second
        program = tmp_path / "sample.py"
        program.write_text(seed_sample.with_url(seed_sample.published(), emu.url + "/metadata/scheduledevents"),
                           encoding="utf-8")
        # Three documents: the sample approves the Freeze (DurationInSeconds 5 < 9) in the first one
        # that shows it Scheduled and logs its Description in the next one, where it is Started.
        proc = subprocess.run([sys.executable, str(program)], input=seed_sample.keystrokes(3), capture_output=True,
                              text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("Press 1 to poll for new events") == 4  # its own prompt, answered 1, 1, 1, 2
        assert proc.stdout.count("Processed events from document: ") == 3
        assert "Virtual machine is being paused because of a memory-preserving Live Migration operation." \
            in proc.stdout
        stats = emu.stats()
        approvals = stats["start_requests"]
        assert [a["event_ids"] for a in approvals] == [[FREEZE_ID]]
        assert approvals[0]["accepted"] and approvals[0]["vm"] == "WestNO_0"
        changes = [h["change"] for h in stats["history"]]
        assert changes[:2] == ["scheduled", "started (approved by WestNO_0)"]
        assert emu.wait_finished(10)
        assert stats["requests"]["WestNO_0"]["by_status"].get("429") is None
        assert stats["requests"]["WestNO_0"]["POST"] == 1


def test_the_launcher_runs_the_same_code_non_interactively() -> None:
    """What tests/integration/test_approvals.py uses: the published code, stdin "1" x N then "2"."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with Emulator(scenario="live-migration-freeze") as emu:
        proc = subprocess.run([sys.executable, str(Path(seed_sample.__file__)),
                               emu.url + "/metadata/scheduledevents", "1"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("Processed events from document: ") == 1
        assert [a["event_ids"] for a in emu.stats()["start_requests"]] == [[FREEZE_ID]]
