"""The App Insights sink's managed-identity token stays with the configured ingestion host.

A real HTTPS peer at ``localhost`` answers 307/308 pointing at a second real HTTPS peer on another
host (``127.0.0.2``) that records every Authorization header it is sent: the token never reaches
it, and the sink does not keep that URL. The token's audience is one of Azure Monitor's, whatever
``AADAudience`` the connection string names.
"""
from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme

from forwarder.emulator import Emulator
from forwarder.sinkapi import Ok, Record, Retry, SinkContext
from sinks.appinsights import AppInsightsSink, ConnectionString

IKEY = "00000000-0000-0000-0000-000000000000"


def _record(n: int) -> Record:
    return Record.from_dict({
        "specversion": "1.0", "id": f"id-{n}", "source": "/vm/web-0", "type": "scheduledevent.scheduled",
        "subject": f"EVT-{n}", "time": "2026-01-02T03:04:05.678Z", "datacontenttype": "application/json",
        "sequence": f"{n:020d}", "data": {"EventId": f"EVT-{n}"},
    })


class Peer:
    """An HTTPS /v2.1/track peer on ``host``: answers ``redirect_to`` (307/308) or 200, records headers."""

    def __init__(self, ca: trustme.CA, host: str, bind: str) -> None:
        self.host = host
        self.seen: list[dict[str, str]] = []
        self.redirect: tuple[int, str] | None = None
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                peer.seen.append({k.lower(): v for k, v in self.headers.items()})
                if peer.redirect is not None:
                    status, location = peer.redirect
                    self.send_response(status)
                    self.send_header("Location", location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"itemsReceived": 1, "itemsAccepted": 1, "errors": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer((bind, 0), Handler)
        self.server.daemon_threads = True
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("localhost", "127.0.0.1", "127.0.0.2").configure_cert(ctx)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[tuple[Peer, Peer, Path]]:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    home, other = Peer(ca, "localhost", "127.0.0.1"), Peer(ca, "127.0.0.2", "127.0.0.2")
    try:
        yield home, other, ca_file
    finally:
        home.close()
        other.close()


@pytest.fixture
def identity(monkeypatch) -> Iterator[Emulator]:
    with Emulator(vms=["web-0"]) as emu:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)  # where azure-identity asks for tokens
        yield emu


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_to_another_host_never_gets_the_token_and_is_not_kept(peers, identity, tmp_path, monkeypatch, status):
    home, other, ca_file = peers
    monkeypatch.setenv("TEST_AI_CONN", f"InstrumentationKey={IKEY};IngestionEndpoint={home.url}/")
    home.redirect = (status, f"{other.url}/v2.1/track")
    sink = AppInsightsSink({"connection_string_env": "TEST_AI_CONN", "ca_file": str(ca_file),
                            "credential": "managed_identity", "timeout": "5s"}, SinkContext("ai", tmp_path / "s"))
    try:
        first = sink.send([_record(1)])
        home.redirect = None
        second = sink.send([_record(2)])
    finally:
        sink.close()
    assert home.seen and home.seen[0]["authorization"].startswith("Bearer ")  # the token went home
    assert not any("authorization" in h for h in other.seen), "the token followed the redirect"
    assert isinstance(first, Retry)  # not delivered through a host the token may not see
    assert second == Ok() and len(home.seen) == 2  # the next batch goes home again: the URL was not kept
    assert home.seen[1]["authorization"].startswith("Bearer ")


def test_a_redirect_on_the_same_host_is_followed_with_the_token(peers, identity, tmp_path, monkeypatch):
    home, other, ca_file = peers
    monkeypatch.setenv("TEST_AI_CONN", f"InstrumentationKey={IKEY};IngestionEndpoint={home.url}/")
    sink = AppInsightsSink({"connection_string_env": "TEST_AI_CONN", "ca_file": str(ca_file),
                            "credential": "managed_identity", "timeout": "5s"}, SinkContext("ai", tmp_path / "s"))
    home.redirect = (308, f"{home.url}/v2.1/track?moved=1")
    try:
        result = sink.send([_record(1)])
    finally:
        sink.close()
    # The peer answers the moved URL with a redirect too: followed on the same host, token included,
    # up to the redirect limit, then retried.
    assert isinstance(result, Retry) and len(home.seen) > 1
    assert all(h["authorization"].startswith("Bearer ") for h in home.seen) and other.seen == []


@pytest.mark.parametrize("audience", ["https://attacker.example/", "https://management.azure.com/",
                                      "https://monitor.azure.com.attacker.example/", "http://monitor.azure.com/"])
def test_an_audience_other_than_azure_monitors_is_a_config_error(monkeypatch, audience):
    monkeypatch.setenv("TEST_AI_CONN", f"InstrumentationKey={IKEY};AADAudience={audience}")
    problems = AppInsightsSink.check({"connection_string_env": "TEST_AI_CONN", "credential": "managed_identity"})
    assert any("AADAudience" in p and "Azure Monitor" in p for p in problems), problems
    with pytest.raises(ValueError):
        ConnectionString.parse(f"InstrumentationKey={IKEY};AADAudience={audience}")


@pytest.mark.parametrize("audience, scope", [
    ("https://monitor.azure.com/", "https://monitor.azure.com//.default"),
    ("https://monitor.azure.us", "https://monitor.azure.us//.default"),
    ("https://MONITOR.azure.cn/", "https://monitor.azure.cn//.default"),
])
def test_azure_monitors_audiences_are_taken(audience, scope):
    assert ConnectionString.parse(f"InstrumentationKey={IKEY};AADAudience={audience}").scope == scope


def test_the_log_analytics_audience_is_azure_monitors_too():
    pytest.importorskip("azure.monitor.ingestion")
    from sinks.loganalytics import LogAnalyticsSink

    base = {"endpoint": "https://dce.example.ingest.monitor.azure.com", "rule_id": "dcr-" + "0" * 32}
    assert not [p for p in LogAnalyticsSink.check({**base, "audience": "https://monitor.azure.us"}) if "audience" in p]
    problems = LogAnalyticsSink.check({**base, "audience": "https://vault.azure.net"})
    assert any("audience" in p and "Azure Monitor" in p for p in problems), problems
