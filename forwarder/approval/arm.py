"""Approve through Azure Resource Manager: ``Microsoft.Maintenance`` scheduled-event acknowledgement.

``POST {arm}/subscriptions/{sub}/resourcegroups/{rg}/providers/Microsoft.Compute/{type}/{name}
/providers/Microsoft.Maintenance/scheduledevents/{EventId}/acknowledge?api-version=2023-10-01-preview``
(REST spec ``ScheduledEvents_Acknowledge``; ``az maintenance scheduledevents acknowledge``). The
request goes through azure-mgmt-core's ``ARMPipelineClient`` (azure-core retry with Retry-After,
bearer tokens from an azure-identity credential for ``https://management.azure.com/.default``).
Needs the ``[arm]`` extra; azure-core is imported only when a client is built.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

DEFAULT_ENDPOINT = "https://management.azure.com"
DEFAULT_SCOPE = "https://management.azure.com/.default"
API_VERSION = "2023-10-01-preview"
# Built-in role with exactly Microsoft.Maintenance/scheduledevents/acknowledge/action (and reads of
# VMs, scale sets, availability sets): "Scheduled Events Contributor".
ROLE_NAME = "Scheduled Events Contributor"
ROLE_ID = "b67fe603-310e-4889-b9ee-8257d09d353d"
RESOURCE_TYPES = {"virtualmachines": "virtualMachines", "virtualmachinescalesets": "virtualMachineScaleSets",
                  "availabilitysets": "availabilitySets"}
MAX_TEXT = 300


@dataclass(frozen=True)
class ArmTarget:
    """The Compute resource an acknowledgement is addressed to (a scale-set instance: its scale set)."""

    subscription: str
    resource_group: str
    resource_type: str  # virtualMachines | virtualMachineScaleSets | availabilitySets
    name: str
    instance: str | None = None  # the scale-set instance the resource id named, if any

    @classmethod
    def from_resource_id(cls, resource_id: str) -> ArmTarget:
        """Parse a VM, scale-set instance, scale-set or availability-set resource ID; ValueError if not one."""
        parts = resource_id.strip().strip("/").split("/")
        lower = [p.lower() for p in parts]
        shape = ("/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/"
                 "{virtualMachines|virtualMachineScaleSets|availabilitySets}/{name}[/virtualMachines/{instance}]")
        if (len(parts) not in (8, 10) or lower[0] != "subscriptions" or lower[2] != "resourcegroups"
                or lower[4] != "providers" or lower[5] != "microsoft.compute" or not all(parts)):
            raise ValueError(f"not a Compute resource ID {resource_id!r}: expected {shape}")
        rtype = RESOURCE_TYPES.get(lower[6])
        if rtype is None:
            raise ValueError(f"resource type {parts[6]!r} has no scheduled events: expected {shape}")
        instance = None
        if len(parts) == 10:
            if rtype != "virtualMachineScaleSets" or lower[8] != "virtualmachines":
                raise ValueError(f"not a Compute resource ID {resource_id!r}: expected {shape}")
            instance = parts[9]
        return cls(parts[1], parts[3], rtype, parts[7], instance)

    @property
    def vm_name(self) -> str | None:
        """The name IMDS lists in Resources for this target's VM (``<scaleset>_<instance>``); None for a set."""
        if self.resource_type == "virtualMachines":
            return self.name
        if self.instance is not None:
            return f"{self.name}_{self.instance}"
        return None

    @property
    def resource_id(self) -> str:
        return (f"/subscriptions/{self.subscription}/resourceGroups/{self.resource_group}/providers/Microsoft.Compute/"
                f"{self.resource_type}/{self.name}")

    def acknowledge_path(self, event_id: str) -> str:
        """The request path, every component percent-escaped (a name can never add a path segment)."""
        def q(value: str) -> str:
            return quote(value, safe="")

        return (f"/subscriptions/{q(self.subscription)}/resourcegroups/{q(self.resource_group)}/providers/"
                f"Microsoft.Compute/{q(self.resource_type)}/{q(self.name)}/providers/Microsoft.Maintenance/"
                f"scheduledevents/{q(event_id)}/acknowledge")


@dataclass
class ArmAttempt:
    """What ARM answered for each EventId: approved, refused (final) or failed (worth a retry later)."""

    approved: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        if self.failed:
            return "failed"
        return "refused" if self.refused else "approved"

    def answer(self) -> dict[str, Any]:
        """Shaped like the on-VM route's answer (``Attempt.answer``): status, reason, approved, refused."""
        body: dict[str, Any] = {"status": self.outcome, "reason": self._reason(), "via": "arm"}
        if self.approved:
            body["approved"] = list(self.approved)
        if self.refused or self.failed:
            body["refused"] = {**self.refused, **self.failed}
        return body

    def _reason(self) -> str:
        reasons = list(self.failed.values()) or list(self.refused.values())
        return reasons[0].partition(":")[0] if reasons else "approved"


def _text(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def _reason(status: int, code: str) -> str:
    """A snake_case reason for a final refusal, from the HTTP status and the ARM error code."""
    if status == 401:
        return "not_authenticated"
    if status == 403:
        return "not_authorized"
    if status == 404:
        return "unknown_resource" if code == "ResourceNotFound" else "unknown_event"
    if status == 429:
        return "throttled"
    return "arm_error" if status >= 500 else "bad_request"


class ArmApprover:
    """Acknowledges scheduled events through ARM with one azure-mgmt-core pipeline (reuse it)."""

    def __init__(self, credential: Any, *, endpoint: str = DEFAULT_ENDPOINT, scope: str = DEFAULT_SCOPE,
                 retry_total: int = 4, retry_backoff_factor: float = 0.8, retry_backoff_max: float = 30.0,
                 timeout: float = 30.0, **transport: Any) -> None:
        from azure.core.configuration import Configuration
        from azure.core.pipeline import policies
        from azure.mgmt.core import ARMPipelineClient
        from azure.mgmt.core.policies import ARMChallengeAuthenticationPolicy

        from forwarder import __version__

        config: Configuration[Any, Any] = Configuration()
        config.headers_policy = policies.HeadersPolicy()
        config.user_agent_policy = policies.UserAgentPolicy(sdk_moniker=f"sefwd/{__version__}")
        config.proxy_policy = policies.ProxyPolicy()
        config.logging_policy = policies.NetworkTraceLoggingPolicy()
        config.retry_policy = policies.RetryPolicy(retry_total=retry_total, retry_backoff_factor=retry_backoff_factor,
                                                   retry_backoff_max=retry_backoff_max, timeout=timeout * 4)
        config.custom_hook_policy = policies.CustomHookPolicy()
        config.redirect_policy = policies.RedirectPolicy()
        config.authentication_policy = ARMChallengeAuthenticationPolicy(credential, scope)
        self.endpoint = endpoint.rstrip("/")
        self._timeout = timeout
        self._client: ARMPipelineClient[Any, Any] = ARMPipelineClient(base_url=self.endpoint, config=config, **transport)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ArmApprover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def acknowledge(self, target: ArmTarget, event_ids: Iterable[str]) -> ArmAttempt:
        """One acknowledgement per EventId (the single form, GA in every cloud); never raises for ARM's answers."""
        from azure.core.exceptions import AzureError, ClientAuthenticationError, ServiceRequestError
        from azure.core.rest import HttpRequest

        attempt = ArmAttempt()
        for event_id in event_ids:
            request = HttpRequest("POST", f"{self.endpoint}{target.acknowledge_path(event_id)}",
                                  params={"api-version": API_VERSION}, headers={"Accept": "application/json"})
            try:
                response = self._client.send_request(request, connection_timeout=self._timeout,
                                                      read_timeout=self._timeout)
            except ClientAuthenticationError as exc:  # the credential could not get a token
                attempt.failed[event_id] = f"no_credential: {_text(exc.message)}"
                continue
            except ServiceRequestError as exc:
                attempt.failed[event_id] = f"unreachable: {_text(exc.message)}"
                continue
            except AzureError as exc:  # e.g. retries exhausted on a dropped connection
                attempt.failed[event_id] = f"arm_error: {_text(exc.message)}"
                continue
            if response.status_code == 200:
                attempt.approved.append(event_id)
                continue
            code, message = _error_of(response.text())
            why = f"{_reason(response.status_code, code)}: HTTP {response.status_code} {code} {message}".rstrip()
            if response.status_code in (408, 429) or response.status_code >= 500:
                attempt.failed[event_id] = why  # azure-core retried it already
            else:
                attempt.refused[event_id] = why
        return attempt


def _error_of(text: str) -> tuple[str, str]:
    """ARM's ``{"error": {"code", "message"}}``, tolerating anything else."""
    try:
        doc = json.loads(text)
    except ValueError:
        return "", _text(text)
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict):
        return "", ""
    return _text(error.get("code") or ""), _text(error.get("message") or "")


def default_credential() -> Any:
    """azure-identity's DefaultAzureCredential (environment, workload identity, managed identity, Azure CLI …)."""
    from azure.identity import DefaultAzureCredential

    return DefaultAzureCredential()


__all__ = ["API_VERSION", "ArmApprover", "ArmAttempt", "ArmTarget", "DEFAULT_ENDPOINT", "DEFAULT_SCOPE",
           "ROLE_ID", "ROLE_NAME", "default_credential"]
