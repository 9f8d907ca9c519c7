"""A slowloris against a running agent's approval callback: one client holding many idle connections
cannot keep another client's signed request from being answered, and the agent lives on."""
from __future__ import annotations

import select
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest
import requests

from forwarder.approval.callback import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT
from forwarder.emulator import Emulator
from forwarder.emulator.model import VmProfile
from forwarder.common.signing import generate_secret, parse_secret, sign_headers
from tests.agent import AgentProcess, callback_url, read_jsonl, wait_until, write_config

pytestmark = pytest.mark.timeout(180)

SECRET = generate_secret()


def idle_connection(port: int, source: str) -> socket.socket | None:
    """A connection from ``source`` that never sends a byte (None once the server refuses to accept more)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.bind((source, 0))
    try:
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def start_agent(tmp_path: Path, emu: Emulator, client_timeout: str) -> tuple[AgentProcess, int]:
    """The agent and its callback's port (it listens on port 0: the port is read from its log)."""
    config = write_config(tmp_path / "c.toml", emu.vm_url("vm0"), tmp_path / "state", extra=(
        "[approval.callback]\n"
        'listen = "127.0.0.1:0"\nsecret_env = "CB_SECRET"\nrate_limit = 600\n'
        f'client_timeout = "{client_timeout}"\n'
    ))
    agent = AgentProcess(config, tmp_path / "agent.log", env={"CB_SECRET": SECRET})
    return agent, urlsplit(callback_url(agent)).port or 0


def test_idle_connections_from_one_client_do_not_starve_another(tmp_path):
    with Emulator(vms=["vm0"], rate_limit=None) as emu:
        # client_timeout: long enough that the idle connections are still held when the signed request comes.
        agent, port = start_agent(tmp_path, emu, "60s")
        held: list[socket.socket] = []
        try:
            wait_until(lambda: read_jsonl(tmp_path / "out.jsonl"), 60, "the agent's first records")
            wait_until(lambda: "approval callback listening" in agent.logs(), 30, "the callback listening")
            # The slowloris: twice as many idle connections as the server has slots, all from 127.0.0.2.
            for _ in range(2 * MAX_CONNECTIONS):
                sock = idle_connection(port, "127.0.0.2")
                if sock is not None:
                    held.append(sock)
            body = orjson.dumps({"StartRequests": [{"EventId": "no-such-event"}],
                                 "ResourceId": VmProfile("vm0").resource_id})
            headers = sign_headers(parse_secret(SECRET), f"msg_{uuid.uuid4().hex}", body, now=time.time())
            headers["content-type"] = "application/json"
            started = time.monotonic()
            answer = requests.post(f"http://127.0.0.1:{port}/approvals", data=body, headers=headers, timeout=30)
            # Answered (the event is unknown, so not approved), and long before the idle clients time out.
            assert (answer.status_code, answer.json()["reason"]) == (422, "unknown_event"), answer.text
            assert time.monotonic() - started < 30
            assert agent.alive()
            cap_logged = f"already has {MAX_CONNECTIONS_PER_CLIENT} connections open"
            wait_until(lambda: cap_logged in agent.logs(), 30, "the per-client cap logged")
        finally:
            for sock in held:
                sock.close()
            rc = agent.terminate()
        assert rc == 0


def read_answer(sock: socket.socket, timeout: float) -> bytes:
    """Everything until the server closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def test_idle_and_dripping_connections_are_cut_at_the_deadline(tmp_path):
    with Emulator(vms=["vm0"], rate_limit=None) as emu:
        agent, port = start_agent(tmp_path, emu, "1s")
        try:
            wait_until(lambda: "approval callback listening" in agent.logs(), 60, "the callback listening")
            idle = idle_connection(port, "127.0.0.2")
            drip = idle_connection(port, "127.0.0.3")
            assert idle is not None and drip is not None
            started = time.monotonic()
            # The drip sends a byte every 200 ms: each recv succeeds, the request never completes. It stops
            # once the answer is there (a byte sent after the server closed would reset the connection).
            for byte in b"POST /approvals HTTP/1.1\r\nHost: x\r\n":
                if time.monotonic() - started > 3.0 or select.select([drip], [], [], 0.2)[0]:
                    break  # the select timeout is the attacker's pace
                try:
                    drip.sendall(bytes([byte]))
                except OSError:
                    break  # already cut
            answers = [read_answer(sock, 30) for sock in (idle, drip)]
            for answer in answers:
                assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
                assert b'"client_timeout"' in answer
            # Both cut near the 1 s deadline, long before 30 s: trickling bytes did not extend it.
            assert time.monotonic() - started < 20
            idle.close()
            drip.close()
            assert agent.alive()
            out = tmp_path / "out.jsonl"
            # Each cut connection is audited on its own: wait for the dripping one's (the idle one's may come first).
            refused = wait_until(lambda: (rs := [r for r in read_jsonl(out) if r["type"] == "approval.refused"
                                                 and r["data"].get("Reason") == "client_timeout"])
                                 and {r["data"]["Client"].split(":")[0] for r in rs} >= {"127.0.0.3"} and rs,
                                 30, "the dripping client's audit record")
            assert {r["data"]["Client"].split(":")[0] for r in refused} >= {"127.0.0.3"}
        finally:
            rc = agent.terminate()
        assert rc == 0
