"""The emulator's Azure Resource Manager side: Microsoft.Maintenance scheduled-event acknowledgement.

REST spec (Azure/azure-rest-api-specs, specification/maintenance, ``ScheduledEvents_Acknowledge``,
2023-10-01-preview, and ``ScheduledEvents_AcknowledgeList``, 2025-10-01-preview)::

    POST /subscriptions/{sub}/resourcegroups/{rg}/providers/Microsoft.Compute/{resourceType}/{name}
         /providers/Microsoft.Maintenance/scheduledevents/{scheduledEventId}/acknowledge?api-version=…
      200 {"value": "Successfully Approved"}; errors {"error": {"code", "message"}}
    POST …/{name}/providers/Microsoft.Maintenance/scheduledevents?api-version=2025-10-01-preview
      body {"value": ["<EventId>", …]}; 200 as above; 207 {"error": {"code": "MultiStatusResponse",
      "message", "details": [{"target": EventId, "code", "message"}]}} when some could not be acknowledged

resourceType is virtualMachines, virtualMachineScaleSets or availabilitySets (the spec has no
scale-set-instance form: an instance's events are acknowledged on its scale set, where ARM accepts an event of
any member). Served on its own
HTTPS listener (azure-core sends bearer tokens over TLS only); a request needs a bearer token the
emulator's own token endpoint issued for Azure Resource Manager. An acknowledgement goes through
the same engine path as a ``StartRequests`` POST from the VM that the resource maps to.

The Maintenance provider has no GET for scheduled events (the spec's only operations are the two
POSTs above); the platform's own record of an event is read from Azure Resource Graph, table
``maintenanceresources``, type ``microsoft.maintenance/scheduledevents`` (spec: specification/resourcegraph,
``Resources``, 2022-10-01)::

    POST /providers/Microsoft.ResourceGraph/resources?api-version=2022-10-01
      body {"subscriptions": [sub], "query": "maintenanceresources | where type =~ '…' | where id =~ '…' | …",
            "options": {"resultFormat": "objectArray"}}
      200 {"totalRecords", "count", "resultTruncated": "false", "data": [{"id", "name", "type", "subscriptionId",
           "resourceGroup", "properties": {the IMDS fields}}], "facets": []}

One row per event and per resource (VM or scale set) a VM named in its Resources belongs to, ``id`` =
``{resource}/providers/microsoft.maintenance/scheduledevents/{EventId}``; rows the caller has no grant
on are left out, as Resource Graph does. The emulator evaluates only the ``where`` clauses of that form
(``type =~``, ``id =~``, ``name =~``) and answers 400 ``BadRequest`` for any other query.
"""
from __future__ import annotations

import logging
import re
import socket
import ssl
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import orjson

from forwarder.common.http_server import HttpServer, QuietHandler
from forwarder.common.listen import host_port_text, tls_server_context
from forwarder.emulator.model import SE_VERSIONS, VmProfile

if TYPE_CHECKING:
    from forwarder.emulator.server import Emulator

log = logging.getLogger(__name__)

ACK_VERSIONS = ("2023-10-01-preview", "2025-10-01-preview")
LIST_VERSIONS = ("2025-10-01-preview",)
# Audiences ARM accepts (resource of a managed-identity token; azure-identity strips "/.default").
ARM_AUDIENCES = frozenset({"https://management.azure.com", "https://management.azure.com/",
                           "https://management.core.windows.net", "https://management.core.windows.net/"})
RESOURCE_TYPES = {"virtualmachines": "virtualMachines", "virtualmachinescalesets": "virtualMachineScaleSets",
                  "availabilitysets": "availabilitySets"}
APPROVED_TEXT = "Successfully Approved"
MAX_BODY = 64 * 1024
_PATH = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourcegroups/(?P<rg>[^/]+)/providers/microsoft\.compute/"
                   r"(?P<resource>.+?)/providers/microsoft\.maintenance/scheduledevents"
                   r"(?:/(?P<event>[^/]+)/acknowledge)?/?$", re.IGNORECASE)
_GRAPH_PATH = re.compile(r"^/providers/microsoft\.resourcegraph/resources/?$", re.IGNORECASE)
GRAPH_VERSIONS = ("2021-03-01", "2022-10-01", "2024-04-01")
EVENT_TYPE = "microsoft.maintenance/scheduledevents"
# The one query form the emulator evaluates: a table and `where <column> =~ '<literal>'` clauses.
_GRAPH_WHERE = re.compile(r"\|\s*where\s+(?P<column>type|id|name)\s*=~\s*'(?P<value>(?:[^'\\]|\\.)*)'\s*", re.IGNORECASE)
_GRAPH_PROJECT = re.compile(r"\|\s*project\s+[A-Za-z_, ]+\s*$", re.IGNORECASE)
_WWW_AUTHENTICATE = ('Bearer authorization_uri="https://login.microsoftonline.com/common", error="invalid_token", '
                     'error_description="The authentication failed because of missing or invalid \'Authorization\' header."')


def arm_keys(vm: VmProfile) -> set[tuple[str, str, str, str]]:
    """The (type, subscription, group, name) keys, lower case, of the ARM resources ``vm`` belongs to.

    A VM is its own ``virtualMachines`` resource, unless it is a scale-set instance
    (``…/virtualMachineScaleSets/S/virtualMachines/I``): then it belongs to the scale set. Either may
    also be in an availability set (``VmProfile.availability_set``).
    """
    keys: set[tuple[str, str, str, str]] = set()
    parts = [unquote(p) for p in vm.resource_id.strip("/").split("/")]
    lower = [p.lower() for p in parts]
    if len(parts) >= 8 and lower[0] == "subscriptions" and lower[2] == "resourcegroups" and lower[5] == "microsoft.compute":
        sub, rg = lower[1], lower[3]
        if len(parts) == 8 and lower[6] == "virtualmachines":
            keys.add(("virtualmachines", sub, rg, lower[7]))
        elif len(parts) == 10 and lower[6] == "virtualmachinescalesets" and lower[8] == "virtualmachines":
            keys.add(("virtualmachinescalesets", sub, rg, lower[7]))
    if vm.availability_set:
        keys.add(("availabilitysets", vm.subscription_id.lower(), vm.resource_group_name.lower(),
                  vm.availability_set.lower()))
    return keys


def _error(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})


class ArmServer(HttpServer):
    """The HTTPS listener; TLS is wrapped per connection, the handshake runs in the handler thread."""

    def __init__(self, address: tuple[str, int], emulator: Emulator, cert: Path | str, key: Path | str) -> None:
        self.emulator = emulator
        self.tls = tls_server_context(cert, key)
        self.log: list[dict[str, Any]] = []  # one entry per answered request (tests assert on retries)
        self.lock = threading.Lock()
        super().__init__(address, _ArmHandler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    @property
    def base_url(self) -> str:
        return f"https://{host_port_text(self.host, self.port)}"


class _ArmHandler(QuietHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sefwd-arm-emulator"
    logger = log
    log_label = "emulator arm"
    timeout = 30
    server: ArmServer

    def setup(self) -> None:
        super().setup()
        try:
            assert isinstance(self.connection, ssl.SSLSocket)
            self.connection.do_handshake()
        except (OSError, ValueError):
            self.close_connection = True
            raise ConnectionError("TLS handshake failed") from None

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError, ssl.SSLError):
            pass

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        with self.server.lock:
            self.server.log.append({"method": self.command, "path": urlsplit(self.path).path, "status": status})
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        request_id = str(uuid.uuid4())
        self.send_header("x-ms-request-id", request_id)
        self.send_header("x-ms-correlation-request-id", self.headers.get("x-ms-correlation-request-id") or request_id)
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _fail(self, status: int, code: str, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        self._send(status, _error(code, message), headers)

    def _dispatch(self, method: str) -> None:
        try:
            self._serve(method)
        except (ConnectionError, TimeoutError, ssl.SSLError):
            self.close_connection = True
        except Exception:  # an emulator bug answers 500, as ARM would
            log.exception("emulator arm: failed to handle %s %s", method, self.path)
            self.close_connection = True
            try:
                self._fail(500, "InternalServerError", "emulator internal error")
            except OSError:
                pass

    def _body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            return None
        return self.rfile.read(length) if length else b""

    def _serve(self, method: str) -> None:
        emu = self.server.emulator
        body = self._body()
        url = urlsplit(self.path)
        match = _PATH.match(url.path)
        resource_name = unquote(match["resource"].rpartition("/")[2]) if match else ""
        fault = emu.faults.take(resource_name, "arm", method)
        if fault is not None and self._apply_fault(emu, fault):
            return
        identity = self._authenticated()
        if identity is None:
            return
        if _GRAPH_PATH.match(url.path):
            self._graph(method, identity, body, dict(parse_qsl(url.query, keep_blank_values=True)))
            return
        if match is None:
            self._fail(404, "NotFound", f"The requested path {url.path!r} is not an ARM route this emulator serves.")
            return
        if method != "POST":
            self._fail(405, "MethodNotAllowed", f"The requested method {method} is not allowed here.",
                       headers=[("Allow", "POST")])
            return
        single = match["event"] is not None
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        version = params.get("api-version")
        if not version:
            self._fail(400, "MissingApiVersionParameter", "The api-version query parameter (?api-version=) is required "
                       "for all requests.")
            return
        supported = ACK_VERSIONS if single else LIST_VERSIONS
        if version not in supported:
            self._fail(400, "InvalidApiVersionParameter", f"The api-version '{version}' is invalid. The supported "
                       f"versions are '{','.join(supported)}'.")
            return
        segments = [unquote(s) for s in match["resource"].split("/")]
        rtype = RESOURCE_TYPES.get(segments[0].lower()) if len(segments) == 2 else None
        if rtype is None:
            self._fail(400, "InvalidResourceType", f"The resource type '{'/'.join(segments[:-1])}' is not supported "
                       "for scheduled events. Supported resource types are VirtualMachines, "
                       "VirtualMachineScaleSets, AvailabilitySets.")
            return
        sub, rg, name = unquote(match["sub"]), unquote(match["rg"]), segments[1]
        resource = f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/{rtype}/{name}"
        if not self._granted(identity, resource):
            self._fail(403, "AuthorizationFailed", f"The client '{identity}' does not have authorization to perform "
                       "action 'Microsoft.Maintenance/scheduledevents/acknowledge/action' over scope "
                       f"'{resource}' or the scope is invalid.")
            return
        key = (rtype.lower(), sub.lower(), rg.lower(), name.lower())
        with emu.platform.lock:
            members = [vm.name for vm in emu.platform.vms.values() if key in arm_keys(vm)]
        if not members:
            self._fail(404, "ResourceNotFound", f"The Resource 'Microsoft.Compute/{rtype}/{name}' under resource "
                       f"group '{rg}' was not found.")
            return
        if single:
            problem = self._acknowledge(members, unquote(match["event"]))
            if problem is None:
                self._send(200, orjson.dumps({"value": APPROVED_TEXT}))
            else:
                self._fail(404, "NotFound", problem)
            return
        ids = self._id_list(body)
        if ids is None:
            self._fail(400, "InvalidRequestContent", 'The request content is invalid: expected {"value": ["<EventId>", …]}.')
            return
        details = []
        for event_id in ids:
            problem = self._acknowledge(members, event_id)
            if problem is not None:
                details.append({"target": event_id, "code": "NotFound", "message": problem})
        if not details:
            self._send(200, orjson.dumps({"value": APPROVED_TEXT}))
            return
        self._send(207, orjson.dumps({"error": {
            "code": "MultiStatusResponse",
            "message": "The operation returned different statuses for the Scheduled Events. Review each event's "
                       "result for details.",
            "details": details}}))

    @staticmethod
    def _id_list(body: bytes | None) -> list[str] | None:
        try:
            doc = orjson.loads(body or b"")
        except orjson.JSONDecodeError:
            return None
        ids = doc.get("value") if isinstance(doc, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
            return None
        return ids

    def _acknowledge(self, members: list[str], event_id: str) -> str | None:
        """Approve as the first member VM the event names (the StartRequests path); a message if unknown."""
        platform = self.server.emulator.platform
        newest = SE_VERSIONS[-1]
        with platform.lock:
            ev = next((e for e in platform.events.values() if e.id.lower() == event_id.lower()), None)
            names = {r.lower(): r for r in ev.resources} if ev is not None else {}
            vm = next((m for m in members if m.lower() in names), None)
            if ev is None or vm is None:
                return f"The scheduled event '{event_id}' was not found for this resource."
            problem = platform.approve(vm, newest, [ev.id], None, via="arm")
        return problem

    def _graph(self, method: str, identity: str, body: bytes | None, params: dict[str, str]) -> None:
        """Resource Graph ``resources``: the ``maintenanceresources`` scheduled-event rows the query selects."""
        if method != "POST":
            self._fail(405, "MethodNotAllowed", f"The requested method {method} is not allowed here.",
                       headers=[("Allow", "POST")])
            return
        if params.get("api-version") not in GRAPH_VERSIONS:
            self._fail(400, "InvalidApiVersionParameter", f"The api-version '{params.get('api-version')}' is invalid. "
                       f"The supported versions are '{','.join(GRAPH_VERSIONS)}'.")
            return
        try:
            request = orjson.loads(body or b"")
        except orjson.JSONDecodeError:
            request = None
        query = request.get("query") if isinstance(request, dict) else None
        subscriptions = request.get("subscriptions", []) if isinstance(request, dict) else None
        if not isinstance(query, str) or not isinstance(subscriptions, list):
            self._fail(400, "BadRequest", "The request content is invalid: expected {\"query\": \"...\", \"subscriptions\": [...]}.")
            return
        table, _, rest = query.strip().partition("|")
        clauses = []
        rest = "|" + rest if rest else ""
        while rest:
            match = _GRAPH_WHERE.match(rest)
            if match is None:
                break
            clauses.append((match["column"].lower(), match["value"].replace("\\'", "'").replace("\\\\", "\\").lower()))
            rest = rest[match.end():]
        if table.strip().lower() != "maintenanceresources" or (rest and not _GRAPH_PROJECT.match(rest)):
            self._fail(400, "BadRequest", "Query is invalid: the emulator evaluates only `maintenanceresources | where "
                       "type|id|name =~ '...'` (| project ...).")
            return
        wanted = {str(s).lower() for s in subscriptions}
        rows = [row for row in self._maintenance_rows()
                if (not wanted or row["subscriptionId"].lower() in wanted)
                and self._granted(identity, row["id"].rpartition("/providers/")[0])
                and all(str(row[column]).lower() == value for column, value in clauses)]
        self._send(200, orjson.dumps({"totalRecords": len(rows), "count": len(rows), "resultTruncated": "false",
                                      "data": rows, "facets": []}))

    def _maintenance_rows(self) -> list[dict[str, Any]]:
        """Every event as Resource Graph lists it: one row per ARM resource a VM it names belongs to."""
        platform = self.server.emulator.platform
        rows: dict[str, dict[str, Any]] = {}
        with platform.lock:
            for ev in platform.events.values():
                properties = ev.render(SE_VERSIONS[-1])
                for name in ev.resources:
                    vm = platform.vms.get(name)
                    if vm is None:
                        continue
                    parts = [unquote(p) for p in vm.resource_id.strip("/").split("/")]
                    if not any(key[0] != "availabilitysets" for key in arm_keys(vm)):
                        continue  # no VM or scale-set resource (events are published there, not on availability sets)
                    base = "/".join(parts[:8])  # subscriptions/S/resourceGroups/G/providers/Microsoft.Compute/<type>/<name>
                    row_id = f"/{base}/providers/microsoft.maintenance/scheduledevents/{ev.id}"
                    rows.setdefault(row_id.lower(), {
                        "id": row_id, "name": ev.id, "type": EVENT_TYPE, "subscriptionId": parts[1],
                        "resourceGroup": parts[3].lower(), "properties": dict(properties)})
        return list(rows.values())

    def _granted(self, identity: str, resource: str) -> bool:
        grants = self.server.emulator.arm_grants
        if grants is None:
            return True
        target = resource.lower()
        scopes = (scope.rstrip("/").lower() for scope in grants.get(identity, ()))
        return any(target == scope or target.startswith(scope + "/") for scope in scopes)

    def _authenticated(self) -> str | None:
        """The identity (VM name) behind a valid ARM bearer token; None after answering 401."""
        emu = self.server.emulator
        header = self.headers.get("Authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            self._fail(401, "AuthenticationFailed", "Authentication failed. The 'Authorization' header is missing.",
                       headers=[("WWW-Authenticate", _WWW_AUTHENTICATE)])
            return None
        with emu.platform.lock:
            issued = emu.platform.issued_tokens.get(token.strip())
        if issued is None:
            self._fail(401, "InvalidAuthenticationToken", "The access token is invalid.",
                       headers=[("WWW-Authenticate", _WWW_AUTHENTICATE)])
            return None
        audience, identity = issued
        if audience not in ARM_AUDIENCES:
            self._fail(401, "InvalidAuthenticationTokenAudience", "The access token has been obtained for wrong "
                       "audience or resource. It should exactly match one of the allowed audiences "
                       f"{', '.join(sorted(ARM_AUDIENCES))}.", headers=[("WWW-Authenticate", _WWW_AUTHENTICATE)])
            return None
        return identity

    def _apply_fault(self, emu: Emulator, fault: Any) -> bool:
        """True if the fault answered (or dropped) the request; a ``slow`` fault only delays it."""
        log.info("emulator arm: injecting %s fault (%s)", fault.kind, fault.status or fault.delay or "")
        if fault.kind == "slow":
            emu.stop_event.wait(fault.delay or 0)
            return False
        if fault.kind in ("hang", "drop"):
            if fault.kind == "hang":
                emu.stop_event.wait(fault.delay)
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return True
        status = fault.status or 500
        headers = [("Retry-After", fault.retry_after)] if fault.retry_after is not None else []
        code = "TooManyRequests" if status == 429 else "ServiceUnavailable" if status == 503 else "InternalServerError"
        message = ("The request is being throttled." if status == 429
                   else "The service is unavailable now; try again later.")
        self._fail(status, code, message, headers=headers)
        return True


__all__ = ["ACK_VERSIONS", "ARM_AUDIENCES", "ArmServer", "EVENT_TYPE", "GRAPH_VERSIONS", "LIST_VERSIONS", "arm_keys"]
