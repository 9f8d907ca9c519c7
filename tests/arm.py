"""Helpers for tests of the Azure Resource Manager route: the emulator's HTTPS ARM side (a trustme
test CA) and the environment that points azure-identity and azure-core at it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trustme

from forwarder.emulator import Emulator


@dataclass(frozen=True)
class ArmCerts:
    cert: Path
    key: Path
    ca: Path


def arm_certs(directory: Path) -> ArmCerts:
    """A server certificate for 127.0.0.1 signed by a fresh test CA, as PEM files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    certs = ArmCerts(directory / "arm-cert.pem", directory / "arm-key.pem", directory / "arm-ca.pem")
    issued.cert_chain_pems[0].write_to_path(str(certs.cert))
    issued.private_key_pem.write_to_path(str(certs.key))
    ca.cert_pem.write_to_path(str(certs.ca))
    return certs


def arm_emulator(certs: ArmCerts, **options: Any) -> Emulator:
    """An emulator (not started) that also serves ARM; no IMDS rate limit unless asked."""
    options.setdefault("rate_limit", None)
    return Emulator(arm_tls=(certs.cert, certs.key), **options)


def arm_env(emu: Emulator, certs: ArmCerts, home: Path) -> dict[str, str]:
    """Environment for a `sefwd approve --via arm` subprocess: managed identity from the emulator's
    token endpoint (DefaultAzureCredential), the test CA for TLS, the emulator as ARM endpoint, and
    nothing from the developer's own Azure login (HOME, AZURE_* cleared)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "SEFWD_", "IDENTITY_", "MSI_"))}
    env.update({
        "AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url,
        "REQUESTS_CA_BUNDLE": str(certs.ca),
        "SEFWD_ARM_ENDPOINT": emu.arm_url,
        "HOME": str(home),
        "AZURE_CONFIG_DIR": str(home / ".azure"),
    })
    return env


def resource_id(emu: Emulator, vm: str) -> str:
    return str(emu.stats()["vms"][vm]["resourceId"])


def event_status(emu: Emulator, event_id: str) -> str | None:
    return next((e["EventStatus"] for e in emu.stats()["events"] if e["EventId"] == event_id), None)
