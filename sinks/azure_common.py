"""Shared by the Azure sinks: credentials and secrets, imported only when such a sink is configured."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CREDENTIAL_KINDS = ("managed_identity",)


def check_credential_options(options: Mapping[str, Any], *, prefix: str = "") -> list[str]:
    """Problems with ``credential`` / ``client_id``."""
    problems = []
    kind = options.get("credential")
    if kind is not None and kind not in CREDENTIAL_KINDS:
        problems.append(f"{prefix}credential must be one of {', '.join(CREDENTIAL_KINDS)}, got {kind!r}")
    client_id = options.get("client_id")
    if client_id is not None and (not isinstance(client_id, str) or not client_id.strip()):
        problems.append(f"{prefix}client_id must be a non-empty string (the managed identity's client id)")
    if client_id is not None and kind is None:
        problems.append(f"{prefix}client_id needs credential = \"managed_identity\"")
    return problems


def managed_identity_credential(options: Mapping[str, Any]) -> Any:
    """A ManagedIdentityCredential (system-assigned, or user-assigned by ``client_id``).

    On a VM it asks IMDS for tokens; ``AZURE_POD_IDENTITY_AUTHORITY_HOST`` points it at the
    emulator in tests.
    """
    from azure.identity import ManagedIdentityCredential

    client_id = options.get("client_id")
    return ManagedIdentityCredential(client_id=client_id) if client_id else ManagedIdentityCredential()


def read_secret_text(options: Mapping[str, Any], name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value named by ``<name>_env`` (an env var) or ``<name>_file`` (a file); never inline."""
    env = os.environ if env is None else env
    var, path = options.get(f"{name}_env"), options.get(f"{name}_file")
    if var and path:
        raise ValueError(f"set only one of {name}_env and {name}_file")
    if var:
        value = env.get(str(var))
        if not value:
            raise ValueError(f"environment variable {var} (from {name}_env) is not set")
        return value.strip()
    if path:
        try:
            return Path(str(path)).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {name}_file {path}: {exc.strerror}") from None
    return None
