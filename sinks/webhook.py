"""The ``webhook`` sink: CloudEvents over HTTP POST, optionally signed with Standard Webhooks.

One record per request by default (structured mode, ``application/cloudevents+json``); with
``batch_size > 1`` a JSON array of records (``application/cloudevents-batch+json``). With a
secret, every request carries ``webhook-id`` / ``webhook-timestamp`` / ``webhook-signature``;
the id is the record id (or a digest of the batch's record ids), so it stays the same on every
retry and a receiver can de-duplicate on it.

CloudEvents HTTP binding: ``mode = "structured"`` (the default) sends the whole event as the body;
``mode = "binary"`` sends each attribute as a ``ce-`` header (percent-encoded as the binding says)
and only ``data`` as the body, typed by ``datacontenttype`` — what many CloudEvents SDK receivers and
routers expect. Binary mode is one record per request. With a secret, the signature covers the body
only, so in binary mode the ``ce-`` headers are not signed (use structured mode when they must be).

``handshake = true`` performs the CloudEvents webhook abuse-protection handshake before the first
delivery: an ``OPTIONS`` request with ``WebHook-Request-Origin``; deliveries start once the
receiver answers 2xx with a matching ``WebHook-Allowed-Origin`` (or ``*``), and never exceed a
``WebHook-Allowed-Rate`` (requests per minute) it grants. Until the receiver allows us the records
wait (retried with backoff, logged, ``handshake_refused`` in ``sefwd status``). A 401/403 on a
delivery may mean the permission was withdrawn: the records wait (retry, never a dead letter) and
the handshake is asked again before the next attempt.

TLS certificates are always verified (``ca_file`` adds trust in a private CA); plain ``http://``
is allowed for loopback receivers, and elsewhere only with ``insecure_http = true``. Redirects are
not followed: a signed POST should not wander to another address unnoticed.
"""
from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

import orjson
import requests

from forwarder import __version__
from forwarder.errors import ConfigError
from forwarder.common.logs import RateLimitedLog, redact, short_reason
from forwarder.common.retry import is_retryable_status, parse_retry_after
from forwarder.common.signing import load_secret, sign_headers
from sinks.azure_common import read_secret_text
from forwarder.sinkapi import Ok, Record, Reject, Result, Retry, SinkContext
from forwarder.common.values import parse_duration
from sinks import check_bool, check_int_range, check_positive_duration, check_readable_file, unknown_options

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = "10s"
MAX_BATCH_SIZE = 1000
CONTENT_TYPE_SINGLE = "application/cloudevents+json; charset=utf-8"
CONTENT_TYPE_BATCH = "application/cloudevents-batch+json; charset=utf-8"
USER_AGENT = f"scheduled-events-forwarder/{__version__}"
# Enough of an answer to explain a rejection; more is drained or the connection dropped.
_MAX_ANSWER_BYTES = 64 * 1024
_DETAIL_CHARS = 200
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# Set by the sink itself; a configured value would break the body or the signature.
_RESERVED_HEADERS = frozenset({
    "content-type", "content-length", "transfer-encoding", "host", "connection",
    "webhook-id", "webhook-timestamp", "webhook-signature", "webhook-request-origin",
})
MODES = ("structured", "binary")
# CloudEvents HTTP binding 3.1.3.2: printable ASCII stays, except space, double quote and percent.
_CE_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in ' "%')
_CE_BODY_ATTRIBUTES = frozenset({"data", "data_base64", "datacontenttype"})


def binary_message(event: Mapping[str, Any]) -> tuple[dict[str, str], bytes]:
    """CloudEvents HTTP binary mode: ``ce-`` headers for the attributes, ``data`` as the body."""
    headers = {}
    for name, value in event.items():
        if name in _CE_BODY_ATTRIBUTES or value is None:
            continue
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        headers[f"ce-{name}"] = quote(text, safe=_CE_SAFE)
    content_type = str(event.get("datacontenttype") or "application/json")
    data = event.get("data")
    if event.get("data_base64") is not None:
        body = base64.b64decode(event["data_base64"])
    elif data is None:
        body = b""
    elif isinstance(data, str) and not content_type.split(";")[0].strip().endswith("json"):
        body = data.encode()
    else:
        body = orjson.dumps(data)
    headers["Content-Type"] = content_type
    return headers, body


def _is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_option(options: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """The receiver URL, from ``url`` or (when it carries a key, e.g. a Logic App's ``sig=``) from
    ``url_env`` / ``url_file``; (None, problems) when there is none usable. Never echoes a secret URL."""
    given = [k for k in ("url", "url_env", "url_file") if options.get(k) is not None]
    if len(given) > 1:
        return None, [f"set only one of url, url_env and url_file (got {', '.join(given)})"]
    if given == ["url"] or not given:
        return options.get("url"), []
    try:
        return read_secret_text(options, "url"), []
    except ValueError as exc:
        return None, [str(exc)]


def _check_url(options: Mapping[str, Any]) -> list[str]:
    url, problems = _url_option(options)
    if problems:
        return problems
    if url is None:
        return ["option 'url' is required (or url_env / url_file)"]
    if not isinstance(url, str) or not url.strip():
        return [f"option 'url' must be a non-empty string, got {url!r}"]
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return [f"option 'url' is not a valid URL: {exc}"]
    if parts.scheme not in ("https", "http"):
        return [f"option 'url' must start with https:// (or http:// for loopback), got scheme {parts.scheme!r}"]
    if not host:
        return ["option 'url' has no host"]
    if parts.username is not None or parts.password is not None:
        return ["option 'url' must not carry credentials: put them in 'headers_env' or 'headers_file' (never logged)"]
    if parts.scheme == "http" and not _is_loopback(host) and options.get("insecure_http") is not True:
        return [
            f"option 'url' uses plain http to non-loopback host {host!r}: use https, "
            "or set insecure_http = true to send records unencrypted"
        ]
    return []


def _check_headers(headers: Any, option: str = "headers") -> list[str]:
    if not isinstance(headers, Mapping):
        return [f"option '{option}' must be a table of name = \"value\", got {type(headers).__name__}"]
    problems = []
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN.match(name):
            problems.append(f"option '{option}': {name!r} is not a valid header name")
        elif name.lower() in _RESERVED_HEADERS:
            problems.append(f"option '{option}': {name!r} is set by the sink and cannot be configured")
        elif not isinstance(value, str):
            problems.append(f"option '{option}': value of {name!r} must be a string")
        elif any(c in value for c in "\r\n\0"):
            # Never echo the value: it may be a token.
            problems.append(f"option '{option}': value of {name!r} must not contain line breaks or NUL")
    return problems


def _secret_headers(options: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Headers whose values come from environment variables (``headers_env``: name = variable) or
    files (``headers_file``: name = path), e.g. an Authorization or a Function key: secrets stay out
    of the config (and out of a VM extension's publicSettings). Values are never echoed."""
    headers: dict[str, str] = {}
    problems: list[str] = []
    inline = {str(k).lower() for k in (options.get("headers") or {})} if isinstance(options.get("headers"), Mapping) else set()
    for option in ("headers_env", "headers_file"):
        table = options.get(option)
        if table is None:
            continue
        if not isinstance(table, Mapping) or not all(isinstance(v, str) and v.strip() for v in table.values()):
            what = "environment variable" if option == "headers_env" else "file path"
            problems.append(f"option '{option}' must be a table of header name = \"{what}\"")
            continue
        for name, source in table.items():
            if str(name).lower() in inline or str(name).lower() in {n.lower() for n in headers}:
                problems.append(f"option '{option}': header {name!r} is set twice")
                continue
            if option == "headers_env":
                value = os.environ.get(source.strip())
                if not value:
                    problems.append(f"option 'headers_env': environment variable {source.strip()} (for {name!r}) is not set")
                    continue
            else:
                try:
                    value = open(os.path.expanduser(source.strip()), encoding="utf-8").read()
                except (OSError, UnicodeDecodeError) as exc:
                    why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                    problems.append(f"option 'headers_file': cannot read {source.strip()} (for {name!r}): {why}")
                    continue
            headers[str(name)] = value.strip()
    if not problems:
        problems = _check_headers(headers, "headers_env/headers_file")
    return headers, problems


def batch_id(batch: Sequence[Record]) -> str:
    """A webhook-id for a batch that is the same on every retry of the same records."""
    digest = hashlib.sha256("\n".join(r.id for r in batch).encode()).hexdigest()
    return "batch_" + digest[:32]


class WebhookSink:
    """POSTs records as CloudEvents JSON to ``url``, one per request or as a JSON array."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "url": "receiver URL (required, or url_env / url_file); https, or http for loopback hosts",
        "url_env": "environment variable holding the URL, when it carries a key (a Logic App's sig=, a Function's code=)",
        "url_file": "file holding the URL, when it carries a key",
        "timeout": f"connect and read timeout per request (default {DEFAULT_TIMEOUT})",
        "headers": "table of extra request headers that are not secret (values are never logged)",
        "headers_env": "table of header name = environment variable holding its value (Authorization, x-functions-key)",
        "headers_file": "table of header name = file holding its value",
        "batch_size": f"records per request, 1 to {MAX_BATCH_SIZE}; above 1 the body is a JSON array (default 1)",
        "secret_env": "environment variable holding a whsec_ secret: sign requests (Standard Webhooks)",
        "secret_file": "file holding a whsec_ secret: sign requests (Standard Webhooks)",
        "insecure_http": "allow plain http:// to a non-loopback host (default false)",
        "ca_file": "PEM file of CA certificates to trust instead of the system store (private CA)",
        "mode": 'CloudEvents HTTP content mode: "structured" (whole event as body, default) or "binary" (ce- headers)',
        "handshake": "ask the receiver's permission first (CloudEvents webhook OPTIONS handshake; default false)",
        "origin": "WebHook-Request-Origin to announce in the handshake (default: this host's name)",
    }

    def __init__(
        self,
        options: Mapping[str, Any],
        context: SinkContext,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        url, _ = _url_option(options)
        assert isinstance(url, str)  # check() made sure
        self.url = url.strip()
        self._safe_url = redact(self.url)
        self._query = urlsplit(self.url).query
        parts = urlsplit(self.url)
        self._hostport = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        # A dead receiver fails every retry the same way: one line a minute per kind, with a count.
        self._errors = RateLimitedLog(log)
        self.timeout = parse_duration(options.get("timeout", DEFAULT_TIMEOUT))
        self.batch_size = int(options.get("batch_size", 1))
        self.max_batch = self.batch_size
        self._key = load_secret(options)
        self._clock = clock
        self._extra_headers = {**dict(options.get("headers") or {}), **_secret_headers(options)[0]}
        self._lock = threading.Lock()
        self._session = requests.Session()
        # Certificates are always checked; ca_file only changes whom we trust. Passed on every
        # request because requests lets REQUESTS_CA_BUNDLE override a Session's own verify.
        self._verify: str | bool = os.path.expanduser(options["ca_file"]) if options.get("ca_file") else True
        self._session.headers["User-Agent"] = USER_AGENT
        self.binary = options.get("mode", "structured") == "binary"
        self._handshake = options.get("handshake") is True
        self.origin = str(options.get("origin") or socket.getfqdn() or socket.gethostname())
        self._allowed = False  # the receiver granted our origin (handshake)
        self._interval = 0.0  # seconds between requests, from WebHook-Allowed-Rate
        self._next_at = 0.0
        self._stop = context.stop
        if urlsplit(self.url).scheme == "http":
            log.warning(
                "sink %r: sending records over plain http to %s (unencrypted%s)",
                self.name, self._safe_url, ", not signed" if self._key is None else "",
            )

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads the secret and ca_file, changes nothing)."""
        problems = unknown_options(options, cls.OPTIONS)
        problems += check_bool(options, "insecure_http")
        problems += _check_url(options)
        problems += check_positive_duration(options, "timeout")
        problems += check_int_range(options, "batch_size", 1, MAX_BATCH_SIZE)
        if options.get("headers") is not None:
            problems += _check_headers(options["headers"])
        problems += _secret_headers(options)[1]
        try:
            load_secret(options)
        except ConfigError as exc:
            problems += exc.problems
        problems += check_readable_file(options, "ca_file")
        problems += check_bool(options, "handshake")
        mode = options.get("mode")
        if mode is not None and mode not in MODES:
            problems.append(f"option 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        configured = [*(options.get("headers") or {}), *(options.get("headers_env") or {}), *(options.get("headers_file") or {})]
        if mode == "binary" and any(str(name).lower().startswith("ce-") for name in configured):
            problems.append("option 'headers': ce- headers are set by the sink in binary mode")
        if mode == "binary" and options.get("batch_size", 1) != 1:
            problems.append("option 'mode' = \"binary\" sends one record per request: leave batch_size at 1")
        origin = options.get("origin")
        if origin is not None and (not isinstance(origin, str) or not _TOKEN.match(origin.replace(":", ""))):
            problems.append(f"option 'origin' must be a host name like sender.example.com, got {origin!r}")
        return problems

    # -- the abuse-protection handshake ---------------------------------------------------------
    def _permission(self) -> Result | None:
        """None once the receiver allows our origin; else the Retry that makes the records wait."""
        if not self._handshake or self._allowed:
            return None
        try:
            response = self._session.options(
                self.url, headers={"WebHook-Request-Origin": self.origin}, timeout=self.timeout,
                allow_redirects=False, verify=self._verify,
            )
            response.close()
        except requests.exceptions.RequestException as exc:
            log.warning("sink %r: handshake with %s failed: %s", self.name, self._safe_url, self._redact(str(exc)))
            return Retry(reason="timeout" if isinstance(exc, requests.exceptions.Timeout) else "connection_error")
        status = response.status_code
        allowed = (response.headers.get("WebHook-Allowed-Origin") or "").strip()
        if 200 <= status < 300 and allowed in (self.origin, "*"):
            self._allowed = True
            rate = (response.headers.get("WebHook-Allowed-Rate") or "*").strip()
            self._interval = 60.0 / int(rate) if rate.isdigit() and int(rate) > 0 else 0.0
            log.info("sink %r: %s allows deliveries from %s%s", self.name, self._safe_url, self.origin,
                     f" at {rate} per minute" if self._interval else "")
            return None
        if status == 429 or status >= 500:
            delay = parse_retry_after(response.headers.get("Retry-After"))
            log.warning("sink %r: handshake with %s answered %d", self.name, self._safe_url, status)
            return Retry(reason=f"handshake_http_{status}", delay=delay)
        log.error("sink %r: %s does not allow deliveries from %r (OPTIONS answered %d, WebHook-Allowed-Origin %r); "
                  "records are kept and the handshake is retried", self.name, self._safe_url, self.origin, status,
                  allowed or None)
        return Retry(reason="handshake_refused")

    def _pace(self) -> bool:
        """Wait for the next request slot the receiver's allowed rate gives; False when stopping."""
        if self._interval:
            wait = self._next_at - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return False
            self._next_at = max(self._next_at, time.monotonic()) + self._interval
        return True

    # -- sending ----------------------------------------------------------------------------
    def send(self, batch: Sequence[Record]) -> Result:
        """POST the batch; maps every outcome to Ok / Retry / Reject and never raises."""
        if not batch:
            return Ok()
        try:
            refused = self._permission()
            if refused is not None:
                return refused
            if self.batch_size == 1:
                # More records than max_batch: send each in turn (a retry re-sends the earlier ones,
                # which is at-least-once as usual).
                for record in batch:
                    if self.binary:
                        headers, body = binary_message(record.to_dict())
                        result = self._post(body, record.id, headers.pop("Content-Type"), headers)
                    else:
                        result = self._post(record.body, record.id, CONTENT_TYPE_SINGLE)
                    if not isinstance(result, Ok):
                        return result
                return Ok()
            body = b"[" + b",".join(record.body for record in batch) + b"]"
            return self._post(body, batch_id(batch), CONTENT_TYPE_BATCH)
        except Exception as exc:  # never raise into the dispatcher: the records stay in the store
            log.error("sink %r: unexpected error sending to %s: %s", self.name, self._safe_url,
                      self._redact(f"{type(exc).__name__}: {exc}"))
            return Retry(reason="internal_error")

    def _post(self, body: bytes, msg_id: str, content_type: str, ce_headers: Mapping[str, str] | None = None) -> Result:
        headers = dict(self._extra_headers)
        headers.update(ce_headers or {})
        headers["Content-Type"] = content_type
        if self._key is not None:
            headers.update(sign_headers(self._key, msg_id, body, now=self._clock()))
        if not self._pace():
            return Retry(reason="stopping")
        with self._lock:
            try:
                response = self._session.post(
                    self.url, data=body, headers=headers, timeout=self.timeout,
                    allow_redirects=False, stream=True, verify=self._verify,
                )
            except requests.exceptions.SSLError as exc:
                # Usually needs a human (expired or untrusted certificate), but the record must not
                # be lost: retry, loudly.
                self._errors.log(logging.ERROR, "tls", "sink %r: TLS error talking to %s: %s (records kept, will "
                                 "retry; check the receiver's certificate or set ca_file)",
                                 self.name, self._safe_url, self._redact(str(exc)))
                return Retry(reason="tls_error")
            except requests.exceptions.Timeout:
                self._errors.log(logging.WARNING, "timeout", "sink %r: %s did not answer within %gs",
                                 self.name, self._safe_url, self.timeout)
                return Retry(reason="timeout")
            except requests.exceptions.RequestException as exc:
                reason = short_reason(exc)
                self._errors.log(logging.WARNING, f"connect:{reason}", "sink %r: cannot reach %s (%s); records kept, "
                                 "will retry", self.name, self._hostport, reason)
                log.debug("sink %r: %s: %s", self.name, self._safe_url, self._redact(str(exc)))
                return Retry(reason="connection_error")
            self._errors.clear_all()  # the receiver answered: the next failure is news again
            if self._handshake and response.status_code in (401, 403):
                # The permission may have been withdrawn: the records wait and the next attempt
                # (after the dispatcher's backoff) asks again; a refusal then keeps them waiting.
                self._allowed = False
                response.close()
                log.error("sink %r: %s refused a delivery with %d: the receiver may have withdrawn its permission "
                          "(or 'headers' lost theirs); records are kept and the handshake is asked again",
                          self.name, self._safe_url, response.status_code)
                return Retry(reason=f"http_{response.status_code}_handshake_again",
                             delay=parse_retry_after(response.headers.get("Retry-After")))
            try:
                return self._result(response)
            except requests.exceptions.RequestException as exc:
                # The status arrived but the body broke off: the receiver's answer is still known.
                log.warning("sink %r: reading the answer of %s failed: %s",
                            self.name, self._safe_url, self._redact(str(exc)))
                return self._map_status(response, b"")
            finally:
                response.close()

    def _result(self, response: requests.Response) -> Result:
        answer = b""
        for chunk in response.iter_content(8192):
            answer += chunk
            if len(answer) >= _MAX_ANSWER_BYTES:
                break  # the rest is dropped with the connection by close()
        return self._map_status(response, answer)

    def _map_status(self, response: requests.Response, answer: bytes) -> Result:
        status = response.status_code
        if 200 <= status < 300:
            return Ok()
        reason = f"http_{status}"
        # 410 Gone (the endpoint was removed) is final here: the shared policy does not retry it.
        if is_retryable_status(status):
            delay = parse_retry_after(response.headers.get("Retry-After"))
            log.warning("sink %r: %s answered %d%s", self.name, self._safe_url, status,
                        f", retry after {delay:g}s" if delay is not None else "")
            return Retry(reason=reason, delay=delay)
        if 300 <= status < 400:
            location = response.headers.get("Location")
            # The Location may carry user:password@ or a key in its query: it goes to logs and dead letters.
            where = redact(location) if location else "no Location header"
            detail = f"HTTP {status} redirect to {where} not followed; point 'url' at the final address"
            log.error("sink %r: %s", self.name, detail)
            return Reject(reason="http_3xx_redirect", detail=detail)
        detail = redact(answer.decode("utf-8", "replace")[:_DETAIL_CHARS])
        log.error("sink %r: %s refused the request with %d: %s", self.name, self._safe_url, status, detail)
        return Reject(reason=reason, detail=detail)

    def _redact(self, text: str) -> str:
        text = text.replace(self._query, "***") if self._query else text
        return redact(text)

    def close(self) -> None:
        """Close the keep-alive connections."""
        with self._lock:
            self._session.close()
