"""The maintenance probe of a real `sefwd run` against the emulator, and the probe server under abuse."""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

from forwarder.agent.maintenance import MaintenancePolicy, MaintenanceTracker
from forwarder.agent.probe import ProbeServer
from forwarder.emulator import Emulator
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config

COMMON = ("state", "EventId", "EventType", "EventStatus", "NotBefore", "until", "DocumentIncarnation")


def probe(url: str, method: str = "GET", source: str | None = None, timeout: float = 10.0
          ) -> tuple[int, dict[str, str], bytes]:
    match = re.match(r"http://([^/:]+):(\d+)(/.*)", url)
    assert match
    conn = http.client.HTTPConnection(match[1], int(match[2]), timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, match[3])
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def state(url: str) -> tuple[int, dict]:
    status, _, body = probe(url)
    return status, json.loads(body)


def start_agent(tmp_path: Path, emu: Emulator, probe_extra: str = "", poll: str = "500ms"
                ) -> tuple[AgentProcess, str, Path]:
    state_file = tmp_path / "run" / "maintenance.json"
    config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", poll_interval=poll,
                          extra=f'[probe]\nlisten = "127.0.0.1:0"\nsettle = "2s"\nstate_file = "{state_file}"\n'
                                f"{probe_extra}")
    agent = AgentProcess(config, tmp_path / "agent.log")
    found = wait_until(lambda: re.search(r"maintenance probe on (http://\S+)", agent.logs()), 30, "the probe to listen")
    return agent, found[1], state_file


def seen(url: str, emu: Emulator) -> dict:
    """The probe's answer once it reflects the emulator's current document."""
    incarnation = emu.stats()["incarnation"]
    return wait_until(lambda: (b := state(url)[1])["DocumentIncarnation"] == incarnation and b, 30,
                      f"the probe to reflect incarnation {incarnation}")


def sefwd_status(tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    return subprocess.run([sys.executable, "-m", "forwarder", "status", "--config", str(tmp_path / "c.toml")],
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT),
                          timeout=60).stdout


def same_as_file(body: dict, state_file: Path) -> None:
    """The state file says what the probe said (it is written just after the probe's state changes)."""
    want = {k: body[k] for k in COMMON}

    def matches() -> dict | None:
        try:
            on_disk = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return None
        return on_disk if {k: on_disk.get(k) for k in COMMON} == want else None

    on_disk = wait_until(matches, 30, f"the state file to say {want}")
    assert datetime.fromisoformat(on_disk["stale_after"]) > datetime.fromisoformat(on_disk["written_at"])


def test_probe_503_within_a_poll_then_200_after_the_end_and_settle(tmp_path):
    with Emulator(vms=["web-0", "web-1"]) as emu:
        agent, url, state_file = start_agent(tmp_path, emu, poll="1s")  # "within a poll" below: 1 s
        try:
            body = seen(url, emu)
            assert body["state"] == "serving" and body["EventId"] is None
            same_as_file(body, state_file)
            event_id = emu.schedule(type="Reboot", resources=["web-0"], start_after=600, complete_after=0.5)
            first = wait_until(lambda: (f := json.loads(state_file.read_text()))["EventId"] == event_id and f, 30,
                               "the state file to name the event")
            status, body = state(url)
            assert status == 503 and body["state"] == "maintenance" and body["EventId"] == event_id
            assert body["EventType"] == "Reboot" and body["EventStatus"] == "Scheduled"
            assert 590 <= body["seconds_left"] <= 600 and body["NotBefore"] == body["until"]
            same_as_file(body, state_file)
            status_page = wait_until(lambda: "maintenance probe: maintenance (Reboot " in (out := sefwd_status(tmp_path))
                                     and out, 30, "sefwd status to show the maintenance")
            assert event_id in status_page
            # Within one poll interval: the state changed in the very cycle that committed the
            # document (the record's time is when that poll read it), not at a later poll. The
            # clocks are the agent's own, so a slow test thread cannot blur this.
            record = wait_until(lambda: [r for r in read_jsonl(tmp_path / "out.jsonl") if r.get("subject") == event_id
                                         and r["type"] == "scheduledevent.scheduled"], 30, "the scheduled record")[0]
            flipped = datetime.fromisoformat(first["written_at"]) - datetime.fromisoformat(record["time"])
            assert 0 <= flipped.total_seconds() < 1.0, flipped

            emu.approve(event_id)  # Started, then gone after complete_after (0.5 s)
            wait_until(lambda: state(url)[1]["state"] == "settling", 30, "settling after the event ended")
            status, body = state(url)
            assert status == 503 and body["EventId"] == event_id and body["EventStatus"] == "Ended"
            assert 0 < body["seconds_left"] <= 2
            wait_until(lambda: json.loads(state_file.read_text())["state"] == "settling", 30, "the file to settle")
            status, body = wait_until(lambda: (s := state(url))[0] == 200 and s, 30, "200 after the settle time")
            assert body["state"] == "serving"
            wait_until(lambda: json.loads(state_file.read_text())["state"] == "serving", 30, "the file to serve")
            same_as_file(body, state_file)
        finally:
            assert agent.terminate() == 0
        assert not state_file.exists()  # a clean stop removes it: no file, like no answer, means no agent


def test_head_other_types_other_vms_and_other_paths(tmp_path):
    with Emulator(vms=["web-0", "web-1"]) as emu:
        agent, url, _ = start_agent(tmp_path, emu)
        try:
            emu.schedule(type="Freeze", resources=["web-0"], start_after=600)  # not a default type
            emu.schedule(type="Reboot", resources=["web-1"], start_after=600)  # another VM
            body = seen(url, emu)
            assert body["state"] == "serving" and body["EventId"] is None
            get_status, get_headers, get_body = probe(url)
            head_status, head_headers, head_body = probe(url, "HEAD")
            assert get_status == head_status == 200 and head_body == b""
            assert head_headers["Content-Length"] == get_headers["Content-Length"] == str(len(get_body))
            assert get_headers["Cache-Control"] == "no-store" and get_headers["Connection"] == "close"
            preempt = emu.schedule(type="Preempt", resources=["web-0", "web-1"])
            assert seen(url, emu)["EventId"] == preempt
            assert probe(url, "HEAD")[0] == 503 and probe(url, "HEAD")[2] == b""
            assert probe(url.replace("/maintenance", "/other"))[0] == 404
            assert probe(url, "POST")[0] == 405
        finally:
            assert agent.terminate() == 0


def test_event_types_and_lead_from_the_config(tmp_path):
    with Emulator(vms=["web-0"]) as emu:
        agent, url, _ = start_agent(tmp_path, emu, 'event_types = ["Freeze"]\nlead = "5m"\n')
        try:
            reboot = emu.schedule(type="Reboot", resources=["web-0"], start_after=60)
            assert seen(url, emu)["state"] == "serving"
            far = emu.schedule(type="Freeze", resources=["web-0"], start_after=3600)
            body = seen(url, emu)
            assert body["state"] == "serving" and body["EventId"] == far  # the window opens in ~55 min
            assert 3200 <= body["seconds_left"] <= 3300
            near = emu.schedule(type="Freeze", resources=["web-0"], start_after=240)  # inside the 5 min lead
            body = seen(url, emu)
            assert body["state"] == "maintenance" and body["EventId"] == near != reboot
            assert probe(url)[0] == 503
        finally:
            assert agent.terminate() == 0


# -- the server under abuse (in process: a long client timeout makes "not delayed" unambiguous) ------

def _server(client_timeout: float = 60.0, **caps: int) -> ProbeServer:
    tracker = MaintenanceTracker(MaintenancePolicy(), lambda: VmIdentity(name="web-0"))
    tracker.observe(parse_document({"DocumentIncarnation": 1, "Events": []}))
    return ProbeServer(tracker, "127.0.0.1", 0, client_timeout=client_timeout, **caps).start()


def _idle_connections(count: int, sources: list[str], port: int, partial: bytes = b"") -> list[socket.socket]:
    socks = []
    for i in range(count):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.connect(("127.0.0.1", port))
        if partial:
            s.sendall(partial)
        socks.append(s)
    return socks


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.parametrize("spread", [1, 40], ids=["one-address", "forty-addresses"])
def test_slowloris_does_not_delay_a_legitimate_probe(spread):
    """200 idle or half-sent connections (from one address, or spread over 40) held open for the whole
    client timeout (60 s); a probe from another address is still answered at once (within its own
    10 s timeout, long before the attackers' connections would time out)."""
    server = _server()
    sources = [f"127.0.0.{10 + i}" for i in range(spread)]
    attackers: list[socket.socket] = []
    try:
        attackers = _idle_connections(100, sources, server.port) + \
            _idle_connections(100, sources, server.port, b"GET /maintenance HTTP/1.1\r\nHost: x\r\n")
        wait_until(lambda: server.refused + server.evicted + server.open_connections() >= 200 or None, 30,
                   "the server to see every attacker connection")
        assert server.open_connections() <= server.max_connections
        for _ in range(5):
            status, _, body = probe(server.url, source="127.0.0.2", timeout=10.0)
            assert status == 200 and json.loads(body)["state"] == "serving"
        assert sum(_still_open(s) for s in attackers) >= min(8 * spread, server.max_connections) - 5
    finally:
        for s in attackers:
            s.close()
        server.stop()


def test_a_trickling_client_is_cut_at_the_deadline_and_a_huge_head_refused():
    server = _server(client_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"GET /main")
            s.settimeout(10)
            assert s.recv(100) == b""  # closed without an answer once the head did not come in time
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"GET /maintenance HTTP/1.1\r\n" + b"X: " + b"a" * 5000 + b"\r\n\r\n")
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"nonsense\r\n\r\n")
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 400 ")
    finally:
        server.stop()


def test_answer_is_rendered_once_per_second_not_per_request():
    server = _server()
    try:
        first = server.answer()
        again = server.answer(first.rendered_at)
        assert again is first
        later = server.answer(first.valid_until)
        assert later is not first and later.status == 200
        assert server.answer(datetime(2000, 1, 1, tzinfo=timezone.utc)) is not later  # clock stepped back
    finally:
        server.stop()


def test_probe_stop_cuts_held_connections():
    server = _server()
    held = _idle_connections(3, ["127.0.0.1"], server.port)
    wait_until(lambda: server.open_connections() == 3, 10, "3 connections")
    done = threading.Event()
    threading.Thread(target=lambda: (server.stop(), done.set()), daemon=True).start()
    assert done.wait(20)
    for s in held:
        s.settimeout(10)
        assert s.recv(10) == b""
        s.close()


def test_a_taken_port_stops_the_agent_with_a_clear_error_and_no_state_file(tmp_path):
    with socket.socket() as taken, Emulator(vms=["web-0"]) as emu:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        state_file = tmp_path / "maintenance.json"
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra=f'[probe]\nlisten = "127.0.0.1:{port}"\nstate_file = "{state_file}"\n')
        agent = AgentProcess(config, tmp_path / "agent.log")
        rc = agent.proc.wait(60)
        agent._drain.join(10)
    assert rc != 0
    assert f"probe.listen 127.0.0.1:{port}: cannot listen" in agent.logs()
    assert not state_file.exists()


def test_probe_listens_on_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    tracker = MaintenanceTracker(MaintenancePolicy(), lambda: VmIdentity(name="web-0"))
    tracker.observe(parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventType": "Preempt", "Resources": ["web-0"], "EventStatus": "Scheduled",
         "NotBefore": ""}]}))
    try:
        server = ProbeServer(tracker, "::1", 0).start()
    except Exception as exc:  # a host without an IPv6 loopback address
        pytest.skip(f"cannot listen on [::1]: {exc}")
    try:
        assert server.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", server.port, timeout=10)
        conn.request("GET", "/maintenance")
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
        assert response.status == 503 and body["EventId"] == "E1" and body["seconds_left"] is None
    finally:
        server.stop()
