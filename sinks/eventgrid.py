"""The ``eventgrid`` sink: records as CloudEvents 1.0 to an Event Grid topic or namespace topic.

Event Grid is Azure's event router: a subscription on the topic pushes each record to Functions,
Logic Apps, Service Bus, Event Hubs or a webhook, filtered by type or subject. Two targets:

* a custom topic created with the CloudEvents 1.0 input schema: ``POST {endpoint}?api-version=2018-01-01``
  (the endpoint ends in ``/api/events``), key in the ``aeg-sas-key`` header;
* a namespace topic: ``POST {endpoint}/topics/{topic}:publish?api-version=2024-06-01``, key as
  ``Authorization: SharedAccessKey ...``.

Either takes a Microsoft Entra token instead of a key (``credential = "managed_identity"``, scope
``https://eventgrid.azure.net/.default``; the identity needs "EventGrid Data Sender").

The body is the records' own structured-mode JSON, byte for byte (``application/cloudevents-batch+json``),
so a subscriber gets exactly what the file and webhook sinks write. Why plain ``requests`` and not
the ``azure-eventgrid`` SDK: the SDK takes ``CloudEvent`` objects or dicts and serializes them again
(4.22.1 against the test peer: the namespace client rewrote ``time``, the topic client ignored
``connection_verify``), and sends whatever list it is given as one request,
while the service refuses a request over 1 MB and an event over 1 MB (413). The sink packs requests
up to ``max_request_bytes`` itself, remembers which records got in when a later request of the same
batch fails (retries send only the rest), and refuses a single record that can never fit.

Errors map to results here: 408 / 429 / 5xx / connection errors retry (Retry-After honoured);
401 / 403 retry loudly (a wrong key or a missing role is fixed in Azure, and the records must
wait for it); 413 splits the request; 400 / 404 and other 4xx go to dead letters with the
service's message (a request of several refused as a whole is tried record by record first).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import quote

from forwarder.common.retry import is_retryable_status, parse_retry_after
from forwarder.sinkapi import Record, Result, Retry, SinkContext
from forwarder.common.values import parse_duration
from sinks import check_int_range, check_positive_duration, check_readable_file, unknown_options
from sinks.azure_common import (
    DETAIL_CHARS, Answer, ItemLedger, ServiceClient, check_credential_options, check_https_endpoint, identity_extra_problems, read_secret_text,
)

log = logging.getLogger(__name__)

TOPIC_API_VERSION = "2018-01-01"
NAMESPACE_API_VERSION = "2024-06-01"
SCOPE = "https://eventgrid.azure.net/.default"
CONTENT_TYPE = "application/cloudevents-batch+json; charset=utf-8"
# The service's limits: 1 MB per request and per event (Event Grid quotas and limits).
MAX_REQUEST_BYTES = 1024 * 1024
DEFAULT_TIMEOUT = "10s"
DEFAULT_MAX_BATCH = 100
MAX_BATCH = 5000
ROLE = "EventGrid Data Sender"
_MAX_REMEMBERED = 4 * MAX_BATCH


def _requests(bodies: Sequence[bytes], limit: int) -> Iterator[tuple[int, int]]:
    """(start, end) index ranges whose JSON array stays within ``limit`` bytes; an oversized body stands alone."""
    start, size = 0, 2  # "[" and "]"
    for index, body in enumerate(bodies):
        extra = len(body) + (1 if index > start else 0)
        if index > start and size + extra > limit:
            yield start, index
            start, size, extra = index, 2, len(body)
        size += extra
    if start < len(bodies):
        yield start, len(bodies)


class EventGridSink:
    """Publishes records as CloudEvents to an Event Grid topic or namespace topic."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "endpoint": "topic endpoint (https://....eventgrid.azure.net/api/events) or namespace endpoint with 'topic' (required)",
        "topic": "namespace topic name: publish to {endpoint}/topics/{topic}:publish (unset: a custom topic)",
        "key_env": "environment variable holding the topic's access key",
        "key_file": "file holding the topic's access key",
        "credential": 'set to "managed_identity" to use Microsoft Entra tokens instead of a key',
        "client_id": "client id of a user-assigned managed identity (with credential)",
        "max_batch": f"records per send, 1 to {MAX_BATCH} (default {DEFAULT_MAX_BATCH}); requests stay within 1 MB",
        "timeout": f"connect and read timeout per request (default {DEFAULT_TIMEOUT})",
        "ca_file": "PEM file of CA certificates to trust instead of the system store (private CA or proxy)",
    }

    def __init__(self, options: Mapping[str, Any], context: SinkContext, *,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        endpoint = options["endpoint"].strip().rstrip("/")
        self.topic: str | None = options.get("topic")
        if self.topic:
            self.url = f"{endpoint}/topics/{quote(self.topic, safe='')}:publish?api-version={NAMESPACE_API_VERSION}"
        else:
            self.url = f"{endpoint}?api-version={TOPIC_API_VERSION}"
        self.max_batch = int(options.get("max_batch", DEFAULT_MAX_BATCH))
        self.max_request_bytes = max_request_bytes
        self._key = read_secret_text(options, "key")
        self._client = ServiceClient(self.name, options, scope=SCOPE, logger=log,
                                     timeout=parse_duration(options.get("timeout", DEFAULT_TIMEOUT)))
        self._errors = self._client.errors
        self._lock = threading.Lock()
        self._ledger = ItemLedger(_MAX_REMEMBERED)

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads the key, changes nothing)."""
        problems = unknown_options(options, cls.OPTIONS)
        problems += check_https_endpoint(options, "the topic endpoint, https://<topic>.<region>-1.eventgrid.azure.net/api/events, "
                                         "or the namespace's https://<namespace>.<region>-1.eventgrid.azure.net with 'topic'")
        topic = options.get("topic")
        if topic is not None and (not isinstance(topic, str) or not topic.strip() or "/" in topic):
            problems.append(f"option 'topic' must be a namespace topic name, got {topic!r}")
        problems += check_credential_options(options)
        try:
            key = read_secret_text(options, "key")
        except ValueError as exc:
            problems.append(str(exc))
            key = "unreadable"
        if key is None and options.get("credential") is None:
            problems.append('set key_env or key_file (the topic\'s access key), or credential = "managed_identity"')
        elif key is not None and options.get("credential") is not None:
            problems.append("set either a key (key_env / key_file) or credential, not both")
        problems += identity_extra_problems(options, "eventgrid")
        problems += check_int_range(options, "max_batch", 1, MAX_BATCH)
        problems += check_positive_duration(options, "timeout")
        problems += check_readable_file(options, "ca_file")
        return problems

    # -- sending ----------------------------------------------------------------------------
    def send(self, batch: Sequence[Record]) -> Result:
        """Publish the batch in requests of at most 1 MB; maps every outcome to Ok / Retry / Reject."""
        with self._lock:
            try:
                pending = self._ledger.pending(batch)
                for start, end in _requests([r.body for r in pending], self.max_request_bytes):
                    retry = self._publish(pending[start:end])
                    if retry is not None:
                        return retry  # what got in is remembered: the retry sends only the rest
            except Exception as exc:  # never raise into the dispatcher: the records stay in the journal
                log.error("sink %r: unexpected error publishing to %s: %s: %s",
                          self.name, self.url, type(exc).__name__, exc)
                return Retry(reason="internal_error")
            self._errors.clear("request")
            return self._ledger.outcome(batch)

    def _publish(self, records: Sequence[Record]) -> Retry | None:
        if len(records) == 1 and len(records[0].body) + 2 > self.max_request_bytes:
            self._refuse(records[0], "event_too_large",
                         f"{len(records[0].body)} bytes: Event Grid takes at most {self.max_request_bytes} bytes per event")
            return None
        answer = self._post(b"[" + b",".join(r.body for r in records) + b"]")
        if isinstance(answer, Retry):
            return answer
        status = answer.status
        if 200 <= status < 300:
            for record in records:
                self._ledger.accept(record)
            return None
        if status == 413 and len(records) > 1:
            middle = len(records) // 2
            log.info("sink %r: 413 for %d events, sending them in two halves", self.name, len(records))
            return self._publish(records[:middle]) or self._publish(records[middle:])
        return self._failed(records, answer)

    def _failed(self, records: Sequence[Record], answer: Answer) -> Retry | None:
        status, message = answer.status, answer.message()
        if is_retryable_status(status):  # not 410: the namespace topic does not exist
            delay = parse_retry_after(answer.headers.get("Retry-After"))
            self._errors.log(logging.WARNING, "request", "sink %r: %s answered %d%s: %s", self.name, self.url, status,
                             f", retry after {delay:g}s" if delay is not None else "", message)
            return Retry(reason="throttled" if status == 429 else f"http_{status}", delay=delay)
        if status in (401, 403):
            hint = ("check the access key (key_env / key_file)" if self._key is not None
                    else f"the identity needs the {ROLE!r} role on the topic")
            self._errors.log(logging.ERROR, "auth", "sink %r: %s answered %d (%s): %s; records are kept and retried",
                             self.name, self.url, status, hint, message)
            return Retry(reason="auth_failed" if status == 401 else "forbidden")
        detail = f"HTTP {status}: {message}"
        if len(records) == 1:
            self._refuse(records[0], "event_too_large" if status == 413 else f"http_{status}", detail)
            return None
        log.warning("sink %r: %s refused %d events as a whole (%s); sending them one by one",
                    self.name, self.url, len(records), detail)
        for record in records:
            retry = self._publish([record])
            if retry is not None:
                return retry
        return None

    def _refuse(self, record: Record, reason: str, detail: str) -> None:
        log.error("sink %r: Event Grid refused record %s for good: %s", self.name, record.id, detail[:DETAIL_CHARS])
        self._ledger.refuse(record, reason, detail[:DETAIL_CHARS])

    def _post(self, body: bytes) -> Answer | Retry:
        headers = {"Content-Type": CONTENT_TYPE}
        if self._key is not None:
            if self.topic:
                headers["Authorization"] = f"SharedAccessKey {self._key}"
            else:
                headers["aeg-sas-key"] = self._key
        return self._client.post(self.url, body, headers)

    def close(self) -> None:
        """Close the keep-alive connections and the credential."""
        with self._lock:
            self._client.close()
