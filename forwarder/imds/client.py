"""Thin IMDS client: one GET per poll, POST StartRequests and GET compute with bounded retries.

It writes HTTP/1.1 requests itself over kept-alive sockets and parses answers with httptools (llhttp),
not ``requests``: an unchanged poll is the agent's whole steady-state cost, and ``requests`` spent
about 1.4 ms of CPU per GET (``http.client``'s email-based header parsing alone 0.15 ms; httptools
0.06 ms in all), plus 18 MiB and 140 ms of start-up on import, on machinery IMDS never needs:
proxies, cookies, redirects, auth, content decoding (see docs/performance.md).
``http.client`` would not be safer either: it has no deadline per request (its timeout is per
``recv``), returns a ``103`` as the answer and reads bodies of any size.

Every request has hard bounds (docs/imds-transport.md): one total deadline for connect, send and
the whole answer; a body cap checked before a byte of an oversized body is buffered; interim
``1xx`` answers skipped; a connection with the least doubt about its framing is closed, never
reused; and every request of the process to one IMDS passes one shared :class:`RequestBudget`,
so the agent stays under IMDS's 5 requests/s with headroom.
"""
from __future__ import annotations

import errno
import json
import logging
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlsplit

import httptools

from forwarder import __version__
from forwarder.common.retry import RETRYABLE_STATUS, Backoff, parse_retry_after
from forwarder.common.values import url_text
from forwarder.errors import ConfigError, ImdsError, ImdsTimeout, ImdsUnreachable
from forwarder.imds.versions import REPROBE_INTERVAL, VersionChoice

if TYPE_CHECKING:
    import ssl


class ImdsSettings(Protocol):
    """What ``ImdsClient.from_config`` reads (the agent's ``[imds]`` config; no import of it here)."""

    @property
    def endpoint(self) -> str: ...
    @property
    def api_version(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @property
    def first_call_timeout(self) -> float: ...
    @property
    def compute_api_version(self) -> str: ...


__all__ = [
    "Fetch", "ImdsClient", "RequestBudget", "MAX_BODY", "RETRY_AFTER_CAP", "REQUEST_BUDGET", "CLI_REQUEST_BUDGET",
    "check_max_body", "validate_endpoint",
]

log = logging.getLogger(__name__)

GONE_WINDOW = 70.0  # IMDS: "410 — retry for up to 70 s in total"
# The shared retryable statuses plus IMDS's own 410 ("retry for up to 70 s"); to other servers 410 is final.
IMDS_RETRYABLE_STATUS: frozenset[int] = RETRYABLE_STATUS | {410}
RETRY_DEADLINE = 90.0  # whole budget of one start_requests()/compute() call
# read_scheduled_events(): an approval's fresh read. Long enough for a few throttled or failed
# attempts at the one-shot budget (1 per 1.1 s) and a 5 s Retry-After; short enough for a caller
# waiting on the callback.
READ_DEADLINE = 30.0
BODY_SNIPPET = 200
# IMDS answers are a few KiB (a scale-set event naming 1,000 instances is ~20 KiB; compute with 50
# tags ~40 KiB): 1 MiB is a 25x margin, and small enough that a hostile answer cannot hurt memory.
MAX_BODY = 1024 * 1024
MAX_BODY_LIMIT = 16 * 1024 * 1024  # the most [imds] max_body may say (RSS stays bounded)
MIN_BODY_LIMIT = 64 * 1024
HEAD_LIMIT = 64 * 1024  # status lines and headers of one exchange, interim answers included
MAX_INTERIM = 8  # 1xx answers before the real one; more is a broken or hostile server
# A Retry-After is honoured up to this long on every IMDS request: IMDS throttles per second, so a
# longer one is bogus, and obeying it would blind the agent (Spot eviction gives 30 s of notice).
# Worst case a throttled poll waits 5 s, then may take its 5 s deadline: 20 of the 30 s remain.
RETRY_AFTER_CAP = 5.0
# IMDS allows 5 requests/s per VM (managed-identity tokens have their own 20/s, 5 concurrent). The
# agent allows itself 4 per window, all requests together (polls, StartRequests, compute), leaving
# 1 for `sefwd approve` / `sefwd once` (CLI_REQUEST_BUDGET); the config floor of 500 ms between
# polls keeps polls to 2 of those 4, so approvals and metadata always find room. The window is
# IMDS's second plus a guard: requests reach IMDS with latencies that differ by milliseconds (tens
# on a loaded VM), so 4 sent exactly 1 s apart could land inside one of IMDS's seconds.
IMDS_RATE_LIMIT = 5
REQUEST_BUDGET = 4
CLI_REQUEST_BUDGET = IMDS_RATE_LIMIT - REQUEST_BUDGET
BUDGET_GUARD = 0.1
BUDGET_WINDOW = 1.0 + BUDGET_GUARD


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


def validate_endpoint(endpoint: Any) -> str:
    """The IMDS base URL ``scheme://host[:port][/prefix]``, or ValueError saying what is wrong with it.

    The one owner of these rules: ``[imds] endpoint`` is parsed with it and the client checks
    what it is given with it. Refused: a non-string, a scheme other than http/https, no host, a
    bad port, userinfo (it would land in the ``Host`` header), a query or fragment (IMDS rejects
    duplicate query parameters, and the client adds ``api-version`` itself) and control characters
    or spaces (request splitting). Normalized: surrounding whitespace, a trailing ``/`` and a
    trailing ``/metadata`` (the client appends ``/metadata/...``) are dropped.
    """
    text = url_text(endpoint)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host, got {endpoint!r}")
    if "@" in parts.netloc:
        raise ValueError("must not carry user:password@ (IMDS takes no credentials)")
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise ValueError(f"must be a base URL without query or fragment, got {endpoint!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"has an invalid port: {endpoint!r}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/metadata"):  # accept the documented base URL as well as the bare host
        path = path[: -len("/metadata")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def _base_url(endpoint: str) -> str:
    try:
        return validate_endpoint(endpoint)
    except ValueError as exc:
        raise ConfigError([f"imds endpoint {endpoint!r}: {exc}"]) from None


def check_max_body(size: int) -> int:
    """``[imds] max_body`` if it is within bounds, else ValueError."""
    if not MIN_BODY_LIMIT <= size <= MAX_BODY_LIMIT:
        raise ValueError(f"must be between {MIN_BODY_LIMIT // 1024}KiB and {MAX_BODY_LIMIT // 2**20}MiB "
                         f"(IMDS answers are a few KiB), got {size}")
    return size


class RequestBudget:
    """At most ``limit`` requests in any ``window`` seconds: every IMDS request of the process waits its turn.

    A request holds its slot from :meth:`acquire` until :meth:`release`, and the window runs from the
    release: IMDS received the request at some moment in between, and only its end is known to be no
    earlier. So however late a request reached IMDS (a loaded VM delays a send by tens of milliseconds,
    sometimes more), the next request in its slot reaches IMDS at least a window after it.
    """

    _shared: dict[str, RequestBudget] = {}
    _shared_lock = threading.Lock()

    def __init__(self, limit: int = REQUEST_BUDGET, window: float = BUDGET_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self._clock = clock
        self._ended: deque[float] = deque()  # when each request of the last window ended, oldest first
        self._in_flight = 0
        self._lock = threading.Lock()
        self.waited = 0  # requests that had to wait for the budget (a sign of too many requests)

    @classmethod
    def for_endpoint(cls, base_url: str) -> RequestBudget:
        """The process-wide budget of one IMDS (every client of the same base URL shares it)."""
        with cls._shared_lock:
            budget = cls._shared.get(base_url)
            if budget is None:
                budget = cls._shared[base_url] = cls()
            return budget

    def acquire(self, stop: threading.Event) -> bool:
        """Take one request's slot, waiting until there is one; False if stopped. :meth:`release` it."""
        while True:
            with self._lock:
                now = self._clock()
                ended = self._ended
                while ended and now - ended[0] >= self.window - 1e-9:  # (float rounding: 101.1 - 100.0 < 1.1)
                    ended.popleft()
                if len(ended) + self._in_flight < self.limit:
                    self._in_flight += 1
                    return True
                # Every slot is taken: the first frees a window after the oldest end (a request still
                # in flight ends later still, so a whole window is never too long a wait).
                wait = self.window - (now - ended[0]) if ended else self.window
                self.waited += 1
            if stop.wait(wait):
                return False

    def release(self) -> None:
        """The request taken by :meth:`acquire` ended (answered, failed or abandoned): its window starts now."""
        with self._lock:
            self._in_flight -= 1
            self._ended.append(self._clock())


class ImdsClient:
    """Talks to IMDS (or an emulator) over kept-alive connections that never use a proxy.

    ``timeout`` (and ``first_call_timeout`` until IMDS first answered) is the total deadline of one
    request: connect, send and the whole answer.
    """

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
        max_body: int = MAX_BODY,
        budget: RequestBudget | None = None,
        reprobe: float = REPROBE_INTERVAL,
    ) -> None:
        base = _base_url(endpoint)
        self.endpoint = base
        self.requested_api_version = api_version
        # "auto": 2024-07-09 where IMDS serves it, else 2020-07-01 (forwarder.imds.versions).
        self.versions = VersionChoice(api_version, clock, reprobe)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.first_call_timeout = first_call_timeout
        self.backoff = backoff
        self.retry_deadline = retry_deadline
        self.gone_window = gone_window
        self._stop = stop or threading.Event()
        self._rng = rng or random.Random()
        self._clock = clock
        self.compute_url = f"{base}/metadata/instance/compute?api-version={quote(compute_api_version, safe='')}"
        self.budget = budget if budget is not None else RequestBudget.for_endpoint(base)
        self._pool = _Pool(base, connect_timeout, max_body)
        self._headers = {"Metadata": "true", "User-Agent": f"sefwd/{__version__}", "Accept": "application/json"}
        self._etag: str | None = None
        self._use_version(self.versions.current)
        self._answered = False  # until IMDS first answers, allow the long first-call timeout
        # The latest request's failure (None once one is answered): the agent names it while it waits.
        self.last_error: ImdsError | None = None

    @classmethod
    def from_config(cls, cfg: ImdsSettings, *, stop: threading.Event | None = None,
                    backoff: Backoff = Backoff(initial=0.5, maximum=5.0),
                    budget: RequestBudget | None = None) -> ImdsClient:
        """The one way the agent and its commands build a client from ``[imds]``.

        ``budget``: None for the agent (the process-wide 4 per window); one-shot commands that run
        beside it pass ``RequestBudget(CLI_REQUEST_BUDGET)``, the 1 request per window it leaves.
        """
        return cls(cfg.endpoint, cfg.api_version, timeout=cfg.timeout, first_call_timeout=cfg.first_call_timeout,
                   compute_api_version=cfg.compute_api_version, max_body=getattr(cfg, "max_body", MAX_BODY),
                   backoff=backoff, stop=stop, budget=budget)

    # -- Scheduled Events poll -----------------------------------------------------------------
    def scheduled_events(self, *, conditional: bool = True) -> Fetch:
        """One GET of the Scheduled Events document; raises ImdsError, never retries.

        ``conditional=False``: a read that needs the body (an approval checks the document it
        approves) never sends ``If-None-Match``, so it is never answered ``304``.
        """
        deadline = self.timeout if self._answered else self.first_call_timeout
        version = self.versions.for_request()
        if version != self.api_version:
            self._use_version(version)
        started = self._clock()
        response = self._send("GET", self.events_url, deadline, self._events_raw if conditional else self._plain_raw)
        fallback = self.versions.unavailable(version, response.status)
        if fallback is not None:  # api_version "auto" and 2024-07-09 is not served here: at once with 2020-07-01
            self._use_version(fallback)
            version = fallback
            response = self._send("GET", self.events_url, deadline, self._events_raw if conditional else self._plain_raw)
        elapsed = self._clock() - started
        status = response.status
        if status in (200, 304):
            self.versions.answered(version)
        if status == 200:
            self._answered = True
            if not conditional:
                return Fetch(200, response.body, response.headers.get("etag"), elapsed)
            self._remember_etag(response.headers.get("etag"))
            return Fetch(200, response.body, self._etag, elapsed)
        if status == 304 and self._etag is not None and conditional:
            self._answered = True
            return Fetch(304, None, response.headers.get("etag") or self._etag, elapsed)
        if status == 304:  # we asked for nothing conditional: there is no body to fall back on
            raise ImdsError(f"IMDS GET {self.events_url} answered 304 to an unconditional request",
                            status=304, retryable=True)
        raise self._status_error("GET", self.events_url, response)

    def read_scheduled_events(self, *, deadline: float = READ_DEADLINE) -> Fetch:
        """The document with its body (never a 304), transient answers retried for up to ``deadline`` seconds.

        For a read that must not fail on one 429, 5xx, 410 or dropped connection (an approval checks the
        document it approves); every attempt waits its turn in the request budget. The poll keeps
        ``scheduled_events``: it never retries, its next turn is its retry.
        """
        # The slow first call (IMDS enables Scheduled Events on it) keeps its long timeout.
        first = self.timeout if self._answered else self.first_call_timeout
        version = self.versions.for_request()
        if version != self.api_version:
            self._use_version(version)
        started = self._clock()
        try:
            response = self._retrying("GET", self.events_url, max(deadline, first), None, self._headers,
                                      attempt_timeout=first)
        except ImdsError as exc:
            fallback = self.versions.unavailable(version, exc.status or 0)
            if fallback is None:  # api_version "auto" and 2024-07-09 is not served here: again with 2020-07-01
                raise
            self._use_version(fallback)
            version = fallback
            response = self._retrying("GET", self.events_url, max(deadline, first), None, self._headers,
                                      attempt_timeout=first)
        self.versions.answered(version)
        self._answered = True
        return Fetch(response.status, response.body, response.headers.get("etag"), self._clock() - started)

    @property
    def api_version(self) -> str:
        """The api-version requests use now (with "auto", the one it settled on)."""
        return self._url_version

    def _use_version(self, version: str) -> None:
        # Built once per version: the poll path must not rebuild URLs. api-version goes in the URL itself
        # and nothing else ever adds a query, so it cannot be duplicated (IMDS rejects duplicates).
        self._url_version = version
        self.events_url = f"{self.endpoint}/metadata/scheduledevents?api-version={quote(version, safe='')}"
        self._plain_raw = self._pool.encode("GET", self.events_url, self._headers)
        # Another version renders another document: an ETag of one says nothing about the other.
        self._etag = None
        self._events_raw = self._plain_raw

    def forget_etag(self) -> None:
        """Stop sending If-None-Match (for a caller that lost the body the ETag stands for, or could
        not commit it: the validator must be the one of the last document the caller kept)."""
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
        headers = {**self._headers, "Content-Type": "application/json"}
        version = self.api_version
        try:
            self._retrying("POST", self.events_url, deadline, body, headers)
        except ImdsError as exc:
            # "auto" before any GET settled the version: a 404/400 may mean 2024-07-09 is not served here.
            fallback = self.versions.unavailable(version, exc.status or 0, confirmed_only=True)
            if fallback is None:
                raise
            self._use_version(fallback)
            self._retrying("POST", self.events_url, deadline, body, headers)
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
                  headers: dict[str, str], *, attempt_timeout: float | None = None) -> _Response:
        budget = self.retry_deadline if deadline is None else deadline
        per_attempt = self.timeout if attempt_timeout is None else attempt_timeout
        raw = self._pool.encode(method, url, headers, body)
        started = self._clock()
        gone_since: float | None = None
        attempt = 0
        while True:
            now = self._clock()
            left = budget - (now - started)
            try:
                response = self._send(method, url, max(0.05, min(per_attempt, left)), raw)
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
            retry_after = min(error.retry_after, RETRY_AFTER_CAP) if error.retry_after is not None else None
            delay = self.backoff.delay(attempt, self._rng, retry_after)
            spent = now - started
            if spent + delay > budget or (gone_since is not None and now - gone_since + delay > self.gone_window):
                raise type(error)(f"{error} (giving up after {attempt + 1} attempt(s) in {spent:.1f}s)",
                                status=error.status, retryable=error.retryable, retry_after=error.retry_after)
            log.debug("IMDS %s %s failed (%s); retry %d in %.2fs", method, url, error, attempt + 1, delay)
            if self._stop.wait(delay):
                raise type(error)(f"stopped while retrying IMDS {method} {url}; last error: {error}",
                                status=error.status, retryable=True)
            attempt += 1

    def _send(self, method: str, url: str, deadline: float, raw: bytes) -> _Response:
        """One exchange; remembers its failure in ``last_error`` (None after an answer below 400)."""
        try:
            response = self._exchange(method, url, deadline, raw)
        except ImdsError as exc:
            if self.last_error is None or type(exc) is not type(self.last_error):
                log.debug("IMDS %s %s: %s", method, url, exc)
            self.last_error = exc
            raise
        self.last_error = self._status_error(method, url, response) if response.status >= 400 else None
        return response

    def _exchange(self, method: str, url: str, deadline: float, raw: bytes) -> _Response:
        held = False

        def turn() -> None:  # every request sent takes a slot of the budget, a resend too
            nonlocal held
            if held:
                self.budget.release()  # (the request the resend replaces ended unanswered)
                held = False
            if not self.budget.acquire(self._stop):
                raise ImdsError(f"stopped before IMDS {method} {url}", status=None, retryable=True)
            held = True

        turn()
        try:
            try:
                response = self._pool.request(raw, deadline, before_resend=turn)
            except TimeoutError as exc:
                if getattr(exc, "connecting", False):
                    raise ImdsTimeout(f"IMDS {method} {url}: connect timed out after {self.connect_timeout:g}s",
                                      status=None, retryable=True) from None
                raise ImdsTimeout(f"IMDS {method} {url}: timed out after {deadline:g}s (deadline for the whole "
                                  "answer)", status=None, retryable=True) from None
            except _TooLarge as exc:
                raise ImdsError(f"IMDS {method} {url}: answer refused: {exc}", status=None,
                                retryable=True) from None
            except OSError as exc:
                if _unreachable(exc):  # named at once: real IMDS never refuses (docs/operations.md)
                    raise ImdsUnreachable(f"IMDS {method} {url}: {_unreachable(exc)}", status=None,
                                          retryable=True) from None
                raise ImdsError(f"IMDS {method} {url}: connection failed: {_reason(exc)}",
                                status=None, retryable=True) from None
            if response.interim:
                log.debug("IMDS %s %s: skipped %d interim (1xx) answer(s) before the %d", method, url,
                          response.interim, response.status)
            if response.doubt:
                log.warning("IMDS %s %s: %s; the connection was closed, not reused", method, url, response.doubt)
            return response
        finally:
            if held:
                self.budget.release()

    @staticmethod
    def _status_error(method: str, url: str, response: _Response) -> ImdsError:
        status = response.status
        text = _snippet(response.body)
        detail = f": {text}" if text else ""
        reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        return ImdsError(
            f"IMDS {method} {url} answered {status} {reason}".rstrip() + detail,
            status=status,
            retryable=status in IMDS_RETRYABLE_STATUS,
            retry_after=parse_retry_after(response.headers.get("retry-after")),
        )


def _unreachable(exc: OSError) -> str:
    """Why nothing can answer at the address (refused, no route, unknown name), or "" for other failures."""
    check = "check [imds] endpoint (SEFWD_IMDS_ENDPOINT)"
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve ({exc.strerror or exc}); {check}"
    if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
        return f"connection refused: nothing listens there (real IMDS never refuses a connection); {check}"
    if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
        return f"unreachable from this machine ({exc.strerror}); IMDS answers only inside an Azure VM; {check}"
    return ""


def _reason(exc: BaseException) -> str:
    """A short human reason for a socket failure ("[Errno 111] Connection refused")."""
    return (str(exc) or type(exc).__name__)[:BODY_SNIPPET]


@dataclass(frozen=True)
class _Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    interim: int = 0  # 1xx answers skipped before this one
    doubt: str | None = None  # why the connection was dropped after this answer, if it was for a reason


class _TooLarge(Exception):
    """The answer is larger than the cap: refused before its body is buffered."""


class _Framing(Exception):
    """The answer's framing is broken or suspicious (a callback stops the parser with this)."""


class _KeptAliveConnection:
    """One kept-alive connection and its response parser (llhttp parses message after message)."""

    __slots__ = ("sock", "parser", "headers", "chunks", "complete", "headers_done", "keep_alive", "interim",
                 "size", "max_body", "limit", "doubt", "_readable")

    def __init__(self, sock: socket.socket, max_body: int) -> None:
        self.sock = sock
        self.max_body = max_body
        self.limit = max_body + HEAD_LIMIT  # bytes of one whole exchange, heads included
        self.parser = httptools.HttpResponseParser(self)
        self._readable = _readable_check(sock)
        self.reset()

    def reset(self) -> None:
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.complete = False
        self.headers_done = False
        self.keep_alive = False
        self.interim = 0
        self.size = 0
        self.doubt: str | None = None

    # httptools callbacks (an exception raised here stops the parser at once)
    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the answer: whatever they are, this connection is not to be trusted
            raise _Framing("data after the end of the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): on_message_complete skips it
        self.headers_done = True
        # llhttp answers this only until the message completes (HTTP/1.0 and "close" say no).
        self.keep_alive = bool(self.parser.should_keep_alive())
        length = self.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            raise _TooLarge(f"Content-Length {int(length)} is over the {self.max_body}-byte cap ([imds] max_body)")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:
            raise _TooLarge(f"the body passed the {self.max_body}-byte cap ([imds] max_body)")
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if not self.headers_done:  # the end of an interim answer: the real one follows
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise _Framing(f"more than {MAX_INTERIM} interim (1xx) answers")
            self.headers = {}
            return
        self.complete = True

    def stale(self) -> bool:
        """Whether an idle connection has something to read: stray bytes, or the server's close."""
        return self._readable()

    def exchange(self, raw: bytes, end: float) -> _Response:
        """Send one request and read its answer by ``end``; raises _NoAnswer if not one byte came back."""
        sock = self.sock
        self.reset()
        _arm(sock, end)
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            raise _NoAnswer() from None
        received = 0
        while not self.complete:
            if received:
                _arm(sock, end)  # the deadline is for the whole answer, not for each recv
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
            received += len(data)
            if received > self.limit:
                raise _TooLarge(f"the answer passed the {self.max_body}-byte cap ([imds] max_body; "
                                f"{received} bytes read, heads and chunk framing included)")
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as exc:
                cause = exc.__context__
                if isinstance(cause, _TooLarge):
                    raise cause from None
                if not self.complete:
                    raise ConnectionResetError(f"malformed HTTP answer: {cause}") from None
                # A complete answer followed by more: keep the answer, drop the connection.
                self.keep_alive, self.doubt = False, str(cause)
            except httptools.HttpParserUpgrade:
                raise ConnectionResetError("malformed HTTP answer: an unrequested protocol switch (101)") from None
            except httptools.HttpParserError as exc:
                if not self.complete:
                    raise ConnectionResetError(f"malformed HTTP answer: {exc}") from None
                self.keep_alive, self.doubt = False, f"data after the end of the answer ({exc})"
        return _Response(self.parser.get_status_code(), self.headers, b"".join(self.chunks), self.interim, self.doubt)


def _arm(sock: socket.socket, end: float) -> None:
    """Give the socket's next operation what is left until ``end`` (TimeoutError when nothing is)."""
    left = end - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    current = sock.gettimeout()
    # settimeout() is a system call: skip it while the deadline barely moved (a kept-alive poll).
    if current is None or abs(current - left) > 0.01:
        sock.settimeout(left)


def _readable_check(sock: socket.socket) -> Callable[[], bool]:
    """A cheap "is there anything to read right now" for an idle plain-TCP socket (one poll() call)."""
    import select

    if hasattr(sock, "do_handshake"):  # TLS 1.3 servers send tickets after the handshake: no peeking there
        return lambda: False
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return lambda: bool(poller.poll(0))
    return lambda: bool(select.select([sock], [], [], 0)[0])


class _Pool:
    """Kept-alive HTTP/1.1 connections to one host: one for the poller, more only while threads overlap.

    Requests are written as bytes and answers parsed by httptools (llhttp, the parser behind uvicorn),
    which handles Content-Length, chunked and close-delimited bodies. Before an idle connection is
    reused one poll() says whether anything arrived on it meanwhile: stray bytes (a late or extra
    answer that would be read as the answer to the next request) or the server's close; either way
    it is dropped. A connection the server closes just as it is used answers nothing, and the
    request is then sent once more on a fresh connection, as urllib3 does.
    """

    MAX_IDLE = 2

    def __init__(self, base_url: str, connect_timeout: float, max_body: int = MAX_BODY) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.netloc = parts.netloc
        self.connect_timeout = connect_timeout
        self.max_body = max_body
        self._idle: list[_KeptAliveConnection] = []
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            import ssl

            self._tls = ssl.create_default_context()  # verification on

    def encode(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> bytes:
        """The request's bytes (the poller builds its GET once and sends it again and again)."""
        target = url[url.index("/", url.index("//") + 2):]  # origin-form: never a proxy's absolute form
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.netloc}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None or method == "POST":
            lines.append(f"Content-Length: {len(body or b'')}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

    def request(self, raw: bytes, timeout: float, before_resend: Callable[[], None] | None = None) -> _Response:
        """One request and its answer, all within ``timeout`` seconds.

        A reused connection that closes before one byte of an answer (the server dropped it while idle) gets
        the request once more on a new one, after ``before_resend`` (the budget's next slot: IMDS counts
        every request it receives)."""
        end = time.monotonic() + timeout
        conn: _KeptAliveConnection | None = None
        with self._lock:
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.stale():
                    conn.sock.close()
                    conn = None
        reused = conn is not None
        while True:
            if conn is None:
                conn = _KeptAliveConnection(self._connect(end), self.max_body)
            try:
                response = conn.exchange(raw, end)
            except _NoAnswer:
                conn.sock.close()
                conn = None
                if reused:
                    reused = False
                    if before_resend is not None:
                        before_resend()
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

    def _connect(self, end: float) -> socket.socket:
        left = end - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("deadline passed before connecting")
            sock = socket.create_connection((self.host, self.port), timeout=min(self.connect_timeout, left))
        except TimeoutError as exc:
            exc.connecting = True  # type: ignore[attr-defined]
            raise
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                _arm(sock, end)
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        return sock

    def _give_back(self, conn: _KeptAliveConnection) -> None:
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
