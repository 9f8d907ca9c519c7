"""The ``appinsights`` sink: every record becomes an Application Insights custom event (AppEvents).

The event's name is the record type (``scheduledevent.scheduled``, ``approval.approved``, ...);
its properties (customDimensions) are the record's CloudEvents attributes (id, source, subject,
time, sequence, eventkey) and its data fields, nested values as JSON strings. The event time is
the record's time, so AppEvents shows when the agent saw the change, not when it got through.

The sink posts the track envelopes itself (``POST {IngestionEndpoint}/v2.1/track``, a gzip'd JSON
array) with ``requests``, the protocol every Application Insights SDK speaks. Why not the
OpenTelemetry exporter: its public ``export()`` answers only SUCCESS or FAILURE, so a partial
success (206), a permanent refusal (400) and an outage look the same, and custom events reach it
only as log records, whose classes live in private OpenTelemetry modules (``opentelemetry._logs``).
Posting the envelope gives the per-item answer: accepted items are remembered and never sent
again, items refused with a retryable status (408, 429, 5xx) are retried alone, and items refused
for good (400: the service will never take them) go to dead letters with the service's message.

Nothing else is kept on the side: the store is the offline buffer, the dispatcher owns retries
and backoff (``Retry-After`` honoured), so ``send`` tries once and says what happened.
"""
from __future__ import annotations

import gzip
import logging
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urljoin, urlsplit

import orjson
from forwarder import __version__
from forwarder.records import rfc3339, utcnow
from forwarder.common.retry import parse_retry_after
from forwarder.sinkapi import Record, Result, Retry, SinkContext
from forwarder.common.connection_strings import appinsights_problems, monitor_audience
from forwarder.common.values import parse_duration
from sinks import check_int_range, check_positive_duration, check_readable_file, unknown_options
from sinks.azure_common import (
    DETAIL_CHARS, Answer, ItemLedger, ServiceClient, check_credential_options, identity_extra_problems, read_secret_text,
)

log = logging.getLogger(__name__)

EVENT_ENVELOPE = "Microsoft.ApplicationInsights.Event"
DEFAULT_ROLE_NAME = "scheduled-events-forwarder"
DEFAULT_TIMEOUT = "10s"
DEFAULT_BATCH = 100
MAX_BATCH = 512
DEFAULT_INGESTION_ENDPOINT = "https://dc.services.visualstudio.com"
TRACK_PATH = "v2.1/track"
# The Entra ID scope of the ingestion endpoint; the double slash is what the service expects
# (the audience is "https://monitor.azure.com/"). A connection string's AADAudience may name
# another cloud's Azure Monitor audience (forwarder.common.connection_strings), never anything else.
DEFAULT_SCOPE = "https://monitor.azure.com//.default"
# Item and request statuses the service means as "later": the rest of the 4xx never change.
RETRYABLE_ITEM_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Daily cap or ingestion quota reached: the service drops until the quota resets, so keep the records.
QUOTA_STATUS = frozenset({402, 439})
MAX_PROPERTY_CHARS = 8192  # the service cuts longer property values; cutting here keeps items small
MAX_REDIRECTS = 3
# Item ids accepted or refused while their batch is still being retried; bounded for safety.
_MAX_REMEMBERED = 4 * MAX_BATCH
# CloudEvents attributes that say nothing a query needs (data is flattened instead).
_SKIPPED_ATTRIBUTES = frozenset({"specversion", "datacontenttype", "data", "type"})


def _property(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = str(value)
    else:
        text = orjson.dumps(value).decode()
    return text[:MAX_PROPERTY_CHARS]


def event_properties(event: Mapping[str, Any]) -> dict[str, str]:
    """A record's fields as custom-event properties: attributes, then data fields, all strings."""
    props = {k: _property(v) for k, v in event.items() if k not in _SKIPPED_ATTRIBUTES and v is not None}
    data = event.get("data")
    if isinstance(data, Mapping):
        for key, value in data.items():
            if value is None:
                continue
            name = str(key) if str(key) not in props else f"data.{key}"
            props[name] = _property(value)
    elif data is not None:
        props["data"] = _property(data)
    return props


@dataclass(frozen=True)
class ConnectionString:
    """The parts of an Application Insights connection string this sink uses."""

    instrumentation_key: str
    ingestion_endpoint: str
    scope: str

    @classmethod
    def parse(cls, text: str) -> ConnectionString:
        """Parse ``Key=Value;...`` (keys case-insensitive); ValueError names what is wrong, never the value."""
        fields: dict[str, str] = {}
        for part in text.split(";"):
            name, sep, value = part.partition("=")
            if sep:
                fields[name.strip().lower()] = value.strip()
        ikey = fields.get("instrumentationkey")
        if not ikey:
            raise ValueError("the connection string has no InstrumentationKey (copy it from the Application Insights resource)")
        endpoint = fields.get("ingestionendpoint")
        if not endpoint and fields.get("endpointsuffix"):
            location = f"{fields['location']}." if fields.get("location") else ""
            endpoint = f"https://{location}dc.{fields['endpointsuffix']}"
        endpoint = (endpoint or DEFAULT_INGESTION_ENDPOINT).rstrip("/")
        parts = urlsplit(endpoint)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError("the connection string's IngestionEndpoint must be an https:// URL")
        audience = fields.get("aadaudience")
        scope = f"{monitor_audience(audience)}/.default" if audience else DEFAULT_SCOPE
        return cls(ikey, endpoint, scope)


def _origin(url: str) -> str:
    """``https://host:port`` of a URL (the port written out): what a redirect may not leave."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{parts.port or 443}"


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    middle = len(items) // 2
    yield items[:middle]
    yield items[middle:]


class AppInsightsSink:
    """Sends each record as a custom event to Application Insights."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "connection_string_env": "environment variable holding the Application Insights connection string",
        "connection_string_file": "file holding the Application Insights connection string",
        "credential": 'set to "managed_identity" to authenticate with Entra ID (resources with local auth off)',
        "client_id": "client id of a user-assigned managed identity (with credential)",
        "role_name": f"cloud role name of the events (AppRoleName; default {DEFAULT_ROLE_NAME!r})",
        "batch_size": f"records per request, 1 to {MAX_BATCH} (default {DEFAULT_BATCH})",
        "timeout": f"connect and read timeout per request (default {DEFAULT_TIMEOUT})",
        "ca_file": "PEM file of CA certificates to trust instead of the system store (private CA or proxy)",
    }

    def __init__(self, options: Mapping[str, Any], context: SinkContext) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        text = read_secret_text(options, "connection_string")
        assert text is not None  # check() made sure
        self._conn = ConnectionString.parse(text)
        self._track_url = urljoin(self._conn.ingestion_endpoint + "/", TRACK_PATH)
        self._home = self._track_url  # redirects are followed on this origin only
        self.max_batch = int(options.get("batch_size", DEFAULT_BATCH))
        self._client = ServiceClient(self.name, options, scope=self._conn.scope, logger=log,
                                     timeout=parse_duration(options.get("timeout", DEFAULT_TIMEOUT)))
        self._errors = self._client.errors
        self._tags = {
            "ai.cloud.role": str(options.get("role_name") or DEFAULT_ROLE_NAME),
            "ai.cloud.roleInstance": socket.gethostname(),
            "ai.internal.sdkVersion": f"sefwd:{__version__}",
        }
        self._lock = threading.Lock()
        self._ledger = ItemLedger(_MAX_REMEMBERED)

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads the connection string, changes nothing)."""
        problems = unknown_options(options, cls.OPTIONS)
        problems += check_credential_options(options)
        problems += identity_extra_problems(options, "appinsights")
        try:
            text = read_secret_text(options, "connection_string")
        except ValueError as exc:
            problems.append(str(exc))
        else:
            if text is None:
                problems.append("set connection_string_env or connection_string_file (never the string inline)")
            else:
                problems += appinsights_problems(text)
                if not problems:
                    try:
                        ConnectionString.parse(text)
                    except ValueError as exc:
                        problems.append(str(exc))
        problems += check_int_range(options, "batch_size", 1, MAX_BATCH)
        problems += check_positive_duration(options, "timeout")
        role = options.get("role_name")
        if role is not None and (not isinstance(role, str) or not role.strip()):
            problems.append(f"option 'role_name' must be a non-empty string, got {role!r}")
        problems += check_readable_file(options, "ca_file")
        return problems

    # -- envelopes ---------------------------------------------------------------------------
    def envelope(self, record: Record) -> dict[str, Any]:
        """The track envelope of one record: a custom event named by the record's type."""
        event = record.to_dict()
        when = event.get("time") if isinstance(event.get("time"), str) else rfc3339(utcnow())
        return {
            "ver": 1, "name": EVENT_ENVELOPE, "time": when, "sampleRate": 100.0,
            "iKey": self._conn.instrumentation_key, "tags": self._tags,
            "data": {"baseType": "EventData",
                     "baseData": {"ver": 2, "name": record.type, "properties": event_properties(event)}},
        }

    # -- sending ----------------------------------------------------------------------------
    def send(self, batch: Sequence[Record]) -> Result:
        """Track the batch's events; maps every outcome to Ok / Retry / Reject and never raises."""
        with self._lock:
            try:
                pending = self._ledger.pending(batch)
                retry = self._deliver(pending) if pending else None
            except Exception as exc:  # never raise into the dispatcher: the records stay in the store
                log.error("sink %r: unexpected error sending to %s: %s: %s",
                          self.name, self._track_url, type(exc).__name__, exc)
                return Retry(reason="internal_error")
            if retry is not None:
                return retry  # accepted and refused items are remembered; only the rest goes again
            self._errors.clear("request")
            return self._ledger.outcome(batch)

    def _deliver(self, records: Sequence[Record]) -> Retry | None:
        """Post the records' envelopes; remembers accepted and refused items; a Retry if any must go again."""
        answer = self._post([self.envelope(r) for r in records])
        if isinstance(answer, Retry):
            return answer
        status, body = answer.status, answer.body
        if status == 413:
            if len(records) == 1:
                self._ledger.refuse(records[0], "item_too_large", f"HTTP 413: {answer.message()}")
                return None
            log.info("sink %r: 413 for %d events, sending them in two halves", self.name, len(records))
            for half in _chunks(records):
                retry = self._deliver(half)
                if retry is not None:
                    return retry
            return None
        errors = body.get("errors") if isinstance(body, dict) else None
        if status in (200, 206) or (status == 400 and isinstance(errors, list) and errors):
            return self._items(records, errors or [], answer.headers)
        return self._request_failed(records, answer)

    def _items(self, records: Sequence[Record], errors: list[Any], headers: Mapping[str, str]) -> Retry | None:
        """Per-item outcome of a 200/206/400 answer: index-less or unknown errors count as retryable."""
        failed: dict[int, tuple[int, str]] = {}
        for error in errors:
            if not isinstance(error, dict):
                continue
            index, status = error.get("index"), error.get("statusCode")
            if isinstance(index, int) and 0 <= index < len(records):
                failed[index] = (status if isinstance(status, int) else 500, " ".join(str(error.get("message") or "").split()))
        retry_later = 0
        for index, record in enumerate(records):
            if index not in failed:
                self._ledger.accept(record)
                continue
            status, message = failed[index]
            if status in RETRYABLE_ITEM_STATUS:
                retry_later += 1
            else:
                self._ledger.refuse(record, f"item_{status}", f"HTTP {status}: {message}"[:DETAIL_CHARS])
        refused = len(failed) - retry_later
        if refused:
            log.error("sink %r: Application Insights refused %d of %d event(s) for good (first: %s)",
                      self.name, refused, len(records),
                      next(m for s, m in failed.values() if s not in RETRYABLE_ITEM_STATUS)[:DETAIL_CHARS])
        if retry_later:
            delay = parse_retry_after(headers.get("Retry-After"))
            self._errors.log(logging.WARNING, "items", "sink %r: %d of %d event(s) not accepted yet; will retry them alone",
                             self.name, retry_later, len(records))
            return Retry(reason="partial_success", delay=delay)
        return None

    def _request_failed(self, records: Sequence[Record], answer: Answer) -> Retry | None:
        status, message = answer.status, answer.message()
        delay = parse_retry_after(answer.headers.get("Retry-After"))
        if status in RETRYABLE_ITEM_STATUS:
            reason = "throttled" if status == 429 else f"http_{status}"
            self._errors.log(logging.WARNING, "request", "sink %r: %s answered %d%s: %s", self.name, self._track_url,
                             status, f", retry after {delay:g}s" if delay is not None else "", message)
            return Retry(reason=reason, delay=delay)
        if status in QUOTA_STATUS:
            self._errors.log(logging.ERROR, "quota", "sink %r: Application Insights quota or daily cap reached (%d): %s; "
                             "records are kept and retried", self.name, status, message)
            return Retry(reason="quota_exceeded", delay=delay)
        if status in (401, 403):
            hint = ("the resource requires Entra ID: set credential = \"managed_identity\"" if self._client.credential is None
                    else "the identity needs the 'Monitoring Metrics Publisher' role on the resource")
            self._errors.log(logging.ERROR, "auth", "sink %r: %s answered %d (%s): %s; records are kept and retried",
                             self.name, self._track_url, status, hint, message)
            return Retry(reason="auth_failed" if status == 401 else "forbidden")
        detail = f"HTTP {status}: {message}"
        if len(records) == 1:
            self._ledger.refuse(records[0], f"http_{status}", detail)
            log.error("sink %r: %s refused event %s: %s", self.name, self._track_url, records[0].id, detail)
            return None
        # Refused as a whole without saying which: each record goes alone to find the bad ones.
        log.warning("sink %r: %s refused a request of %d events (%s); sending them one by one",
                    self.name, self._track_url, len(records), detail)
        for record in records:
            retry = self._deliver([record])
            if retry is not None:
                return retry
        return None

    def _post(self, envelopes: list[dict[str, Any]]) -> Answer | Retry:
        """One POST (following the service's 307/308 to a regional endpoint); the answer or a Retry."""
        body = gzip.compress(orjson.dumps(envelopes), compresslevel=6)
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip", "Accept": "application/json"}
        url = self._track_url
        for _ in range(MAX_REDIRECTS + 1):
            answer = self._client.post(url, body, headers)
            location = answer.headers.get("Location") if isinstance(answer, Answer) else None
            if isinstance(answer, Answer) and answer.status in (307, 308) and location \
                    and urlsplit(urljoin(url, location)).scheme == "https":
                target = urljoin(url, location)
                if _origin(target) != _origin(self._home):
                    # The bearer token (and the records) go only where the connection string says.
                    self._errors.log(logging.ERROR, "redirect", "sink %r: %s answered %d to another host (%s); "
                                     "not followed: the managed-identity token and the records go only to the "
                                     "connection string's IngestionEndpoint (put the new endpoint there if the "
                                     "resource moved); will retry", self.name, _origin(url), answer.status,
                                     _origin(target))
                    return Retry(reason="redirect_to_another_host")
                url = target
                self._track_url = url  # the service moved this resource's ingestion: go there from now on
                continue
            return answer
        return Retry(reason="too_many_redirects")

    def close(self) -> None:
        """Close the keep-alive connections and the credential."""
        with self._lock:
            self._client.close()
