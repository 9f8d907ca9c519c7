"""Thin IMDS client: one GET per poll, POST StartRequests and GET compute with bounded retries."""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter

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
        # requests never gets ``params=``, so it cannot be duplicated (IMDS rejects duplicates).
        self.events_url = f"{base}/metadata/scheduledevents?api-version={quote(api_version, safe='')}"
        self.compute_url = f"{base}/metadata/instance/compute?api-version={quote(compute_api_version, safe='')}"
        self._session = session = requests.Session()
        session.trust_env = False  # never HTTP_PROXY/NO_PROXY/.netrc: IMDS must not go through a proxy
        session.proxies.clear()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=2, max_retries=0)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        session.headers.clear()
        session.headers.update({"Metadata": "true", "User-Agent": f"sefwd/{__version__}", "Accept": "application/json"})
        self._no_proxy = {"http": None, "https": None}
        self._events_headers: dict[str, str] = {}
        self._etag: str | None = None
        self._answered = False  # until IMDS first answers, allow the long first-call timeout

    # -- Scheduled Events poll -----------------------------------------------------------------
    def scheduled_events(self) -> Fetch:
        """One GET of the Scheduled Events document; raises ImdsError, never retries."""
        read_timeout = self.timeout if self._answered else self.first_call_timeout
        started = self._clock()
        response = self._send("GET", self.events_url, read_timeout, headers=self._events_headers)
        elapsed = self._clock() - started
        status = response.status_code
        if status == 200:
            self._answered = True
            self._remember_etag(response.headers.get("ETag"))
            return Fetch(200, response.content, self._etag, elapsed)
        if status == 304 and self._etag is not None:
            self._answered = True
            return Fetch(304, None, response.headers.get("ETag") or self._etag, elapsed)
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
            self._events_headers = {"If-None-Match": etag} if etag else {}

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
        self._retrying("POST", self.events_url, deadline, data=body,
                       headers={"Content-Type": "application/json"})
        log.info("IMDS accepted StartRequests for %s", ", ".join(map(str, event_ids)))

    def compute(self, *, deadline: float | None = None) -> dict[str, Any]:
        """GET instance compute metadata (retried like start_requests); nested objects are kept."""
        response = self._retrying("GET", self.compute_url, deadline)
        try:
            data = json.loads(response.content)
        except ValueError as exc:
            raise ImdsError(f"IMDS GET {self.compute_url}: not JSON ({exc}): {_snippet(response.content)!r}",
                            status=response.status_code, retryable=False) from None
        if not isinstance(data, dict):
            raise ImdsError(f"IMDS GET {self.compute_url}: expected a JSON object, got {type(data).__name__}",
                            status=response.status_code, retryable=False)
        return data

    def close(self) -> None:
        """Close the keep-alive connection."""
        self._session.close()

    def __enter__(self) -> ImdsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _retrying(self, method: str, url: str, deadline: float | None, **kwargs: Any) -> requests.Response:
        budget = self.retry_deadline if deadline is None else deadline
        started = self._clock()
        gone_since: float | None = None
        attempt = 0
        while True:
            now = self._clock()
            left = budget - (now - started)
            try:
                response = self._send(method, url, max(0.05, min(self.timeout, left)), **kwargs)
            except ImdsError as exc:
                error = exc
            else:
                if 200 <= response.status_code < 300:
                    return response
                error = self._status_error(method, url, response)
                if response.status_code == 410:
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

    def _send(self, method: str, url: str, read_timeout: float, **kwargs: Any) -> requests.Response:
        try:
            return self._session.request(method, url, timeout=(self.connect_timeout, read_timeout),
                                         proxies=self._no_proxy, allow_redirects=False, **kwargs)  # type: ignore[arg-type]
        except requests.exceptions.ConnectTimeout:
            raise ImdsError(f"IMDS {method} {url}: connect timed out after {self.connect_timeout:g}s",
                            status=None, retryable=True) from None
        except requests.exceptions.Timeout:
            raise ImdsError(f"IMDS {method} {url}: timed out after {read_timeout:g}s",
                            status=None, retryable=True) from None
        except requests.exceptions.ConnectionError as exc:
            # requests reports a read timeout while reading the body as a ConnectionError.
            if exc.args and isinstance(exc.args[0], urllib3.exceptions.ReadTimeoutError):
                raise ImdsError(f"IMDS {method} {url}: timed out after {read_timeout:g}s",
                                status=None, retryable=True) from None
            raise ImdsError(f"IMDS {method} {url}: connection failed: {_reason(exc)}",
                            status=None, retryable=True) from None
        except requests.exceptions.RequestException as exc:
            raise ImdsError(f"IMDS {method} {url}: {type(exc).__name__}: {_reason(exc)}",
                            status=None, retryable=True) from None

    @staticmethod
    def _status_error(method: str, url: str, response: requests.Response) -> ImdsError:
        status = response.status_code
        text = _snippet(response.content)
        detail = f": {text}" if text else ""
        return ImdsError(
            f"IMDS {method} {url} answered {status} {response.reason or ''}".rstrip() + detail,
            status=status,
            retryable=is_retryable_status(status),
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
        )


def _reason(exc: BaseException) -> str:
    """The innermost message of a requests/urllib3 error chain ("[Errno 111] Connection refused")."""
    inner: BaseException = exc
    for _ in range(8):  # chains are short; bound the walk anyway
        reason = getattr(inner, "reason", None)
        if inner.args and isinstance(inner.args[0], BaseException):
            inner = inner.args[0]
        elif isinstance(reason, BaseException):
            inner = reason
        elif isinstance(inner.__cause__, BaseException):
            inner = inner.__cause__
        else:
            break
    return (str(inner) or type(inner).__name__)[:BODY_SNIPPET]
