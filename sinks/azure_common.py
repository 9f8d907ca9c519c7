"""Shared by the Azure sinks: credentials, secrets and per-item outcomes; imported only when such a sink is configured."""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forwarder.sinkapi import Ok, Record, Reject, Result

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


class ItemLedger:
    """What became of each record of a batch the dispatcher is still retrying.

    Services that answer per item (Application Insights 206) or per request of a split batch (Event
    Grid) accept some records and refuse others before the batch as a whole is done. The ledger
    remembers both, so a retry sends only what is still pending, and a record refused for good is
    rejected alone (the dispatcher re-sends a rejected batch record by record) and dead-lettered
    with the service's reason. Bounded: a batch the dispatcher gave up on cannot grow it forever.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._accepted: OrderedDict[str, None] = OrderedDict()
        self._refused: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def pending(self, batch: Sequence[Record]) -> list[Record]:
        """The records neither accepted nor refused yet."""
        return [r for r in batch if r.id not in self._accepted and r.id not in self._refused]

    def accept(self, record: Record) -> None:
        self._remember(self._accepted, record.id, None)

    def refuse(self, record: Record, reason: str, detail: str) -> None:
        self._remember(self._refused, record.id, (reason, detail))

    def outcome(self, batch: Sequence[Record]) -> Result:
        """Once nothing is pending: Ok, the Reject of a lone refused record, or a Reject to go record by record."""
        refused = [r for r in batch if r.id in self._refused]
        if refused and len(batch) == 1:
            reason, detail = self._refused.pop(batch[0].id)
            return Reject(reason=reason, detail=detail)
        if refused:
            return Reject(reason="items_refused", detail=f"{len(refused)} of {len(batch)} refused")
        for record in batch:
            self._accepted.pop(record.id, None)
        return Ok()

    def _remember(self, store: OrderedDict[str, Any], key: str, value: Any) -> None:
        store[key] = value
        while len(store) > self._limit:
            store.popitem(last=False)
