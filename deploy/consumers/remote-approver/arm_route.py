"""The ARM route (APPROVAL_ROUTE=arm): approve through Azure Resource Manager with the Function's
managed identity, no inbound port on any VM.

POST {ARM}/subscriptions/{sub}/resourcegroups/{rg}/providers/Microsoft.Compute/{virtualMachines|
virtualMachineScaleSets}/{name}/providers/Microsoft.Maintenance/scheduledevents/{EventId}/acknowledge
?api-version=2023-10-01-preview (REST spec ScheduledEvents_Acknowledge), through azure-mgmt-core's
ARMPipelineClient (azure-core retry honouring Retry-After, bearer tokens for
https://management.azure.com/.default from azure-identity). The identity needs
Microsoft.Maintenance/scheduledevents/acknowledge/action on the VMs / scale sets: the built-in role
"Scheduled Events Contributor" (b67fe603-310e-4889-b9ee-8257d09d353d), assigned on the resource
groups (or the VMs) it may approve for, nothing wider.

A scale-set instance's events are acknowledged on its scale set, where ARM accepts an event of *any*
member: a record is only the VM's word, so before such an acknowledgement the route reads the event
from the platform itself — Azure Resource Graph, ``maintenanceresources`` (the Maintenance provider has
no GET for scheduled events: its REST spec holds only the two acknowledge POSTs) — and acknowledges
only when the platform's own ``Resources`` name the authenticated instance and the event is still
Scheduled. The identity needs read access to the scale sets for that (Reader, or the Scheduled Events
Contributor role, which includes it). A plain VM is acknowledged on its own resource, where ARM itself
accepts only that VM's events.

Every trust decision is pipeline.RemoteApprover's, the same as the callback route's: only records
whose ``sefwdauth`` verifies for the VM in their ``source`` (decide.authenticated_vm), each record id
once (the durable seen-records cache), none older than RECORD_MAX_AGE_SECONDS, and only events whose
Resources name that VM and whose leader it is. This module only delivers: the target is built only
from the authenticated identity (never from Resources or other free-text fields), every path
component percent-escaped.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from decide import Deduper, VmIdentity
from pipeline import Delivery, RemoteApprover, TrustSettings, ca_bundle_setting, positive_numbers
from seen_records import SeenRecords

log = logging.getLogger(__name__)

ROUTES = ("callback", "arm")
DEFAULT_ENDPOINT = "https://management.azure.com"
DEFAULT_SCOPE = "https://management.azure.com/.default"
API_VERSION = "2023-10-01-preview"
GRAPH_API_VERSION = "2022-10-01"  # Microsoft.ResourceGraph/resources, stable
EVENT_TYPE = "microsoft.maintenance/scheduledevents"
# What an identifier spliced into a Resource Graph query may hold (Azure names: letters, digits, -_.() ).
_PLAIN = re.compile(r"^[A-Za-z0-9._()-]{1,128}$")
_TYPES = {"virtualmachines": "virtualMachines", "virtualmachinescalesets": "virtualMachineScaleSets"}
MAX_TEXT = 300


def route(env: Mapping[str, str]) -> str:
    """APPROVAL_ROUTE: ``callback`` (default: the signed callback on each VM) or ``arm``."""
    value = env.get("APPROVAL_ROUTE", "").strip().lower() or "callback"
    if value not in ROUTES:
        raise ValueError(f"remote approver settings: APPROVAL_ROUTE must be one of {', '.join(ROUTES)}, got {value!r}")
    return value


@dataclass(frozen=True)
class ArmTarget:
    """The resource to acknowledge on, and the name IMDS lists for the VM in Resources."""

    subscription: str
    resource_group: str
    resource_type: str  # virtualMachines | virtualMachineScaleSets (a scale-set instance: its scale set)
    name: str
    vm_name: str  # "<vm>" or "<scaleset>_<instance>"

    def resource(self) -> str:
        """The resource's path, every component percent-escaped: a name can never add a path segment."""
        q = lambda value: quote(value, safe="")  # noqa: E731
        return (f"/subscriptions/{q(self.subscription)}/resourcegroups/{q(self.resource_group)}/providers/"
                f"Microsoft.Compute/{q(self.resource_type)}/{q(self.name)}")

    @property
    def shared(self) -> bool:
        """Whether ARM accepts other VMs' events here too (a scale set): then the platform must confirm."""
        return self.resource_type != "virtualMachines"

    def event_id_in_graph(self, event_id: str) -> str:
        """The Resource Graph id of ``event_id`` on this resource; ValueError for an unsafe identifier."""
        for part in (self.subscription, self.resource_group, self.name, event_id):
            if not _PLAIN.match(part):
                raise ValueError(f"identifier {part!r} is not a plain Azure name")
        return (f"/subscriptions/{self.subscription}/resourceGroups/{self.resource_group}/providers/Microsoft.Compute/"
                f"{self.resource_type}/{self.name}/providers/{EVENT_TYPE}/{event_id}")

    def path(self, event_id: str) -> str:
        return (f"{self.resource()}/providers/Microsoft.Maintenance/scheduledevents/{quote(event_id, safe='')}"
                "/acknowledge")


def target_of(resource_id: str) -> ArmTarget:
    """A VM or scale-set-instance resource ID -> its target; ValueError for anything else."""
    parts = resource_id.strip("/").split("/")
    lower = [p.lower() for p in parts]
    if (len(parts) not in (8, 10) or lower[0] != "subscriptions" or lower[2] != "resourcegroups"
            or lower[4] != "providers" or lower[5] != "microsoft.compute" or not all(parts)):
        raise ValueError(f"not a VM resource ID: {resource_id!r}")
    if len(parts) == 8 and lower[6] == "virtualmachines":
        return ArmTarget(parts[1], parts[3], "virtualMachines", parts[7], parts[7])
    if len(parts) == 10 and lower[6] == "virtualmachinescalesets" and lower[8] == "virtualmachines":
        return ArmTarget(parts[1], parts[3], "virtualMachineScaleSets", parts[7], f"{parts[7]}_{parts[9]}")
    raise ValueError(f"not a VM or scale-set instance resource ID: {resource_id!r}")


def target_for(vm: VmIdentity) -> ArmTarget:
    """The target of an authenticated VM: its own resource ID (a scale-set instance: its scale set)."""
    try:
        return target_of(vm.resource_id)
    except ValueError as exc:
        raise LookupError(str(exc)) from None


@dataclass(frozen=True)
class ArmSettings(TrustSettings):
    """App settings of the ARM route (README.md: "The ARM route"), besides the shared trust settings."""

    endpoint: str = DEFAULT_ENDPOINT
    scope: str = DEFAULT_SCOPE
    retries: int = 4
    timeout: float = 10.0
    verify: bool | str = True  # ARM_CA_BUNDLE: a private CA (tests, an ARM proxy)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ArmSettings:
        """Read and check every setting; raises ValueError listing all problems at once."""
        problems: list[str] = []
        endpoint = env.get("ARM_ENDPOINT", "").strip().rstrip("/") or DEFAULT_ENDPOINT
        if not endpoint.lower().startswith("https://"):
            problems.append(f"ARM_ENDPOINT must be https:// (bearer tokens never go over plain HTTP), got {endpoint!r}")
        shared = cls.shared_from_env(env, problems)
        numbers = positive_numbers(env, (("ARM_RETRIES", 4.0), ("ARM_TIMEOUT_SECONDS", 10.0)), problems,
                                   zero_ok=("ARM_RETRIES",))
        ca_bundle = ca_bundle_setting(env, "ARM_CA_BUNDLE", problems)
        if problems:
            raise ValueError("remote approver settings (APPROVAL_ROUTE=arm): " + "; ".join(problems))
        return cls(
            **shared, endpoint=endpoint,
            scope=env.get("ARM_SCOPE", "").strip() or DEFAULT_SCOPE, retries=int(numbers["ARM_RETRIES"]),
            timeout=numbers["ARM_TIMEOUT_SECONDS"],
            verify=ca_bundle or True,
        )


def _text(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


class ArmClient:
    """One ARMPipelineClient per function instance (token cache, connection pool)."""

    def __init__(self, settings: ArmSettings, credential: Any = None) -> None:
        from azure.core.configuration import Configuration
        from azure.core.pipeline import policies
        from azure.mgmt.core import ARMPipelineClient
        from azure.mgmt.core.policies import ARMChallengeAuthenticationPolicy

        if credential is None:
            from azure.identity import DefaultAzureCredential

            credential = DefaultAzureCredential(managed_identity_client_id=settings.managed_identity_client_id)
        config: Configuration[Any, Any] = Configuration()
        config.headers_policy = policies.HeadersPolicy()
        config.user_agent_policy = policies.UserAgentPolicy(sdk_moniker="sefwd-remote-approver")
        config.proxy_policy = policies.ProxyPolicy()
        config.logging_policy = policies.NetworkTraceLoggingPolicy()
        config.retry_policy = policies.RetryPolicy(retry_total=settings.retries, retry_backoff_max=30)
        config.custom_hook_policy = policies.CustomHookPolicy()
        config.redirect_policy = policies.RedirectPolicy()
        config.authentication_policy = ARMChallengeAuthenticationPolicy(credential, settings.scope)
        self.settings = settings
        self._client: ARMPipelineClient[Any, Any] = ARMPipelineClient(base_url=settings.endpoint, config=config,
                                                                      connection_verify=settings.verify)

    def acknowledge(self, target: ArmTarget, event_id: str) -> dict[str, Any]:
        """{"ok", "final", "http_status", "reason"}; never raises for ARM's or the network's answers."""
        from azure.core.exceptions import AzureError
        from azure.core.rest import HttpRequest

        request = HttpRequest("POST", self.settings.endpoint + target.path(event_id),
                              params={"api-version": API_VERSION}, headers={"Accept": "application/json"})
        try:
            response = self._client.send_request(request, connection_timeout=self.settings.timeout,
                                                  read_timeout=self.settings.timeout)
        except AzureError as exc:  # no token, unreachable, retries exhausted on a dropped connection
            return {"ok": False, "final": False, "http_status": None, "reason": f"arm_unavailable: {_text(exc.message)}"}
        status = response.status_code
        if status == 200:
            return {"ok": True, "final": True, "http_status": 200, "reason": "approved"}
        try:
            error = json.loads(response.text()).get("error") or {}
        except (ValueError, AttributeError):
            error = {}
        code = _text(error.get("code", "")) if isinstance(error, dict) else ""
        # 408/429/5xx were retried by the pipeline already: not final, a later copy may try again.
        final = status not in (408, 429) and status < 500
        return {"ok": False, "final": final, "http_status": status, "reason": f"arm_{status}_{code or 'error'}"}

    def platform_refusal(self, target: ArmTarget, event_id: str) -> dict[str, Any] | None:
        """None when Azure's own record of ``event_id`` on ``target`` names ``target.vm_name`` and the
        event is Scheduled; else why not, as an answer ({"ok": False, "final", "http_status", "reason"})."""
        from azure.core.exceptions import AzureError
        from azure.core.rest import HttpRequest

        try:
            event_resource = target.event_id_in_graph(event_id)
        except ValueError:
            return {"ok": False, "final": True, "http_status": None, "reason": "not_a_plain_identifier"}
        request = HttpRequest("POST", self.settings.endpoint + "/providers/Microsoft.ResourceGraph/resources",
                              params={"api-version": GRAPH_API_VERSION},
                              headers={"Accept": "application/json", "Content-Type": "application/json"},
                              json={"subscriptions": [target.subscription], "query": graph_query(event_resource),
                                    "options": {"resultFormat": "objectArray"}})
        try:
            response = self._client.send_request(request, connection_timeout=self.settings.timeout,
                                                  read_timeout=self.settings.timeout)
        except AzureError as exc:
            return {"ok": False, "final": False, "http_status": None,
                    "reason": f"resource_graph_unavailable: {_text(exc.message)}"}
        status = response.status_code
        if status != 200:
            # Not final: the acknowledgement is never sent unconfirmed, and a later copy may try again.
            return {"ok": False, "final": False, "http_status": status, "reason": f"resource_graph_{status}"}
        try:
            rows = json.loads(response.text()).get("data")
        except (ValueError, AttributeError):
            rows = None
        if not isinstance(rows, list):
            return {"ok": False, "final": False, "http_status": status, "reason": "resource_graph_unreadable"}
        row = next((r for r in rows if isinstance(r, dict) and str(r.get("id", "")).lower() == event_resource.lower()),
                   None)
        properties = row.get("properties") if row is not None else None
        if not isinstance(properties, dict):
            # Resource Graph lags the platform by seconds: a later copy of the record may find it.
            return {"ok": False, "final": False, "http_status": status, "reason": "platform_has_no_such_event"}
        if not names_vm(properties.get("Resources"), target.vm_name):
            log.warning("record of %s claimed event %s, whose Resources on the platform are %.300r: not acknowledged",
                        target.vm_name, event_id, properties.get("Resources"))
            return {"ok": False, "final": True, "http_status": status, "reason": "platform_does_not_name_this_vm"}
        names = [r.lstrip("_") for r in properties["Resources"] if isinstance(r, str) and r.lstrip("_")]
        if min(names, key=lambda name: (name.lower(), name)).lower() != target.vm_name.lower():
            # The leader rule on the platform's own list, as the agent's callback applies it on its IMDS.
            return {"ok": False, "final": True, "http_status": status, "reason": "platform_names_another_leader"}
        if properties.get("EventStatus") != "Scheduled":
            return {"ok": False, "final": True, "http_status": status, "reason": "platform_event_not_scheduled"}
        return None


def names_vm(resources: object, vm_name: str) -> bool:
    """Whether the platform's ``Resources`` name ``vm_name`` ("_" prefix stripped, any case)."""
    mine = vm_name.lower()
    return isinstance(resources, list) and any(isinstance(r, str) and r.lstrip("_").lower() == mine for r in resources)


def graph_query(event_resource_id: str) -> str:
    """The Resource Graph query for one event (the id is a plain-name path: nothing to escape but quotes)."""
    literal = event_resource_id.replace("\\", "\\\\").replace("'", "\\'")
    return (f"maintenanceresources | where type =~ '{EVENT_TYPE}' | where id =~ '{literal}' "
            "| project id, properties")


class ArmRoute:
    """APPROVAL_ROUTE=arm: acknowledge on the authenticated VM's own resource, with the app's identity."""

    name = "arm"

    def __init__(self, settings: ArmSettings, client: ArmClient | None = None) -> None:
        self.settings = settings
        self._client = client

    @property
    def client(self) -> ArmClient:
        if self._client is None:  # lazily: a dry run or an untrusted stream never needs a token
            self._client = ArmClient(self.settings)
        return self._client

    def delivery(self, vm: VmIdentity) -> Delivery:
        target = target_for(vm)

        def send(event_id: str, note: str) -> dict[str, Any]:
            if target.shared:  # ARM would accept any member's event here: believe only the platform
                refusal = self.client.platform_refusal(target, event_id)
                if refusal is not None:
                    return refusal
            return self.client.acknowledge(target, event_id)
        return Delivery(f"{target.resource_type}/{target.name}", target.resource(), send)


class ArmRemoteApprover(RemoteApprover):
    """pipeline.RemoteApprover (the one decision path) delivering through ARM."""

    def __init__(self, settings: ArmSettings, *, client: ArmClient | None = None, deduper: Deduper | None = None,
                 seen: SeenRecords | None = None) -> None:
        super().__init__(settings, route=ArmRoute(settings, client), deduper=deduper, seen=seen)


def from_env(env: Mapping[str, str] | None = None) -> ArmRemoteApprover:
    return ArmRemoteApprover(ArmSettings.from_env(os.environ if env is None else env))
