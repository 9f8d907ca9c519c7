"""Thin IMDS client: one GET per poll, POST StartRequests and GET compute with bounded retries.

It writes HTTP/1.1 requests itself over kept-alive sockets and parses answers with httptools (llhttp),
not ``requests``: an unchanged poll is the agent's whole steady-state cost, and ``requests`` spent
about 1.4 ms of CPU per GET (``http.client``'s email-based header parsing alone 0.15 ms; httptools
0.06 ms in all), plus 18 MiB and 140 ms of start-up on import, on machinery IMDS never needs:
proxies, cookies, redirects, auth, content decoding (see the README's performance section).
"""
from __future__ import annotations

import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import quote, urlsplit

import httptools

from forwarder import __version__
from forwarder.errors import ConfigError, ImdsError
from forwarder.retry import Backoff, is_retryable_status, parse_retry_after

__all__ = ["Fetch", "ImdsClient"]

log = logging.getLogger(__name__)

GONE_WINDOW = 70.0  # IMDS: "410 — retry for up to 70 s in total"
RETRY_DEADLINE = 90.0  # whole budget of one start_requests()/compute() call
BODY_SNIPPET = 200


@dataclass(frozen=True)
class Fetch:
    """One Scheduled Events answer: raw bytes (the caller parses), None on 304."""

    status: int
    body: bytes | None
    etag: str | None
    elapsed: float


def _snippet(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return text if len(text) <= BODY_SNIPPET else text[:BODY_SNIPPET] + "…"


def _base_url(endpoint: str) -> str:
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError([f"imds endpoint {endpoint!r}: expected http://host[:port][/prefix]"])
    if parts.query or parts.fragment:
        raise ConfigError([f"imds endpoint {endpoint!r}: must not carry a query string or fragment"])
    path = parts.path.rstrip("/")
    if path.endswith("/metadata"):  # accept the documented base URL as well as the bare host
        path = path[: -len("/metadata")]
    return f"{parts.scheme}://{parts.netloc}{path}"


class ImdsClient:
    """Talks to IMDS (or an emulator) over one keep-alive session that never uses a proxy."""

    def __init__(
        self,
        endpoint: str,
        api_version: str,
        *,
        timeout: float = 5.0,
        connect_timeout: float = 2.0,
        first_call_timeout: float = 150.0,
        compute_api_version: str = "2021-02-01",
        backoff: Backoff = Backoff(initial=0.5, maximum=10),
        stop: threading.Event | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_deadline: float = RETRY_DEADLINE,
        gone_window: float = GONE_WINDOW,
    ) -> None:
        base = _base_url(endpoint)
        self.endpoint = base
        self.api_version = api_version
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.first_call_timeout = first_call_timeout
        self.backoff = backoff
        self.retry_deadline = retry_deadline
        self.gone_window = gone_window
        self._stop = stop or threading.Event()
        self._rng = rng or random.Random()
        self._clock = clock
        # Built once: the poll path must not rebuild URLs. api-version goes in the URL itself and
        # nothing else ever adds a query, so it cannot be duplicated (IMDS rejects duplicates).
        self.events_url = f"{base}/metadata/scheduledevents?api-version={quote(api_version, safe='')}"
        self.compute_url = f"{base}/metadata/instance/compute?api-version={quote(compute_api_version, safe='')}"
        self._pool = _Pool(base, connect_timeout)
        self._headers = {"Metadata": "true", "User-Agent": f"sefwd/{__version__}", "Accept": "application/json"}
        self._events_raw = self._pool.encode("GET", self.events_url, self._headers)
        self._etag: str | None = None
        self._answered = False  # until IMDS first answers, allow the long first-call timeout

    # -- Scheduled Events poll -----------------------------------------------------------------
    def scheduled_events(self) -> Fetch:
        """One GET of the Scheduled Events document; raises ImdsError, never retries."""
        read_timeout = self.timeout if self._answered else self.first_call_timeout
        started = self._clock()
        response = self._send("GET", self.events_url, read_timeout, self._events_raw)
        elapsed = self._clock() - started
        status = response.status
        if status == 200:
            self._answered = True
            self._remember_etag(response.headers.get("etag"))
            return Fetch(200, response.body, self._etag, elapsed)
        if status == 304 and self._etag is not None:
            self._answered = True
            return Fetch(304, None, response.headers.get("etag") or self._etag, elapsed)
        if status == 304:  # we asked for nothing conditional: there is no body to fall back on
            raise ImdsError(f"IMDS GET {self.events_url} answered 304 to an unconditional request",
                            status=304, retryable=True)
        raise self._status_error("GET", self.events_url, response)

    def forget_etag(self) -> None:
        """Stop sending If-None-Match (for a caller that lost the body the ETag stands for)."""
        self._remember_etag(None)

    def _remember_etag(self, etag: str | None) -> None:
        # The ETag must describe the body the caller holds: a 200 without one clears it, or a
        # later 304 against an older ETag would leave the caller on a newer, different body.
        if etag != self._etag:
            self._etag = etag
            headers = {**self._headers, "If-None-Match": etag} if etag else self._headers
            self._events_raw = self._pool.encode("GET", self.events_url, headers)

    # -- approvals and instance metadata -------------------------------------------------------
    def start_requests(
        self,
        event_ids: Sequence[str],
        incarnation: int | str | None = None,
        *,
        deadline: float | None = None,
    ) -> None:
        """POST StartRequests for ``event_ids``, retrying transient failures until ``deadline`` seconds."""
        if isinstance(event_ids, str):
            raise TypeError("event_ids must be a sequence of EventIds, not one string")
        if not event_ids:
            return
        payload: dict[str, Any] = {"StartRequests": [{"EventId": str(e)} for e in event_ids]}
        if incarnation is not None:
            payload["DocumentIncarnation"] = incarnation
        body = json.dumps(payload, separators=(",", ":")).encode()
        self._retrying("POST", self.events_url, deadline, body,
                       {**self._headers, "Content-Type": "application/json"})
        log.info("IMDS accepted StartRequests for %s", ", ".join(map(str, event_ids)))

    def compute(self, *, deadline: float | None = None) -> dict[str, Any]:
        """GET instance compute metadata (retried like start_requests); nested objects are kept."""
        response = self._retrying("GET", self.compute_url, deadline, None, self._headers)
        try:
            data = json.loads(response.body)
        except ValueError as exc:
            raise ImdsError(f"IMDS GET {self.compute_url}: not JSON ({exc}): {_snippet(response.body)!r}",
                            status=response.status, retryable=False) from None
        if not isinstance(data, dict):
            raise ImdsError(f"IMDS GET {self.compute_url}: expected a JSON object, got {type(data).__name__}",
                            status=response.status, retryable=False)
        return data

    def close(self) -> None:
        """Close the keep-alive connections."""
        self._pool.close()

    def __enter__(self) -> ImdsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _retrying(self, method: str, url: str, deadline: float | None, body: bytes | None,
                  headers: dict[str, str]) -> _Response:
        budget = self.retry_deadline if deadline is None else deadline
        raw = self._pool.encode(method, url, headers, body)
        started = self._clock()
        gone_since: float | None = None
        attempt = 0
        while True:
            now = self._clock()
            left = budget - (now - started)
            try:
                response = self._send(method, url, max(0.05, min(self.timeout, left)), raw)
            except ImdsError as exc:
                error = exc
            else:
                if 200 <= response.status < 300:
                    return response
                error = self._status_error(method, url, response)
                if response.status == 410:
                    gone_since = self._clock() if gone_since is None else gone_since
            if not error.retryable:
                raise error
            now = self._clock()
            delay = self.backoff.delay(attempt, self._rng, error.retry_after)
            spent = now - started
            if spent + delay > budget or (gone_since is not None and now - gone_since + delay > self.gone_window):
                raise ImdsError(f"{error} (giving up after {attempt + 1} attempt(s) in {spent:.1f}s)",
                                status=error.status, retryable=error.retryable, retry_after=error.retry_after)
            log.debug("IMDS %s %s failed (%s); retry %d in %.2fs", method, url, error, attempt + 1, delay)
            if self._stop.wait(delay):
                raise ImdsError(f"stopped while retrying IMDS {method} {url}; last error: {error}",
                                status=error.status, retryable=True)
            attempt += 1

    def _send(self, method: str, url: str, read_timeout: float, raw: bytes) -> _Response:
        try:
            return self._pool.request(raw, read_timeout)
        except TimeoutError as exc:
            if getattr(exc, "connecting", False):
                raise ImdsError(f"IMDS {method} {url}: connect timed out after {self.connect_timeout:g}s",
                                status=None, retryable=True) from None
            raise ImdsError(f"IMDS {method} {url}: timed out after {read_timeout:g}s",
                            status=None, retryable=True) from None
        except OSError as exc:
            raise ImdsError(f"IMDS {method} {url}: connection failed: {_reason(exc)}",
                            status=None, retryable=True) from None

    @staticmethod
    def _status_error(method: str, url: str, response: _Response) -> ImdsError:
        status = response.status
        text = _snippet(response.body)
        detail = f": {text}" if text else ""
        reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        return ImdsError(
            f"IMDS {method} {url} answered {status} {reason}".rstrip() + detail,
            status=status,
            retryable=is_retryable_status(status),
            retry_after=parse_retry_after(response.headers.get("retry-after")),
        )


def _reason(exc: BaseException) -> str:
    """A short human reason for a socket failure ("[Errno 111] Connection refused")."""
    return (str(exc) or type(exc).__name__)[:BODY_SNIPPET]


@dataclass(frozen=True)
class _Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


class _Conn:
    """One kept-alive connection and its response parser (llhttp parses message after message)."""

    __slots__ = ("sock", "parser", "headers", "chunks", "complete", "headers_done", "keep_alive")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = httptools.HttpResponseParser(self)
        self.reset()

    def reset(self) -> None:
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.complete = False
        self.headers_done = False
        self.keep_alive = False

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # llhttp answers this only until the message completes (HTTP/1.0 and "close" say no).
        self.keep_alive = bool(self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def exchange(self, raw: bytes, read_timeout: float) -> _Response:
        """Send one request and read its answer; raises _NoAnswer if not one byte came back."""
        sock = self.sock
        if sock.gettimeout() != read_timeout:  # each settimeout() is a system call
            sock.settimeout(read_timeout)
        self.reset()
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            raise _NoAnswer() from None
        received = False
        while not self.complete:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                if received:
                    raise
                raise _NoAnswer() from None
            if not data:
                if not received:
                    raise _NoAnswer()
                if self.headers_done and "content-length" not in self.headers \
                        and "chunked" not in self.headers.get("transfer-encoding", "").lower():
                    self.keep_alive = False
                    break  # a close-delimited body ends here
                raise ConnectionResetError("the server closed the connection in the middle of its answer")
            received = True
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise ConnectionResetError(f"malformed HTTP answer: {exc}") from None
        return _Response(self.parser.get_status_code(), self.headers, b"".join(self.chunks))


class _Pool:
    """Kept-alive HTTP/1.1 connections to one host: one for the poller, more only while threads overlap.

    Requests are written as bytes and answers parsed by httptools (llhttp, the parser behind uvicorn),
    which handles Content-Length, chunked and close-delimited bodies. No liveness probe runs before a
    connection is reused: one the server closed while idle answers nothing, and the request is then
    sent once more on a fresh connection, as urllib3 does. IMDS closes idle connections, and that
    must cost neither a failed poll nor a system call on every other poll.
    """

    MAX_IDLE = 2

    def __init__(self, base_url: str, connect_timeout: float) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.netloc = parts.netloc
        self.connect_timeout = connect_timeout
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None  # verification on

    def encode(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> bytes:
        """The request's bytes (the poller builds its GET once and sends it again and again)."""
        target = url[url.index("/", url.index("//") + 2):]  # origin-form: never a proxy's absolute form
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.netloc}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None or method == "POST":
            lines.append(f"Content-Length: {len(body or b'')}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

    def request(self, raw: bytes, read_timeout: float) -> _Response:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        reused = conn is not None
        while True:
            if conn is None:
                conn = _Conn(self._connect())
            try:
                response = conn.exchange(raw, read_timeout)
            except _NoAnswer:
                conn.sock.close()
                conn = None
                if reused:
                    reused = False
                    continue  # the server dropped an idle connection just as we used it
                raise ConnectionResetError("the server closed the connection without answering") from None
            except BaseException:
                conn.sock.close()
                raise
            if conn.keep_alive and conn.complete:
                self._give_back(conn)
            else:
                conn.sock.close()
            return response

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except TimeoutError as exc:
            exc.connecting = True  # type: ignore[attr-defined]
            raise
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        return sock

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if len(self._idle) < self.MAX_IDLE:
                self._idle.append(conn)
                return
        conn.sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()


class _NoAnswer(Exception):
    """The connection closed before one byte of an answer: safe to send the request again."""
