"""A Logs Ingestion API peer: HTTPS on loopback (trustme CA), enforcing the service's contract.

Usage::

    with LogsIngestionPeer(token_validator=emulator_tokens(emu)) as peer:
        ... LogsIngestionClient(peer.url, credential, connection_verify=peer.ca_file) ...
        rows = peer.wait_rows(10)

Each ``POST /dataCollectionRules/{rule}/streams/{stream}?api-version=2023-01-01`` is checked in
the service's order: path (404 for an unknown rule or stream, 405 for another method),
api-version (400), ``Authorization: Bearer`` (401 when missing, 403 when the token is not one the
validator accepts, 403 when ``authorized`` is False: the identity lacks "Monitoring Metrics
Publisher"), then scripted answers (``queue``: 429 + Retry-After, 500, slow...), then the body
(``row_rule`` can refuse the whole request with 400 for a row the service would never take).

Size limit: the service says "Maximum allowed content length: 1048576 bytes (1 MB)" and users see
gzip lower the chance of a 413, so the limit is on the bytes on the wire (the gzip body when
``Content-Encoding: gzip``), 1 MiB by default (``max_body``). The body must be a JSON array of
objects (400 otherwise). Accepted rows are stored in arrival order and answered with 204.
"""
from __future__ import annotations

import gzip
import json
import socket
import ssl
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.peers.lifecycle import ServerPeer
from urllib.parse import parse_qs, unquote, urlsplit

import trustme

API_VERSION = "2023-01-01"
MAX_BODY = 1024 * 1024
DEFAULT_RULE_ID = "dcr-00112233445566778899aabbccddeeff"
DEFAULT_STREAM = "Custom-SefwdEvents"


@dataclass(frozen=True)
class Reply:
    """A scripted answer for the next authorized request: status, headers, JSON/bytes body, delay."""

    status: int = 204
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Any = b""
    delay: float = 0.0

    def payload(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


# Queue this to let one request through the normal contract (e.g. accept a chunk, then fail the next).
PASS = Reply(status=0)


@dataclass(frozen=True)
class Upload:
    """One request as received, with the peer's answer."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    wire_bytes: int
    body: bytes  # decompressed when it was gzip
    status: int
    rows: tuple[dict[str, Any], ...] = ()
    received_at: float = 0.0
    delayed: bool = False  # answered late (the client may have given up; accepted rows still count)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def gzip(self) -> bool:
        return (self.header("content-encoding") or "").lower() == "gzip"


def error_body(code: str, message: str) -> dict[str, Any]:
    """The service's error shape."""
    return {"error": {"code": code, "message": message}}


def emulator_tokens(emu: Any) -> Callable[[str], bool]:
    """Accept exactly the tokens the IMDS emulator has issued (``emulator-token.<vm>.<n>``)."""
    def valid(token: str) -> bool:
        prefix, _, rest = token.partition(".")
        vm, _, serial = rest.rpartition(".")
        if prefix != "emulator-token" or not serial.isdigit():
            return False
        stats = emu.stats()
        return vm in stats["vms"] and 1 <= int(serial) <= stats["token_requests"]
    return valid


@dataclass(frozen=True)
class _Verdict:
    status: int
    body: Any = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    decoded: bytes = b""
    delay: float = 0.0


def refuse_method_or_version(method: str, query: str, version: str, code: str, wire: bytes) -> _Verdict | None:
    """A data-plane POST's first checks, as Azure answers them: 405 for another method, 400 (``code``) for an
    api-version other than ``version``; None when both are right."""
    if method != "POST":
        return _Verdict(405, error_body("MethodNotAllowed", "only POST is supported"), {"Allow": "POST"}, decoded=wire)
    versions = parse_qs(query, keep_blank_values=True).get("api-version", [])
    if versions != [version]:
        return _Verdict(400, error_body(code, f"api-version must be {version}, got {versions}"), decoded=wire)
    return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output clean
        pass

    def _answer(self, status: int, body: Any = b"", headers: Mapping[str, str] | None = None) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if payload:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if payload and status != 204:
            self.wfile.write(payload)
        self.wfile.flush()

    def _handle(self) -> None:
        peer = self.server.peer
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        if "chunked" in (headers.get("transfer-encoding") or "").lower():
            self.close_connection = True
            self._answer(411, error_body("LengthRequired", "Content-Length is required"))
            return
        length = int(headers.get("content-length") or 0)
        wire = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        verdict = peer._decide(self.command, parts.path, parts.query, headers, wire)
        peer._record(Upload(
            method=self.command, path=parts.path, query=parse_qs(parts.query, keep_blank_values=True),
            headers=headers, wire_bytes=len(wire), body=verdict.decoded, status=verdict.status,
            rows=tuple(verdict.rows), received_at=time.monotonic(), delayed=verdict.delay > 0,
        ))
        if verdict.delay > 0 and peer._released.wait(verdict.delay):
            self.close_connection = True
            return
        self._answer(verdict.status, verdict.body, verdict.headers)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    peer: LogsIngestionPeer

    def finish_request(self, request: Any, client_address: Any) -> None:
        # TLS handshake in the worker thread, so one slow client cannot stall accept().
        request.settimeout(10)
        try:
            tls = self.peer._context.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            return
        self.peer._track(tls, add=True)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            self.peer._track(tls, add=False)
            try:
                tls.close()
            except OSError:
                pass


class LogsIngestionPeer(ServerPeer):
    """The peer; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        rule_id: str = DEFAULT_RULE_ID,
        streams: Collection[str] = (DEFAULT_STREAM,),
        *,
        token_validator: Callable[[str], bool] | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        self.rule_id = rule_id
        self.streams = set(streams)
        self.token_validator = token_validator or (lambda token: token == "valid-token")
        self.max_body = max_body
        self.authorized = True  # False: every valid token gets 403 (role not assigned)
        # Says why the service would refuse a row (the whole request gets 400), or None.
        self.row_rule: Callable[[dict[str, Any]], str | None] | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Reply] = deque()
        self._uploads: list[Upload] = []
        self._rows: list[dict[str, Any]] = []
        self._tokens: list[str] = []
        self._sockets: set[socket.socket] = set()
        self._released = threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="logs-ingestion-peer-")
        ca = trustme.CA()
        self._ca_file = str(Path(self._tmp.name) / "ca.pem")
        ca.cert_pem.write_to_path(self._ca_file)
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(self._context)
        self._server: _Server | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, port: int = 0) -> LogsIngestionPeer:
        """Listen on ``port`` (0: any free one; the old port to come back after ``stop``)."""
        self._released.clear()
        server = _Server(("127.0.0.1", port), _Handler)
        server.peer = self
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         name="logs-ingestion-peer", daemon=True).start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:  # idle keep-alive connections would otherwise pin handler threads
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # The CA file stays (until garbage collection): clients of a stopped peer still load it.

    @property
    def url(self) -> str:
        """The endpoint to configure (like a DCR's logsIngestion endpoint)."""
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> str:
        """PEM of the test CA that signed the peer's certificate."""
        return self._ca_file

    # -- scripting ---------------------------------------------------------------------------
    def queue(self, *replies: Reply | int) -> None:
        """Answer the next authorized requests with these, in order (then the normal contract).

        ``PASS`` lets one request through the normal contract (after its ``delay``, if any)."""
        with self._lock:
            self._queue.extend(r if isinstance(r, Reply) else Reply(int(r)) for r in replies)

    # -- observation -------------------------------------------------------------------------
    @property
    def uploads(self) -> list[Upload]:
        """Every request, accepted or not, in arrival order."""
        with self._lock:
            return list(self._uploads)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every accepted row, in arrival order."""
        with self._lock:
            return list(self._rows)

    @property
    def tokens(self) -> list[str]:
        """The bearer token of every request that carried one."""
        with self._lock:
            return list(self._tokens)

    def wait_rows(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Block until at least ``count`` rows were accepted; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while len(self._rows) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} row(s), got {len(self._rows)}")
                self._arrived.wait(left)
            return list(self._rows)

    def wait_uploads(self, count: int, timeout: float = 10.0) -> list[Upload]:
        """Block until at least ``count`` requests arrived; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while len(self._uploads) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} request(s), got {len(self._uploads)}")
                self._arrived.wait(left)
            return list(self._uploads)

    # -- the contract ------------------------------------------------------------------------
    def _decide(
        self, method: str, path: str, query: str, headers: Mapping[str, str], wire: bytes,
    ) -> _Verdict:
        """What to answer one request, and the rows it brings if accepted."""
        segments = [unquote(s) for s in path.strip("/").split("/")]
        if len(segments) != 4 or segments[0] != "dataCollectionRules" or segments[2] != "streams":
            return _Verdict(404, error_body("NotFound", f"no such resource: {path}"), decoded=wire)
        rule_id, stream = segments[1], segments[3]
        if rule_id != self.rule_id:
            return _Verdict(404, error_body("NotFound", f"Data collection rule {rule_id} was not found"), decoded=wire)
        if stream not in self.streams:
            return _Verdict(404, error_body("InvalidStream", f"Stream {stream} is not declared in rule {rule_id}"), decoded=wire)
        refused = refuse_method_or_version(method, query, API_VERSION, "InvalidApiVersion", wire)
        if refused is not None:
            return refused
        auth = headers.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _Verdict(401, error_body("InvalidToken", "An Authorization: Bearer token is required"), decoded=wire)
        with self._lock:
            self._tokens.append(token.strip())
        if not self.token_validator(token.strip()):
            return _Verdict(403, error_body("Forbidden", "The provided token is not valid for this endpoint"), decoded=wire)
        if not self.authorized:
            return _Verdict(403, error_body(
                "OperationFailed",
                "The authentication token provided does not have access to ingest data for the data "
                f"collection rule with immutable Id '{rule_id}'.",
            ), decoded=wire)
        with self._lock:
            scripted = self._queue.popleft() if self._queue else None
        if scripted is not None and scripted.status != 0:
            return _Verdict(scripted.status, scripted.payload(), dict(scripted.headers), decoded=wire, delay=scripted.delay)
        if len(wire) > self.max_body:
            return _Verdict(413, error_body(
                "ContentLengthLimitExceeded",
                f"Maximum allowed content length: {self.max_body} bytes (1 MB). Provided content length: {len(wire)} bytes.",
            ), decoded=wire)
        body = wire
        encoding = (headers.get("content-encoding") or "").lower()
        if encoding == "gzip":
            try:
                body = gzip.decompress(wire)
            except (OSError, EOFError, zlib.error):
                return _Verdict(400, error_body("InvalidContentEncoding", "The body is not valid gzip"), decoded=wire)
        elif encoding not in ("", "identity"):
            return _Verdict(415, error_body("UnsupportedContentEncoding", f"Content-Encoding {encoding} is not supported"), decoded=wire)
        if not (headers.get("content-type") or "").lower().startswith("application/json"):
            return _Verdict(415, error_body("UnsupportedMediaType", "Content-Type must be application/json"), decoded=body)
        try:
            rows = json.loads(body)
        except ValueError:
            return _Verdict(400, error_body("InvalidPayload", "The body is not valid JSON"), decoded=body)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            return _Verdict(400, error_body("InvalidPayload", "The body must be a JSON array of objects"), decoded=body)
        for row in rows if self.row_rule is not None else ():
            why = self.row_rule(row)
            if why:
                return _Verdict(400, error_body("InvalidPayload", why), decoded=body)
        return _Verdict(204, rows=rows, decoded=body, delay=scripted.delay if scripted is not None else 0.0)

    def _record(self, upload: Upload) -> None:
        with self._arrived:
            self._uploads.append(upload)
            if 200 <= upload.status < 300:
                self._rows.extend(upload.rows)
            self._arrived.notify_all()

    def _track(self, sock: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)
