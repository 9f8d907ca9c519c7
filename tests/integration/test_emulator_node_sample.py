"""The protocol behaviour Microsoft's Node sample client depends on, from a real Node client.

The sample (Azure/vm-scheduled-events, node/) uses node-fetch 2, which sends ``Connection: close``
on every request, through Node's global agent, which keeps sockets alive (Node >= 19); its approval
POST follows the GET at once. Unless the emulator answers ``Connection: close`` when it closes, the
POST goes out on the dead socket and fails with "socket hang up". ``tests/peers/node_keepalive_client.js``
(written here, no npm dependencies) does exactly that.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from forwarder.emulator import Emulator
from tests.conftest import ROOT

CLIENT = ROOT / "tests" / "peers" / "node_keepalive_client.js"

if shutil.which("node") is None and os.environ.get("SEFWD_REQUIRE_PEERS"):
    raise RuntimeError("node is required here (SEFWD_REQUIRE_PEERS)")
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")


def test_keep_alive_client_with_connection_close_approves_without_socket_hang_up() -> None:
    with Emulator(vms=["flatcar-vm1"]) as emu:
        event_id = emu.schedule(type="Reboot", source="User", resources=["flatcar-vm1"], not_before="+15m",
                                complete_after=600)
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        proc = subprocess.run(["node", str(CLIENT), emu.url, "3"], env=env, capture_output=True, timeout=120)
        output = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
        stats = emu.stats()
    assert proc.returncode == 0, output
    assert "socket hang up" not in output and "ERROR" not in output, output
    assert f"scheduled={event_id}" in output
    assert "POST 200 connection=close" in output, output
    assert output.count("GET 200 connection=close") == 3, output
    (approval,) = stats["start_requests"]
    assert approval["event_ids"] == [event_id] and approval["accepted"] and approval["vm"] == "flatcar-vm1"
