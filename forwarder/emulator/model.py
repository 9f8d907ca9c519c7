"""Events, VMs and api-version rendering of the emulated IMDS, faithful to the seed docs."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime, parsedate_to_datetime
from typing import Any

from forwarder.common.values import parse_duration
from forwarder.imds.event_types import EVENT_TYPES as _EVENT_TYPES
from forwarder.imds.event_types import TYPE_SINCE as _TYPE_SINCE

# Oldest first; the seeds' changelog says which fields each version added.
SE_VERSIONS: tuple[str, ...] = (
    "2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01",
    "2024-07-09",  # adds SpotRebalanceRecommendation; not available everywhere (IMDS answers 404 there)
)
# The newest generally available version: an emulator told not to serve newer ones answers 404 to them.
GA_SE_VERSION = "2020-07-01"
# Instance metadata versions IMDS lists under /metadata/versions (public docs).
INSTANCE_VERSIONS: tuple[str, ...] = (
    "2017-03-01", "2017-04-02", "2017-08-01", "2017-10-01", "2017-12-01", "2018-02-01", "2018-04-02",
    "2018-10-01", "2019-02-01", "2019-03-11", "2019-04-30", "2019-06-01", "2019-06-04", "2019-08-01",
    "2019-08-15", "2019-11-01", "2020-06-01", "2020-07-15", "2020-09-01", "2020-10-01", "2020-12-01",
    "2021-01-01", "2021-02-01", "2021-03-01", "2021-05-01", "2021-08-01", "2021-10-01", "2021-11-01",
    "2021-11-15", "2021-12-13", "2022-02-01", "2022-03-01", "2022-05-01", "2022-07-01", "2022-08-01",
    "2022-09-01", "2022-11-01", "2023-01-01", "2023-03-01", "2023-05-01", "2023-07-01", "2023-11-15",
    "2024-03-01",
)
MIN_COMPUTE_VERSION = "2017-04-02"
MIN_TOKEN_VERSION = "2018-02-01"
_VERSION_RE = re.compile(r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$")

EVENT_TYPES = _EVENT_TYPES
EVENT_SOURCES = ("Platform", "User")
SCHEDULED, STARTED = "Scheduled", "Started"

# Minimum notice per type (seeds: "Event Scheduling"); Terminate is user-configurable 5-15 min.
# SpotRebalanceRecommendation is advisory, with no promised notice: the emulator gives it Preempt's.
MIN_NOTICE: dict[str, float] = {"Freeze": 900.0, "Reboot": 900.0, "Redeploy": 600.0, "Preempt": 30.0, "Terminate": 300.0,
                                "SpotRebalanceRecommendation": 30.0}
# The version in which each type became visible; older versions simply never show it.
TYPE_SINCE = _TYPE_SINCE

DEFAULT_DESCRIPTIONS = {
    ("Freeze", "Platform"): "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
    ("Reboot", "Platform"): "Host server is undergoing maintenance.",
    ("Redeploy", "Platform"): "Virtual machine is being redeployed to another host because of hardware maintenance.",
    ("Reboot", "User"): "Virtual machine is going to be restarted as requested by authorized user.",
    ("Redeploy", "User"): "Virtual machine is going to be redeployed as requested by authorized user.",
    ("Preempt", "Platform"): "Spot virtual machine is being evicted because Azure needs the capacity back.",
    ("SpotRebalanceRecommendation", "Platform"): "Spot virtual machine is at an elevated risk of eviction.",
    ("Terminate", "User"): "Virtual machine is being deleted as requested by authorized user.",
    ("Terminate", "Platform"): "Virtual machine is being deleted.",
}

# IMDS field names accepted as aliases of spec keys (handy for the JSON control API).
SPEC_ALIASES = {
    "EventId": "id", "EventType": "type", "EventStatus": "status", "EventSource": "source",
    "Description": "description", "DurationInSeconds": "duration", "Resources": "resources",
    "ResourceType": "resource_type", "NotBefore": "not_before",
}
SPEC_KEYS = frozenset({
    "id", "type", "status", "source", "description", "duration", "resources", "resource_type",
    "not_before", "start_after", "complete_after", "require_all_approvals",
})
UPDATE_KEYS = frozenset({"type", "source", "description", "duration", "resources", "not_before",
                         "start_after", "complete_after"})


class SpecError(ValueError):
    """An event spec, fault spec or scenario step is invalid."""


def looks_like_version(value: str) -> bool:
    """True for a syntactically valid YYYY-MM-DD api-version."""
    return bool(_VERSION_RE.match(value))


def rfc1123(dt: datetime) -> str:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` as in every doc and capture."""
    return format_datetime(dt.astimezone(timezone.utc).replace(microsecond=0), usegmt=True)


def iso_z(dt: datetime) -> str:
    """``2016-09-19T18:29:47Z`` as the 2017-03-01 preview doc shows."""
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_not_before(value: object, now: datetime, scale: float = 1.0) -> datetime:
    """A datetime from an aware datetime, "+15m" (relative to now, times ``scale``), RFC 1123 or ISO 8601 text."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("+"):
            return now + timedelta(seconds=parse_duration(text[1:]) * scale)
        try:
            return parsedate_to_datetime(text).astimezone(timezone.utc)
        except (TypeError, ValueError, IndexError):
            pass
        try:
            dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise SpecError(f"not_before: expected RFC 1123, ISO 8601 or '+<duration>', got {value!r}") from None
        return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    raise SpecError(f"not_before: expected a time string, got {value!r}")


def _seconds(key: str, value: object) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise SpecError(f"{key}: {exc}") from None


def normalize_spec(spec: dict[str, Any], *, allowed: frozenset[str] = SPEC_KEYS) -> dict[str, Any]:
    """Map IMDS-style aliases to spec keys and reject unknown or mistyped keys."""
    out: dict[str, Any] = {}
    problems = []
    for key, value in spec.items():
        key = SPEC_ALIASES.get(key, key)
        if key not in allowed:
            problems.append(f"unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")
            continue
        out[key] = value
    if "type" in out and out["type"] not in EVENT_TYPES:
        problems.append(f"type must be one of {', '.join(EVENT_TYPES)}, got {out['type']!r}")
    if "source" in out and out["source"] not in EVENT_SOURCES:
        problems.append(f"source must be Platform or User, got {out['source']!r}")
    if "status" in out and out["status"] not in (SCHEDULED, STARTED):
        problems.append(f"status must be Scheduled or Started, got {out['status']!r}")
    if "duration" in out and (isinstance(out["duration"], bool) or not isinstance(out["duration"], int)):
        problems.append(f"duration (DurationInSeconds) must be an integer, got {out['duration']!r}")
    if "resources" in out and (not isinstance(out["resources"], list)
                               or not all(isinstance(r, str) and r for r in out["resources"])):
        problems.append("resources must be a list of VM names")
    for key in ("id", "description", "resource_type"):
        if key in out and not isinstance(out[key], str):
            problems.append(f"{key} must be a string")
    for key in ("start_after", "complete_after"):
        if key in out:
            try:
                out[key] = _seconds(key, out[key])
            except SpecError as exc:
                problems.append(str(exc))
    if problems:
        raise SpecError("; ".join(problems))
    return out


@dataclass
class Event:
    """One scheduled event as the platform holds it (rendered per api-version on read)."""

    id: str
    type: str
    resources: list[str]
    status: str
    not_before: datetime | None
    description: str
    source: str
    duration: int
    resource_type: str = "VirtualMachine"
    require_all_approvals: bool = False
    approvals: list[str] = field(default_factory=list)
    started_by: str = ""
    # Real seconds (already scaled): Started -> removal. Unapproved, an event starts at its NotBefore.
    complete_after: float = 2.0
    # Bumped whenever pending timers for this event must be ignored.
    timer_gen: int = 0

    def visible_in(self, version: str) -> bool:
        since = TYPE_SINCE.get(self.type)
        return since is None or version >= since

    def render(self, version: str) -> dict[str, Any]:
        """The event object in the key order of the seeds' example documents."""
        preview = version == "2017-03-01"
        if self.status == STARTED or self.not_before is None:
            nb = ""
        else:
            nb = iso_z(self.not_before) if preview else rfc1123(self.not_before)
        out: dict[str, Any] = {
            "EventId": self.id,
            "EventStatus": self.status,
            "EventType": self.type,
            "ResourceType": self.resource_type,
            "Resources": [f"_{r}" for r in self.resources] if preview else list(self.resources),
            "NotBefore": nb,
        }
        if version >= "2019-04-01":
            out["Description"] = self.description
        if version >= "2019-08-01":
            out["EventSource"] = self.source
        if version >= "2020-07-01":
            out["DurationInSeconds"] = self.duration
        return out


_SUBSCRIPTION = "8d10da13-8125-4ba9-a717-bf7490507b3d"


@dataclass
class VmProfile:
    """Instance metadata of one emulated VM; every value is a string, "" when missing."""

    name: str
    vm_id: str = ""
    computer_name: str = ""
    resource_id: str = ""
    subscription_id: str = _SUBSCRIPTION
    resource_group_name: str = "myResourceGroup"
    location: str = "norwayeast"
    zone: str = ""
    vm_scale_set_name: str = ""
    vm_size: str = "Standard_D2s_v5"
    os_type: str = "Linux"
    tags: dict[str, str] = field(default_factory=dict)
    # Not in instance metadata: the availability set ARM knows the VM by (forwarder.emulator.arm).
    availability_set: str = ""

    def __post_init__(self) -> None:
        # Scale-set instances are named <scaleset>_<instanceId> (FACTS); derive the rest like Azure does.
        prefix, _, instance = self.name.rpartition("_")
        is_vmss_instance = bool(self.vm_scale_set_name) and prefix == self.vm_scale_set_name and instance.isdigit()
        if not self.vm_id:
            self.vm_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"sefwd-emulator:{self.name}"))
        if not self.computer_name:
            self.computer_name = f"{prefix}{int(instance):06d}" if is_vmss_instance else self.name
        if not self.resource_id:
            base = (f"/subscriptions/{self.subscription_id}/resourceGroups/{self.resource_group_name}"
                    "/providers/Microsoft.Compute")
            if is_vmss_instance:
                self.resource_id = f"{base}/virtualMachineScaleSets/{prefix}/virtualMachines/{instance}"
            else:
                self.resource_id = f"{base}/virtualMachines/{self.name}"

    @classmethod
    def from_spec(cls, spec: str | dict[str, Any]) -> VmProfile:
        if isinstance(spec, str):
            return cls(name=spec)
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise SpecError(f"a VM must be a name or a table with a name, got {spec!r}")
        allowed = set(cls.__dataclass_fields__)
        unknown = set(spec) - allowed
        if unknown:
            raise SpecError(f"unknown VM keys {sorted(unknown)} (allowed: {', '.join(sorted(allowed))})")
        tags = spec.get("tags", {})
        if not isinstance(tags, dict):
            raise SpecError("VM tags must be a table of strings")
        fields = {k: str(v) for k, v in spec.items() if k != "tags"}
        return cls(**fields, tags={str(k): str(v) for k, v in tags.items()})

    def compute(self) -> dict[str, Any]:
        """The ``/metadata/instance/compute`` document (the fields FACTS lists, plus a few real ones)."""
        return {
            "azEnvironment": "AzurePublicCloud",
            "location": self.location,
            "name": self.name,
            "osProfile": {"adminUsername": "azureuser", "computerName": self.computer_name,
                          "disablePasswordAuthentication": "true"},
            "osType": self.os_type,
            "resourceGroupName": self.resource_group_name,
            "resourceId": self.resource_id,
            "subscriptionId": self.subscription_id,
            "tags": ";".join(f"{k}:{v}" for k, v in self.tags.items()),
            "tagsList": [{"name": k, "value": v} for k, v in self.tags.items()],
            "vmId": self.vm_id,
            "vmScaleSetName": self.vm_scale_set_name,
            "vmSize": self.vm_size,
            "zone": self.zone,
        }
