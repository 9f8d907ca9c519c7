"""The agent's own metrics (OpenTelemetry), on a Prometheus ``/metrics`` endpoint and/or to Azure Monitor.

Off by default. Without ``[telemetry]`` the service gets ``NO_TELEMETRY``, whose hooks hand their
argument back untouched: no wrapper, no OpenTelemetry import, no cost. When configured, the
service wraps three things with :class:`Telemetry`'s ``instrument_*`` methods, so the core needs
no hooks of its own:

* the IMDS client — polls, poll latency, errors by status, and how long IMDS has been failing
  (``/healthz`` turns 503 past ``unhealthy_after``);
* every sink — send outcomes and detection-to-delivery latency (now minus the record's ``time``);
* the poller's outbox — records journaled by type, approvals by outcome, and whether the
  journal can still be appended to.

Backlog, oldest-undelivered age, deliveries, retries, dead letters, store losses and whether a
sink is stuck are read from ``Dispatcher.snapshot()`` when metrics are collected (observable instruments).
The MeterProvider is the agent's own, never the global one.
"""
from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import orjson

from forwarder import __version__
from forwarder.errors import ConfigError, ImdsError, ImdsTimeout, StartError
from forwarder.common.http_server import ConnectionLimits, HttpServer, QuietHandler
from forwarder.common.listen import host_port_text
from forwarder.sinkapi import Ok, Record, Reject, Result, Sink

if TYPE_CHECKING:
    from forwarder.agent.config import TelemetryConfig
    from forwarder.agent.maintenance import MaintenanceTracker
    from forwarder.agent.poller import Poller
    from forwarder.imds.client import Fetch, ImdsClient
    from forwarder.store.database import SavedState
    from forwarder.store.outbox import Outbox

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install 'scheduled-events-forwarder[telemetry]'"
SERVICE_NAME = "scheduled-events-forwarder"
METER_NAME = "sefwd"
# Seconds. Polls are local HTTP calls; delivery spans retries and outages.
POLL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DELIVERY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
_QUIET_LOGGERS = ("azure.core.pipeline.policies.http_logging_policy", "azure.monitor.opentelemetry.exporter")
_SNAPSHOT_TTL = 0.5  # one collection reads many instruments: share one Dispatcher snapshot


class AgentTelemetry(Protocol):
    """What the service asks of its telemetry: wrap the core's objects, bind the figures, start, stop.

    Two implementations: :class:`NullTelemetry` (not configured, every hook a no-op) and
    :class:`Telemetry` (OpenTelemetry metrics).
    """

    @property
    def enabled(self) -> bool: ...

    def instrument_imds(self, imds: ImdsClient) -> ImdsClient: ...

    def instrument_sinks(self, sinks: dict[str, Sink]) -> dict[str, Sink]: ...

    def instrument_outbox(self, outbox: Outbox) -> Outbox: ...

    def bind(self, *, snapshot: Callable[[], Mapping[str, Any]] | None = None, poller: Poller | None = None,
             maintenance: MaintenanceTracker | None = None) -> None: ...

    def action_finished(self, kind: str, outcome: str) -> None: ...

    def observe_poll(self, seconds: float, status: int | str) -> None: ...

    def observe_send(self, sink: str, result: Result, count: int, latencies: Sequence[float] = ()) -> None: ...

    def observe_append(self, records: Sequence[Record], error: BaseException | None = None) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class NullTelemetry:
    """Telemetry that is not configured: every hook is a no-op and returns its argument."""

    enabled = False

    def instrument_imds(self, imds: ImdsClient) -> ImdsClient:
        return imds

    def instrument_sinks(self, sinks: dict[str, Sink]) -> dict[str, Sink]:
        return sinks

    def instrument_outbox(self, outbox: Outbox) -> Outbox:
        return outbox

    def bind(self, *, snapshot: Callable[[], Mapping[str, Any]] | None = None, poller: Poller | None = None,
             maintenance: MaintenanceTracker | None = None) -> None:
        pass

    def action_finished(self, kind: str, outcome: str) -> None:
        pass

    def observe_poll(self, seconds: float, status: int | str) -> None:
        pass

    def observe_send(self, sink: str, result: Result, count: int, latencies: Sequence[float] = ()) -> None:
        pass

    def observe_append(self, records: Sequence[Record], error: BaseException | None = None) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


NO_TELEMETRY = NullTelemetry()


def create_telemetry(config: TelemetryConfig, state_dir: Path) -> AgentTelemetry:
    """The agent's telemetry: NO_TELEMETRY unless configured; raises ConfigError if its extra is missing."""
    if not config.enabled:
        return NO_TELEMETRY
    try:
        return Telemetry(config, state_dir)
    except ImportError as exc:
        raise ConfigError([f"telemetry cannot be loaded ({exc}); install it with: {EXTRA_HINT}"]) from None


# -- health ------------------------------------------------------------------------------------


class Health:
    """What /healthz says: IMDS failing for longer than ``unhealthy_after``, or records that cannot be journaled."""

    def __init__(self, unhealthy_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.unhealthy_after = unhealthy_after
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._last_ok: float | None = None
        self._failing_since: float | None = None
        self._last_error: str | None = None
        self._consecutive = 0
        self._journal_error: str | None = None
        self._poller: Poller | None = None
        self._outbox_errors_seen = 0
        self.stuck_sinks: Callable[[], list[str]] = list  # degraded sinks: failing for long, dead-lettering, dead worker
        self.sink_details: Callable[[], dict[str, str]] = dict  # per degraded sink: its state and latest error

    def poll(self, ok: bool, error: str | None = None) -> None:
        now = self._clock()
        with self._lock:
            if ok:
                self._last_ok, self._failing_since, self._consecutive = now, None, 0
            else:
                self._consecutive += 1
                self._last_error = error
                if self._failing_since is None:
                    self._failing_since = now

    def append(self, error: BaseException | None) -> None:
        with self._lock:
            if error is None:
                self._journal_error = None
                if self._poller is not None:
                    self._outbox_errors_seen = self._poller.stats.outbox_errors
            else:
                self._journal_error = f"{type(error).__name__}: {error}"

    def bind_poller(self, poller: Poller) -> None:
        with self._lock:
            self._poller = poller
            self._outbox_errors_seen = poller.stats.outbox_errors

    def report(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, JSON body)."""
        now = self._clock()
        with self._lock:
            failing_for = now - self._failing_since if self._failing_since is not None else 0.0
            problems = []
            if self._failing_since is not None and failing_for > self.unhealthy_after:
                problems.append(f"IMDS has failed for {failing_for:.0f}s ({self._consecutive} poll(s) in a row; "
                                f"last error: {self._last_error})")
            journal_error = self._journal_error
            poller = self._poller
            # State saves go through the poller, not the outbox: a failing save shows in its counter.
            if journal_error is None and poller is not None and poller.stats.outbox_errors > self._outbox_errors_seen:
                journal_error = "the poller cannot commit records (see the agent's log)"
            if journal_error is not None:
                problems.append(f"records cannot be journaled: {journal_error}")
        stuck = self.stuck_sinks()
        if stuck:
            details = self.sink_details()
            problems.append("sink(s) degraded: " + "; ".join(
                f"{name} ({details[name]})" if details.get(name) else name for name in stuck))
        with self._lock:
            body = {
                "status": "unhealthy" if problems else "ok",
                "problems": problems,
                "version": __version__,
                "uptime_s": round(now - self._started, 1),
                "imds": {
                    "consecutive_failures": self._consecutive,
                    "failing_for_s": round(failing_for, 1),
                    "last_ok_age_s": round(now - self._last_ok, 1) if self._last_ok is not None else None,
                    "unhealthy_after_s": self.unhealthy_after,
                },
                "journal": {"ok": journal_error is None},
                "stuck_sinks": stuck,
            }
        return not problems, body


# -- wrappers the service puts around the core's objects ---------------------------------------

def _error_label(exc: ImdsError) -> str:
    if exc.status is not None:
        return str(exc.status)
    return "timeout" if isinstance(exc, ImdsTimeout) else "connection_error"


class _TimedImds:
    """The IMDS client, with every Scheduled Events poll observed; everything else passes through."""

    def __init__(self, imds: ImdsClient, telemetry: Telemetry) -> None:
        self._imds = imds
        self._telemetry = telemetry

    def scheduled_events(self) -> Fetch:
        started = time.monotonic()
        try:
            fetch = self._imds.scheduled_events()
        except ImdsError as exc:
            self._telemetry.observe_poll(time.monotonic() - started, _error_label(exc))
            raise
        self._telemetry.observe_poll(time.monotonic() - started, fetch.status)
        return fetch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._imds, name)


def _record_time(record: Record) -> float | None:
    try:
        text = orjson.loads(record.body).get("time")
        return datetime.fromisoformat(text).timestamp() if isinstance(text, str) else None
    except (ValueError, AttributeError):
        return None


class _ObservedSink:
    """A sink whose send outcomes and detection-to-delivery latencies are observed."""

    def __init__(self, name: str, sink: Sink, telemetry: Telemetry) -> None:
        self.name = name
        self.sink = sink
        self.max_batch = sink.max_batch
        self._telemetry = telemetry

    def send(self, batch: Sequence[Record]) -> Result:
        result = self.sink.send(batch)
        latencies: list[float] = []
        if isinstance(result, Ok):
            now = time.time()
            latencies = [now - t for t in map(_record_time, batch) if t is not None]
        self._telemetry.observe_send(self.name, result, len(batch), latencies)
        return result

    def close(self) -> None:
        self.sink.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)


class _ObservedOutbox:
    """The poller's outbox, with journaled records and append failures observed."""

    def __init__(self, outbox: Outbox, telemetry: Telemetry) -> None:
        self._outbox = outbox
        self._telemetry = telemetry

    def commit(self, records: Sequence[Record], state: SavedState | None = None, *, inbox_ids: Sequence[int] = (),
               then: Callable[[sqlite3.Connection], Sequence[Record]] | None = None) -> None:
        try:
            self._outbox.commit(records, state, inbox_ids=inbox_ids, then=then)
        except BaseException as exc:
            self._telemetry.observe_append(records, exc)
            raise
        self._telemetry.observe_append(records)

    def inbox(self) -> list[tuple[int, object]]:
        return self._outbox.inbox()


# -- the endpoint ----------------------------------------------------------------------------------

class _Handler(QuietHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    logger = log
    log_label = "telemetry"

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        path = self.path.split("?", 1)[0]
        telemetry = self.server.telemetry
        try:
            if path == "/metrics":
                body, content_type = telemetry.render_metrics()
                self._send(200, body, content_type)
            elif path in ("/healthz", "/health"):
                healthy, report = telemetry.health.report()
                self._send(200 if healthy else 503, orjson.dumps(report) + b"\n", "application/json")
            else:
                self._send(404, b"not found: try /metrics or /healthz\n", "text/plain; charset=utf-8")
        except Exception:  # a scrape must never take the agent down
            log.exception("telemetry: answering %s failed", path)
            self._send(500, b"internal error\n", "text/plain; charset=utf-8")

    do_HEAD = do_GET


# A scraper needs one connection at a time: a local user holding idle half-sent requests gets a few
# threads for a few seconds, and a scrape from elsewhere is still answered (docs/config-and-secrets.md).
TELEMETRY_LIMITS = ConnectionLimits(max_connections=16, max_per_client=4, request_timeout=10.0)


class _Server(HttpServer):
    telemetry: Telemetry


def _read_connection_string(config: TelemetryConfig) -> str:
    if config.connection_string_env:
        value = os.environ.get(config.connection_string_env, "").strip()
        if not value:
            raise ConfigError([f"telemetry: environment variable {config.connection_string_env} "
                               "(connection_string_env) is not set"])
        return value
    assert config.connection_string_file is not None
    try:
        return Path(config.connection_string_file).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError([f"telemetry: cannot read connection_string_file "
                           f"{config.connection_string_file}: {exc.strerror}"]) from None


# -- the real thing --------------------------------------------------------------------------------

class Telemetry:
    """OpenTelemetry metrics for one agent: instruments, readers, and the /metrics + /healthz endpoint."""

    enabled = True

    def __init__(self, config: TelemetryConfig, state_dir: Path) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource

        self.config = config
        self.health = Health(config.unhealthy_after)
        self._snapshot_fn: Callable[[], Mapping[str, Any]] | None = None
        self._snap_lock = threading.Lock()
        self._snap: tuple[float, Mapping[str, Any]] | None = None
        self._server: _Server | None = None
        self._maintenance: MaintenanceTracker | None = None
        readers: list[Any] = []
        self._registry: Any = None
        if config.listen is not None:
            readers.append(self._prometheus_reader())
        if config.azure_monitor:
            readers.append(self._azure_monitor_reader(state_dir))
        self.provider = MeterProvider(
            metric_readers=readers,
            resource=Resource.create({"service.name": SERVICE_NAME, "service.version": __version__,
                                      "service.instance.id": socket.gethostname()}),
            shutdown_on_exit=False,
        )
        self._instruments()

    # -- readers --
    def _prometheus_reader(self) -> Any:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, ProcessCollector

        # Our own registry: nothing global, and the process's RSS/CPU/fds beside our metrics.
        self._registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self._registry)
        try:
            return PrometheusMetricReader(registry=self._registry, scope_info_enabled=False)
        except TypeError:  # older exporter: only the global registry
            from prometheus_client import REGISTRY

            self._registry = REGISTRY
            return PrometheusMetricReader()

    def _azure_monitor_reader(self, state_dir: Path) -> Any:
        from azure.monitor.opentelemetry.exporter import AzureMonitorMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        for name in _QUIET_LOGGERS:  # every request's headers and every success, at INFO
            logger = logging.getLogger(name)
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.WARNING)
        kwargs: dict[str, Any] = {}
        if self.config.credential == "managed_identity":
            # Entra ID instead of the instrumentation key alone (resources with local auth off); on a
            # VM the token comes from IMDS, in tests AZURE_POD_IDENTITY_AUTHORITY_HOST names the emulator.
            from azure.identity import ManagedIdentityCredential

            client_id = self.config.client_id
            kwargs["credential"] = ManagedIdentityCredential(client_id=client_id) if client_id else ManagedIdentityCredential()
        exporter = AzureMonitorMetricExporter(
            connection_string=_read_connection_string(self.config),
            # Metrics of an outage are not worth a disk queue; the directory keeps the SDK out of /tmp.
            disable_offline_storage=True,
            storage_directory=str(state_dir / "telemetry" / "offline"),
            retry_total=0,
            timeout=10.0,
            **kwargs,
        )
        interval_ms = self.config.export_interval * 1000
        return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms,
                                             export_timeout_millis=min(interval_ms, 30_000))

    # -- instruments --
    def _instruments(self) -> None:
        from opentelemetry.metrics import CallbackOptions, Observation

        meter = self.provider.get_meter(METER_NAME, __version__)
        self._polls = meter.create_counter("sefwd.imds.polls", "1", "Scheduled Events polls")
        self._poll_duration = meter.create_histogram(
            "sefwd.imds.poll.duration", "s", "Latency of one Scheduled Events poll",
            explicit_bucket_boundaries_advisory=POLL_BUCKETS)
        self._imds_errors = meter.create_counter(
            "sefwd.imds.errors", "1", "Failed polls by HTTP status (or timeout / connection_error)")
        self._records = meter.create_counter("sefwd.records", "1", "Records journaled, by type")
        self._approvals = meter.create_counter("sefwd.approvals", "1", "Approval attempts by outcome")
        self._sends = meter.create_counter("sefwd.sink.sends", "1", "Sink send calls by result")
        self._delivery_latency = meter.create_histogram(
            "sefwd.sink.delivery.latency", "s", "From detection (record time) to delivery, per sink",
            explicit_bucket_boundaries_advisory=DELIVERY_BUCKETS)

        def per_sink(field: str, idle: float | None = None) -> Callable[[CallbackOptions], list[Observation]]:
            def observe(options: CallbackOptions) -> list[Observation]:
                out = []
                for name, figures in (self._snapshot().get("sinks") or {}).items():
                    value = figures.get(field)
                    if value is None:
                        value = idle
                    if value is not None:
                        out.append(Observation(float(value), {"sink": name}))
                return out
            return observe

        def per_sink_reason(field: str) -> Callable[[CallbackOptions], list[Observation]]:
            def observe(options: CallbackOptions) -> list[Observation]:
                sinks = self._snapshot().get("sinks") or {}
                return [Observation(n, {"sink": name, "reason": reason})
                        for name, v in sinks.items() for reason, n in (v.get(field) or {}).items()]
            return observe

        def lost(options: CallbackOptions) -> list[Observation]:
            store = self._snapshot().get("store") or {}
            return [Observation(n, {"sink": name, "reason": reason})
                    for name, reasons in (store.get("lost") or {}).items() for reason, n in reasons.items()]

        def healthy(options: CallbackOptions) -> list[Observation]:
            return [Observation(1 if self.health.report()[0] else 0)]

        meter.create_observable_counter("sefwd.sink.delivered", [per_sink("delivered")], "1",
                                        "Records delivered per sink")
        meter.create_observable_counter("sefwd.sink.retries", [per_sink("retries")], "1",
                                        "Failed sends that will be retried, per sink")
        meter.create_observable_counter("sefwd.sink.dead_letters", [per_sink_reason("dead_by_reason")], "1",
                                        "Records moved to dead letters, per sink and reason")
        meter.create_observable_counter("sefwd.sink.filtered", [per_sink_reason("filtered_by_reason")], "1",
                                        "Records a sink's filter held back (cursor advanced, not sent), per sink and reason")
        meter.create_observable_counter("sefwd.sink.lost", [lost], "1",
                                        "Records lost from the store (size cap, damage; sink '*' = whole store), per reason")
        meter.create_observable_gauge("sefwd.sink.backlog", [per_sink("backlog")], "1",
                                      "Journaled records not yet delivered, per sink")
        meter.create_observable_gauge("sefwd.sink.oldest_undelivered_age", [per_sink("oldest_undelivered_age_s", 0.0)],
                                      "s", "Age of the oldest record being delivered, per sink (0 when idle)")
        meter.create_observable_gauge("sefwd.sink.stuck", [per_sink("stuck")], "1",
                                      "1 when a sink is degraded (same as sefwd.sink.degraded)")
        meter.create_observable_gauge("sefwd.sink.degraded", [per_sink("stuck")], "1",
                                      "1 when a sink has failed longer than [agent] degraded_after, sends records "
                                      "to dead letters, or its worker died")
        meter.create_observable_gauge("sefwd.healthy", [healthy], "1", "1 when /healthz says ok")

        def poller_stat(field: str) -> Callable[[CallbackOptions], list[Observation]]:
            def observe(options: CallbackOptions) -> list[Observation]:
                poller = self.health._poller
                return [Observation(getattr(poller.stats, field))] if poller is not None else []
            return observe

        meter.create_observable_counter("sefwd.poller.cycle_errors", [poller_stat("cycle_errors")], "1",
                                        "Unexpected exceptions inside a poll cycle (logged; polling went on)")
        meter.create_observable_counter("sefwd.poller.bad_documents", [poller_stat("bad_documents")], "1",
                                        "IMDS documents refused as bad (logged; the last good one stays the baseline)")
        from forwarder.agent.alert_metrics import register

        # Pending events, seconds to NotBefore, maintenance and actions: fixed label sets, for alerts.
        self._actions = register(meter, lambda: self._maintenance)
        from forwarder.agent.notice_metrics import NoticeWindow

        # Notice lead and approval lead per event type (docs/notice-window.md).
        self._notice = NoticeWindow(meter)
        from forwarder.protect.metrics import ProtectMetrics

        self._protect = ProtectMetrics(meter)  # drain slack, held, missed: from the protect.* records

    def _snapshot(self) -> Mapping[str, Any]:
        if self._snapshot_fn is None:
            return {}
        with self._snap_lock:
            now = time.monotonic()
            if self._snap is None or now - self._snap[0] > _SNAPSHOT_TTL:
                self._snap = (now, self._snapshot_fn())
            return self._snap[1]

    # -- hooks --
    def instrument_imds(self, imds: ImdsClient) -> ImdsClient:
        return cast("ImdsClient", _TimedImds(imds, self))

    def instrument_sinks(self, sinks: dict[str, Sink]) -> dict[str, Sink]:
        return {name: _ObservedSink(name, sink, self) for name, sink in sinks.items()}

    def instrument_outbox(self, outbox: Outbox) -> Outbox:
        return _ObservedOutbox(outbox, self)

    def bind(self, *, snapshot: Callable[[], Mapping[str, Any]] | None = None, poller: Poller | None = None,
             maintenance: MaintenanceTracker | None = None) -> None:
        """Where the observable gauges read from (``Dispatcher.snapshot``, the poller's counters, the maintenance state)."""
        if maintenance is not None:
            self._maintenance = maintenance
        if snapshot is not None:
            from forwarder.agent.sink_health import describe_sink_health

            self._snapshot_fn = snapshot
            self.health.stuck_sinks = lambda: sorted(
                name for name, v in (self._snapshot().get("sinks") or {}).items() if v.get("stuck"))
            self.health.sink_details = lambda: {
                name: describe_sink_health(v.get("health") or {})
                for name, v in (self._snapshot().get("sinks") or {}).items() if v.get("stuck")}
        if poller is not None:
            self.health.bind_poller(poller)

    def action_finished(self, kind: str, outcome: str) -> None:
        """Count one finished action (hook, approval, undo...) by kind and outcome (bounded label values)."""
        self._actions.finished(kind, outcome)

    def observe_poll(self, seconds: float, status: int | str) -> None:
        ok = status in (200, 304)
        self._polls.add(1)
        self._poll_duration.record(seconds)
        if not ok:
            self._imds_errors.add(1, {"status": str(status)})
        self.health.poll(ok, None if ok else str(status))

    def observe_send(self, sink: str, result: Result, count: int, latencies: Sequence[float] = ()) -> None:
        kind = "ok" if isinstance(result, Ok) else "reject" if isinstance(result, Reject) else "retry"
        self._sends.add(1, {"sink": sink, "result": kind})
        attributes = {"sink": sink}
        for seconds in latencies:
            self._delivery_latency.record(max(0.0, seconds), attributes)

    def observe_append(self, records: Sequence[Record], error: BaseException | None = None) -> None:
        self.health.append(error)
        if error is not None:
            return
        for record in records:
            self._records.add(1, {"type": record.type})
            if record.type.startswith("approval."):
                self._approvals.add(1, {"outcome": record.type.partition(".")[2]})
            elif record.type.startswith("protect."):
                self._protect.observe(record)
        self._notice.observe(records)

    # -- endpoint --
    def render_metrics(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    @property
    def url(self) -> str | None:
        return self._server.url() if self._server is not None else None

    def start(self) -> None:
        """Serve /metrics and /healthz if ``listen`` is set (the Azure Monitor reader runs on its own)."""
        if self.config.listen is None or self._server is not None:
            return
        from forwarder.agent.preflight import listen_problem

        host, port = self.config.listen
        try:
            server = _Server((host, port), _Handler, TELEMETRY_LIMITS)
        except OSError as exc:
            raise StartError([f"telemetry.listen {host_port_text(host, port)}: cannot listen: "
                              f"{listen_problem(exc, port)}"]) from None
        server.telemetry = self
        self._server = server
        server.start("telemetry-http", poll_interval=0.2)
        loopback = server.loopback
        log.log(logging.INFO if loopback else logging.WARNING, "telemetry: /metrics and /healthz on %s%s", self.url,
                "" if loopback else " (not loopback: reachable from the network)")

    def stop(self) -> None:
        """Stop the endpoint, then flush and shut the readers (a last Azure Monitor export)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        try:
            self.provider.shutdown(timeout_millis=5_000)
        except Exception as exc:  # shutting down must not mask the agent's own exit
            log.debug("telemetry: shutdown failed: %s", exc)
