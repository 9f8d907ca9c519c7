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

Transport: AMQP over TLS (port 5671) or, with ``transport = "websocket"``, AMQP over secure
WebSocket (port 443, ``/$servicebus/websocket``), optionally through an HTTP proxy (``http_proxy``).
``ca_file`` verifies the service (or a TLS-inspecting proxy) against another CA bundle;
``custom_endpoint_address`` reaches the namespace through a gateway or relay.

One producer stays open across sends and is rebuilt after a failure. The SDK retries little (the
dispatcher owns retrying). Sends run on one long-lived sender thread that the sink watches: the
SDK's TLS and SASL handshakes have no timeout, so a peer that accepts TCP and never answers would
otherwise block the sink for good; a sender that stops making progress is abandoned with its
producer.
"""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import urlparse

import orjson
from azure.core.exceptions import ClientAuthenticationError
from azure.eventhub import EventData, EventHubProducerClient, TransportType, parse_connection_string
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
from forwarder.common.connection_strings import eventhubs_problems
from forwarder.common.values import parse_duration
from sinks import check_int_range, check_positive_duration, check_readable_file, unknown_options
from sinks.azure_common import (
    check_credential_options,
    managed_identity_credential,
    read_secret_text,
)

log = logging.getLogger(__name__)

MODES = ("structured", "binary")
TRANSPORTS = {"amqp": TransportType.Amqp, "websocket": TransportType.AmqpOverWebsocket}
PROXY_KEYS = ("host", "port", "credentials_env", "credentials_file")

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
    # What the SDK's parser lets through but its client later fails on (CR/LF, a non-sb Endpoint...).
    problems = eventhubs_problems(conn_str)
    if problems:
        return problems
    entity = props.eventhub_name
    if not entity and not eventhub:
        return ["the connection string has no EntityPath: add EntityPath=<hub> to it or set option 'eventhub'"]
    if entity and eventhub and entity != eventhub:
        return [f"option 'eventhub' ({eventhub!r}) differs from the connection string's EntityPath ({entity!r})"]
    return []


def _check_endpoint(value: Any) -> list[str]:
    if not isinstance(value, str) or not value.strip():
        return [f"option 'custom_endpoint_address' must be an address like sb://gateway.example.com:5671, got {value!r}"]
    parsed = urlparse(value if "//" in value else "sb://" + value)
    try:
        parsed.port  # noqa: B018  # raises on a port that is not a number
    except ValueError:
        return [f"option 'custom_endpoint_address' has an invalid port: {value!r}"]
    if not parsed.hostname or parsed.path.strip("/"):
        return [f"option 'custom_endpoint_address' must be host[:port] (optionally sb://host[:port]), got {value!r}"]
    return []


def _check_proxy(value: Any, transport: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return ["option 'http_proxy' must be a table: http_proxy = { host = \"proxy.example.com\", port = 3128 }"]
    problems = [f"option 'http_proxy.{k}' is unknown (known: {', '.join(PROXY_KEYS)})" for k in value if k not in PROXY_KEYS]
    if "password" in value or "username" in value:
        problems.append("proxy credentials are not allowed inline: put user:password in a file "
                        "(http_proxy.credentials_file) or an environment variable (http_proxy.credentials_env)")
    host = value.get("host")
    if not isinstance(host, str) or not host.strip() or "/" in host:
        problems.append(f"option 'http_proxy.host' must be a host name or address, got {host!r}")
    port = value.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        problems.append(f"option 'http_proxy.port' must be a port number, got {port!r}")
    if transport == "amqp":
        problems.append("option 'http_proxy' needs transport = \"websocket\" (an HTTP proxy carries only WebSockets)")
    try:
        creds = read_secret_text(value, "credentials")
    except ValueError as exc:
        problems.append(f"option 'http_proxy': {exc}")
    else:
        if creds is not None and ":" not in creds:
            problems.append("the http_proxy credentials must read user:password")
    return problems


def proxy_settings(value: Mapping[str, Any]) -> dict[str, Any]:
    """The SDK's ``http_proxy`` dict (proxy_hostname, proxy_port, username, password)."""
    settings: dict[str, Any] = {"proxy_hostname": value["host"].strip(), "proxy_port": int(value["port"])}
    creds = read_secret_text(value, "credentials")
    if creds is not None:
        settings["username"], _, settings["password"] = creds.partition(":")
    return settings


class _Job:
    """One send handed to the sender thread; ``progress`` is the last time it moved forward."""

    def __init__(self, work: Callable[[_Job], Result]) -> None:
        self.work = work
        self.result: Result | None = None
        self.progress = time.monotonic()
        self.done = threading.Event()


class _Sender:
    """One long-lived thread that owns a producer and runs its sends, so none needs a thread of its own.

    The sink watches each job; if one stops making progress the sender is abandoned: it closes its
    producer when (if ever) the SDK call returns, and exits. Idle, it blocks on its queue (no ticking).
    """

    def __init__(self, factory: Callable[[], EventHubProducerClient]) -> None:
        self._factory = factory
        self.producer: EventHubProducerClient | None = None
        self.abandoned = False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="eventhubs-sender", daemon=True)
        self.thread.start()

    def submit(self, work: Callable[[_Job], Result]) -> _Job:
        job = _Job(work)
        self._jobs.put(job)
        return job

    def client(self) -> EventHubProducerClient:
        """The open producer (built on first use; called on the sender thread only)."""
        if self.producer is None:
            self.producer = self._factory()
        return self.producer

    def drop_producer(self) -> None:
        """Close the producer after a failure (it may hold a broken link); the next job builds a new one."""
        producer, self.producer = self.producer, None
        if producer is not None:
            _close_quietly(producer)

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self.abandoned:
                self.drop_producer()
                return
            try:
                job.result = job.work(job)
            except BaseException as exc:  # noqa: BLE001  # a result must always come back
                log.debug("eventhubs sender job failed: %r", exc)
            finally:
                job.done.set()
            if self.abandoned:
                self.drop_producer()
                return


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
        "transport": "\"amqp\" (AMQP over TLS, port 5671, default) or \"websocket\" (AMQP over WebSocket, port 443)",
        "http_proxy": "{ host, port, credentials_env | credentials_file (user:password) }: HTTP proxy for websocket",
        "ca_file": "CA bundle (PEM) to verify the service's certificate (default: certifi's bundle, as the SDK)",
        "custom_endpoint_address": "host[:port] to connect to instead of the namespace (a gateway or relay)",
    }

    def __init__(self, options: Mapping[str, Any], context: SinkContext) -> None:
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
        self._credential: Any = None  # one managed identity credential for every producer: it caches tokens
        self._transport_options = self._sdk_transport_options(options)
        self._sender: _Sender | None = None
        self._stuck: _Sender | None = None
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
        transport = options.get("transport")
        if transport is not None and transport not in TRANSPORTS:
            problems.append(f"option 'transport' must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if "http_proxy" in options:
            problems += _check_proxy(options["http_proxy"], transport)
        problems += check_readable_file(options, "ca_file")
        if "custom_endpoint_address" in options:
            problems += _check_endpoint(options["custom_endpoint_address"])
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

    @staticmethod
    def _sdk_transport_options(options: Mapping[str, Any]) -> dict[str, Any]:
        """transport_type, http_proxy, connection_verify, custom_endpoint_address for the SDK."""
        kwargs: dict[str, Any] = {}
        proxy = options.get("http_proxy")
        transport = options.get("transport", "websocket" if proxy else "amqp")
        kwargs["transport_type"] = TRANSPORTS[transport]
        if proxy:
            kwargs["http_proxy"] = proxy_settings(proxy)
        if options.get("ca_file"):
            kwargs["connection_verify"] = str(options["ca_file"])
        if options.get("custom_endpoint_address"):
            kwargs["custom_endpoint_address"] = str(options["custom_endpoint_address"]).strip()
        return kwargs

    def _producer_client(self) -> EventHubProducerClient:
        kwargs: dict[str, Any] = {**SDK_RETRY, "auth_timeout": self.timeout, **self._transport_options}
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
            if self._stuck.thread.is_alive():
                return Retry(reason="peer_not_answering")
            self._stuck = None
        if self._sender is None:
            self._sender = _Sender(self._producer_client)
        sender = self._sender
        job = sender.submit(lambda j: self._attempt(sender, j, batch))
        # Wake only when the job ends or could have stalled: no polling while the SDK works.
        while not job.done.wait(max(0.05, job.progress + self.stall_limit - time.monotonic())):
            if time.monotonic() - job.progress > self.stall_limit:
                log.warning("sink %r: Event Hubs (%s) made no progress for %.0fs; dropping the connection "
                            "(records kept, will retry)", self.name, self._where, self.stall_limit)
                sender.abandoned = True
                sender.stop()
                self._stuck, self._sender = sender, None
                return Retry(reason="timeout")
        return job.result if job.result is not None else Retry(reason="internal_error")

    def _attempt(self, sender: _Sender, job: _Job, batch: Sequence[Record]) -> Result:
        """On the sender thread: build every batch first (so a too-large record sends nothing), then send."""
        try:
            producer = sender.client()
            ready = self._batches(producer, job, batch)
            if not isinstance(ready, list):
                return ready
            # No stop check here: the agent drains its sinks after stop is set.
            for event_batch in ready:
                if sender.abandoned:  # the sink gave up on this call and reported Retry: send nothing more
                    return Retry(reason="timeout")
                started = time.monotonic()
                producer.send_batch(event_batch, timeout=self.timeout)
                job.progress = time.monotonic()
                log.debug("sink %r: sent %d event(s), %d bytes, in %.1f ms", self.name, len(event_batch),
                          event_batch.size_in_bytes, (job.progress - started) * 1000)
            return Ok()
        except Exception as exc:
            result = self._map_error(exc)
            if isinstance(result, Retry):
                sender.drop_producer()
            return result

    def _batches(self, producer: EventHubProducerClient, job: _Job, batch: Sequence[Record]) -> list[Any] | Reject:
        groups: dict[str, list[tuple[Record, dict[str, Any]]]] = {}
        for record in batch:
            event = record.to_dict()
            groups.setdefault(partition_key(event), []).append((record, event))
        ready: list[Any] = []
        for key, items in groups.items():
            current = producer.create_batch(partition_key=key)
            job.progress = time.monotonic()
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
        return ready

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
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            log.error("sink %r: the TLS certificate of Event Hubs (%s) could not be verified: %s. Records are kept "
                      "and retried. Behind a TLS-inspecting proxy set ca_file to the proxy's CA bundle.",
                      self.name, self._where, text)
            return Retry(reason="certificate_error")
        if "via proxy status: 407" in text:
            log.error("sink %r: the HTTP proxy refused the credentials (407); records are kept and retried. "
                      "Check http_proxy.credentials_env / credentials_file (user:password).", self.name)
            return Retry(reason="proxy_auth_failed")
        if "via proxy" in text:
            log.warning("sink %r: the HTTP proxy refused the tunnel to Event Hubs (%s): %s", self.name, self._where, text)
            return Retry(reason="proxy_error")
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
        """Close the producer on its sender thread, waiting at most one timeout for a peer that does not answer."""
        with self._lock:
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.stop()
            sender.thread.join(self.timeout)
        if self._credential is not None:
            self._credential.close()
