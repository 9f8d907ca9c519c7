"""The emulator's hostile-answer faults, so users can test their own handling: observed by raw sockets
(for the framing) and by the real agent (which must survive each of them)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forwarder.emulator import FAULT_KINDS, Emulator, SpecError
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config
from tests.conftest import ROOT

REQUEST = b"GET /metadata/scheduledevents?api-version=2020-07-01 HTTP/1.1\r\nHost: x\r\nMetadata: true\r\nConnection: close\r\n\r\n"


def raw_answer(emu: Emulator, limit: int = 1 << 20, timeout: float = 30) -> bytes:
    with socket.create_connection(("127.0.0.1", emu.port), timeout=timeout) as s:
        s.sendall(REQUEST)
        data = bytearray()
        while len(data) < limit:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return bytes(data)


@pytest.fixture
def emu() -> Emulator:
    with Emulator(vms=["myVM"], rate_limit=None) as e:
        e.schedule(type="Reboot", resources=["myVM"], not_before="+15m")
        yield e


def test_interim_answers_come_first_each_on_its_own(emu: Emulator) -> None:
    emu.inject_fault("interim", statuses=[100, 103], delay=0.05)
    data = raw_answer(emu)
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 ")


def test_drip_sends_the_answer_byte_by_byte(emu: Emulator) -> None:
    emu.inject_fault("drip", delay=0.001)
    started = time.monotonic()
    data = raw_answer(emu)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["Events"]
    assert time.monotonic() - started >= 0.001 * len(data) * 0.5  # (not a timing goal: it did drip)


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_answer_is_streamed(emu: Emulator, chunked: bool) -> None:
    emu.inject_fault("oversized", size=4 * 1024 * 1024, chunked=chunked)
    data = raw_answer(emu, limit=8 * 1024 * 1024)
    head = data.partition(b"\r\n\r\n")[0].lower()
    assert (b"transfer-encoding: chunked" in head) if chunked else (b"content-length: 4194304" in head)
    assert len(data) >= 4 * 1024 * 1024


def test_nested_and_out_of_range_documents_are_valid_json_with_hostile_values(emu: Emulator) -> None:
    emu.inject_fault("nested", depth=50)
    body = raw_answer(emu).partition(b"\r\n\r\n")[2]
    assert body.count(b'{"Nested":') == 50
    emu.inject_fault("out_of_range")
    doc = json.loads(raw_answer(emu).partition(b"\r\n\r\n")[2])
    assert doc["DocumentIncarnation"] > 2**64 and doc["Events"][0]["DurationInSeconds"] > 2**64
    assert doc["Events"][0]["NotBefore"].startswith("0001-")


def test_bad_hostile_fault_specs_are_refused(emu: Emulator) -> None:
    for spec in ({"size": 0}, {"size": True}):
        with pytest.raises(SpecError):
            emu.inject_fault("oversized", **spec)
    with pytest.raises(SpecError):
        emu.inject_fault("interim", statuses=[101])
    with pytest.raises(SpecError):
        emu.inject_fault("out_of_range", field="nope")


def ctl_fault(emu: Emulator, *args: str) -> subprocess.CompletedProcess[str]:
    """``sefwd emulator ctl URL fault ...`` as a user types it, against the running emulator."""
    return subprocess.run([sys.executable, "-m", "forwarder", "emulator", "ctl", emu.url, "fault", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_ctl_offers_every_fault_kind_of_the_control_api() -> None:
    done = subprocess.run([sys.executable, "-m", "forwarder", "emulator", "ctl", "http://127.0.0.1:1", "fault", "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert all(kind in done.stdout for kind in FAULT_KINDS), done.stdout
    for option in ("--size", "--chunked", "--depth", "--statuses", "--field", "--delay", "--path"):
        assert option in done.stdout


@pytest.mark.parametrize(("args", "pending", "check"), [
    (["drip", "--delay", "1ms"], {"kind": "drip", "delay": 0.001},
     lambda data: data.startswith(b"HTTP/1.1 200") and json.loads(data.partition(b"\r\n\r\n")[2])["Events"]),
    (["interim", "--statuses", "100,102", "--delay", "10ms"], {"kind": "interim", "statuses": [100, 102], "delay": 0.01},
     lambda data: data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200 ")),
    (["oversized", "--size", "2MiB"], {"kind": "oversized", "size": 2 * 1024 * 1024, "chunked": False},
     lambda data: b"content-length: 2097152" in data.partition(b"\r\n\r\n")[0].lower() and len(data) > 2 * 1024 * 1024),
    (["oversized", "--size", "1048576", "--chunked"], {"kind": "oversized", "size": 1024 * 1024, "chunked": True},
     lambda data: b"transfer-encoding: chunked" in data.partition(b"\r\n\r\n")[0].lower()),
    (["nested", "--depth", "30"], {"kind": "nested", "depth": 30},
     lambda data: data.partition(b"\r\n\r\n")[2].count(b'{"Nested":') == 30),
    (["out_of_range", "--field", "not_before"], {"kind": "out_of_range", "field": "not_before"},
     lambda data: (doc := json.loads(data.partition(b"\r\n\r\n")[2]))["DocumentIncarnation"] < 2**63
     and doc["Events"][0]["NotBefore"].startswith("0001-")),
    (["out_of_range", "--field", "incarnation", "--count", "2"], {"kind": "out_of_range", "field": "incarnation", "count": 2},
     lambda data: json.loads(data.partition(b"\r\n\r\n")[2])["DocumentIncarnation"] > 2**64),
])
def test_each_hostile_fault_through_the_ctl_command(emu: Emulator, args: list[str], pending: dict, check) -> None:
    done = ctl_fault(emu, *args)
    assert done.returncode == 0, done.stderr
    queued = emu.stats()["faults_pending"]
    assert len(queued) == 1 and queued[0].items() >= pending.items(), queued
    assert check(raw_answer(emu, limit=4 * 1024 * 1024)), "the answer is not shaped as the fault says"


@pytest.mark.parametrize(("args", "code", "says"), [
    (["interim", "--statuses", "101"], 1, "1xx codes other than 101"),
    (["interim", "--statuses", "1xx"], 2, "expected 1xx codes"),
    (["oversized", "--size", "huge"], 2, "expected a size"),
    (["out_of_range", "--field", "nope"], 2, "invalid choice"),
    (["nested", "--depth", "0"], 1, "fault depth must be an integer from 1"),
])
def test_ctl_refuses_bad_fault_options_saying_why(emu: Emulator, args: list[str], code: int, says: str) -> None:
    done = ctl_fault(emu, *args)
    assert done.returncode == code and says in done.stdout + done.stderr, (done.stdout, done.stderr)
    assert emu.stats()["faults_pending"] == []


def test_hostile_faults_in_a_scenario_file(tmp_path: Path) -> None:
    path = tmp_path / "hostile.toml"
    path.write_text("""
name = "hostile"
vms = ["myVM"]

[[steps]]
at = "0s"
action = "schedule"
id = "EV-H"
type = "Reboot"
resources = ["myVM"]
start_after = "15m"

[[steps]]
at = "0s"
action = "fault"
kind = "out_of_range"
field = "duration"

[[steps]]
at = "0s"
action = "fault"
kind = "oversized"
size = "2MiB"
chunked = true

[[steps]]
at = "0s"
action = "fault"
kind = "interim"
statuses = [103]
delay = "10ms"

[[steps]]
at = "0s"
action = "fault"
kind = "nested"
depth = 20
""")
    with Emulator(scenario=path, rate_limit=None) as emu:
        wait_until(lambda: len(emu.stats()["faults_pending"]) == 4 and emu.stats()["events"], 30,
                   "the scenario's event and its four faults")
        doc = json.loads(raw_answer(emu).partition(b"\r\n\r\n")[2])
        assert doc["Events"][0]["EventId"] == "EV-H" and doc["Events"][0]["DurationInSeconds"] > 2**64
        head = raw_answer(emu, limit=4 * 1024 * 1024).partition(b"\r\n\r\n")[0].lower()
        assert b"transfer-encoding: chunked" in head
        assert raw_answer(emu).startswith(b"HTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 ")
        assert raw_answer(emu).partition(b"\r\n\r\n")[2].count(b'{"Nested":') == 20
        normal = json.loads(raw_answer(emu).partition(b"\r\n\r\n")[2])  # then normal service again
        assert normal["Events"][0]["DurationInSeconds"] == -1 and emu.stats()["faults_pending"] == []


@pytest.mark.slow  # every hostile fault against a real agent
def test_the_agent_survives_every_hostile_fault(tmp_path: Path, emu: Emulator) -> None:
    out = tmp_path / "out.jsonl"
    config = write_config(tmp_path / "sefwd.toml", emu.url, tmp_path / "state", poll_interval="500ms")
    agent = AgentProcess(config, tmp_path / "agent.log", env={"SEFWD_IMDS_TIMEOUT": "2s"})
    try:
        wait_until(lambda: [r for r in read_jsonl(out) if r["type"] == "scheduledevent.scheduled"], 60, "first record")
        for kind, options in [("interim", {}), ("drip", {"delay": 0.5}), ("oversized", {"size": 32 * 1024 * 1024}),
                              ("oversized", {"size": 32 * 1024 * 1024, "chunked": True}), ("nested", {"depth": 5000}),
                              ("out_of_range", {})]:
            before = emu.stats()["requests"]["myVM"]["GET"]
            emu.inject_fault(kind, count=2, **options)
            wait_until(lambda: emu.stats()["requests"]["myVM"]["GET"] >= before + 3, 60, f"polls through {kind}")
            assert agent.alive(), agent.logs()[-3000:]
        second = emu.schedule(type="Freeze", resources=["myVM"], not_before="+15m")
        wait_until(lambda: any(r["subject"] == second for r in read_jsonl(out)), 60, "a record after every fault")
        kinds = [r["type"] for r in read_jsonl(out) if r["type"].startswith("scheduledevent.")]
        assert "scheduledevent.canceled" not in kinds and "scheduledevent.ended" not in kinds, kinds
    finally:
        assert agent.terminate() == 0, agent.logs()[-3000:]


def test_emulator_on_a_busy_port_is_one_clear_line(emu: Emulator) -> None:
    done = subprocess.run([sys.executable, "-m", "forwarder", "emulator", "--listen", f"127.0.0.1:{emu.port}"],
                          capture_output=True, cwd=ROOT, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err.strip() == f"sefwd: cannot listen on 127.0.0.1:{emu.port}: Address already in use", err


def test_emulator_refuses_a_name_that_only_looks_like_loopback() -> None:
    done = subprocess.run([sys.executable, "-m", "forwarder", "emulator", "--listen", "localhost.example.com:0"],
                          capture_output=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "--allow-remote" in done.stderr.decode(), done.stderr.decode()
