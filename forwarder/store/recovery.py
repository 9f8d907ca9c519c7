"""Opening the agent's store at start: one agent per state dir, old layouts and damaged files set
aside (never deleted), what can be read salvaged, and every loss counted and described.

A damaged ``state.db`` is salvaged into ``state.db.salvage-tmp`` while it stays in place; only
the complete result is renamed ``state.db.salvaged-<ns>``, then the damaged files are renamed
``state.db.damaged-<ns>*`` and the salvage becomes ``state.db``. A failure or crash at any step
leaves a state the next start resumes from, and the ``forwarder.data_lost`` announcement waits
in the new database's inbox until it is committed as a record."""
from __future__ import annotations

import logging
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from forwarder.errors import StateError
from forwarder.store.actions import ACTIONS_SCHEMA
from forwarder.store.database import DB_FILE, FORMAT, SCHEMA, Store, connect, parse_meta, priority_of, sequence_floor
from forwarder.store.marker import (LOCK_FILE, MAX_MARKER, Marker, MarkerData, marker_bytes, parse_marker, read_marker,
                                    rewrite)

log = logging.getLogger(__name__)

# The hand-made stores before state.db. No release shipped them, so they are set aside, not migrated.
OLD_LAYOUT = ("state.json", "journal", "deadletter", "spool", "callback-replay.log", "approved.json", "status.json")
_SALVAGE_CHUNK = 512
SALVAGE_TMP = DB_FILE + ".salvage-tmp"  # being built; a leftover one is discarded and built again
SALVAGED = DB_FILE + ".salvaged-"  # complete, to replace state.db (whose files go aside with the same <ns>)
DAMAGE = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_FORMAT"})  # errors that mean a damaged file
# Tables with rules of their own: records and dead letters are read in id ranges around damage and
# renumbered; meta is read field by field; cursors are not copied (the records are renumbered and
# every sink resumes at the oldest salvaged record: duplicates, never a loss). Every other table,
# whoever added it, is copied row by row as it is.
OWN_RULES = ("records", "dead_letters", "meta", "cursors")
# What a file whose schema cannot be read at all held (at least): every table of the schema.
SCHEMA_TABLES = tuple(t for t in re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA + ACTIONS_SCHEMA)
                      if t not in ("meta", "cursors"))
REPLAY_FLOOR = "replay_floor"  # meta: callback requests signed before it are refused (forwarder.approval.seen_ids)


@dataclass
class Loss:
    """What a start found unusable, for the ``forwarder.data_lost`` record, status and metrics."""

    reason: str
    detail: str
    renamed_to: str
    salvaged_records: int = 0
    salvaged_dead_letters: int = 0
    unreadable_rows: int = 0  # ids in damaged ranges, and rows with a missing or wrong-kind value
    state_restored: bool = False
    uncounted: list[str] = field(default_factory=list)  # tables not (wholly) copied: loss not in unreadable_rows
    uncounted_rows: dict[str, int | None] = field(default_factory=dict)  # their rows not copied; None: unreadable
    previous_store: str | None = None  # a vanished or replaced store: its id and the last sequence it handed out
    last_sequence: int | None = None

    def not_copied(self, table: str, rows: int | None) -> None:
        if table not in self.uncounted:
            self.uncounted.append(table)
        self.uncounted_rows[table] = rows

    def record_data(self) -> dict[str, Any]:
        return {
            "Reason": self.reason, "Detail": self.detail, "RenamedTo": self.renamed_to,
            "SalvagedRecords": self.salvaged_records, "SalvagedDeadLetters": self.salvaged_dead_letters,
            "UnreadableRows": self.unreadable_rows, "UncountedTables": self.uncounted,
            "UncountedRows": self.uncounted_rows, "StateRestored": self.state_restored,
            "PreviousStore": self.previous_store, "LastSequence": self.last_sequence,
        }

    @classmethod
    def from_data(cls, d: dict[str, Any]) -> Loss:
        def num(key: str) -> int:
            return d[key] if isinstance(d.get(key), int) else 0

        found = d.get("UncountedRows")
        rows: dict[Any, Any] = found if isinstance(found, dict) else {}
        return cls(str(d.get("Reason")), str(d.get("Detail")), str(d.get("RenamedTo")), num("SalvagedRecords"),
                   num("SalvagedDeadLetters"), num("UnreadableRows"), d.get("StateRestored") is True,
                   [str(t) for t in d.get("UncountedTables") or []],
                   {str(k): v if isinstance(v, int) else None for k, v in rows.items()},
                   d["PreviousStore"] if isinstance(d.get("PreviousStore"), str) else None,
                   num("LastSequence") if isinstance(d.get("LastSequence"), int) else None)


def lock_state_dir(state_dir: Path) -> int | None:
    """One agent per state dir (two would double-deliver); returns the lock's fd."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    except OSError as exc:
        raise StateError(f"cannot create state dir {state_dir}: {exc.strerror}") from None
    try:
        import fcntl
    except ImportError:  # Windows: the service manager already runs one instance
        return None
    path = state_dir / LOCK_FILE
    if path.exists() and not path.is_file():
        _aside(path, "not a regular file")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StateError(f"another sefwd agent is running with state dir {state_dir}") from None
    # Our pid, and the store marker kept as it was (forwarder.store.marker: a vanished state.db is announced).
    try:
        rewrite(fd, marker_bytes(parse_marker(os.read(fd, MAX_MARKER))))
    except OSError:
        pass
    return fd


def _aside(path: Path, why: str) -> Path:
    target = path.with_name(f"{path.name}.aside-{time.time_ns()}")
    os.replace(path, target)
    log.error("state dir: %s is %s; renamed it to %s", path, why, target.name)
    return target


def set_old_layout_aside(state_dir: Path) -> Path | None:
    """Move the files of the pre-SQLite layout into ``old-layout-<time>/`` with one log line."""
    found = [state_dir / n for n in OLD_LAYOUT if os.path.lexists(state_dir / n)]
    if not found:
        return None
    target = state_dir / f"old-layout-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    try:
        target.mkdir()
        for path in found:
            os.replace(path, target / path.name)
    except OSError as exc:  # nothing reads these files any more: leaving them is harmless
        log.error("state dir %s holds the old file layout; could not move it aside (%s), ignoring it", state_dir, exc)
        return None
    log.error("state dir %s holds the old file layout (%s); it is not migrated: moved to %s, starting with a "
              "new %s", state_dir, ", ".join(p.name for p in found), target.name, DB_FILE)
    return target


def _problem(path: Path, fsync: bool) -> str | None:
    """Why the database cannot be used as it is (None: fine, or not there yet)."""
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if os.path.lexists(p) and not p.is_file():  # (a link to a regular file is fine)
            return f"{p.name} is not a regular file"
    if not path.exists():
        return None
    if path.stat().st_size == 0 and not Path(f"{path}-wal").exists():
        return "state.db is empty (truncated to nothing?)"  # the agent never leaves it empty
    try:
        conn = connect(path, fsync=fsync)
        try:
            rows = conn.execute("PRAGMA quick_check").fetchall()
            if rows != [("ok",)]:
                return "quick_check: " + "; ".join(str(r[0]) for r in rows[:5])
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            problems = parse_meta(meta, 0.0)[1] if "sequence" in meta else []  # (no sequence: never run yet)
            if problems:
                return "; ".join(problems)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        if getattr(exc, "sqlite_errorname", "SQLITE_CORRUPT") not in DAMAGE:
            # A full disk or an I/O error says nothing about the file: never set a good one aside.
            raise StateError(f"cannot open {path}: {exc}") from None
        return f"cannot open: {exc}"
    return None


def _top_id(conn: sqlite3.Connection, table: str) -> int | None:
    """The highest id the table ever handed out (None: unknown, its pages are unreadable)."""
    for sql, args in (("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)), (f"SELECT max(id) FROM {table}", ())):
        try:
            row = conn.execute(sql, args).fetchone()
            if row is not None:
                return int(row[0] or 0)
        except (sqlite3.Error, ValueError, TypeError):
            pass
    return None


def _rows(conn: sqlite3.Connection, table: str, columns: str, after: int, loss: Loss) -> list[tuple[Any, ...]]:
    """Every readable row with an id above ``after``, read in id ranges narrowed around damaged pages.

    Each id in a range that cannot be read counts as one unreadable row. Past 64 unreadable ids in
    a row the skips double (a damaged interior page can hide a long range), so a few readable rows
    after it may be counted lost instead of salvaged. Without a known top id, reading stops at the
    first damage and the table is named in ``loss.uncounted``.
    """
    top = _top_id(conn, table)
    out: list[tuple[Any, ...]] = []
    last, step, failures = after, _SALVAGE_CHUNK, 0
    while top is None:
        try:
            chunk = conn.execute(f"SELECT id, {columns} FROM {table} WHERE id > ? ORDER BY id LIMIT ?",
                                 (last, _SALVAGE_CHUNK)).fetchall()
        except sqlite3.Error:
            loss.not_copied(table, None)
            return out
        if not chunk:
            return out
        out.extend(chunk)
        last = int(chunk[-1][0])
    while last < top:
        high = min(top, last + step)
        try:
            chunk = conn.execute(f"SELECT id, {columns} FROM {table} WHERE id > ? AND id <= ? ORDER BY id",
                                 (last, high)).fetchall()
        except sqlite3.Error:
            if step > 1:
                step = max(1, step // 8)  # narrow down to the damaged place
                continue
            failures += 1
            skip = 1 if failures <= 64 else min(top - last, 2 ** (failures - 64))
            loss.unreadable_rows += skip
            last += skip
            continue
        out.extend(chunk)
        last, step, failures = high, min(_SALVAGE_CHUNK, step * 2), 0
    return out


@dataclass
class _Table:
    """A table copied as it is: its schema (and indexes) as the damaged file declares them, its rows."""

    name: str
    sql: str
    indexes: list[str]
    columns: list[str]
    rows: list[tuple[Any, ...]]


def _count(conn: sqlite3.Connection, table: str) -> int | None:
    try:
        return int(conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])
    except (sqlite3.Error, TypeError, ValueError):
        return None


def _other_tables(conn: sqlite3.Connection, loss: Loss) -> list[_Table]:
    """Every table but those with rules of their own, read whole; what cannot be read is named."""
    try:
        found = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                             "ORDER BY rowid").fetchall()
        indexes = conn.execute("SELECT tbl_name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL").fetchall()
    except sqlite3.Error:
        for table in SCHEMA_TABLES:
            if table not in OWN_RULES:
                loss.not_copied(table, None)
        return []
    # Every store the agent opened has the whole schema: a table of it missing from the file was lost with its schema.
    for table in SCHEMA_TABLES:
        if table not in OWN_RULES and table not in {n for n, _ in found}:
            loss.not_copied(table, None)
    out: list[_Table] = []
    for name, sql in found:
        if name in OWN_RULES or not isinstance(name, str):
            continue
        rows: list[tuple[Any, ...]] = []
        try:
            columns = [str(c[1]) for c in conn.execute(f'PRAGMA table_info("{name}")').fetchall()]
            cursor = conn.execute(f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in columns)} FROM "{name}"')
            while chunk := cursor.fetchmany(_SALVAGE_CHUNK):
                rows.extend(chunk)
        except sqlite3.Error:
            total = _count(conn, name)
            loss.not_copied(name, None if total is None else max(0, total - len(rows)))
            if not rows:
                continue
        if not isinstance(sql, str) or not columns:
            loss.not_copied(name, _count(conn, name))
            continue
        out.append(_Table(name, sql, [s for t, s in indexes if t == name and isinstance(s, str)], columns, rows))
    return out


def _salvage(db: Path, loss: Loss) -> tuple[dict[str, Any], list[tuple[Any, ...]], list[tuple[Any, ...]], list[_Table]]:
    """Meta, undelivered records, dead letters and every other table that can still be read from a damaged database."""
    meta: dict[str, Any] = {}
    if not db.is_file():
        for table in SCHEMA_TABLES:
            loss.not_copied(table, None)
        return meta, [], [], []
    try:
        conn = sqlite3.connect(db.absolute().as_uri() + "?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error:
        for table in SCHEMA_TABLES:
            loss.not_copied(table, None)
        return meta, [], [], []
    try:
        try:  # (read-only: lets SQLite read a file shorter than its header says, e.g. truncated)
            conn.execute("PRAGMA writable_schema=ON")
        except sqlite3.Error:
            pass
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error:
            pass
        try:
            low = int(conn.execute("SELECT min(next) FROM cursors").fetchone()[0] or 1)
        except (sqlite3.Error, ValueError, TypeError):
            low = 1  # cursors unknown: resend everything readable (duplicates, not loss)
        records = _rows(conn, "records", "body, type, time_ms", low - 1, loss)
        dead = _rows(conn, "dead_letters", "sink, body, reason, detail, time", 0, loss)
        others = _other_tables(conn, loss)
    finally:
        conn.close()
    return meta, records, dead, others


def _blob(value: Any) -> bytes | None:
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    return value if isinstance(value, bytes) and value else None


def _copy_table(conn: sqlite3.Connection, table: _Table, loss: Loss) -> None:
    """One table into the new database: created as the damaged file declared it when the schema
    does not have it, then its rows (columns both know), each on its own: a row that does not fit
    is counted unreadable."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table.name,)).fetchone():
        try:
            conn.execute(table.sql)
            for index in table.indexes:
                conn.execute(index)
        except sqlite3.Error:
            loss.not_copied(table.name, len(table.rows))
            return
    have = {str(c[1]) for c in conn.execute(f'PRAGMA table_info("{table.name}")').fetchall()}
    keep = [n for n, c in enumerate(table.columns) if c in have]
    names = ", ".join(f'"{table.columns[n]}"' for n in keep)
    sql = f'INSERT OR REPLACE INTO "{table.name}"({names}) VALUES ({", ".join("?" * len(keep))})'
    for row in table.rows:
        try:
            conn.execute(sql, [row[n] for n in keep])
        except sqlite3.Error:
            loss.unreadable_rows += 1


def _restore(conn: sqlite3.Connection, meta: dict[str, Any], records: list[tuple[Any, ...]],
             dead: list[tuple[Any, ...]], others: list[_Table], loss: Loss, now: float) -> None:
    """Put what was salvaged into the new database, with the announcement of the loss, in one
    transaction. A row with a value missing or of the wrong kind is counted lost, never fatal."""
    now_ms = int(now * 1000)
    seqs = [sequence_floor(now)]
    rows, letters = [], []
    for _, body, rtype, ms in records:
        blob = _blob(body)
        if blob is None or not isinstance(rtype, str):
            loss.unreadable_rows += 1
            continue
        rows.append((blob, rtype, priority_of(rtype), ms if isinstance(ms, int) else now_ms))
        try:
            seqs.append(int(orjson.loads(blob).get("sequence", 0)))
        except (ValueError, TypeError, AttributeError):
            pass
    for _, sink, body, reason, detail, when in dead:
        blob = _blob(body)
        if blob is None or not isinstance(sink, str):
            loss.unreadable_rows += 1
            continue
        letters.append((sink, blob, *("" if v is None else str(v) for v in (reason, detail, when))))
    state, _ = parse_meta(meta, now)
    seqs.append(state.sequence)
    loss.state_restored = state.document is not None
    loss.salvaged_records, loss.salvaged_dead_letters = len(rows), len(letters)
    conn.execute("BEGIN IMMEDIATE")
    for table in others:  # (first: the loss counters below add to the salvaged ones)
        _copy_table(conn, table, loss)
    counts = {loss.reason: 1, **({"unreadable_rows": loss.unreadable_rows} if loss.unreadable_rows else {})}
    conn.executemany("INSERT INTO records(body, type, priority, time_ms) VALUES (?, ?, ?, ?)", rows)
    conn.executemany("INSERT INTO dead_letters(sink, body, reason, detail, time) VALUES (?, ?, ?, ?, ?)", letters)
    own = {"sequence", "format", "document", "api_version", "vm", "evidence", REPLAY_FLOOR}
    conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
        *((k, v) for k, v in meta.items() if isinstance(k, str) and k not in own),  # keys added later, as they are
        ("sequence", max(seqs)), ("format", FORMAT), ("document", state.document),
        ("api_version", state.api_version), ("vm", orjson.dumps(state.vm)), ("evidence", orjson.dumps(state.evidence)),
        # The replay cache may have lost ids (a damaged page, a lost WAL): requests signed before
        # now are refused, so none accepted before can be replayed (stale after the tolerance anyway).
        (REPLAY_FLOOR, now)])
    for reason, n in counts.items():
        Store._count(conn, "*", reason, n)
    # The announcement waits in the inbox until the agent commits it as a record (deleting the row
    # in the same transaction): a failed commit or a crash before it only delays it.
    conn.execute("INSERT INTO inbox(entry, time) VALUES (?, ?)",
                 (orjson.dumps({"Lifecycle": "data_lost", "Data": loss.record_data()}), now))
    conn.execute("COMMIT")


def _sync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # (Windows: directories cannot be opened; renames there are durable enough)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard_partial(state_dir: Path) -> None:
    """A salvage that did not finish is started again from the damaged file, which is still in place."""
    for name in (SALVAGE_TMP, SALVAGE_TMP + "-journal"):
        if os.path.lexists(state_dir / name):
            os.unlink(state_dir / name)


def _build(path: Path, problem: str, fsync: bool, now: float) -> Path:
    """Salvage the damaged ``path`` into a new file beside it; returns it once complete.

    Nothing is renamed before this succeeds: a full disk or a crash here leaves the damaged
    database where it was, and the next attempt starts over.
    """
    ns = time.time_ns()
    unusable = ("not a regular file", "not a database", "unable to open")
    reason = "database_unusable" if any(u in problem for u in unusable) else "database_damaged"
    loss = Loss(reason, problem, f"{DB_FILE}.damaged-{ns}")
    log.error("%s: %s; salvaging what can be read into a new database, then renaming it to %s",
              path, problem, loss.renamed_to)
    tmp = path.with_name(SALVAGE_TMP)
    try:
        salvaged = _salvage(path, loss)
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            os.chmod(tmp, 0o640)
            conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")  # (rollback journal: one file)
            conn.executescript(SCHEMA)
            _restore(conn, *salvaged, loss, now)
        finally:
            conn.close()
        ready = path.with_name(f"{SALVAGED}{ns}")
        os.replace(tmp, ready)
        _sync_dir(path.parent)
    except (OSError, sqlite3.Error) as exc:
        try:
            _discard_partial(path.parent)
        except OSError:
            pass
        raise StateError(f"cannot salvage {path} ({problem}): {exc}; it is left in place for the next attempt") from None
    log.error("salvaged %d record(s) and %d dead letter(s) from %s; %d row(s) unreadable%s",
              loss.salvaged_records, loss.salvaged_dead_letters, path.name, loss.unreadable_rows,
              f", rows of {', '.join(loss.uncounted)} uncounted" if loss.uncounted else "")
    return ready


def _switch(path: Path, ready: Path) -> None:
    """Set the damaged files aside under the salvage's name, then move the salvaged database in.
    Every step is a rename, so a start after a crash half way finishes it."""
    suffix = ".damaged-" + ready.name[len(SALVAGED):]
    try:
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            if os.path.lexists(p):
                target = p.with_name(p.name.replace(DB_FILE, DB_FILE + suffix, 1))
                if os.path.lexists(target):  # (a state.db created after the first rename: keep both)
                    _aside(p, "not the damaged database")
                else:
                    os.replace(p, target)
        os.replace(ready, path)
        _sync_dir(path.parent)
        log.error("%s: renamed it to %s and moved the salvaged database into its place", path, DB_FILE + suffix)
    except OSError as exc:
        raise StateError(f"cannot move the salvaged database {ready.name} into place: {exc}") from None


def pending_loss(store: Store) -> Loss | None:
    """The loss whose ``forwarder.data_lost`` record is still waiting in the inbox, if any."""
    for _, entry in store.inbox(1000):
        if isinstance(entry, dict) and entry.get("Lifecycle") == "data_lost" and isinstance(entry.get("Data"), dict):
            return Loss.from_data(entry["Data"])
    return None


def open_agent_store(state_dir: Path, *, fsync: bool = True, max_size: int = 256 * 1024 * 1024,
                     clock: Callable[[], float] = time.time) -> tuple[Store, Loss | None]:
    """The agent's store, whatever the state dir holds; a Loss while one is still to be announced."""
    set_old_layout_aside(state_dir)
    path = state_dir / DB_FILE
    try:
        _discard_partial(state_dir)
    except OSError as exc:
        raise StateError(f"cannot remove an unfinished salvage in {state_dir}: {exc}") from None
    # (only ever one, unless someone copied files around; other names are stray files, ignored)
    found = sorted(p for p in state_dir.glob(f"{SALVAGED}*") if p.name[len(SALVAGED):].isdigit())
    resume = found[-1] if found and found[-1].is_file() else None
    for extra in found:
        if extra != resume:
            _aside(extra, "not a salvage to resume")
    if resume is not None:
        _switch(path, resume)  # a salvage that finished before the last start ended
    else:
        problem = _problem(path, fsync)
        if problem is not None:
            _switch(path, _build(path, problem, fsync, clock()))
    previous = read_marker(state_dir)  # (read before the store is opened: opening it creates a missing one)
    try:
        store = Store(connect(path, fsync=fsync), path, max_size=max_size, clock=clock)
    except sqlite3.Error as exc:
        raise StateError(f"cannot create {path}: {exc}") from None
    try:
        store.marker = Marker(state_dir, _adopt(store, previous, clock()))
        store.marker.write(int(store.meta().get("sequence") or 0))
        return store, pending_loss(store)
    except StateError:
        store.close()
        raise


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value else None


def _adopt(store: Store, previous: MarkerData | None, now: float) -> str:
    """This store's id (given to a store that has none); when the marker names another store, the
    loss is announced: the previous store's id and the last sequence it handed out."""
    meta = store.meta()
    store_id, replaced = _text(meta.get("store_id")), _text(meta.get("replaced_store"))
    new_id = store_id or uuid.uuid4().hex
    lost = previous is not None and previous.store != new_id and previous.store != replaced
    if new_id == store_id and not lost:
        return new_id
    with store.transaction() as c:
        c.execute("INSERT OR REPLACE INTO meta VALUES ('store_id', ?)", (new_id,))
        if lost:
            assert previous is not None
            reason = "database_replaced" if store_id else "database_vanished"
            what = "is another store" if store_id else "was not found (deleted, or never restored)"
            loss = Loss(reason, f"{DB_FILE} {what}: store {previous.store} held this state dir, its last sequence "
                        f"{previous.sequence}", "", previous_store=previous.store, last_sequence=previous.sequence)
            for table in SCHEMA_TABLES:
                loss.not_copied(table, None)
            log.error("%s: %s; starting a new store and announcing the loss (remove %s too to start over on purpose)",
                      store.path, loss.detail, LOCK_FILE)
            c.execute("INSERT OR REPLACE INTO meta VALUES ('replaced_store', ?)", (previous.store,))
            # Numbers never reused, even with a wall clock set back; no replay of what the lost cache saw.
            c.execute("INSERT OR IGNORE INTO meta VALUES ('sequence', ?), ('format', ?)",
                      (max(sequence_floor(now), previous.sequence), FORMAT))
            c.execute("UPDATE meta SET value = max(CAST(value AS INTEGER), ?) WHERE key = 'sequence'", (previous.sequence,))
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (REPLAY_FLOOR, now))
            Store._count(c, "*", reason, 1)
            c.execute("INSERT INTO inbox(entry, time) VALUES (?, ?)",
                      (orjson.dumps({"Lifecycle": "data_lost", "Data": loss.record_data()}), now))
    return new_id
