"""A durable cache of the records already acted on, so a replayed record is acted on once.

One SQLite file (``SEEN_RECORDS_PATH``); keys are ``<source>|<record id>``, kept ``retention``
seconds (longer than RECORD_MAX_AGE: an older record is refused as stale anyway, so its key can go).
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

PURGE_EVERY = 500  # claims between two purges of expired keys


class SeenRecords:
    """``claim(key)`` is True once per key (across restarts and processes sharing the file)."""

    def __init__(self, path: Path, retention: float, clock: Callable[[], float] = time.time) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS seen (key TEXT PRIMARY KEY, at REAL NOT NULL)")
        self._retention = retention
        self._clock = clock
        self._lock = threading.Lock()
        self._claims = 0

    def claim(self, key: str) -> bool:
        now = self._clock()
        with self._lock:
            self._claims += 1
            if self._claims % PURGE_EVERY == 1:
                self._db.execute("DELETE FROM seen WHERE at < ?", (now - self._retention,))
            cursor = self._db.execute("INSERT OR IGNORE INTO seen (key, at) VALUES (?, ?)", (key, now))
            return cursor.rowcount == 1

    def release(self, key: str) -> None:
        """Forget ``key`` after a transient failure, so a redelivery of the record tries again."""
        with self._lock:
            self._db.execute("DELETE FROM seen WHERE key = ?", (key,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
