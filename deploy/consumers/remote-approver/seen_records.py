"""A durable record of the records acted on: a replayed record is acted on once, and a record whose
approval a crash cut short is acted on again.

One SQLite file (``SEEN_RECORDS_PATH``); keys are ``<vm resource id>|<record id>``, kept ``retention``
seconds (longer than RECORD_MAX_AGE: an older record is refused as stale anyway, so its key can go).

A claim is *pending* from the moment the approval is about to be sent until ``settle`` (the answer
was final: approved or refused) or ``release`` (a transient failure: a redelivery tries again). A
pending claim names its owner process (host, pid, the pid's start time). The next copy of the record
takes over a claim whose owner is gone — on this host: no such pid, or the pid reused by another
process; on another host (where nothing can be checked): after ``lease`` seconds. A claim held by a
live owner answers as a replay does. Without this, a process killed between claiming and sending
left the record "seen" for good: its redelivery answered ``replayed`` and the approval was never sent.
"""
from __future__ import annotations

import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

PURGE_EVERY = 500  # claims between two purges of expired keys
LEASE = 600.0  # seconds a claim from another host stays its owner's (a send takes at most a few minutes)


def _started(pid: int) -> str:
    """The start time of process ``pid`` (Linux: /proc/PID/stat field 22, in clock ticks); "" unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # the fields after the command name, which may hold spaces


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 would signal our own process group: a damaged owner, not a process
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a pid no process can have
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


HOST = socket.gethostname()


def owner_token(pid: int | None = None) -> str:
    """``host|pid|start`` of this process (or of ``pid`` on this host)."""
    pid = os.getpid() if pid is None else pid
    return f"{HOST}|{pid}|{_started(pid)}"


def owner_gone(owner: str) -> bool | None:
    """Whether the process that made a claim is gone: True/False on this host, None on another."""
    host, _, rest = owner.partition("|")
    pid_text, _, started = rest.partition("|")
    if host != HOST or not pid_text.isdigit():
        return None
    pid = int(pid_text)
    if not _alive(pid):
        return True
    return bool(started) and _started(pid) not in ("", started)  # the pid now belongs to another process


class SeenRecords:
    """``claim(key)`` is True once per key (across restarts and processes sharing the file), and
    again when the claim's owner died before ``settle`` or ``release``."""

    def __init__(self, path: Path, retention: float, clock: Callable[[], float] = time.time,
                 lease: float = LEASE) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS seen (key TEXT PRIMARY KEY, at REAL NOT NULL)")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(seen)")}
        if "owner" not in columns:  # a file from before pending claims: its keys count as settled (owner NULL)
            self._db.execute("ALTER TABLE seen ADD COLUMN owner TEXT")
        self._retention = retention
        self._lease = lease
        self._clock = clock
        self._owner = owner_token()
        self._lock = threading.Lock()
        self._claims = 0

    def claim(self, key: str) -> bool:
        """Take ``key`` (pending, this process): True when it was free or its owner is gone."""
        now = self._clock()
        with self._lock:
            self._claims += 1
            if self._claims % PURGE_EVERY == 1:
                self._db.execute("DELETE FROM seen WHERE at < ?", (now - self._retention,))
            for _ in range(2):  # a second round when the key was released between the insert and the read
                if self._db.execute("INSERT OR IGNORE INTO seen (key, at, owner) VALUES (?, ?, ?)",
                                    (key, now, self._owner)).rowcount == 1:
                    return True
                row = self._db.execute("SELECT at, owner FROM seen WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    break
            else:
                return False
            at, owner = row
            if owner is None or owner == self._owner:  # acted on; or being acted on here
                return False
            gone = owner_gone(owner)
            if gone is False or (gone is None and now - at < self._lease):
                return False
            # The owner died between claiming and settling: take the claim over (compare and set).
            return self._db.execute("UPDATE seen SET owner = ?, at = ? WHERE key = ? AND owner = ?",
                                    (self._owner, now, key, owner)).rowcount == 1

    def settle(self, key: str) -> None:
        """The approval got a final answer: ``key`` is acted on, for good."""
        with self._lock:
            self._db.execute("UPDATE seen SET owner = NULL WHERE key = ?", (key,))

    def release(self, key: str) -> None:
        """Forget ``key`` after a transient failure, so a redelivery of the record tries again."""
        with self._lock:
            self._db.execute("DELETE FROM seen WHERE key = ?", (key,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
