"""Where reconciliation keeps what it saw: a small interface, and its SQLite implementation (one instance).

Everything is keyed by EventId (a Table Storage partition) and a row key, and every "do this once"
is a conditional insert (``claim``), so the same interface maps onto Azure Table Storage for
several instances: ``claim`` = ``create_entity`` (409 Conflict: already claimed), ``put`` =
``upsert_entity``, ``rows`` = a query on one PartitionKey, ``open_events`` = a query on a
``Open eq true`` index row per event (docs/platform-events.md, "State").
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol


class ReconcileState(Protocol):
    """What the reconciler needs from its state."""

    def claim(self, event_id: str, key: str) -> bool:
        """True the first time (event_id, key) is claimed, False ever after (Event Grid ids, once-only records)."""
        ...

    def has(self, event_id: str, key: str) -> bool:
        """Whether (event_id, key) was claimed."""
        ...

    def put(self, event_id: str, row: str, value: dict[str, Any]) -> None:
        """Write (replace) one row of an event."""
        ...

    def rows(self, event_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """The event's rows whose key starts with ``prefix``."""
        ...

    def set_open(self, event_id: str, due: float | None) -> None:
        """Mark the event as waiting for a check at ``due`` (unix seconds), or closed (None)."""
        ...

    def due(self, now: float) -> list[str]:
        """Events whose check is due by ``now``."""
        ...


class SqliteState:
    """ReconcileState in one SQLite file (or ``:memory:``): for one consumer instance and local runs."""

    def __init__(self, path: str | Path = ":memory:", *, retention: float = 14 * 86400.0) -> None:
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self.retention = retention
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS claims (event TEXT, key TEXT, at REAL, PRIMARY KEY (event, key))")
            self._db.execute("CREATE TABLE IF NOT EXISTS rows (event TEXT, row TEXT, value TEXT, at REAL, PRIMARY KEY (event, row))")
            self._db.execute("CREATE TABLE IF NOT EXISTS open (event TEXT PRIMARY KEY, due REAL)")

    def claim(self, event_id: str, key: str) -> bool:
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO claims VALUES (?, ?, ?)", (event_id, key, time.time()))
            return cur.rowcount == 1

    def has(self, event_id: str, key: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM claims WHERE event = ? AND key = ?", (event_id, key)).fetchone() is not None

    def put(self, event_id: str, row: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?)",
                             (event_id, row, json.dumps(value), time.time()))

    def rows(self, event_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        with self._lock:
            found = self._db.execute("SELECT row, value FROM rows WHERE event = ? AND substr(row, 1, ?) = ?",
                                     (event_id, len(prefix), prefix)).fetchall()
        return {row: json.loads(value) for row, value in found}

    def set_open(self, event_id: str, due: float | None) -> None:
        with self._lock:
            if due is None:
                self._db.execute("DELETE FROM open WHERE event = ?", (event_id,))
            else:
                self._db.execute("INSERT OR REPLACE INTO open VALUES (?, ?)", (event_id, due))

    def due(self, now: float) -> list[str]:
        with self._lock:
            return [e for (e,) in self._db.execute("SELECT event FROM open WHERE due <= ? ORDER BY due", (now,))]

    def purge(self, now: float | None = None) -> None:
        """Forget events older than ``retention`` (a replayed delivery older than that is accepted again)."""
        cutoff = (now or time.time()) - self.retention
        with self._lock:
            self._db.execute("DELETE FROM claims WHERE at < ?", (cutoff,))
            self._db.execute("DELETE FROM rows WHERE at < ?", (cutoff,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


__all__ = ["ReconcileState", "SqliteState"]
