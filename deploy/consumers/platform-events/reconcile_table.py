"""ReconcileState in an Azure Storage table, shared by any number of instances (STATE_BACKEND=table).

Decisions are fleet_state claims (namespace ``reconcile``, key ``EventId\\nkey``: an insert that fails
on an existing row, a takeover conditional on the ETag once the owner's lease ran out). Observations
are one row each in the event's partition (``ev-`` + SHA-256 of the EventId; RowKey a SHA-256 of the
row name, kept in ``Row``; the JSON value in ``Value0``… chunks, a property holds 32K characters),
replaced only with the ETag they were read with. Open events are rows of partition ``open`` with
``Due``; ``set_open`` always writes (so a ``reschedule`` based on an older read fails with 412).
Decisions and observations carry ``Expires`` (``retention`` after their last write): ``purge`` deletes
them once it passed, as the SQLite state forgets them; open events go when they are done.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reconcile_state import BUSY, DEFAULT_LEASE, DEFAULT_RETENTION, DEFAULT_TABLE, DONE, TAKEN, Change

try:
    import fleet_state  # copied (linked) beside the app when published
except ImportError:  # run from the repository
    sys.path.append(str(Path(__file__).resolve().parent.parent / "shared"))
    import fleet_state

CHUNK = 30000  # characters per string property (Table Storage: 64 KiB, UTF-16)
OPEN = "open"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _partition(event_id: str) -> str:
    return "ev-" + _digest(event_id)[:40]


class TableReconcileState:
    """ReconcileState on ``fleet_state.TableState``: every write conditional, so instances decide once."""

    def __init__(self, state: Any, *, lease: float = DEFAULT_LEASE, retention: float = DEFAULT_RETENTION,
                 clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.lease = lease
        self.retention = retention
        self.owner = state.owner
        self._table = state.table
        self._clock = clock
        self._claims = fleet_state.TableClaims(state.table, "reconcile", lease=lease, retention=retention,
                                               owner=state.owner, clock=clock)

    @classmethod
    def open(cls, *, table: str = DEFAULT_TABLE, lease: float = DEFAULT_LEASE, clock: Callable[[], float] = time.time,
             owner: str | None = None, **options: Any) -> TableReconcileState:
        """``fleet_state.TableState.open``'s options (a connection string, or an endpoint and a credential)."""
        opened = fleet_state.TableState.open(table=table, **options)
        return cls(fleet_state.TableState(opened.table, owner=owner, clock=clock), lease=lease, clock=clock)

    # -- decisions --
    def claim(self, event_id: str, key: str) -> str:
        name = f"{event_id}\n{key}"
        if self._claims.claim(name):
            return TAKEN
        return DONE if self._claims.status(name) == fleet_state.SETTLED else BUSY

    def settle(self, event_id: str, key: str) -> None:
        self._claims.settle(f"{event_id}\n{key}")

    def release(self, event_id: str, key: str) -> None:
        self._claims.release(f"{event_id}\n{key}")

    def has(self, event_id: str, key: str) -> bool:
        return self._claims.status(f"{event_id}\n{key}") is not None

    # -- observations --
    def update(self, event_id: str, row: str, change: Change) -> dict[str, Any]:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from azure.data.tables import UpdateMode

        partition, key = _partition(event_id), _digest(row)
        while True:  # each round ends in a write, or a conflict another instance's write caused
            try:
                current = self._table.get_entity(partition, key)
            except ResourceNotFoundError:
                current = None
            value = change(None if current is None else _value(current))
            now = self._clock()
            entity = {"PartitionKey": partition, "RowKey": key, "EventId": event_id[:1000], "Row": row,
                      "At": now, "Expires": now + self.retention, **_chunks(json.dumps(value))}
            try:
                if current is None:
                    self._table.create_entity(entity)
                else:
                    self._table.update_entity(entity, mode=UpdateMode.REPLACE, etag=current.metadata["etag"],
                                              match_condition=MatchConditions.IfNotModified)
                return value
            except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError):
                continue

    def rows(self, event_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        found = self._table.query_entities("PartitionKey eq @p", parameters={"p": _partition(event_id)})
        return {str(e["Row"]): _value(e) for e in found if str(e.get("Row", "")).startswith(prefix)}

    # -- open events --
    def set_open(self, event_id: str, due: float) -> None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
        from azure.data.tables import UpdateMode

        key = _digest(event_id)
        while True:
            try:
                current = self._table.get_entity(OPEN, key)
            except ResourceNotFoundError:
                current = None
            entity = {"PartitionKey": OPEN, "RowKey": key, "EventId": event_id,
                      "Due": due if current is None else min(due, float(current["Due"]))}
            try:
                if current is None:
                    self._table.create_entity(entity)
                else:  # always a write: a reschedule based on an older read must fail
                    self._table.update_entity(entity, mode=UpdateMode.REPLACE, etag=current.metadata["etag"],
                                              match_condition=MatchConditions.IfNotModified)
                return
            except (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError):
                continue

    def due(self, now: float) -> list[tuple[str, str]]:
        found = self._table.query_entities("PartitionKey eq @p and Due le @now", parameters={"p": OPEN, "now": float(now)})
        return [(str(e["EventId"]), str(e.metadata["etag"])) for e in sorted(found, key=lambda e: float(e["Due"]))]

    def reschedule(self, event_id: str, token: str, due: float | None) -> bool:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError
        from azure.data.tables import UpdateMode

        key = _digest(event_id)
        try:
            if due is None:
                self._table.delete_entity(OPEN, key, etag=token, match_condition=MatchConditions.IfNotModified)
            else:
                self._table.update_entity({"PartitionKey": OPEN, "RowKey": key, "EventId": event_id, "Due": due},
                                          mode=UpdateMode.REPLACE, etag=token,
                                          match_condition=MatchConditions.IfNotModified)
            return True
        except (ResourceModifiedError, ResourceNotFoundError):
            return False

    def purge(self, now: float | None = None) -> int:
        """Delete decisions and observations ``retention`` after their last write (conditional on each ETag)."""
        return int(self.state.purge(now))

    def close(self) -> None:
        self.state.close()


def _chunks(text: str) -> dict[str, str]:
    parts = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    return {f"Value{n}": part for n, part in enumerate(parts)}


def _value(entity: Any) -> dict[str, Any]:
    parts, n = [], 0
    while f"Value{n}" in entity:
        parts.append(str(entity[f"Value{n}"]))
        n += 1
    value: dict[str, Any] = json.loads("".join(parts))
    return value


__all__ = ["TableReconcileState"]
