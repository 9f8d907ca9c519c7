"""Opening the agent's store at start: one agent per state dir, old layouts and damaged files set
aside (never deleted), what can be read salvaged, and every loss counted and described."""
from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from forwarder.errors import StateError
from forwarder.store.database import DB_FILE, FORMAT, Store, connect, parse_meta, priority_of, sequence_floor

log = logging.getLogger(__name__)

LOCK_FILE = "agent.lock"
# The hand-made stores before state.db. No release shipped them, so they are set aside, not migrated.
OLD_LAYOUT = ("state.json", "journal", "deadletter", "spool", "callback-replay.log", "approved.json", "status.json")
_SALVAGE_CHUNK = 500
DAMAGE = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_FORMAT"})  # errors that mean a damaged file


@dataclass
class Loss:
    """What a start found unusable, for the ``forwarder.data_lost`` record, status and metrics."""

    reason: str
    detail: str
    renamed_to: str
    salvaged_records: int = 0
    salvaged_dead_letters: int = 0
    unreadable_rows: int = 0  # rows known to exist that could not be read (a lower bound)
    state_restored: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    def record_data(self) -> dict[str, Any]:
        return {
            "Reason": self.reason, "Detail": self.detail, "RenamedTo": self.renamed_to,
            "SalvagedRecords": self.salvaged_records, "SalvagedDeadLetters": self.salvaged_dead_letters,
            "UnreadableRows": self.unreadable_rows, "StateRestored": self.state_restored,
        }


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
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
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


def _rows(conn: sqlite3.Connection, table: str, columns: str, loss: Loss) -> list[tuple[Any, ...]]:
    """Every readable row of a table, read in id order around damaged pages."""
    out: list[tuple[Any, ...]] = []
    try:
        top = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", (table,)).fetchone()
        top_id = int(top[0]) if top else None
    except sqlite3.Error:
        top_id = None
    last, step = 0, _SALVAGE_CHUNK
    for _ in range(100_000):
        try:
            chunk = conn.execute(f"SELECT id, {columns} FROM {table} WHERE id > ? ORDER BY id LIMIT ?",
                                 (last, _SALVAGE_CHUNK)).fetchall()
            step = _SALVAGE_CHUNK
        except sqlite3.Error:
            if top_id is None or last >= top_id:
                loss.unreadable_rows += 1
                break
            loss.unreadable_rows += min(step, top_id - last)
            last += step  # skip the damaged range, count it, and try further on
            step *= 2
            continue
        if not chunk:
            break
        out.extend(chunk)
        last = int(chunk[-1][0])
    return out


def _salvage(aside: Path, loss: Loss) -> tuple[dict[str, Any], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Meta, undelivered records and dead letters that can still be read from a set-aside database."""
    meta: dict[str, Any] = {}
    if not aside.is_file():
        return meta, [], []
    try:
        conn = sqlite3.connect(f"file:{aside}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error:
        return meta, [], []
    try:
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error:
            pass
        try:
            low = conn.execute("SELECT min(next) FROM cursors").fetchone()[0] or 0
        except sqlite3.Error:
            low = 0  # cursors unknown: resend everything readable (duplicates, not loss)
        records = [r for r in _rows(conn, "records", "body, type, time_ms", loss) if r[0] >= low]
        dead = _rows(conn, "dead_letters", "sink, body, reason, detail, time", loss)
    finally:
        conn.close()
    return meta, records, dead


def _restore(store: Store, meta: dict[str, Any], records: list[tuple[Any, ...]], dead: list[tuple[Any, ...]],
             loss: Loss, now: float) -> None:
    """Put what was salvaged into the fresh database; the sequence continues above anything seen."""
    seqs = [sequence_floor(now)]
    for row in records:
        try:
            seqs.append(int(orjson.loads(row[1]).get("sequence", 0)))
        except (ValueError, TypeError, AttributeError):
            pass
    state, _ = parse_meta(meta, now)
    seqs.append(state.sequence)
    keep = {"document": state.document, "api_version": state.api_version, "vm": orjson.dumps(state.vm)}
    loss.state_restored = state.document is not None
    with store.transaction() as c:
        c.executemany("INSERT INTO records(body, type, priority, time_ms) VALUES (?, ?, ?, ?)",
                      [(b, t, priority_of(str(t)), ms) for _, b, t, ms in records])
        c.executemany("INSERT INTO dead_letters(sink, body, reason, detail, time) VALUES (?, ?, ?, ?, ?)",
                      [row[1:] for row in dead])
        c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                      [("sequence", max(seqs)), ("format", FORMAT), *keep.items()])
        for reason, n in loss.counts.items():
            Store._count(c, "*", reason, n)
    loss.salvaged_records, loss.salvaged_dead_letters = len(records), len(dead)


def open_agent_store(state_dir: Path, *, fsync: bool = True, max_size: int = 256 * 1024 * 1024,
                     clock: Callable[[], float] = time.time) -> tuple[Store, Loss | None]:
    """The agent's store, whatever the state dir holds; a Loss when something had to be set aside."""
    set_old_layout_aside(state_dir)
    path = state_dir / DB_FILE
    problem = _problem(path, fsync)
    loss: Loss | None = None
    salvaged: tuple[dict[str, Any], list[tuple[Any, ...]], list[tuple[Any, ...]]] = ({}, [], [])
    if problem is not None:
        suffix = f".damaged-{time.time_ns()}"
        aside = path.with_name(path.name + suffix)
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            if os.path.lexists(p):
                os.replace(p, p.with_name(p.name.replace(DB_FILE, DB_FILE + suffix, 1)))
        unusable = ("not a regular file", "not a database", "unable to open")
        reason = "database_unusable" if any(u in problem for u in unusable) else "database_damaged"
        loss = Loss(reason, problem, aside.name)
        salvaged = _salvage(aside, loss)
        loss.counts = {reason: 1, **({"unreadable_rows": loss.unreadable_rows} if loss.unreadable_rows else {})}
        log.error("%s: %s; renamed it to %s, salvaging what can be read into a new database", path, problem, aside.name)
    try:
        store = Store(connect(path, fsync=fsync), path, max_size=max_size, clock=clock)
    except sqlite3.Error as exc:
        raise StateError(f"cannot create {path}: {exc}") from None
    if loss is not None:
        _restore(store, *salvaged, loss, clock())
        store.size = int(store.query("SELECT total(length(body)) FROM records")[0][0])
        store.refresh()
        log.error("salvaged %d record(s) and %d dead letter(s) from %s; %d row(s) unreadable",
                  loss.salvaged_records, loss.salvaged_dead_letters, loss.renamed_to, loss.unreadable_rows)
    return store, loss
