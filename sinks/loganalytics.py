"""The ``loganalytics`` sink: records as rows of ``SefwdEvents_CL`` through the Logs Ingestion API.

Uses ``azure-monitor-ingestion`` (the HTTP Data Collector API is retired) with a managed identity
token for ``https://monitor.azure.com``. Rows have the one flat shape of ``sinks.la_schema``;
``deploy/azure/loganalytics/azuredeploy.json`` creates the matching table, DCR and role assignment.

The client splits a batch into ~1 MiB chunks and gzips each one. The sink stops at the first
failed chunk (``on_error`` raises), so the rows that got in are exactly those before it, in order;
it remembers their record ids, and when the dispatcher retries the batch those rows are skipped.
So a retry only duplicates rows across an agent restart (delivery stays at-least-once: de-duplicate
on ``RecordId``). A 413 splits the failed chunk in halves until it fits; a single row refused as
too large is rejected (``row_too_large``) and the dispatcher dead-letters just that record.

Errors map to results at this boundary: 429 / 5xx / connection errors retry (honouring
Retry-After); 403 retries with a loud error, because the usual cause — the identity lacks
"Monitoring Metrics Publisher" on the DCR — is fixed in Azure and takes up to 30 minutes to
propagate; 401 and token failures retry; 400 / 404 (wrong rule id or stream) reject with the
service's message. The SDK's own retries are off: backoff belongs to the dispatcher, whose waits
end promptly at shutdown.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, ClassVar

import azure.identity  # noqa: F401 - a missing extra then fails at load time, where config check names it
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.monitor.ingestion import LogsIngestionClient, LogsUploadError

from forwarder.common.connection_strings import AZURE_MONITOR_AUDIENCES, monitor_audience
from forwarder.common.logs import RateLimitedLog
from forwarder.common.retry import parse_retry_after
from forwarder.sinkapi import Ok, Record, Reject, Result, Retry, SinkContext
from forwarder.common.values import parse_duration
from sinks import check_int_range, check_positive_duration, check_readable_file, unknown_options
from sinks.azure_common import check_credential_options, check_https_endpoint, managed_identity_credential
from sinks.la_schema import STREAM, to_row

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = "30s"
DEFAULT_AUDIENCE = "https://monitor.azure.com"
DEFAULT_MAX_BATCH = 500
MAX_BATCH = 10_000
ROLE = "Monitoring Metrics Publisher"
_RULE_ID = re.compile(r"^dcr-[0-9a-fA-F]{32}$")
_STREAM = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_DETAIL_CHARS = 300
# Ids of rows accepted while their batch as a whole is still being retried; bounded for safety.
_MAX_REMEMBERED = 4 * MAX_BATCH


class _ChunkFailed(Exception):
    """Raised from ``on_error`` so the client stops at the first failed chunk."""

    def __init__(self, failure: LogsUploadError) -> None:
        super().__init__(str(failure.error))
        self.failure = failure


def _abort(failure: LogsUploadError) -> None:
    raise _ChunkFailed(failure)


def _service_message(exc: HttpResponseError) -> str:
    """``code: message`` from the service's JSON error, else the start of its answer."""
    error = getattr(exc, "error", None)
    code, message = getattr(error, "code", None), getattr(error, "message", None)
    if code or message:
        text = f"{code}: {message}" if code and message else str(code or message)
    else:
        try:
            text = exc.response.text() if exc.response is not None else ""
        except Exception:  # an unreadable body must not hide the status
            text = ""
        text = text or (exc.reason or "")
    return " ".join(text.split())[:_DETAIL_CHARS]


class LogAnalyticsSink:
    """Uploads records as rows of one custom table through a data collection rule."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "endpoint": "logs ingestion endpoint of the DCR (kind Direct) or a DCE, https://... (required)",
        "rule_id": "immutable id of the data collection rule, dcr-<32 hex> (required)",
        "stream": f"stream declared in the DCR (default {STREAM})",
        "credential": 'how to get tokens: "managed_identity" (the default)',
        "client_id": "client id of a user-assigned managed identity (default: the system-assigned one)",
        "audience": f"token audience, for sovereign clouds (default {DEFAULT_AUDIENCE}; e.g. https://monitor.azure.us)",
        "ca_file": "PEM file of CA certificates to trust instead of the system store (private CA, tests)",
        "timeout": f"connect and read timeout per request (default {DEFAULT_TIMEOUT})",
        "max_batch": f"records per upload, 1 to {MAX_BATCH} (default {DEFAULT_MAX_BATCH}); the client chunks to 1 MiB",
    }

    def __init__(self, options: Mapping[str, Any], context: SinkContext) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        self.endpoint = options["endpoint"].strip().rstrip("/")
        self.rule_id = options["rule_id"].strip()
        self.stream = options.get("stream", STREAM)
        self.timeout = parse_duration(options.get("timeout", DEFAULT_TIMEOUT))
        self.max_batch = int(options.get("max_batch", DEFAULT_MAX_BATCH))
        verify: str | bool = os.path.expanduser(options["ca_file"]) if options.get("ca_file") else True
        self._credential = managed_identity_credential(options)
        audience = options.get("audience", DEFAULT_AUDIENCE).strip().rstrip("/")
        # retry_total=0: the dispatcher owns backoff (and its waits end at shutdown); the client's
        # own retry policy would sleep inside send() for up to minutes on 429/5xx.
        self._client = LogsIngestionClient(
            self.endpoint, self._credential, credential_scopes=[f"{audience}/.default"],
            connection_verify=verify, retry_total=0,
            connection_timeout=self.timeout, read_timeout=self.timeout,
        )
        self._lock = threading.Lock()
        self._accepted: OrderedDict[str, None] = OrderedDict()
        # One rate limit per kind of failure, so a burst of 429s cannot hide the first 403.
        self._errors = RateLimitedLog(log)
        self._failing = False

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads nothing but ca_file's existence)."""
        problems = unknown_options(options, cls.OPTIONS)
        problems += check_https_endpoint(options, "the DCR's logs ingestion endpoint or a DCE, https://...", path=False)
        rule_id = options.get("rule_id")
        if rule_id is None:
            problems.append("option 'rule_id' is required (the DCR's immutableId, dcr-...)")
        elif not isinstance(rule_id, str) or not _RULE_ID.match(rule_id.strip()):
            problems.append(f"option 'rule_id' must be a DCR immutable id like dcr-<32 hex digits>, got {rule_id!r}")
        stream = options.get("stream")
        if stream is not None and (not isinstance(stream, str) or not _STREAM.match(stream)):
            problems.append(f"option 'stream' must be a stream name like {STREAM}, got {stream!r}")
        audience = options.get("audience")
        if audience is not None and (not isinstance(audience, str) or not audience.strip().startswith("https://")):
            problems.append(f"option 'audience' must be an https:// URL like {DEFAULT_AUDIENCE}, got {audience!r}")
        elif audience is not None:
            try:  # a token for another service's audience is never requested
                monitor_audience(audience)
            except ValueError:
                problems.append(f"option 'audience' must be one of Azure Monitor's audiences "
                                f"({', '.join(AZURE_MONITOR_AUDIENCES)}), got {audience!r}")
        # The credential defaults to managed_identity here, so client_id alone is fine.
        problems += check_credential_options({"credential": "managed_identity", **options})
        problems += check_positive_duration(options, "timeout")
        problems += check_int_range(options, "max_batch", 1, MAX_BATCH)
        problems += check_readable_file(options, "ca_file")
        return problems

    # -- sending ----------------------------------------------------------------------------
    def send(self, batch: Sequence[Record]) -> Result:
        """Upload the batch's rows; maps every outcome to Ok / Retry / Reject and never raises."""
        with self._lock:
            try:
                pending = [(r.id, to_row(r.to_dict())) for r in batch if r.id not in self._accepted]
                result = self._upload(pending)
            except Exception as exc:  # never raise into the dispatcher: the records stay in the journal
                log.error("sink %r: unexpected error uploading to %s: %s: %s",
                          self.name, self.endpoint, type(exc).__name__, exc)
                result = Retry(reason="internal_error")
            if not isinstance(result, Ok):
                self._failing = True
            if isinstance(result, Ok) or (isinstance(result, Reject) and len(batch) == 1):
                # Done with these records: the dispatcher commits them (or dead-letters the one).
                # A Reject of several goes back record by record, where the accepted ones are skipped.
                for record in batch:
                    self._accepted.pop(record.id, None)
            if isinstance(result, Ok) and self._failing:
                # The trouble is over: log the next failure at once, whatever its kind.
                self._errors = RateLimitedLog(log)
                self._failing = False
            return result

    def _upload(self, pending: list[tuple[str, dict[str, Any]]]) -> Result:
        """Upload rows in order, stopping at the first failure; 413 splits the failed chunk."""
        start = 0
        while start < len(pending):
            rows: list[MutableMapping[str, Any]] = [row for _, row in pending[start:]]
            position = {id(row): start + i for i, row in enumerate(rows)}
            try:
                self._client.upload(self.rule_id, self.stream, rows, on_error=_abort)
            except _ChunkFailed as failed:
                first = position[id(failed.failure.failed_logs[0])]
                end = first + len(failed.failure.failed_logs)
                self._remember(pending[start:first])
                error = failed.failure.error
                if not (isinstance(error, HttpResponseError) and error.status_code == 413):
                    return self._map_error(error, end - first)
                if end - first == 1:
                    detail = f"one row is larger than the service accepts: {_service_message(error)}"
                    log.error("sink %r: record %s rejected: %s", self.name, pending[first][0], detail)
                    return Reject(reason="row_too_large", detail=detail)
                middle = (first + end) // 2
                log.info("sink %r: 413 for %d rows, sending them in two halves", self.name, end - first)
                for half in (pending[first:middle], pending[middle:end]):
                    result = self._upload(half)
                    if not isinstance(result, Ok):
                        return result
                start = end
                continue
            self._remember(pending[start:])
            return Ok()
        return Ok()

    def _remember(self, uploaded: Sequence[tuple[str, dict[str, Any]]]) -> None:
        for record_id, _ in uploaded:
            self._accepted[record_id] = None
        while len(self._accepted) > _MAX_REMEMBERED:
            self._accepted.popitem(last=False)

    def _map_error(self, error: Exception, rows: int) -> Result:
        where = f"{self.endpoint} (rule {self.rule_id}, stream {self.stream})"
        if isinstance(error, HttpResponseError) and error.status_code is not None:
            status = error.status_code
            message = _service_message(error)
            if status == 429 or status == 408 or status >= 500:
                headers = getattr(error.response, "headers", None) or {}
                delay = parse_retry_after(headers.get("Retry-After"))
                self._errors.log(logging.WARNING, "throttled" if status == 429 else "http_error", "sink %r: %s answered %d for %d row(s)%s: %s",
                                 self.name, where, status, rows,
                                 f", retry after {delay:g}s" if delay is not None else "", message)
                return Retry(reason="throttled" if status == 429 else f"http_{status}", delay=delay)
            if status == 403:
                self._errors.log(
                    logging.ERROR, "forbidden",
                    "sink %r: %s answered 403 Forbidden (%s): the agent's managed identity needs the %r role "
                    "assigned on the data collection rule %s (deploy/azure/loganalytics/azuredeploy.json does it). "
                    "A new role assignment can take up to 30 minutes to take effect, so records are kept and retried.",
                    self.name, where, message, ROLE, self.rule_id,
                )
                return Retry(reason="forbidden")
            if status == 401:
                self._errors.log(logging.ERROR, "auth_failed", "sink %r: %s refused the token (401): %s; will retry",
                                 self.name, where, message)
                return Retry(reason="auth_failed")
            if status in (400, 404):
                detail = f"HTTP {status}: {message}"
                log.error("sink %r: %s refused the upload: %s (check endpoint, rule_id and stream)",
                          self.name, where, detail)
                return Reject(reason=f"http_{status}", detail=detail)
            self._errors.log(logging.ERROR, "http_error", "sink %r: %s answered %d: %s; will retry",
                             self.name, where, status, message)
            return Retry(reason=f"http_{status}")
        if isinstance(error, ClientAuthenticationError):
            # No HTTP status: getting the token failed (no managed identity, IMDS unreachable...).
            self._errors.log(logging.ERROR, "credential", "sink %r: cannot get a token for Azure Monitor: %s; will retry",
                             self.name, " ".join(str(error).split())[:_DETAIL_CHARS])
            return Retry(reason="credential_unavailable")
        if isinstance(error, (ServiceRequestError, ServiceResponseError)):
            text = " ".join(str(error).split())[:_DETAIL_CHARS]
            if "CERTIFICATE_VERIFY_FAILED" in text or "SSL" in text:
                self._errors.log(logging.ERROR, "tls_error", "sink %r: TLS error talking to %s: %s "
                                 "(records kept, will retry; check the certificate or set ca_file)",
                                 self.name, self.endpoint, text)
                return Retry(reason="tls_error")
            reason = "timeout" if "timed out" in text.lower() or "timeout" in type(error).__name__.lower() else "connection_error"
            self._errors.log(logging.WARNING, reason, "sink %r: cannot reach %s (%s): %s", self.name, self.endpoint, reason, text)
            return Retry(reason=reason)
        self._errors.log(logging.ERROR, "internal_error", "sink %r: upload to %s failed: %s: %s",
                         self.name, where, type(error).__name__, error)
        return Retry(reason="internal_error")

    def close(self) -> None:
        """Close the client's connections and the credential."""
        with self._lock:
            for closable in (self._client, self._credential):
                try:
                    closable.close()
                except Exception as exc:  # closing must not fail the shutdown
                    log.debug("sink %r: close failed: %s", self.name, exc)
