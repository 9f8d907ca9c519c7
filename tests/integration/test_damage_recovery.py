"""The real agent starts on a damaged journal, reports what it skipped, and delivers the rest."""
from __future__ import annotations

import orjson

from forwarder.emulator import Emulator
from forwarder.journal import MAGIC
from tests.agent import AgentProcess, wait_until
from tests.integration.test_cli import sefwd
from tests.peers.webhook_receiver import WebhookReceiver


def test_flipped_bytes_torn_tail_zero_segment_and_lost_cursor(tmp_path):
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver(default=503) as rx:
        config = tmp_path / "c.toml"
        config.write_text(
            f'[imds]\nendpoint = "{emu.url}"\npoll_interval = "300ms"\n[state]\ndir = "{state}"\n'
            f'[agent]\nheartbeat = "0"\ndrain_timeout = "0s"\n[delivery]\nretry_initial = "50ms"\nretry_max = "200ms"\n'
            f'[journal]\nsegment_size = "64KiB"\n'
            f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\ntimeout = "1s"\n'
        )
        agent = AgentProcess(config, tmp_path / "a1.log")
        ids = [emu.schedule(type="Reboot", resources=["myVM"], start_after=600) for _ in range(12)]
        wait_until(lambda: _journal_records(state) >= 13, 60, "records journaled while the webhook is down")
        assert agent.terminate() == 0
        segment = sorted((state / "journal").glob("seg-*.log"))[-1]
        data = bytearray(segment.read_bytes())
        data[len(MAGIC) + 2000] ^= 0xFF                      # damage one record in the middle
        segment.write_bytes(bytes(data) + b"\x99\x00\x00\x00torn")  # and leave a torn tail
        (state / "journal" / "seg-99999999999999999999.log").write_bytes(b"")
        (state / "journal" / "cursors" / "hook.cursor").write_bytes(b"garbage")
        rx.set_policy(200)
        agent = AgentProcess(config, tmp_path / "a2.log")
        got = lambda: {r.json()["subject"] for r in rx.requests if r.body and r.json()["type"] == "scheduledevent.scheduled"}  # noqa: E731
        wait_until(lambda: len(got()) >= len(ids) - 1, 60, "the undamaged records delivered")
        wait_until(lambda: (state / "status.json").exists() and orjson.loads((state / "status.json").read_bytes())
                   ["journal"]["corrupt_skipped"], 30, "status reports the skipped record")
        status = orjson.loads(sefwd("status", "--config", str(config), "--json").stdout)
        assert agent.terminate() == 0
    logs = agent.logs()
    assert "truncating a torn tail" in logs and "cursor file damaged" in logs and "skipped 1 damaged" in logs
    assert status["agent"]["journal"]["corrupt_skipped"] == {"hook": 1}
    assert status["agent"]["journal"]["cursor_resets"] == {"hook": 1}
    assert len(got()) == len(ids) - 1  # exactly the damaged record is missing, and counted


def _journal_records(state) -> int:
    from forwarder.journal import decode_at

    total = 0
    for seg in (state / "journal").glob("seg-*.log"):
        buf, pos = seg.read_bytes(), len(MAGIC)
        while (found := decode_at(buf, pos)) is not None:
            total, pos = total + 1, found[1]
    return total
