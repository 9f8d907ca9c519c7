"""The seed's own Python sample (windows, 2020-07-01), unmodified but for its URL, against the emulator."""
from __future__ import annotations

import os
import subprocess
import sys

from forwarder.emulator import Emulator
from tests.conftest import ROOT

SAMPLE = ROOT / "tests" / "peers" / "seed_sample.py"
FREEZE_ID = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"


def test_seed_sample_sees_the_freeze_and_its_approval_starts_it() -> None:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # the sample uses plain requests
    with Emulator(scenario="live-migration-freeze") as emu:  # real rate limit: the sample polls once a second
        url = emu.url + "/metadata/scheduledevents"
        # Three documents: the sample approves the Freeze (DurationInSeconds 5 < 9) in the first one
        # that shows it Scheduled and logs its Description in the next one, where it is Started.
        proc = subprocess.run([sys.executable, str(SAMPLE), url, "3"], capture_output=True, text=True,
                              timeout=30, env=env)
        assert proc.returncode == 0, proc.stderr
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
