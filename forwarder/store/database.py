"""The agent's one store: ``state.db`` (SQLite, WAL) holds state, records, cursors, dead letters,
approvals, seen webhook ids, loss counters and the approval inbox.

Every change is one short transaction: a changed document, its records and the new sequence
counter commit together; a sink's cursor advance (with its dead letters) commits together.
Other processes (``sefwd status|approve|deadletter``) open the same file with ``connect``.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from forwarder.errors import StateError
from forwarder.sinkapi import Record
from forwarder.store.marker import Marker
from forwarder.store.actions import ACTIONS_SCHEMA

log = logging.getLogger(__name__)

DB_FILE = "state.db"
FORMAT = 1
BUSY_TIMEOUT_MS = 5000
# SQLite's page cache per connection (its default is 2000 KiB). The agent's working set is the tail of
# `records` and a few small tables; what grows is history (finished actions, kept 30 days). SQLite takes
# a new page slot for every page it has not seen until the cap is reached, so the cache is a slow
# climb to the cap, not a working set: at 1 MiB a soak (one event every 5 s) was still filling it after
# 45 minutes (heaptrack: the one C-level grower). 256 KiB fills within minutes; throughput of batched
# appends and of a cursor's drain stayed the same (benchmarks/journal.py, run both ways); older pages
# come from the OS page cache when a scan needs them.
PAGE_CACHE_KIB = 256
# Eviction order under the size cap: lifecycle first, then audits, scheduled events last.
PRIORITY_LIFECYCLE, PRIORITY_AUDIT, PRIORITY_EVENT = 0, 1, 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value BLOB);
CREATE TABLE IF NOT EXISTS records(
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- AUTOINCREMENT: an id is never handed out twice
    body BLOB NOT NULL, type TEXT NOT NULL, priority INTEGER NOT NULL, time_ms INTEGER NOT NULL
);
-- Only the records evicted first are indexed: a scheduled event's insert pays for no index.
CREATE INDEX IF NOT EXISTS records_evict_first ON records(priority, id) WHERE priority < 2;
CREATE TABLE IF NOT EXISTS cursors(sink TEXT PRIMARY KEY, next INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS dead_letters(
    id INTEGER PRIMARY KEY AUTOINCREMENT, sink TEXT NOT NULL, body BLOB NOT NULL,
    reason TEXT NOT NULL, detail TEXT NOT NULL, time TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_sink ON dead_letters(sink, id);
CREATE TABLE IF NOT EXISTS approvals(event_id TEXT PRIMARY KEY, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS webhook_ids(digest TEXT PRIMARY KEY, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS webhook_ids_expires ON webhook_ids(expires);
CREATE TABLE IF NOT EXISTS losses(sink TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
                                  PRIMARY KEY(sink, reason));
CREATE TABLE IF NOT EXISTS inbox(id INTEGER PRIMARY KEY AUTOINCREMENT, entry BLOB NOT NULL, time REAL NOT NULL);
"""
# (the actions table: forwarder.store.actions)



APPROVALS_KEPT = 1000  # accepted approvals remembered (the outcome evidence needs the recent ones)


def put_approvals(c: sqlite3.Connection, event_ids: Sequence[str], now: float, keep: int = APPROVALS_KEPT) -> None:
    """Remember accepted approvals inside the caller's transaction, keeping the newest ``keep``."""
    c.executemany("INSERT OR REPLACE INTO approvals VALUES (?, ?)", [(e.lower(), now) for e in event_ids])
    c.execute("DELETE FROM approvals WHERE event_id NOT IN (SELECT event_id FROM approvals ORDER BY time DESC LIMIT ?)",
              (keep,))

class StoreError(StateError):
    """The store could not commit (disk full, I/O error, locked too long); nothing was changed."""


def priority_of(rtype: str) -> int:
    if rtype.startswith("scheduledevent.") or rtype == "forwarder.data_lost":
        return PRIORITY_EVENT
    return PRIORITY_AUDIT if rtype.startswith("approval.") else PRIORITY_LIFECYCLE


def sequence_floor(now: float) -> int:
    """Wall-clock microseconds: a new database starts above any number an earlier one handed out.

    A counter that started at this floor passes it only by emitting more than one record per
    microsecond on average, which the agent never does; only a clock set back breaks it.
    """
    return int(now * 1_000_000)


def parse_meta(m: dict[str, Any], now: float) -> tuple[SavedState, list[str]]:
    """The state in a meta table, field by field: an unreadable field is dropped and named."""
    state, problems = SavedState(), []
    try:
        state.sequence = int(m["sequence"])
    except (KeyError, ValueError, TypeError):
        state.sequence = sequence_floor(now)
        problems.append("the sequence counter is unreadable; continuing from the wall-clock floor")
    for key in ("document", "api_version"):
        value = m.get(key)
        if isinstance(value, bytes):
            try:
                value = value.decode()
            except UnicodeDecodeError:
                value = 0
        if value is None or isinstance(value, str) and (key != "document" or _is_json(value)):
            setattr(state, key, value)
        else:
            problems.append(f"the saved {key} is unreadable; dropped")
    try:
        vm = orjson.loads(m["vm"]) if m.get("vm") else {}
        state.vm = {str(k): str(v) for k, v in vm.items()}
    except (ValueError, TypeError, AttributeError):
        problems.append("the saved VM identity is unreadable; dropped")
    try:
        evidence = orjson.loads(m["evidence"]) if m.get("evidence") else {}
        if not isinstance(evidence, dict):
            raise TypeError("not an object")
        state.evidence = evidence
    except (ValueError, TypeError) as exc:
        # Without it a reboot is "unknown", so no vanished event can be called canceled.
        problems.append(f"the saved outcome evidence is unreadable ({exc}); dropped")
    return state, problems


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
        return True
    except ValueError:
        return False


def connect(path: Path, *, fsync: bool = True) -> sqlite3.Connection:
    """A connection with the house settings; creates the schema if the file is new.

    On POSIX the file is opened as ``open_owned`` allows (no link, no FIFO, nobody else's: root's
    ``sefwd approve`` runs in the service user's directory), and SQLite must then open that very
    file: it is told not to create one (a link swapped in meanwhile creates nothing anywhere), and
    a connection to any other inode is closed before a single statement ran.
    """
    if os.name != "posix":
        new = not path.exists()
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
        if new:
            os.chmod(path, 0o640)
        return _configure(conn, fsync)
    from forwarder.common.owned_files import checked_sqlite

    return _configure(checked_sqlite(path, BUSY_TIMEOUT_MS / 1000), fsync)


def _configure(conn: sqlite3.Connection, fsync: bool) -> sqlite3.Connection:
    try:
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        conn.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
        conn.executescript(SCHEMA)
        conn.executescript(ACTIONS_SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass(frozen=True, slots=True)
class Entry:
    index: int
    appended_ms: int
    body: bytes


@dataclass
class SavedState:
    """What must survive a restart. ``document`` is the last good document's raw body."""

    sequence: int = 0
    document: str | None = None
    api_version: str | None = None
    vm: dict[str, str] = field(default_factory=dict)
    # forwarder.imds.evidence.evidence_to_dict(): the boot id the document was seen at, accepted approvals.
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    sink: str
    time: str
    reason: str
    detail: str
    record: Record | None  # None: the body is damaged (not a CloudEvents JSON object), see ``damage``
    raw: bytes = b""
    damage: str | None = None  # why the body cannot be read as a record

    def raw_text(self, limit: int = 1024) -> str:
        """The raw body for a reader: undecodable bytes as \\xNN, cut at ``limit`` characters."""
        text = self.raw[: limit * 4].decode("utf-8", "backslashreplace")
        return text if len(text) <= limit else text[: limit - 1] + "…"


def _dead_letter(i: int, sink: str, when: str, reason: str, detail: str, body: bytes) -> DeadLetter:
    """One row as a DeadLetter; a damaged body never fails the others (it is kept, marked)."""
    try:
        record: Record | None = Record.from_body(body)
        damage = None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        record, damage = None, f"damaged record body ({len(body)} bytes): {type(exc).__name__}: {str(exc)[:200]}"
    return DeadLetter(i, str(sink), str(when), str(reason), str(detail), record, body, damage)


class Store:
    """One connection shared by the agent's threads (a lock orders them); WAL lets others read."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, max_size: int = 256 * 1024 * 1024,
                 clock: Callable[[], float] = time.time) -> None:
        self.conn = conn
        self.path = path
        self.max_size = max_size
        self._clock = clock
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self.sinks: tuple[str, ...] = ()  # configured sinks: only they hold records back from collection
        row = conn.execute("SELECT total(length(body)), coalesce(max(id), 0) FROM records").fetchone()
        self.size = int(row[0])
        seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
        self.next_index = max(int(row[1]), int(seq[0]) if seq else 0) + 1
        self.append_failures = 0
        self._data_version: int | None = None
        self.marker: Marker | None = None  # the agent's store only (forwarder.store.recovery): high-water sequence
        self.inbox_written = False

    @classmethod
    def open(cls, state_dir: Path, *, fsync: bool = True, max_size: int = 256 * 1024 * 1024,
             clock: Callable[[], float] = time.time) -> Store:
        """Open (creating if needed) without any recovery: for the CLI next to a running agent."""
        path = Path(state_dir) / DB_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            conn = connect(path, fsync=fsync)
        except (OSError, sqlite3.Error) as exc:
            raise StateError(f"cannot open {path}: {exc}") from None
        return cls(conn, path, max_size=max_size, clock=clock)

    # -- transactions ---------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT; any failure rolls back and raises StoreError."""
        with self._lock:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                yield self.conn
                self.conn.execute("COMMIT")
            except sqlite3.Error as exc:
                try:
                    self.conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # no transaction left open (SQLite rolled it back itself)
                raise StoreError(f"{self.path}: {exc}") from None
            except BaseException:
                try:
                    self.conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """Rows of a read; raises StoreError."""
        with self._lock:
            try:
                return self.conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from None

    # -- state ----------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {k: v for k, v in self.query("SELECT key, value FROM meta")}

    def load_state(self) -> SavedState:
        """The saved state; a new database starts its sequence at the wall-clock floor."""
        m = self.meta()
        if "sequence" not in m:
            with self.transaction() as c:
                c.execute("INSERT OR IGNORE INTO meta VALUES ('sequence', ?), ('format', ?)",
                          (sequence_floor(self._clock()), FORMAT))
            m = self.meta()
        state, problems = parse_meta(m, self._clock())
        for problem in problems:
            log.error("%s: %s", self.path, problem)
        return state

    def commit(self, records: Sequence[Record], state: SavedState | None = None, *,
               inbox_ids: Sequence[int] = (),
               then: Callable[[sqlite3.Connection], Sequence[Record]] | None = None) -> None:
        """Records, the state they came from and the inbox rows they consumed, in one transaction;
        ``then`` writes more in the same transaction (the actions planned from these records) and
        returns the records that go with it (their audit)."""
        now_ms = int(self._clock() * 1000)
        rows: list[tuple[bytes, str, int, int]] = []
        added = 0
        try:
            with self.transaction() as c:
                if then is not None:
                    records = [*records, *then(c)]
                rows = [(r.body, r.type, priority_of(r.type), now_ms) for r in records]
                added = sum(len(r.body) for r in records)
                if rows:
                    c.executemany("INSERT INTO records(body, type, priority, time_ms) VALUES (?, ?, ?, ?)", rows)
                if state is not None:
                    c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
                        ("sequence", state.sequence), ("document", state.document),
                        ("api_version", state.api_version), ("vm", orjson.dumps(state.vm)),
                        ("evidence", orjson.dumps(state.evidence)),
                    ])
                if inbox_ids:
                    c.executemany("DELETE FROM inbox WHERE id = ?", [(i,) for i in inbox_ids])
                if self.size + added > self.max_size:
                    added -= self._evict(c, self.size + added - self.max_size)
        except StoreError:
            self.append_failures += 1
            raise
        if state is not None and self.marker is not None:
            self.marker.write(state.sequence)
        self.size += added
        if rows:
            with self.changed:  # this connection is the only writer of records: ids follow on
                self.next_index += len(rows)
                self.changed.notify_all()

    def _evict(self, c: sqlite3.Connection, excess: int) -> int:
        """Size cap: delete lowest priority, oldest first, counting each loss per sink; returns bytes freed."""
        freed = 0
        cursors = dict(c.execute("SELECT sink, next FROM cursors").fetchall())
        while freed < excess:
            victims = c.execute(f"SELECT id, length(body) FROM records WHERE priority < {PRIORITY_EVENT} "
                                "ORDER BY priority, id LIMIT 256").fetchall() or \
                c.execute("SELECT id, length(body) FROM records ORDER BY id LIMIT 256").fetchall()
            if not victims:
                break
            for rid, size in victims:
                for name in self.sinks:
                    if rid >= cursors.get(name, 0):
                        self._count(c, name, "evicted_size_cap", 1)
                freed += size
                c.execute("DELETE FROM records WHERE id = ?", (rid,))
                if freed >= excess:
                    break
        log.error("store over its size cap (%d bytes): evicted %d bytes of records", self.max_size, freed)
        return freed

    @staticmethod
    def _count(c: sqlite3.Connection, sink: str, reason: str, n: int) -> None:
        c.execute("INSERT INTO losses VALUES (?, ?, ?) ON CONFLICT(sink, reason) DO UPDATE SET count = count + excluded.count",
                  (sink, reason, n))

    def count_loss(self, sink: str, reason: str, n: int) -> None:
        with self.transaction() as c:
            self._count(c, sink, reason, n)

    def losses(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for sink, reason, n in self.query("SELECT sink, reason, count FROM losses"):
            out.setdefault(sink, {})[reason] = n
        return out

    # -- sink cursors ---------------------------------------------------------------------
    def cursor(self, sink: str) -> int:
        """Where a sink resumes; a sink new to this store starts at the oldest record kept."""
        row = self.query("SELECT next FROM cursors WHERE sink = ?", (sink,))
        if row:
            return int(row[0][0])
        oldest = self.query("SELECT coalesce(min(id), ?) FROM records", (self.next_index,))[0][0]
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO cursors VALUES (?, ?)", (sink, oldest))
        return int(oldest)

    def read(self, sink: str, position: int, limit: int) -> list[Entry]:
        rows = self.query(
            "SELECT id, time_ms, body FROM records WHERE id >= ? ORDER BY id LIMIT ?", (position, limit))
        return [Entry(int(i), int(t), bytes(b)) for i, t, b in rows]

    def backlog(self, sink: str, cursor: int) -> int:
        return int(self.query("SELECT count(*) FROM records WHERE id >= ?", (cursor,))[0][0])

    def advance(self, sink: str, next_index: int, dead: Sequence[tuple[bytes, str, str]] = (), now: str = "") -> None:
        """Move a sink's cursor, with the dead letters it set aside, in one transaction."""
        with self.transaction() as c:
            if dead:
                c.executemany("INSERT INTO dead_letters(sink, body, reason, detail, time) VALUES (?, ?, ?, ?, ?)",
                              [(sink, body, reason, detail[:2000], now) for body, reason, detail in dead])
            c.execute("INSERT INTO cursors VALUES (?, ?) ON CONFLICT(sink) DO UPDATE SET next = max(next, excluded.next)",
                      (sink, next_index))

    def collect(self) -> None:
        """Delete records every configured sink has passed."""
        if not self.sinks:
            return
        marks = ",".join("?" * len(self.sinks))
        with self.transaction() as c:
            low = c.execute(f"SELECT min(next), count(*) FROM cursors WHERE sink IN ({marks})", self.sinks).fetchone()
            if low[1] < len(self.sinks) or low[0] is None:
                return
            freed = c.execute("SELECT total(length(body)) FROM records WHERE id < ?", (low[0],)).fetchone()[0]
            if freed:
                c.execute("DELETE FROM records WHERE id < ?", (low[0],))
        self.size = max(0, self.size - int(freed))

    def wait(self, position: int, timeout: float, unless: Sequence[threading.Event] = ()) -> bool:
        """Wait until a record at or past ``position`` may exist (or timeout), or one of ``unless`` is set.

        ``unless`` is checked under the same lock as ``wake()`` takes: an event set just before a
        ``wake()`` is never missed (a worker told to drain does not sleep through it).
        """
        with self.changed:
            if position < self.next_index or any(event.is_set() for event in unless):
                return True
            self.changed.wait(timeout)
            return position < self.next_index or any(event.is_set() for event in unless)

    def refresh(self) -> bool:
        """Whether another connection committed since the last look (``sefwd approve``, a replay)."""
        version = self.query("PRAGMA data_version")[0][0]
        if version == self._data_version:
            return False
        self._data_version = version
        seq = self.query("SELECT seq FROM sqlite_sequence WHERE name = 'records'")
        with self.changed:
            self.next_index = max(self.next_index, int(seq[0][0]) + 1 if seq else 1)
            self.changed.notify_all()
        return True

    def wake(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -- dead letters ---------------------------------------------------------------------
    def dead_letters(self, sink: str | None = None) -> list[DeadLetter]:
        sql = "SELECT id, sink, time, reason, detail, body FROM dead_letters"
        rows = self.query(sql + (" WHERE sink = ? ORDER BY id" if sink else " ORDER BY sink, id"), (sink,) if sink else ())
        return [_dead_letter(i, s, t, r, d, b if isinstance(b, bytes) else str(b).encode("utf-8", "surrogateescape"))
                for i, s, t, r, d, b in rows]

    def dead_counts(self) -> dict[str, int]:
        return {s: n for s, n in self.query("SELECT sink, count(*) FROM dead_letters GROUP BY sink")}

    def settle_dead(self, ids: Sequence[int], reason: str | None = None, detail: str = "") -> None:
        """After a replay attempt: delete delivered dead letters, or record why they failed again."""
        with self.transaction() as c:
            if reason is None:
                c.executemany("DELETE FROM dead_letters WHERE id = ?", [(i,) for i in ids])
            else:
                c.executemany("UPDATE dead_letters SET reason = ?, detail = ? WHERE id = ?",
                              [(reason, detail[:2000], i) for i in ids])

    # -- approvals, webhook ids, inbox --------------------------------------------------------
    def approved(self, event_id: str) -> bool:
        return bool(self.query("SELECT 1 FROM approvals WHERE event_id = ?", (event_id.lower(),)))

    def add_approvals(self, event_ids: Sequence[str], keep: int = APPROVALS_KEPT) -> None:
        with self.transaction() as c:
            put_approvals(c, event_ids, self._clock(), keep)

    def add_webhook_id(self, digest: str, expires: float) -> bool:
        """Remember a webhook id until ``expires``; False when it is already remembered (atomic)."""
        with self.transaction() as c:
            c.execute("DELETE FROM webhook_ids WHERE expires < ?", (self._clock(),))  # indexed: stays small
            return c.execute("INSERT OR IGNORE INTO webhook_ids VALUES (?, ?)", (digest, expires)).rowcount == 1

    def inbox_add(self, entry: dict[str, Any]) -> None:
        with self.transaction() as c:
            self.inbox_put(c, entry)

    def inbox_put(self, c: sqlite3.Connection, entry: dict[str, Any]) -> None:
        """Queue an audit entry inside an open transaction (the poller turns it into a record)."""
        c.execute("INSERT INTO inbox(entry, time) VALUES (?, ?)", (orjson.dumps(entry, default=str), self._clock()))
        self.inbox_written = True  # this connection's own writes do not move data_version

    def inbox(self, limit: int = 100) -> list[tuple[int, Any]]:
        """Entries other processes queued (``sefwd approve``); unreadable ones come back as None."""
        out: list[tuple[int, Any]] = []
        for i, raw in self.query("SELECT id, entry FROM inbox ORDER BY id LIMIT ?", (limit,)):
            try:
                out.append((int(i), orjson.loads(raw)))
            except (ValueError, TypeError):
                out.append((int(i), None))
        return out

    def close(self) -> None:
        with self._lock:
            self.conn.close()
            if self.marker is not None:
                self.marker.close()
