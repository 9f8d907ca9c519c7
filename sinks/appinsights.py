"""The ``appinsights`` sink: every record becomes an Application Insights custom event (AppEvents).

The event's name is the record type (``scheduledevent.scheduled``, ``approval.approved``, ...);
its properties (customDimensions) are the record's CloudEvents attributes (id, source, subject,
time, sequence, eventkey) and its data fields, nested values as JSON strings. The event time is
the record's time, so AppEvents shows when the agent saw the change, not when it got through.

Built on azure-monitor-opentelemetry's exporter, used directly and synchronously: no global
``configure_azure_monitor`` (which would install process-wide providers and also ship the agent's
own logs), no background batching — ``send`` knows whether Azure took the records. The exporter's
own offline retry storage is turned off because the agent's journal already keeps undelivered
records on disk and retries them in order; its directory is still pinned inside the sink's state
directory, so nothing of the SDK ever lands in the temp directory.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import orjson

# Imported at module load on purpose: a missing extra then fails `config check` with the pip hint.
from azure.monitor.opentelemetry.exporter import AzureMonitorLogExporter
from opentelemetry._logs import LogRecord
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource

from forwarder.sinkapi import Ok, Record, Result, Retry, SinkContext
from forwarder.connection_strings import appinsights_problems
from forwarder.units import parse_duration
from sinks import check_int_range, check_positive_duration, check_readable_file, unknown_options
from sinks.azure_common import check_credential_options, managed_identity_credential, read_secret_text

log = logging.getLogger(__name__)

# The attribute that makes the exporter write a custom event (AppEvents) named by its value.
EVENT_NAME_ATTRIBUTE = "microsoft.custom_event.name"
DEFAULT_ROLE_NAME = "scheduled-events-forwarder"
DEFAULT_TIMEOUT = "10s"
DEFAULT_BATCH = 100
MAX_BATCH = 512
OFFLINE_DIR = "offline"
# CloudEvents attributes that say nothing a query needs (data is flattened instead).
_SKIPPED_ATTRIBUTES = frozenset({"specversion", "datacontenttype", "data", "type"})
# Chatty at INFO (every request's headers, every success); the agent logs outcomes itself.
_QUIET_LOGGERS = ("azure.core.pipeline.policies.http_logging_policy", "azure.monitor.opentelemetry.exporter")


def _property(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return orjson.dumps(value).decode()


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


def _timestamp_ns(event: Mapping[str, Any]) -> int:
    text = event.get("time")
    if isinstance(text, str):
        try:
            return int(datetime.fromisoformat(text).timestamp() * 1_000_000_000)
        except ValueError:
            pass
    return time.time_ns()



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
        connection_string = read_secret_text(options, "connection_string")
        assert connection_string is not None  # check() made sure
        self.max_batch = int(options.get("batch_size", DEFAULT_BATCH))
        timeout = parse_duration(options.get("timeout", DEFAULT_TIMEOUT))
        self.storage_dir = Path(context.state_dir) / OFFLINE_DIR
        for name in _QUIET_LOGGERS:
            logger = logging.getLogger(name)
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.WARNING)
        kwargs: dict[str, Any] = {
            "connection_string": connection_string,
            # The journal is the offline buffer; the directory only keeps the SDK out of /tmp.
            "disable_offline_storage": True,
            "storage_directory": str(self.storage_dir),
            # One attempt per send: the dispatcher owns retries, backoff and Retry-After.
            "retry_total": 0,
            "timeout": timeout,
            "read_timeout": timeout,
        }
        if options.get("ca_file"):
            kwargs["connection_verify"] = os.path.expanduser(str(options["ca_file"]))
        if options.get("credential") == "managed_identity":
            kwargs["credential"] = managed_identity_credential(options)
        self._exporter = AzureMonitorLogExporter(**kwargs)
        self._resource = Resource.create({
            "service.name": str(options.get("role_name") or DEFAULT_ROLE_NAME),
            "service.instance.id": socket.gethostname(),
        })
        self._lock = threading.Lock()

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options`` (reads the connection string, changes nothing)."""
        problems = unknown_options(options, cls.OPTIONS)
        problems += check_credential_options(options)
        try:
            text = read_secret_text(options, "connection_string")
        except ValueError as exc:
            problems.append(str(exc))
        else:
            if text is None:
                problems.append("set connection_string_env or connection_string_file (never the string inline)")
            else:
                problems += appinsights_problems(text)
        problems += check_int_range(options, "batch_size", 1, MAX_BATCH)
        problems += check_positive_duration(options, "timeout")
        role = options.get("role_name")
        if role is not None and (not isinstance(role, str) or not role.strip()):
            problems.append(f"option 'role_name' must be a non-empty string, got {role!r}")
        problems += check_readable_file(options, "ca_file")
        return problems

    def _log_record(self, record: Record) -> ReadableLogRecord:
        event = record.to_dict()
        attributes: dict[str, Any] = {EVENT_NAME_ATTRIBUTE: record.type, **event_properties(event)}
        return ReadableLogRecord(
            LogRecord(timestamp=_timestamp_ns(event), observed_timestamp=time.time_ns(),
                      body=record.type, attributes=attributes),
            resource=self._resource,  # no instrumentation scope: it would add a logger_name property
        )

    def send(self, batch: Sequence[Record]) -> Result:
        """Export the batch as custom events; SUCCESS is Ok, anything else is retried."""
        if not batch:
            return Ok()
        try:
            logs = [self._log_record(r) for r in batch]
            with self._lock:
                result = self._exporter.export(logs)
        except Exception as exc:  # never raise into the dispatcher: the records stay in the journal
            log.error("sink %r: unexpected error exporting to Application Insights: %s: %s",
                      self.name, type(exc).__name__, exc)
            return Retry(reason="internal_error")
        if result == LogRecordExportResult.SUCCESS:
            return Ok()
        # The exporter reports only success or failure (it logs the status itself). Everything is
        # retried: throttling, outages and auth failures come back, and a partial success (206)
        # is sent again whole, at least once as always.
        return Retry(reason="export_failed")

    def close(self) -> None:
        """Shut the exporter down."""
        with self._lock:
            try:
                self._exporter.shutdown()
            except Exception as exc:  # closing must not mask the agent's own shutdown
                log.debug("sink %r: exporter shutdown failed: %s", self.name, exc)
