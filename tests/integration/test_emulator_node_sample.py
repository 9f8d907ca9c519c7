"""Microsoft's Node sample client (Azure/vm-scheduled-events), unchanged but for its URL, against the emulator.

The sample uses node-fetch 2, which sends ``Connection: close`` on every request, through Node's
global agent, which keeps sockets alive (Node >= 19). Its approval POST follows the GET at once:
unless the emulator answers ``Connection: close`` when it closes, the POST goes out on the dead
socket and fails with "socket hang up".
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from forwarder.emulator import Emulator
from tests.agent import wait_until
from tests.conftest import ROOT

SAMPLE = ROOT / "tests" / "peers" / "node_sample"
BUILT = SAMPLE / "dist" / "index.js"

_MISSING = "node or the built sample missing: run tests/peers/node_sample/install.sh"
if (shutil.which("node") is None or not BUILT.is_file()) and os.environ.get("SEFWD_REQUIRE_PEERS"):
    raise RuntimeError(f"the Node sample is required here (SEFWD_REQUIRE_PEERS): {_MISSING}")
pytestmark = pytest.mark.skipif(shutil.which("node") is None or not BUILT.is_file(), reason=_MISSING)


def test_node_sample_approves_on_a_keep_alive_agent_without_socket_hang_up(tmp_path: Path) -> None:
    with Emulator(vms=["flatcar-vm1"]) as emu:  # real rate limit: the sample polls once a second
        event_id = emu.schedule(type="Reboot", source="User", resources=["flatcar-vm1"], not_before="+15m",
                                complete_after=600)
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env["SAMPLE_IMDS_URL"] = emu.url
        proc = subprocess.Popen(["node", str(BUILT)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log = tmp_path / "AzureScheduledEvents.log"  # the sample's own log file, in its working directory
        try:
            wait_until(lambda: log.is_file() and f"Acknowledged event {event_id}" in log.read_text(), 60,
                       "the sample's approval")
            # Let it poll on for a few documents over the same agent: every request still answered.
            polls = emu.stats()["requests"]["flatcar-vm1"]["GET"]
            wait_until(lambda: emu.stats()["requests"]["flatcar-vm1"]["GET"] >= polls + 3, 30, "three more polls")
        finally:
            proc.terminate()
            output = proc.communicate(timeout=30)[0].decode(errors="replace")
        text = log.read_text()
        stats = emu.stats()
    assert "[ERR]" not in text and "[WRN]" not in text, text
    assert "socket hang up" not in text + output
    assert "Accepting event " + event_id in text
    (approval,) = stats["start_requests"]
    assert approval["event_ids"] == [event_id] and approval["accepted"] and approval["vm"] == "flatcar-vm1"
    assert stats["history"][1]["change"] == "started (approved by flatcar-vm1)"
    assert set(stats["requests"]["flatcar-vm1"]["by_status"]) == {"200"}
