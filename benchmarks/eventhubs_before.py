# The eventhubs sink as it was before the sender thread (commit 35a0c77: one thread per send),
# kept verbatim so benchmarks/eventhubs_send.py can measure it beside today's sink in one run.
# Not used by the agent. Transport options reach it through ``client_options``.
# mypy: ignore-errors
"""The ``eventhubs`` sink: records as events on an Azure Event hub (azure-eventhub, AMQP).

Authentication is either a connection string (``connection_string_env`` / ``connection_string_file``,
never inline) or a managed identity (``fully_qualified_namespace`` + ``eventhub`` +
``credential = "managed_identity"``; the identity needs the "Azure Event Hubs Data Sender" role).

The partition key is the scheduled event's ``EventId``, so every copy of one event, from every VM
that reports it, lands in one partition in order; records without an EventId (lifecycle, some
approvals) use the record's ``source``, so one VM's own records stay ordered. A batch is grouped by
key and each group is filled into ``create_batch(partition_key=...)`` batches up to the hub's
message size limit. Structured mode sends the CloudEvents JSON as the event body; binary mode sends
``data`` as the body and the attributes as ``cloudEvents_*`` application properties (the CloudEvents
AMQP binding).

One producer stays open across sends and is rebuilt after a failure. The SDK retries little (the
dispatcher owns retrying), and every send runs under a watchdog: the SDK's SASL handshake has no
timeout, so a peer that accepts TCP and never answers would otherwise block the sink for good.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import orjson
from azure.core.exceptions import ClientAuthenticationError
from azure.eventhub import EventData, EventHubProducerClient, parse_connection_string
from azure.eventhub.exceptions import (
    AuthenticationError,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    EventDataError,
    EventDataSendError,
    EventHubError,
    OperationTimeoutError,
)

from forwarder.sinkapi import Ok, Record, Reject, Result, Retry, SinkContext
from forwarder.common.values import parse_duration
from sinks import check_int_range, check_positive_duration, unknown_options
from sinks.azure_common import (
    check_credential_options,
    managed_identity_credential,
    read_secret_text,
)

log = logging.getLogger(__name__)

MODES = ("structured", "binary")
DEFAULT_TIMEOUT = "10s"
DEFAULT_MAX_BATCH = 500
MAX_BATCH = 5000
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json; charset=utf-8"
# The service refuses longer partition keys; a longer source is replaced by its digest.
MAX_PARTITION_KEY = 128
# The dispatcher retries; the SDK only smooths over a dropped link or connection.
SDK_RETRY = {"retry_total": 2, "retry_backoff_factor": 0.2, "retry_backoff_max": 2.0}
# CloudEvents attributes that are not sent as binary-mode properties (the body and its type).
_BODY_ATTRIBUTES = frozenset({"data", "data_base64", "datacontenttype"})
_THROTTLED = ("server-busy", "resource-limit-exceeded", "quota-exceeded")
_AUTH = ("unauthorized-access", "unauthorized")
_TOO_LARGE = ("message-size-exceeded",)
_REFUSED = ("not-allowed", "invalid-field", "decode-error", "not-implemented")


def partition_key(event: Mapping[str, Any]) -> str:
    """EventId for scheduled-event records (and approvals of one event), else the record's source."""
    data = event.get("data")
    if isinstance(data, Mapping):
        event_id = data.get("EventId")
        if isinstance(event_id, str) and event_id:
            return event_id
    source = str(event.get("source") or event.get("subject") or "")
    if len(source) > MAX_PARTITION_KEY:
        return "source-sha256:" + hashlib.sha256(source.encode()).hexdigest()
    return source


def _check_fqns(value: Any) -> list[str]:
    if not isinstance(value, str) or not value.strip():
        return [f"option 'fully_qualified_namespace' must be a host name like mynamespace.servicebus.windows.net, got {value!r}"]
    if "://" in value or "/" in value.strip().rstrip("/") or any(c.isspace() for c in value.strip()):
        return [("option 'fully_qualified_namespace' must be a bare host name like "
                 "mynamespace.servicebus.windows.net (no scheme, no path)")]
    return []


def _connection_string_problems(conn_str: str, eventhub: Any) -> list[str]:
    try:
        props = parse_connection_string(conn_str)
    except ValueError as exc:
        return [f"the connection string is not valid: {exc}"]
    entity = props.eventhub_name
    if not entity and not eventhub:
        return ["the connection string has no EntityPath: add EntityPath=<hub> to it or set option 'eventhub'"]
    if entity and eventhub and entity != eventhub:
        return [f"option 'eventhub' ({eventhub!r}) differs from the connection string's EntityPath ({entity!r})"]
    return []


class _Attempt:
    """One send running on its own thread, so a hung SDK call cannot hold the sink forever."""

    def __init__(self, producer: EventHubProducerClient, work: Callable[[_Attempt], Result]) -> None:
        self.producer = producer
        self.result: Result | None = None
        self.progress = time.monotonic()
        self.abandoned = False
        self.done = threading.Event()
        self._work = work
        self.thread = threading.Thread(target=self._run, name="eventhubs-send", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self._work(self)
            # A producer that failed may hold a broken link: close it here, under the watchdog.
            if isinstance(self.result, Retry):
                _close_quietly(self.producer)
        finally:
            self.done.set()
            if self.abandoned:
                _close_quietly(self.producer)


def _close_quietly(producer: EventHubProducerClient) -> None:
    try:
        producer.close()
    except Exception as exc:  # closing a broken connection may fail; it is gone either way
        log.debug("closing the Event Hubs producer failed: %s: %s", type(exc).__name__, exc)


class EventHubsSink:
    """Sends records to one Event hub, grouped into batches by partition key."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "connection_string_env": "environment variable holding the connection string (with EntityPath, or set eventhub)",
        "connection_string_file": "file holding the connection string (with EntityPath, or set eventhub)",
        "fully_qualified_namespace": "namespace host, e.g. mynamespace.servicebus.windows.net (with credential)",
        "eventhub": "Event hub name (required with fully_qualified_namespace)",
        "credential": "\"managed_identity\": authenticate with the VM's managed identity",
        "client_id": "client id of a user-assigned managed identity (default: system-assigned)",
        "mode": "\"structured\" (CloudEvents JSON body, default) or \"binary\" (data body, cloudEvents_* properties)",
        "max_batch": f"records per send, 1 to {MAX_BATCH} (default {DEFAULT_MAX_BATCH})",
        "timeout": f"timeout of one send (default {DEFAULT_TIMEOUT})",
    }

    def __init__(self, options: Mapping[str, Any], context: SinkContext, *,
                 client_options: Mapping[str, Any] | None = None) -> None:
        """``client_options`` go to EventHubProducerClient unchanged (tests: ``use_tls=False``)."""
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        self.name = context.name
        self.mode = str(options.get("mode", "structured"))
        self.max_batch = int(options.get("max_batch", DEFAULT_MAX_BATCH))
        self.timeout = parse_duration(options.get("timeout", DEFAULT_TIMEOUT))
        # Generous: only a call that stopped making progress altogether is abandoned.
        self.stall_limit = 2 * self.timeout + 5.0
        self._conn_str = read_secret_text(options, "connection_string")
        self._eventhub: str | None = options.get("eventhub")
        fqns = options.get("fully_qualified_namespace")
        self._fqns: str | None = fqns.strip().rstrip("/") if isinstance(fqns, str) else None
        self._options = dict(options)
        self._client_options = dict(client_options or {})
        self._credential: Any = None  # one managed identity credential for every producer: it caches tokens
        self._producer: EventHubProducerClient | None = None
        self._stuck: _Attempt | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        if self._conn_str is not None:  # for log lines: the namespace and hub, never the key
            props = parse_connection_string(self._conn_str)
            self._where = f"{props.fully_qualified_namespace}/{self._eventhub or props.eventhub_name}"
        else:
            self._where = f"{self._fqns}/{self._eventhub}"

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads the connection string, connects to nothing)."""
        problems = unknown_options(options, cls.OPTIONS)
        if "connection_string" in options:
            problems.append("option 'connection_string' is not allowed inline (it holds a key): "
                            "use connection_string_env or connection_string_file")
        by_string = bool(options.get("connection_string_env") or options.get("connection_string_file"))
        by_identity = any(k in options for k in ("fully_qualified_namespace", "credential", "client_id"))
        if by_string and by_identity:
            problems.append("set either connection_string_env/connection_string_file, or "
                            "fully_qualified_namespace + eventhub + credential, not both")
        elif not by_string and not by_identity:
            problems.append("set connection_string_env or connection_string_file, or "
                            "fully_qualified_namespace + eventhub + credential = \"managed_identity\"")
        elif by_identity:
            problems += check_credential_options(options, prefix="option ")
            if "fully_qualified_namespace" not in options:
                problems.append("option 'fully_qualified_namespace' is required with credential")
            else:
                problems += _check_fqns(options["fully_qualified_namespace"])
            if "credential" not in options:
                problems.append("option 'credential' is required with fully_qualified_namespace "
                                "(credential = \"managed_identity\")")
            if "eventhub" not in options:
                problems.append("option 'eventhub' is required with fully_qualified_namespace")
        eventhub = options.get("eventhub")
        if eventhub is not None and (not isinstance(eventhub, str) or not eventhub.strip()):
            problems.append(f"option 'eventhub' must be a non-empty string, got {eventhub!r}")
            eventhub = None
        if by_string and not by_identity:
            try:
                conn_str = read_secret_text(options, "connection_string")
            except ValueError as exc:
                problems.append(str(exc))
            else:
                if conn_str is not None:
                    problems += _connection_string_problems(conn_str, eventhub)
        mode = options.get("mode", "structured")
        if mode not in MODES:
            problems.append(f"option 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        problems += check_int_range(options, "max_batch", 1, MAX_BATCH)
        problems += check_positive_duration(options, "timeout")
        return problems

    # -- building events -----------------------------------------------------------------------
    def _event(self, record: Record, event: Mapping[str, Any]) -> EventData:
        if self.mode == "structured":
            data = EventData(record.body)
            data.content_type = STRUCTURED_CONTENT_TYPE
        else:
            data = EventData(orjson.dumps(event.get("data")))
            data.content_type = str(event.get("datacontenttype") or "application/json")
            data.properties = {
                f"cloudEvents_{name}": value if isinstance(value, (str, int, float, bool)) else orjson.dumps(value).decode()
                for name, value in event.items()
                if name not in _BODY_ATTRIBUTES and value is not None
            }
        data.message_id = record.id  # lets a consumer drop the duplicates of at-least-once delivery
        return data

    def _producer_client(self) -> EventHubProducerClient:
        kwargs: dict[str, Any] = {**SDK_RETRY, "auth_timeout": self.timeout, **self._client_options}
        if self._conn_str is not None:
            if self._eventhub:
                kwargs["eventhub_name"] = self._eventhub
            return EventHubProducerClient.from_connection_string(self._conn_str, **kwargs)
        if self._credential is None:
            self._credential = managed_identity_credential(self._options)
        return EventHubProducerClient(str(self._fqns), str(self._eventhub), self._credential, **kwargs)

    # -- sending --------------------------------------------------------------------------------
    def send(self, batch: Sequence[Record]) -> Result:
        """Send the batch; maps every outcome to Ok / Retry / Reject and never raises."""
        if not batch:
            return Ok()
        with self._lock:
            try:
                return self._send(batch)
            except Exception as exc:  # never raise into the dispatcher: the records stay in the journal
                return self._unexpected(exc)

    def _send(self, batch: Sequence[Record]) -> Result:
        if self._stuck is not None:
            if not self._stuck.done.is_set():
                return Retry(reason="peer_not_answering")
            self._stuck = None
        if self._producer is None:
            self._producer = self._producer_client()
        attempt = _Attempt(self._producer, lambda a: self._attempt(a, batch))
        attempt.thread.start()
        while not attempt.done.wait(0.25):
            if time.monotonic() - attempt.progress > self.stall_limit:
                log.warning("sink %r: Event Hubs (%s) made no progress for %.0fs; dropping the connection "
                            "(records kept, will retry)", self.name, self._where, self.stall_limit)
                attempt.abandoned = True
                self._stuck = attempt
                self._producer = None
                if attempt.done.is_set():  # finished just now: nobody else will close it
                    _close_quietly(attempt.producer)
                return Retry(reason="timeout")
        result = attempt.result
        if result is None:  # the worker died of a BaseException; treat like any unexpected error
            result = Retry(reason="internal_error")
        if isinstance(result, Retry):
            self._producer = None  # closed by the attempt; the next send builds a new one
        return result

    def _attempt(self, attempt: _Attempt, batch: Sequence[Record]) -> Result:
        """Runs on the attempt's thread: build every batch first (so a too-large record sends nothing), then send."""
        producer = attempt.producer
        try:
            groups: dict[str, list[tuple[Record, dict[str, Any]]]] = {}
            for record in batch:
                event = record.to_dict()
                groups.setdefault(partition_key(event), []).append((record, event))
            ready = []
            for key, items in groups.items():
                current = producer.create_batch(partition_key=key)
                attempt.progress = time.monotonic()
                for record, event in items:
                    data = self._event(record, event)
                    try:
                        current.add(data)
                        continue
                    except ValueError:
                        if len(current) == 0:
                            return self._too_large(record, current.max_size_in_bytes)
                    ready.append(current)
                    current = producer.create_batch(partition_key=key)
                    try:
                        current.add(data)
                    except ValueError:
                        return self._too_large(record, current.max_size_in_bytes)
                ready.append(current)
            # No stop check here: the agent drains its sinks after stop is set.
            for event_batch in ready:
                started = time.monotonic()
                producer.send_batch(event_batch, timeout=self.timeout)
                attempt.progress = time.monotonic()
                log.debug("sink %r: sent %d event(s), %d bytes, in %.1f ms", self.name, len(event_batch),
                          event_batch.size_in_bytes, (attempt.progress - started) * 1000)
            return Ok()
        except Exception as exc:
            return self._map_error(exc)

    def _too_large(self, record: Record, limit: int) -> Reject:
        detail = (f"record {record.id} ({record.type}, {len(record.body)} bytes) does not fit in one "
                  f"event: the hub accepts at most {limit} bytes per batch")
        log.error("sink %r: %s", self.name, detail)
        return Reject(reason="event_too_large", detail=detail)

    def _map_error(self, exc: Exception) -> Result:
        condition = str(getattr(exc, "error", None) or "")
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, (AuthenticationError, ClientAuthenticationError)) or any(a in condition for a in _AUTH):
            log.error("sink %r: Event Hubs refused the credentials for %s: %s. Records are kept and retried. "
                      "With a managed identity it needs the 'Azure Event Hubs Data Sender' role on the hub or "
                      "namespace (a new role assignment can take several minutes to apply); with a connection "
                      "string check the key and EntityPath.", self.name, self._where, text)
            return Retry(reason="auth_failed")
        if any(t in condition for t in _THROTTLED):
            log.warning("sink %r: Event Hubs is busy (%s); records kept, will retry", self.name, condition)
            return Retry(reason="throttled")
        if any(t in condition for t in _TOO_LARGE):
            log.error("sink %r: Event Hubs refused the batch as too large: %s", self.name, text)
            return Reject(reason="event_too_large", detail=text)
        if isinstance(exc, EventDataSendError) and any(t in condition for t in _REFUSED):
            log.error("sink %r: Event Hubs refused the events (%s): %s", self.name, condition, text)
            return Reject(reason="rejected_by_service", detail=text)
        if isinstance(exc, EventDataError):
            log.error("sink %r: Event Hubs refused the events: %s", self.name, text)
            return Reject(reason="event_invalid", detail=text)
        if isinstance(exc, OperationTimeoutError):
            log.warning("sink %r: Event Hubs (%s) did not confirm the send within %gs; will retry",
                        self.name, self._where, self.timeout)
            return Retry(reason="timeout")
        if isinstance(exc, (ConnectionLostError, ConnectError, ClientClosedError)):
            hint = " (check the hub name)" if "not-found" in condition else ""
            log.warning("sink %r: cannot reach Event Hubs (%s)%s: %s", self.name, self._where, hint, text)
            return Retry(reason="connection_error")
        if isinstance(exc, (EventHubError, OSError)):
            log.warning("sink %r: sending to Event Hubs (%s) failed: %s", self.name, self._where, text)
            return Retry(reason="send_failed")
        return self._unexpected(exc)

    def _unexpected(self, exc: BaseException) -> Retry:
        kind = type(exc).__name__
        if kind not in self._logged:  # once per kind: a retry loop must not flood the log with tracebacks
            self._logged.add(kind)
            log.error("sink %r: unexpected error sending to Event Hubs: %s: %s (records kept, will retry)",
                      self.name, kind, exc, exc_info=exc)
        return Retry(reason="internal_error")

    def close(self) -> None:
        """Close the producer, waiting at most one timeout for a peer that does not answer."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            closer = threading.Thread(target=_close_quietly, args=(producer,), name="eventhubs-close", daemon=True)
            closer.start()
            closer.join(self.timeout)
        if self._credential is not None:
            self._credential.close()
