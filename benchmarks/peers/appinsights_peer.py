"""An Application Insights ingestion peer (``POST /v2.1/track``) over HTTPS on loopback.

It answers like the ingestion endpoint's published protocol (``{"itemsReceived", "itemsAccepted",
"errors": [{"index", "statusCode", "message"}]}``): 200 when every item is accepted, 206 when some
are, 400 when every item is refused as invalid. Each envelope is validated (name, time, iKey, data
with baseType; a custom event needs a name), and ``item_rule(envelope)`` may answer an item with a
status of its own (400 refused for good, 500/429 retryable), so a test can make one record fail
wherever it lands in a batch. Every accepted envelope is stored.

Scripting: ``peer.queue(500, 429, ...)`` answers the next requests with those statuses
(``Retry-After`` via ``Answer(429, retry_after=2)``), a 206 with per-item errors via
``Answer(206, reject=[0])`` (500, retryable) or ``refuse=[1]`` (400, for good), a slow answer via
``Answer(200, delay=s)``; a body over ``max_body`` bytes on the wire gets 413. With
``require_bearer=True`` a request without ``Authorization: Bearer ...`` gets 401.
``request_rule(envelopes)`` may answer a whole request by its content (an ``Answer``, or None for
the usual answer); ``Answer(400, itemized=False)`` is a refusal without per-item errors, as a
gateway in front of the service gives.

TLS uses a throw-away CA made by trustme: ``peer.ca_file`` is its PEM for the client's trust.

Usage::

    with AppInsightsPeer(tmp_path) as peer:
        conn = peer.connection_string
        ... export ...
        events = peer.wait_for_envelopes(3)
"""
from __future__ import annotations

import gzip
import json
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.peers.lifecycle import ServerPeer

import trustme

IKEY = "00000000-0000-0000-0000-000000000000"
TRACK_PATH = "/v2.1/track"


@dataclass(frozen=True)
class Answer:
    """One scripted answer."""

    status: int = 200
    retry_after: float | None = None
    reject: tuple[int, ...] | list[int] = ()  # for 206: item indexes answered 500 (retryable)
    refuse: tuple[int, ...] | list[int] = ()  # for 206: item indexes answered 400 (never accepted)
    delay: float = 0.0
    itemized: bool = True  # for statuses other than 200/206: list every item with the request's status


@dataclass
class TrackRequest:
    """One POST as received (body decompressed)."""

    path: str
    headers: dict[str, str]
    envelopes: list[dict[str, Any]]
    status: int
    gzipped: bool
    delayed: bool = False  # answered late (the client may have given up: the items still count)
    received_at: float = field(default_factory=time.monotonic)


def _invalid(envelope: Any) -> str | None:
    """Why the service would refuse this envelope (400), or None."""
    if not isinstance(envelope, dict):
        return "109: the item is not an object"
    for name in ("name", "time", "iKey"):
        if not isinstance(envelope.get(name), str) or not envelope[name]:
            return f"109: Field '{name}' on type 'Envelope' is required but missing or empty"
    if envelope["iKey"] != IKEY:
        return "400: Invalid instrumentation key"
    data = envelope.get("data")
    if not isinstance(data, dict) or not data.get("baseType"):
        return "109: Field 'baseType' on type 'Data' is required but missing or empty"
    base = data.get("baseData")
    if data["baseType"] == "EventData" and (not isinstance(base, dict) or not base.get("name")):
        return "109: Field 'name' on type 'EventData' is required but missing or empty"
    return None


def _parse_body(raw: bytes) -> list[dict[str, Any]]:
    text = raw.decode("utf-8").strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]  # newline-delimited JSON


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output clean
        pass

    def _reply(self, status: int, body: dict[str, Any] | None, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
            self.wfile.flush()
        except OSError:  # the client gave up waiting (a scripted slow answer)
            self.close_connection = True

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        peer = self.server.peer
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        gzipped = headers.get("content-encoding", "").lower() == "gzip"
        if self.path.split("?")[0] != TRACK_PATH:
            self._reply(404, {"error": f"unknown path {self.path}"})
            return
        try:
            envelopes = _parse_body(gzip.decompress(raw) if gzipped else raw)
        except (ValueError, OSError) as exc:
            self._reply(400, {"itemsReceived": 0, "itemsAccepted": 0, "errors": [], "message": f"bad body: {exc}"})
            return
        answer = peer._next_answer()
        ruled = peer.request_rule(envelopes) if peer.request_rule else None
        if ruled is not None:
            answer = ruled
        if peer.require_bearer and not headers.get("authorization", "").startswith("Bearer "):
            answer = Answer(401)
        if answer.delay and peer._stopping.wait(answer.delay):
            self.close_connection = True
            return
        request = TrackRequest(self.path, headers, envelopes, answer.status, gzipped, delayed=answer.delay > 0)
        n = len(envelopes)
        extra = {"Retry-After": f"{answer.retry_after:g}"} if answer.retry_after is not None else None
        if answer.status in (200, 206) and peer.max_body is not None and length > peer.max_body:
            request.status = 413
            peer._store(request, [])
            self._reply(413, {"itemsReceived": n, "itemsAccepted": 0,
                              "errors": [{"index": i, "statusCode": 413, "message": "Payload too large"} for i in range(n)]})
            return
        if answer.status not in (200, 206):
            peer._store(request, [])
            if not answer.itemized:
                self._reply(answer.status, {"error": {"code": "BadRequest", "message": "scripted refusal of the request"}},
                            extra)
                return
            # Like the service: each item carries the request's status.
            self._reply(answer.status, {"itemsReceived": n, "itemsAccepted": 0,
                                        "errors": [{"index": i, "statusCode": answer.status, "message": "scripted"}
                                                   for i in range(n)]},
                        extra)
            return
        errors = []
        for i, envelope in enumerate(envelopes):
            why = _invalid(envelope)
            status = 400 if why else (peer.item_rule(envelope) if peer.item_rule else None)
            if i in answer.refuse:
                status, why = 400, "scripted item refusal"
            elif i in answer.reject:
                status, why = 500, "scripted item failure"
            if status is not None and status != 200:
                errors.append({"index": i, "statusCode": status, "message": why or f"item answered {status}"})
        failed = {e["index"] for e in errors}
        accepted = [e for i, e in enumerate(envelopes) if i not in failed]
        status = 200 if not errors else 400 if not accepted and all(e["statusCode"] == 400 for e in errors) else 206
        request.status = status
        peer._store(request, accepted)
        self._reply(status, {"itemsReceived": n, "itemsAccepted": len(accepted), "errors": errors}, extra)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    peer: AppInsightsPeer


class AppInsightsPeer(ServerPeer):
    """The peer; a context manager. ``envelopes`` holds what was accepted, in arrival order."""

    def __init__(self, workdir: Path, *, require_bearer: bool = False) -> None:
        self.workdir = Path(workdir)
        self.require_bearer = require_bearer
        self.max_body: int | None = None  # bytes on the wire; larger requests get 413
        self.item_rule: Callable[[dict[str, Any]], int | None] | None = None
        self.request_rule: Callable[[list[dict[str, Any]]], Answer | None] | None = None
        self._lock = threading.Condition()
        self._answers: deque[Answer] = deque()
        self.requests: list[TrackRequest] = []
        self.envelopes: list[dict[str, Any]] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = self.workdir / "appinsights-ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self._ctx)

    def start(self, port: int = 0) -> AppInsightsPeer:
        server = _Server(("127.0.0.1", port), _Handler)
        server.socket = self._ctx.wrap_socket(server.socket, server_side=True)
        server.peer = self
        self._server = server
        self._stopping.clear()
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         name="appinsights-peer", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def connection_string(self) -> str:
        return f"InstrumentationKey={IKEY};IngestionEndpoint=https://127.0.0.1:{self.port}/"

    def queue(self, *answers: Answer | int) -> None:
        """Answer the next requests with these, in order, then 200 again."""
        with self._lock:
            self._answers.extend(a if isinstance(a, Answer) else Answer(int(a)) for a in answers)

    def _next_answer(self) -> Answer:
        with self._lock:
            return self._answers.popleft() if self._answers else Answer(200)

    def _store(self, request: TrackRequest, accepted: list[dict[str, Any]]) -> None:
        with self._lock:
            self.requests.append(request)
            self.envelopes.extend(accepted)
            self._lock.notify_all()

    def events(self) -> list[dict[str, Any]]:
        """Accepted custom-event envelopes (``Microsoft.ApplicationInsights.Event``)."""
        with self._lock:
            return [e for e in self.envelopes if e.get("data", {}).get("baseType") == "EventData"]

    def event_ids(self) -> list[str]:
        """The record id (property ``id``) of every accepted custom event, in arrival order."""
        return [e["data"]["baseData"]["properties"]["id"] for e in self.events()]

    def sent_ids(self) -> list[str]:
        """The record id of every custom event in every request, accepted or not."""
        with self._lock:
            return [e["data"]["baseData"]["properties"]["id"] for r in self.requests for e in r.envelopes
                    if isinstance(e, dict) and e.get("data", {}).get("baseType") == "EventData"]

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[TrackRequest]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} track request(s), got {len(self.requests)}")
                self._lock.wait(left)
            return list(self.requests)

    def wait_for_events(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                found = [e for e in self.envelopes if e.get("data", {}).get("baseType") == "EventData"]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} custom event(s), got {len(found)}")
                self._lock.wait(left)
