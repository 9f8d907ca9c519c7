"""Who this VM is (from IMDS instance metadata), and whether an event's Resources name it."""
from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class VmIdentity:
    """The VM fields carried in every record's ``data.Vm``; "" when unknown."""

    vm_id: str = ""
    name: str = ""
    computer_name: str = ""
    resource_id: str = ""
    subscription_id: str = ""
    resource_group_name: str = ""
    location: str = ""
    zone: str = ""
    vm_scale_set_name: str = ""

    @classmethod
    def from_compute(cls, compute: Mapping[str, Any]) -> VmIdentity:
        """Build from ``/metadata/instance/compute`` (computerName lives under osProfile)."""
        def s(value: object) -> str:
            return value if isinstance(value, str) else ""

        os_profile = compute.get("osProfile")
        computer_name = s(os_profile.get("computerName")) if isinstance(os_profile, Mapping) else ""
        return cls(
            vm_id=s(compute.get("vmId")),
            name=s(compute.get("name")),
            computer_name=computer_name or s(compute.get("computerName")),
            resource_id=s(compute.get("resourceId")),
            subscription_id=s(compute.get("subscriptionId")),
            resource_group_name=s(compute.get("resourceGroupName")),
            location=s(compute.get("location")),
            zone=s(compute.get("zone")),
            vm_scale_set_name=s(compute.get("vmScaleSetName")),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VmIdentity:
        return cls(**{k: str(v) for k, v in data.items() if k in cls.__dataclass_fields__})

    @classmethod
    def fallback(cls) -> VmIdentity:
        """Used when instance metadata was never readable: the host name is all we know."""
        host = socket.gethostname()
        return cls(name=host, computer_name=host)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def known(self) -> bool:
        return bool(self.vm_id or self.resource_id)

    @property
    def key(self) -> str:
        """Stable identity used in record ids."""
        return self.vm_id or self.resource_id or f"host:{self.computer_name or self.name}"

    @property
    def source(self) -> str:
        """CloudEvents ``source``: the resource id; ``/vm/<vmId>`` when instance metadata gave a vmId
        but no resourceId; ``/host/<hostname>`` only when instance metadata was never readable
        (no vmId exists then; README "Records" documents all three)."""
        if self.resource_id:
            return self.resource_id
        if self.vm_id:
            return f"/vm/{self.vm_id}"
        return f"/host/{self.computer_name or self.name or 'unknown'}"

    def record_data(self) -> dict[str, str]:
        """The ``data.Vm`` object, with IMDS-style names."""
        return {
            "VmId": self.vm_id,
            "Name": self.name,
            "ComputerName": self.computer_name,
            "ResourceId": self.resource_id,
            "SubscriptionId": self.subscription_id,
            "ResourceGroupName": self.resource_group_name,
            "Location": self.location,
            "Zone": self.zone,
            "VmScaleSetName": self.vm_scale_set_name,
        }

    def names(self) -> frozenset[str]:
        """Lower-cased names this VM may appear under in Resources."""
        return frozenset(n.lower() for n in (self.name, self.computer_name) if n)

    def affected_by(self, resources: Iterable[str]) -> bool | None:
        """Whether Resources names this VM; None when we do not know our own name."""
        names = self.names()
        if not names:
            return None
        # 2017-03-01 prefixed IaaS VM names with "_".
        return any(r.lstrip("_").lower() in names for r in resources)

    def is_leader(self, resources: Iterable[str]) -> bool | None:
        """True when this VM is the first of the sorted Resources (the approval leader)."""
        names = self.names()
        ordered = sorted(r.lstrip("_").lower() for r in resources)
        if not names or not ordered:
            return None
        return ordered[0] in names
