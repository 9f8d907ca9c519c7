"""Where reconciliation keeps what it saw: a small interface, SQLite (one instance) and the setting that chooses.

Two kinds of entries, keyed by EventId:

* decisions (``claim``/``settle``/``release``): each record the reconciler makes is claimed before it is
  emitted (pending, with an owner and a lease), settled after the output took it, released when the
  output failed. Any number of instances sharing the state make each decision once; a claim whose owner
  died mid-way is taken over once its lease ran out (at-least-once delivery, at-most-once decisions).
* observations (``update``/``rows``): the platform's view of the event and each VM's report, merged
  atomically (read, change, write only if nobody wrote meanwhile), written before any decision reads them.

Open events (``set_open``/``due``/``reschedule``) say when an event must be looked at again: its
``fleet.missed`` check, or a decision another instance holds. ``STATE_BACKEND=table``
(``reconcile_table.TableReconcileState``, on deploy/consumers/shared/fleet_state.py) shares them
through Azure Table Storage; ``sqlite`` (the default) keeps them in one file.
"""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

TAKEN, DONE, BUSY = "taken", "done", "busy"  # what ``claim`` answers
DEFAULT_LEASE = 120.0  # seconds: an emit is one Event Hubs send; a dead owner's decisions wait this long
DEFAULT_RETENTION = 14 * 86400.0
DEFAULT_TABLE = "sefwdreconcile"

Change = Callable[[Any], dict[str, Any]]  # the current value (None when there is none) -> the new value


class ReconcileState(Protocol):
    """What the reconciler needs from its state (see the module docstring)."""

    lease: float  # seconds a decision's owner holds it before another instance may take it over

    def claim(self, event_id: str, key: str) -> str:
        """TAKEN: this instance now owns the decision; DONE: made already; BUSY: another live owner holds it."""
        ...

    def settle(self, event_id: str, key: str) -> None:
        """The decision's record got out: made for good."""
        ...

    def release(self, event_id: str, key: str) -> None:
        """The output failed: the next attempt (any instance) makes the decision again."""
        ...

    def has(self, event_id: str, key: str) -> bool:
        """Whether the decision is made or being made."""
        ...

    def update(self, event_id: str, row: str, change: Change) -> dict[str, Any]:
        """Replace one row of the event with ``change(current)`` atomically; returns the new value."""
        ...

    def rows(self, event_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """The event's rows whose key starts with ``prefix``."""
        ...

    def set_open(self, event_id: str, due: float) -> None:
        """Look at the event again by ``due`` (unix seconds; an earlier due already set stays)."""
        ...

    def due(self, now: float) -> list[tuple[str, str]]:
        """(EventId, token) of the events due by ``now``."""
        ...

    def reschedule(self, event_id: str, token: str, due: float | None) -> bool:
        """Move the event's check to ``due`` (None: close it), only if unchanged since ``due()`` gave ``token``."""
        ...

    def purge(self, now: float | None = None) -> int:
        """Forget decisions and observations ``retention`` after their last write; returns how many went."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


def owner_id() -> str:
    """Who holds a decision: the process, and a random part (a restarted process is a new owner)."""
    return f"{os.getpid()}|{uuid.uuid4().hex[:8]}"


class SqliteState:
    """ReconcileState in one SQLite file (or ``:memory:``): for one consumer instance and local runs."""

    def __init__(self, path: str | Path = ":memory:", *, lease: float = DEFAULT_LEASE,
                 retention: float = DEFAULT_RETENTION, clock: Callable[[], float] = time.time) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        self.lease, self.retention, self._clock = lease, retention, clock
        self.owner = owner_id()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS decisions (event TEXT, key TEXT, state TEXT, owner TEXT, "
                             "lease_until REAL, at REAL, PRIMARY KEY (event, key))")
            self._db.execute("CREATE TABLE IF NOT EXISTS observations (event TEXT, row TEXT, value TEXT, at REAL, "
                             "PRIMARY KEY (event, row))")
            self._db.execute("CREATE TABLE IF NOT EXISTS open_events (event TEXT PRIMARY KEY, due REAL, version INTEGER)")

    def _write(self, work: Callable[[], Any]) -> Any:
        """``work`` in one write transaction (other processes on the same file wait)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = work()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result

    def claim(self, event_id: str, key: str) -> str:
        def work() -> str:
            now = self._clock()
            found = self._db.execute("SELECT state, owner, lease_until FROM decisions WHERE event = ? AND key = ?",
                                     (event_id, key)).fetchone()
            if found is not None and found[0] == "settled":
                return DONE
            if found is not None and found[2] > now:
                return BUSY  # a live lease (ours too: the same decision in flight on another thread)
            self._db.execute("INSERT OR REPLACE INTO decisions VALUES (?, ?, 'pending', ?, ?, ?)",
                             (event_id, key, self.owner, now + self.lease, now))
            return TAKEN
        result: str = self._write(work)
        return result

    def settle(self, event_id: str, key: str) -> None:
        self._write(lambda: self._db.execute("INSERT OR REPLACE INTO decisions VALUES (?, ?, 'settled', '', 0, ?)",
                                             (event_id, key, self._clock())))

    def release(self, event_id: str, key: str) -> None:
        self._write(lambda: self._db.execute("DELETE FROM decisions WHERE event = ? AND key = ? AND owner = ? "
                                             "AND state = 'pending'", (event_id, key, self.owner)))

    def has(self, event_id: str, key: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM decisions WHERE event = ? AND key = ?",
                                    (event_id, key)).fetchone() is not None

    def update(self, event_id: str, row: str, change: Change) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            found = self._db.execute("SELECT value FROM observations WHERE event = ? AND row = ?",
                                     (event_id, row)).fetchone()
            value = change(json.loads(found[0]) if found else None)
            self._db.execute("INSERT OR REPLACE INTO observations VALUES (?, ?, ?, ?)",
                             (event_id, row, json.dumps(value), self._clock()))
            return value
        result: dict[str, Any] = self._write(work)
        return result

    def rows(self, event_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        with self._lock:
            found = self._db.execute("SELECT row, value FROM observations WHERE event = ? AND substr(row, 1, ?) = ?",
                                     (event_id, len(prefix), prefix)).fetchall()
        return {row: json.loads(value) for row, value in found}

    def set_open(self, event_id: str, due: float) -> None:
        self._write(lambda: self._db.execute(
            "INSERT INTO open_events VALUES (?, ?, 1) ON CONFLICT(event) DO UPDATE SET "
            "due = min(due, excluded.due), version = version + 1", (event_id, due)))

    def due(self, now: float) -> list[tuple[str, str]]:
        with self._lock:
            return [(e, str(v)) for e, v in self._db.execute(
                "SELECT event, version FROM open_events WHERE due <= ? ORDER BY due", (now,))]

    def reschedule(self, event_id: str, token: str, due: float | None) -> bool:
        if due is None:
            cur = self._write(lambda: self._db.execute("DELETE FROM open_events WHERE event = ? AND version = ?",
                                                       (event_id, int(token))))
        else:
            cur = self._write(lambda: self._db.execute(
                "UPDATE open_events SET due = ?, version = version + 1 WHERE event = ? AND version = ?",
                (due, event_id, int(token))))
        return bool(cur.rowcount == 1)

    def purge(self, now: float | None = None) -> int:
        """Forget events older than ``retention`` (a replayed delivery older than that is accepted again)."""
        cutoff = (self._clock() if now is None else now) - self.retention

        def work() -> int:
            decisions = self._db.execute("DELETE FROM decisions WHERE at < ?", (cutoff,)).rowcount
            return int(decisions + self._db.execute("DELETE FROM observations WHERE at < ?", (cutoff,)).rowcount)
        return int(self._write(work))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def state_from_env(settings: Mapping[str, str]) -> ReconcileState:
    """The state the app settings name: the remote approver's setting names (its README, "Scaling out").

    ``STATE_BACKEND``: ``sqlite`` (default; ``RECONCILE_STATE_PATH``: one instance) or ``table`` (Azure
    Table Storage, any number of instances: ``STATE_TABLE_ENDPOINT`` with the app's managed identity,
    ``AZURE_CLIENT_ID`` for a user-assigned one, or ``STATE_TABLE_CONNECTION``; ``STATE_TABLE_NAME``);
    ``STATE_LEASE_SECONDS``: how long a decision held by an instance that died waits for a takeover.
    Every problem is named at once; the connection string never appears in an error.
    """
    from reconcile_table import fleet_state  # the shared module: the same settings as every fleet-side consumer

    problems: list[str] = []
    found = fleet_state.table_settings(settings, problems, default_table=DEFAULT_TABLE)
    backend, connection, endpoint, table = found["backend"], found["connection"], found["endpoint"], found["table"]
    lease_text = settings.get("STATE_LEASE_SECONDS", "").strip() or str(DEFAULT_LEASE)
    try:
        lease = float(lease_text)
        if not lease > 0:
            raise ValueError
    except ValueError:
        problems.append(f"STATE_LEASE_SECONDS must be a positive number of seconds, got {lease_text!r}")
    if problems:
        raise ValueError("; ".join(problems))
    if backend == "sqlite":
        return SqliteState(settings.get("RECONCILE_STATE_PATH", "/tmp/sefwd-platform-events.db"), lease=lease)
    from reconcile_table import TableReconcileState

    if connection:
        return TableReconcileState.open(connection_string=connection, table=table, lease=lease)
    from azure.identity import DefaultAzureCredential

    credential = DefaultAzureCredential(managed_identity_client_id=settings.get("AZURE_CLIENT_ID", "").strip() or None)
    # The role is on the table alone (deploy/azure/approver-state creates it): do not try to create it.
    return TableReconcileState.open(endpoint=endpoint, credential=credential, table=table, lease=lease, create=False)


__all__ = ["BUSY", "DEFAULT_LEASE", "DEFAULT_TABLE", "DONE", "ReconcileState", "SqliteState", "TAKEN",
           "owner_id", "state_from_env"]
