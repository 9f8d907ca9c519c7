"""The IMDS emulator: an HTTP server (stdlib) over the emulated platform, plus its Python API."""
from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import orjson

from forwarder.emulator.engine import Clock, Platform

if TYPE_CHECKING:
    from forwarder.emulator.arm import ArmServer
    from forwarder.emulator.eventgrid import EventGridPublisher
from forwarder.emulator.faults import SHAPING_KINDS, Fault, FaultQueue
from forwarder.emulator.model import (
    INSTANCE_VERSIONS, MIN_COMPUTE_VERSION, MIN_NOTICE, MIN_TOKEN_VERSION, SE_VERSIONS, SpecError, VmProfile,
    looks_like_version,
)
from forwarder.emulator.scenario import Scenario, load_scenario
from forwarder.errors import ConfigError
from forwarder.common.http_server import ConnectionLimits, HttpServer, QuietHandler
from forwarder.common.listen import host_port_text

log = logging.getLogger(__name__)

# path after the VM prefix -> (endpoint name, allowed methods)
ROUTES: dict[str, tuple[str, tuple[str, ...]]] = {
    "/metadata/scheduledevents": ("scheduledevents", ("GET", "POST")),
    "/metadata/instance": ("instance", ("GET",)),
    "/metadata/instance/compute": ("instance", ("GET",)),
    "/metadata/identity/oauth2/token": ("token", ("GET",)),
    "/metadata/versions": ("versions", ("GET",)),
}
MAX_BODY = 64 * 1024
_HTML_PAGE = (b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n"
              b"<body><h1>Bad Gateway</h1><p>The proxy server received an invalid response.</p></body></html>\n")
_MALFORMED = b'{"DocumentIncarnation": 7, "Events": [{"EventId": "C7061BAC-AFDC-45'


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _wants_close(values: list[str]) -> bool:
    """Whether the Connection header fields (a comma-separated option list) carry "close"."""
    return any(token.strip().lower() == "close" for value in values for token in value.split(","))


# Sized for a fleet of agents on one host (benchmarks/fleet.py: 100 kept-alive connections from
# 127.0.0.1); an idle kept-alive connection is closed after 60 s, as before.
EMULATOR_LIMITS = ConnectionLimits(max_connections=512, max_per_client=256, request_timeout=60.0)


class _Server(HttpServer):
    def __init__(self, addr: tuple[str, int], emulator: Emulator, limits: ConnectionLimits = EMULATOR_LIMITS) -> None:
        self.emulator = emulator
        self.connections: set[socket.socket] = set()
        self.conn_lock = threading.Lock()
        super().__init__(addr, _Handler, limits)

    def close_connections(self) -> None:
        # Keep-alive connections outlive shutdown(); close them so a stopped emulator stops answering.
        with self.conn_lock:
            conns = list(self.connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(QuietHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sefwd-imds-emulator"
    logger = log
    log_label = "emulator"
    timeout = 60
    _count_ctx: tuple[str, str, str] | None = None  # (vm, method, endpoint) of the request being served
    _shaping: Fault | None = None  # a hostile-answer fault waiting for the normal 200 answer
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without this, Nagle adds ~40 ms per answer.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.conn_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.conn_lock:
            self.server.connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    # -- plumbing -----------------------------------------------------------------------------

    def _read_body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            return None
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", *, content_type: str = "application/json; charset=utf-8",
              headers: Iterable[tuple[str, str]] = ()) -> None:
        shaping, self._shaping = self._shaping, None
        if shaping is not None and status == 200:
            self._send_hostile(shaping, body, content_type, headers)
            return
        self._record(status)
        self.send_response(status)
        if body or status not in (204, 304):
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            # RFC 9112 9.6: say "close" in the last answer on a connection, then close it. A client's
            # keep-alive pool (Node's agent) otherwise reuses the socket and its next request fails.
            self.send_header("Connection", "close")
        # What end_headers() does, with the body in the same write: one TCP segment per answer,
        # as IMDS sends it, instead of waking the client twice (headers, then body).
        buffered: list[bytes] = self._headers_buffer  # type: ignore[attr-defined]  # (set by send_response)
        buffered.append(b"\r\n")
        if body and self.command != "HEAD":
            buffered.append(body)
        self.flush_headers()

    def _send_hostile(self, fault: Fault, body: bytes, content_type: str, headers: Iterable[tuple[str, str]]) -> None:
        """The normal answer, shaped as ``fault`` says: dripped, oversized, nested or out of range."""
        emu = self.server.emulator
        if fault.kind in ("nested", "out_of_range"):
            body = fault.reshape(body)
        self._record(200)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        for name, value in headers:
            self.send_header(name, value)
        pieces: Iterable[bytes] = [body]
        if fault.kind == "oversized":
            length, pieces = fault.oversized(body)
            if fault.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(length))
        else:
            self.send_header("Content-Length", str(len(body)))
        self.close_connection = True  # a hostile answer is the last one on its connection
        self.send_header("Connection", "close")
        try:
            if fault.kind == "drip":
                head: list[bytes] = self._headers_buffer  # type: ignore[attr-defined]  # (set by send_response)
                data = b"".join(head) + b"\r\n" + body
                head.clear()
                for i in range(len(data)):
                    if emu.stop_event.wait(fault.delay or 0):
                        return
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                return
            self.end_headers()
            for piece in pieces:
                if emu.stop_event.is_set():
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if fault.chunked else piece)
            if fault.kind == "oversized" and fault.chunked:
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client gave up on it, as it should
            pass

    def _record(self, status: int | str) -> None:
        # Counted before the answer leaves, so a client that got it always finds it in stats().
        ctx, self._count_ctx = self._count_ctx, None
        if ctx is not None:
            vm, method, endpoint = ctx
            self.server.emulator.platform.count(vm, method, endpoint, status)

    def _error(self, status: int, message: str, **extra: Any) -> None:
        self._send(status, _json({"error": message, **extra}))

    # -- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        try:
            self._dispatch_checked(method)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception:  # an emulator bug must answer 500, not kill the connection silently
            log.exception("emulator: failed to handle %s %s", method, self.path)
            self.close_connection = True
            try:
                self._send(500, _json({"error": "emulator internal error"}))
            except OSError:
                pass

    def _dispatch_checked(self, method: str) -> None:
        emu = self.server.emulator
        self._count_ctx = None
        self._shaping = None
        if _wants_close(self.headers.get_all("Connection") or []):
            self.close_connection = True
        body = self._read_body()
        url = urlsplit(self.path)
        path = url.path
        if path == "/_emulator" or path.startswith("/_emulator/"):
            self._control(method, path, body)
            return
        vm = emu.platform.default_vm
        if path.startswith("/vm/"):
            name, sep, rest = path[4:].partition("/")
            name = unquote(name)
            with emu.platform.lock:
                known = name in emu.platform.vms
            if not known:
                self._error(404, "Not found")
                return
            vm, path = name, "/" + rest if sep else ""
        route = ROUTES.get(path.rstrip("/") if path != "/" else path)
        if route is None:
            self._count_ctx = (vm, method, "unknown")
            self._error(404, "Not found")
            return
        endpoint, methods = route
        self._count_ctx = (vm, method, endpoint)
        if endpoint != "token":
            self._serve(emu, vm, method, endpoint, methods, path, url.query, body)
        elif not emu.platform.token_slot_acquire(vm):
            self._error(429, "Too many concurrent requests")  # IMDS: 5 concurrent token requests per VM
        else:
            try:
                self._serve(emu, vm, method, endpoint, methods, path, url.query, body)
            finally:
                emu.platform.token_slot_release(vm)

    def _serve(self, emu: Emulator, vm: str, method: str, endpoint: str, methods: tuple[str, ...],
               path: str, query: str, body: bytes | None) -> int | str:
        if method not in methods:
            self._send(405, _json({"error": "Method not allowed"}), headers=[("Allow", ", ".join(methods))])
            return 405
        fault = emu.faults.take(vm, endpoint, method)
        if fault is not None:
            outcome = self._apply_fault(emu, fault)
            if outcome is not None:
                return outcome
        if not emu.platform.allow(vm, endpoint):
            self._error(429, "Too many requests")
            return 429
        if self.headers.get("X-Forwarded-For") is not None:
            self._error(400, "Bad request. Request contains X-Forwarded-For header")
            return 400
        if (self.headers.get("Metadata") or "").strip().lower() != "true":
            self._error(400, "Bad request. Required metadata header not specified")
            return 400
        pairs = parse_qsl(query, keep_blank_values=True)
        params = dict(pairs)
        if len(params) != len(pairs):
            dupes = sorted({k for k, _ in pairs if sum(1 for k2, _ in pairs if k2 == k) > 1})
            self._error(400, f"Bad request. Query parameter specified more than once: {', '.join(dupes)}")
            return 400
        if body is None:
            self._error(400, "Bad request. Request body is too large or its length is invalid")
            return 400
        if endpoint == "versions":
            self._send(200, _json({"apiVersions": list(INSTANCE_VERSIONS)}))
            return 200
        version = params.get("api-version")
        if endpoint == "scheduledevents" and version in SE_VERSIONS and version > emu.max_api_version:
            # Where a version is not available (2024-07-09 outside its preview) IMDS answers 404.
            self._error(404, "Not found. The requested api-version is not available on this VM")
            return 404
        problem = self._check_version(endpoint, version)
        if problem is not None:
            newest = list(reversed(SE_VERSIONS if endpoint == "scheduledevents" else INSTANCE_VERSIONS))[:3]
            self._error(400, problem, **{"newest-versions": newest})
            return 400
        assert version is not None
        if endpoint == "scheduledevents":
            if emu.platform.first_call(vm) and emu.first_call_delay > 0 and emu.stop_event.wait(emu.first_call_delay):
                return self._released_by_stop()
            return self._post_events(emu, vm, version, body) if method == "POST" else self._get_events(emu, version)
        if endpoint == "instance":
            compute = emu.platform.vms[vm].compute()
            doc = compute if path.rstrip("/").endswith("/compute") else {"compute": compute, "network": {"interface": []}}
            self._send(200, _json(doc))
            return 200
        return self._token(emu, vm, params)

    @staticmethod
    def _check_version(endpoint: str, version: str | None) -> str | None:
        if not version:
            return "Bad request. api-version was not specified in the request. For more information refer to aka.ms/azureimds"
        if endpoint == "scheduledevents":
            ok = version in SE_VERSIONS
        elif endpoint == "token":
            ok = looks_like_version(version) and version >= MIN_TOKEN_VERSION
        else:
            ok = looks_like_version(version) and version >= MIN_COMPUTE_VERSION
        return None if ok else "Bad request. api-version is invalid. For more information refer to aka.ms/azureimds"

    def _released_by_stop(self) -> str:
        """A request held until the emulator stopped gets no answer: its connection is closed. Answering
        would race ``stop()`` cutting the connection (a client then saw either a 200 or RemoteDisconnected)."""
        self.close_connection = True
        self._record("stopped")
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return "stopped"

    def _apply_fault(self, emu: Emulator, fault: Fault) -> int | str | None:
        log.info("emulator: injecting %s fault (%s)", fault.kind, fault.status or fault.delay or "")
        if fault.kind in SHAPING_KINDS:
            self._shaping = fault  # applied by _send to the normal answer
            return None
        if fault.kind == "interim":
            try:
                for head in fault.interim_heads():  # each in its own TCP segment
                    self.wfile.write(head)
                    self.wfile.flush()
                    if emu.stop_event.wait(fault.delay or 0):
                        return self._released_by_stop()
            except OSError:
                pass
            return None
        if fault.kind == "slow":
            if emu.stop_event.wait(fault.delay or 0):
                return self._released_by_stop()
            return None
        if fault.kind in ("hang", "drop"):
            if fault.kind == "hang":
                emu.stop_event.wait(fault.delay)
            self.close_connection = True
            self._record(fault.kind)
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return fault.kind
        if fault.kind == "malformed":
            self._send(200, _MALFORMED)
            return 200
        status = fault.status or 500
        headers = [("Retry-After", fault.retry_after)] if fault.retry_after is not None else []
        if fault.kind == "html":
            self._send(status, _HTML_PAGE, content_type="text/html; charset=utf-8", headers=headers)
        else:
            phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
            self._send(status, _json({"error": phrase}), headers=headers)
        return status

    def _get_events(self, emu: Emulator, version: str) -> int:
        body = _json(emu.platform.document(version))
        if not emu.etag:
            self._send(200, body)
            return 200
        tag = '"' + hashlib.sha256(body).hexdigest()[:24] + '"'
        inm = self.headers.get("If-None-Match")
        if inm is not None and (inm.strip() == "*" or tag in [t.strip() for t in inm.split(",")]):
            self._send(304, headers=[("ETag", tag)])
            return 304
        self._send(200, body, headers=[("ETag", tag)])
        return 200

    def _post_events(self, emu: Emulator, vm: str, version: str, body: bytes) -> int:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._error(400, "Bad request. The request body is not valid JSON")
            return 400
        requests = doc.get("StartRequests") if isinstance(doc, dict) else None
        if (not isinstance(requests, list) or not requests
                or not all(isinstance(r, dict) and isinstance(r.get("EventId"), str) and r["EventId"] for r in requests)):
            self._error(400, 'Bad request. Expected {"StartRequests": [{"EventId": "..."}]}')
            return 400
        problem = emu.platform.approve(vm, version, [r["EventId"] for r in requests], doc.get("DocumentIncarnation"))
        if problem is not None:
            self._error(400, problem)
            return 400
        self._send(200)
        return 200

    def _token(self, emu: Emulator, vm: str, params: dict[str, str]) -> int:
        resource = params.get("resource")
        if not resource:
            self._send(400, _json({"error": "invalid_request",
                                   "error_description": "Required audience parameter not specified"}))
            return 400
        now = int(time.time())
        with emu.platform.lock:
            serial = emu.platform.token_requests + 1
            emu.platform.issued_tokens[f"emulator-token.{vm}.{serial}"] = (resource, vm)
        token = {
            "access_token": f"emulator-token.{vm}.{serial}",
            "client_id": emu.platform.vms[vm].vm_id,
            "expires_in": "86399",
            "expires_on": str(now + 86399),
            "ext_expires_in": "86399",
            "not_before": str(now - 300),
            "resource": resource,
            "token_type": "Bearer",
        }
        self._send(200, _json(token))
        return 200

    # -- control API --------------------------------------------------------------------------

    def _control(self, method: str, path: str, body: bytes | None) -> None:
        emu = self.server.emulator
        parts = [unquote(p) for p in path.strip("/").split("/")[1:]]
        try:
            spec = orjson.loads(body) if body else {}
            if not isinstance(spec, dict):
                raise SpecError("the request body must be a JSON object")
        except orjson.JSONDecodeError:
            self._error(400, "the request body is not valid JSON")
            return
        except SpecError as exc:
            self._error(400, str(exc))
            return
        try:
            if parts == ["state"] and method == "GET":
                self._send(200, _json(emu.stats()))
            elif parts == ["events"] and method == "POST":
                self._send(201, _json({"EventId": emu.schedule(**spec)}))
            elif len(parts) == 3 and parts[0] == "events" and method == "POST" and parts[2] in (
                    "start", "cancel", "complete", "update", "approve"):
                event_id, action = parts[1], parts[2]
                if action == "approve":
                    vm = spec.get("vm")
                    if vm is not None and not isinstance(vm, str):
                        raise SpecError('expected {"vm": "<name>"} (optional)')
                    emu.approve(event_id, vm)
                elif action == "start":
                    emu.start_event(event_id)
                elif action == "cancel":
                    emu.cancel(event_id)
                elif action == "complete":
                    emu.complete(event_id)
                else:
                    emu.update(event_id, **spec)
                self._send(200, _json({"ok": True, "incarnation": emu.platform.incarnation}))
            elif parts == ["faults"] and method == "POST":
                kind = spec.pop("kind", None)
                emu.inject_fault(kind, **spec)
                self._send(201, _json({"pending": emu.faults.pending()}))
            elif parts == ["reset"] and method == "POST":
                emu.reset()
                self._send(200, _json({"ok": True}))
            elif parts == ["scenario"] and method == "POST":
                name = spec.get("name")
                if not isinstance(name, str):
                    raise SpecError('expected {"name": "<built-in scenario or file>"}')
                emu.run_scenario(name)
                self._send(200, _json({"ok": True, "scenario": emu.platform.snapshot()["scenario"]}))
            else:
                self._error(404, f"no control endpoint {method} {path}")
        except KeyError as exc:
            self._error(404, str(exc.args[0]) if exc.args else "not found")
        except ConfigError as exc:
            self._error(400, "; ".join(exc.problems))
        except (SpecError, ValueError, TypeError) as exc:
            self._error(400, str(exc))


class Emulator:
    """A faithful Azure IMDS (Scheduled Events, instance compute, managed identity) on loopback."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        scenario: str | Path | Scenario | None = None,
        vms: Iterable[str | VmProfile | dict[str, Any]] | None = None,
        rate_limit: float | None = 5,
        token_rate_limit: float | None = 20,
        token_concurrency: int | None = 5,
        time_scale: float = 1.0,
        clock: Clock | None = None,
        first_call_delay: float | None = None,
        terminate_notice: float | None = None,
        etag: bool = False,
        arm_tls: tuple[str | Path, str | Path] | None = None,
        arm_port: int = 0,
        arm_grants: Mapping[str, Iterable[str]] | None = None,
        limits: ConnectionLimits = EMULATOR_LIMITS,
        max_api_version: str | None = None,
        start_scenario: bool = True,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must not be negative, got {time_scale!r}")
        self.host = host
        self.port = port
        self.scenario = load_scenario(scenario) if scenario is not None else None
        # False: the scenario gives the VMs and their settings, its timeline waits for run_scenario() (`sefwd demo`
        # starts it once the agent has polled, so a slow start never loses the scenario's first seconds).
        self.start_scenario = start_scenario
        profiles = [v if isinstance(v, VmProfile) else VmProfile.from_spec(v) for v in vms] if vms is not None else []
        if not profiles and self.scenario is not None:
            profiles = list(self.scenario.vms)
        sc = self.scenario
        self.first_call_delay = (first_call_delay if first_call_delay is not None
                                 else sc.first_call_delay if sc and sc.first_call_delay is not None else 0.0)
        notice = (terminate_notice if terminate_notice is not None
                  else sc.terminate_notice if sc and sc.terminate_notice is not None else MIN_NOTICE["Terminate"])
        self.etag = etag
        self.limits = limits
        # The newest Scheduled Events api-version served; newer known ones answer 404 (e.g. GA_SE_VERSION).
        if max_api_version is not None and max_api_version not in SE_VERSIONS:
            raise ValueError(f"max_api_version must be one of {', '.join(SE_VERSIONS)}, got {max_api_version!r}")
        self.max_api_version = max_api_version or SE_VERSIONS[-1]
        self.platform = Platform(profiles, time_scale=time_scale, clock=clock, terminate_notice=notice,
                                 rate_limit=rate_limit, token_rate_limit=token_rate_limit,
                                 token_concurrency=token_concurrency)
        self.faults = FaultQueue()
        self.platform.on_fault_step = lambda spec: self.inject_fault(**spec)  # type: ignore[method-assign]
        self.publishers: list[EventGridPublisher] = []  # the Event Grid side (publish_to)
        self.stop_event = threading.Event()
        self._server: _Server | None = None
        # Azure Resource Manager (scheduled-event acknowledgement) on its own HTTPS listener, when
        # given a certificate and key (forwarder.emulator.arm).
        self.arm_tls = arm_tls
        self.arm_port = arm_port
        # Azure RBAC, reduced to what the acknowledgement needs: identity (the VM whose managed
        # identity got the token) -> scopes (resource ID prefixes) where it holds
        # Microsoft.Maintenance/scheduledevents/acknowledge/action. None: every identity everywhere.
        self.arm_grants = {who: tuple(scopes) for who, scopes in arm_grants.items()} if arm_grants is not None else None
        self._arm: ArmServer | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Emulator:
        """Bind, serve in a background thread and start the scenario's timeline."""
        self._server = _Server((self.host, self.port), self, self.limits)
        self.port = self._server.port
        self._server.start("imds-emulator", poll_interval=0.1)
        if self.arm_tls is not None:
            from forwarder.emulator.arm import ArmServer

            try:
                self._arm = ArmServer((self.host, self.arm_port), self, *self.arm_tls)
            except OSError:
                self._server.stop()  # nothing half-started
                self._server = None
                raise
            self.arm_port = self._arm.port
            self._arm.start("arm-emulator", poll_interval=0.1)
        self.platform.timeline.start()
        log.debug("IMDS emulator listening on %s (default VM %s)", self.url, self.platform.default_vm)  # `sefwd emulator` prints it
        if self.scenario is not None and self.start_scenario:
            self.platform.run_scenario(self.scenario)
        return self

    def stop(self) -> None:
        """Stop serving: pending timers are dropped and held (hanging) requests released."""
        self.stop_event.set()
        self.platform.timeline.close()
        if self._server is not None:
            self._server.stop()
        self._server = None
        if self._arm is not None:
            self._arm.stop()
        self._arm = None
        for publisher in self.publishers:
            publisher.stop()

    def publish_to(self, url: str, *, duplicates: int = 0, delay: float = 0.0) -> EventGridPublisher:
        """Also push every change of an event to ``url`` as Event Grid ``ScheduledEventEmitted`` events,
        after the subscription validation handshake (forwarder.emulator.eventgrid); every ``duplicates``-th
        event twice, each ``delay`` seconds late."""
        from forwarder.emulator.eventgrid import EventGridPublisher

        publisher = EventGridPublisher(url, self.platform.vms, duplicates=duplicates, delay=delay).start()
        self.publishers.append(publisher)
        with self.platform.lock:
            self.platform.listeners.append(publisher)
        return publisher

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL of the default VM (``http://127.0.0.1:PORT``); append ``/metadata/...``."""
        return f"http://{host_port_text(self.host, self.port)}"

    @property
    def arm_url(self) -> str:
        """Base URL of the Azure Resource Manager side (``https://127.0.0.1:PORT``); needs ``arm_tls``."""
        if self._arm is None:
            raise RuntimeError("the emulator serves ARM only when started with arm_tls=(cert, key)")
        return self._arm.base_url

    def vm_url(self, name: str) -> str:
        """Base URL of one VM (``{url}/vm/<name>``); the VM is created if it does not exist yet."""
        with self.platform.lock:
            self.platform.ensure_vm(name)
        return f"{self.url}/vm/{name}"

    @property
    def default_vm(self) -> str:
        return self.platform.default_vm

    @property
    def finished(self) -> threading.Event:
        """Set when the scenario's last step ran and all its events are gone."""
        return self.platform.finished

    def wait_finished(self, timeout: float | None = None) -> bool:
        return self.platform.finished.wait(timeout)

    # -- events -------------------------------------------------------------------------------

    def schedule(self, **spec: Any) -> str:
        """Add an event; keys: id, type, status, source, description, duration, resources, resource_type,
        not_before, start_after, complete_after, require_all_approvals. Returns the EventId."""
        return self.platform.schedule(spec)

    def start_event(self, event_id: str) -> None:
        """Force Started now, ignoring NotBefore (the one way to break IMDS's promise on purpose)."""
        self.platform.start_event(event_id)

    def approve(self, event_id: str, vm: str | None = None) -> None:
        """As if ``vm`` (default: the last VM in Resources) POSTed StartRequests: starts it at once."""
        self.platform.approve_as(event_id, vm)

    def cancel(self, event_id: str) -> None:
        self.platform.cancel(event_id)

    def complete(self, event_id: str) -> None:
        self.platform.complete(event_id)

    def update(self, event_id: str, **fields: Any) -> None:
        self.platform.update(event_id, fields)

    def document(self, api_version: str = SE_VERSIONS[-1]) -> dict[str, Any]:
        """The Scheduled Events document as a VM would read it now."""
        return self.platform.document(api_version)

    def run_scenario(self, scenario: str | Path | Scenario) -> None:
        """Start (or restart) a scenario's timeline from now."""
        self.scenario = load_scenario(scenario)
        self.platform.run_scenario(self.scenario)

    # -- faults, stats, reset -----------------------------------------------------------------

    def inject_fault(self, kind: str | None = None, **options: Any) -> None:
        """Queue a fault: kind status|slow|hang|drop|malformed|html|drip|interim|oversized|nested|out_of_range
        (forwarder.emulator.faults); count, status, retry_after, delay, vm, path
        (scheduledevents|instance|token|versions|any), method, size, chunked, depth, statuses, field."""
        self.faults.add(Fault.from_spec({"kind": kind, **options}))

    def stats(self) -> dict[str, Any]:
        """Events, incarnation, per-VM request counters, StartRequests, token requests, history."""
        snap = self.platform.snapshot()
        snap["url"] = self.url
        snap["faults_pending"] = self.faults.pending()
        if self._arm is not None:
            with self._arm.lock:
                snap["arm_requests"] = [dict(r) for r in self._arm.log]
        return snap

    def reset(self) -> None:
        """Drop events, faults, counters and the running scenario."""
        self.faults.clear()
        self.platform.reset()


__all__ = ["Emulator"]
