"""Every listener has the same limits (the server base's): a local user opening hundreds of idle,
half-sent requests against the telemetry endpoint, the maintenance probe or the IMDS emulator holds
at most a few threads, for a bounded time, and legitimate requests from elsewhere are still answered.

The attacker connects from 127.0.0.2 (another loopback address, so another client for the
per-client cap) — or, against the probe, from 40 addresses at once, so that the total cap and
"cut the oldest" are what holds; the legitimate scraper or load balancer from 127.0.0.1.
"""
from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from forwarder.common.http_server import ConnectionLimits
from forwarder.emulator import Emulator
from tests.agent import AgentProcess, wait_until, write_config

pytestmark = pytest.mark.timeout(180)

ATTACKERS = 600
HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nX-Slow: "  # headers never finished


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def open_half_requests(host: str, port: int, count: int, sources: tuple[str, ...] = ("127.0.0.2",),
                       half: bytes = HALF_REQUEST) -> list[socket.socket]:
    socks = []
    for i in range(count):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.settimeout(10)
        try:
            s.connect((host, port))
            s.sendall(half)
        except OSError:
            s.close()  # refused at once: fine, that is a cap
            continue
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        data = s.recv(65536)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return data == b"" or data.startswith(b"HTTP/")  # EOF, or an error answer before it


def settled(socks: list[socket.socket], cap: int) -> None:
    """Until the server has dealt with every connection: all but the ``cap`` it serves are closed."""
    closed: set[int] = set()

    def done() -> bool:
        closed.update(i for i, s in enumerate(socks) if i not in closed and closed_by_server(s))
        return len(closed) >= len(socks) - cap

    wait_until(done, 60, "the connections over the cap to be closed")


def cut_and_released(agent: AgentProcess, socks: list[socket.socket], baseline: int, deadline: float) -> None:
    """The half-sent requests are cut after the listener's request ``deadline``, and their threads go."""
    wait_until(lambda: all(closed_by_server(s) for s in socks), deadline + 30, "the half-sent requests to be cut")
    wait_until(lambda: threads_of(agent.proc.pid) <= baseline + 2, 30, "the threads to go")


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        response.read()
        return response.status


def listening_agent(tmp_path: Path, emu: Emulator, section: str, logged: str) -> tuple[AgentProcess, str]:
    """A real agent with ``section`` listening on port 0, and the URL its log line ``logged (URL)`` names."""
    config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", extra=f'{section}\nlisten = "127.0.0.1:0"\n')
    agent = AgentProcess(config, tmp_path / "agent.log")
    try:
        return agent, wait_until(lambda: re.search(logged + r" (http://\S+)", agent.logs()), 30, section)[1]
    except BaseException:
        agent.terminate()
        raise


@pytest.mark.slow  # 600 connections held to their deadline
def test_idle_half_sent_requests_against_metrics_hold_few_threads(tmp_path):
    pytest.importorskip("opentelemetry.exporter.prometheus")
    from forwarder.agent.telemetry import TELEMETRY_LIMITS

    with Emulator(vms=["web-0"]) as emu:
        agent, base = listening_agent(tmp_path, emu, "[telemetry]", "/metrics and /healthz on")
        socks: list[socket.socket] = []
        try:
            assert get(base + "/metrics") == 200
            baseline = threads_of(agent.proc.pid)
            host, port = base.removeprefix("http://").rsplit(":", 1)
            socks = open_half_requests(host, int(port), ATTACKERS)
            settled(socks, TELEMETRY_LIMITS.max_per_client)
            held = threads_of(agent.proc.pid) - baseline
            print(f"\nthreads held by {ATTACKERS} half-sent requests: {held} (cap per client "
                  f"{TELEMETRY_LIMITS.max_per_client}, total {TELEMETRY_LIMITS.max_connections})")
            assert held <= TELEMETRY_LIMITS.max_per_client + 2
            # A scrape from another client is answered while the attacker holds its share.
            started = time.monotonic()
            assert get(base + "/metrics") == 200 and get(base + "/healthz") in (200, 503)
            assert time.monotonic() - started < 5
            # And the attacker's connections do not stay: cut after the request deadline.
            cut_and_released(agent, socks, baseline, TELEMETRY_LIMITS.request_timeout)
        finally:
            for s in socks:
                s.close()
            assert agent.terminate() == 0


@pytest.mark.slow  # connections held to their deadline
def test_the_emulator_bounds_idle_connections_too():
    limits = ConnectionLimits(max_connections=40, max_per_client=20, request_timeout=2.0)
    with Emulator(vms=["web-0"], limits=limits) as emu:
        before = threading.active_count()
        host, port = emu.url.removeprefix("http://").rsplit(":", 1)
        socks = open_half_requests(host, int(port), ATTACKERS)
        try:
            settled(socks, limits.max_per_client)
            assert threading.active_count() - before <= limits.max_per_client + 2
            request = urllib.request.Request(emu.url + "/metadata/scheduledevents?api-version=2020-07-01",
                                             headers={"Metadata": "true"})
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 200
            wait_until(lambda: all(closed_by_server(s) for s in socks), limits.request_timeout + 30,
                       "the half-sent requests to be cut")
        finally:
            for s in socks:
                s.close()


def test_idle_half_sent_requests_against_the_probe_hold_few_threads(tmp_path):
    """600 half-sent probe requests from 40 addresses (15 each: over the per-client cap, and 5 times
    the total): the agent holds at most the total cap in threads, a load balancer's probe from
    another address is answered at once, and the attackers are cut at the probe's head deadline."""
    from forwarder.agent.probe import CLIENT_TIMEOUT, MAX_CONNECTIONS

    sources = tuple(f"127.0.0.{10 + i}" for i in range(40))
    with Emulator(vms=["web-0"]) as emu:
        agent, url = listening_agent(tmp_path, emu, "[probe]", "maintenance probe on")
        socks: list[socket.socket] = []
        try:
            assert get(url) == 200
            baseline = threads_of(agent.proc.pid)
            host, port = url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
            socks = open_half_requests(host, int(port), ATTACKERS, sources,
                                       b"GET /maintenance HTTP/1.1\r\nHost: lb\r\nX-Slow: ")
            settled(socks, MAX_CONNECTIONS)
            held = threads_of(agent.proc.pid) - baseline
            print(f"\nthreads held by {ATTACKERS} half-sent probe requests from {len(sources)} addresses: {held} "
                  f"(total cap {MAX_CONNECTIONS})")
            assert held <= MAX_CONNECTIONS + 2
            started = time.monotonic()
            for _ in range(5):
                assert get(url) == 200  # cuts the oldest attacker to make room, answered on the accept loop
            assert time.monotonic() - started < 5
            cut_and_released(agent, socks, baseline, CLIENT_TIMEOUT)
        finally:
            for s in socks:
                s.close()
            assert agent.terminate() == 0
