"""A document listener that raises (the maintenance probe's tracker, after a bug) must not cost the
poll cycle its heartbeat: the poller counts and logs it as a cycle error and carries on."""
from __future__ import annotations

import threading
from pathlib import Path

from forwarder.emulator import Emulator
from tests.agent import wait_until
from tests.integration.test_outcome_poller import poller_for, records


def test_a_raising_document_listener_costs_no_heartbeat(tmp_path: Path) -> None:
    stop = threading.Event()
    calls: list[object] = []

    def broken_listener(document: object) -> None:
        calls.append(document)
        raise RuntimeError("a bug in a listener")

    with Emulator(rate_limit=None) as emu:
        emu.schedule(type="Reboot", not_before="+15m")
        with poller_for(emu, tmp_path, poll_interval=0.05, heartbeat=0.1, stop=stop) as poller:
            poller.on_document = broken_listener
            thread = threading.Thread(target=poller.run, daemon=True)
            thread.start()
            try:
                wait_until(lambda: sum(r["type"] == "forwarder.heartbeat" for r in records(tmp_path)) >= 2, 30,
                           "two heartbeats while the listener raises on every cycle")
            finally:
                stop.set()
                thread.join(30)
            assert len(calls) >= 2 and poller.stats.cycle_errors >= 2
            assert any(r["type"] == "scheduledevent.scheduled" for r in records(tmp_path))
