"""The ``actions`` table: every hook run, approval and undo the agent means to take, as a row.

A row is written in the same transaction as the records it was planned from, before anything
happens; workers take due rows, mark them ``running`` (committed) before the side effect and
commit the outcome (with its audit entry in the inbox) after it. States:

    planned ─▶ due ─▶ running ─▶ done | failed | superseded | skipped
       └──────────┴──────────────▶ superseded | skipped

A row left ``running`` by a crash goes back to ``due`` at the next start; an approval that may
have been posted (``phase = 'posting'``) is then resolved by asking IMDS, never posted blindly.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from forwarder.store.database import Store

HOOK, APPROVE, UNDO = "hook", "approve", "undo"
# This VM's hold (forwarder.protect): its way out of service and back, run by the hold's own worker.
ENTER, LEAVE = "enter", "leave"
KINDS = (HOOK, APPROVE, UNDO, ENTER, LEAVE)
WORKER_KINDS = (HOOK, APPROVE, UNDO)  # what the approval workers take (never a hold's transition)
PLANNED, DUE, RUNNING = "planned", "due", "running"
DONE, FAILED, SUPERSEDED, SKIPPED = "done", "failed", "superseded", "skipped"
OPEN_STATES = (PLANNED, DUE, RUNNING)
FINAL_STATES = (DONE, FAILED, SUPERSEDED, SKIPPED)
STATES = OPEN_STATES + FINAL_STATES
POSTING = "posting"  # an approval's phase once its POST may have left

ACTIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS actions(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,                 -- hook | approve | undo | enter | leave
    event_id TEXT NOT NULL,
    change TEXT NOT NULL,               -- the change kind it was planned for
    hook TEXT,                          -- hook, undo: the [approval.hooks] key it runs
    rule TEXT,                          -- approve: the rule that planned it
    actor TEXT,                         -- approve: policy | hook
    incarnation TEXT,                   -- the DocumentIncarnation the planner saw (JSON)
    event BLOB NOT NULL,                -- the event as the planner saw it (JSON)
    record BLOB,                        -- the record of the change (a hook's stdin)
    state TEXT NOT NULL,
    due REAL NOT NULL,                  -- not before this (epoch seconds)
    deadline REAL,                      -- the event's NotBefore (epoch seconds), if any
    after INTEGER,                      -- approve after hooks: the hook action it waits for
    attempts INTEGER NOT NULL DEFAULT 0,
    phase TEXT,                         -- approve: 'posting' once the POST may have left
    dry_run INTEGER NOT NULL DEFAULT 0,
    result BLOB,                        -- the outcome (JSON)
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS actions_open ON actions(state, due) WHERE state IN ('planned', 'due', 'running');
CREATE INDEX IF NOT EXISTS actions_event ON actions(event_id);
"""

_COLUMNS = ("id", "kind", "event_id", "change", "hook", "rule", "actor", "incarnation", "event", "record",
            "state", "due", "deadline", "after", "attempts", "phase", "dry_run", "result", "created", "updated")
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM actions"


def _loads(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return orjson.loads(raw)
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Action:
    """One row of the actions table."""

    id: int
    kind: str
    event_id: str
    change: str
    hook: str | None
    rule: str | None
    actor: str | None
    incarnation: Any
    event: dict[str, Any]
    record: dict[str, Any] | None
    state: str
    due: float
    deadline: float | None
    after: int | None
    attempts: int
    phase: str | None
    dry_run: bool
    result: dict[str, Any] | None
    created: float
    updated: float

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Action:
        values = dict(zip(_COLUMNS, row, strict=True))
        values["incarnation"] = _loads(values["incarnation"])
        values["event"] = _loads(values["event"]) or {}
        values["record"] = _loads(values["record"])
        values["result"] = _loads(values["result"])
        values["dry_run"] = bool(values["dry_run"])
        return cls(**values)


@dataclass(frozen=True)
class NewAction:
    """A row to insert (the planner's output)."""

    kind: str
    event_id: str
    change: str
    event: Mapping[str, Any]
    due: float
    deadline: float | None = None
    hook: str | None = None
    rule: str | None = None
    actor: str | None = None
    incarnation: Any = None
    record: Mapping[str, Any] | None = None
    after: int | None = None
    dry_run: bool = False


def insert(c: sqlite3.Connection, action: NewAction, now: float) -> int:
    """Insert inside an open transaction; returns the new row's id."""
    state = PLANNED
    cur = c.execute(
        "INSERT INTO actions(kind, event_id, change, hook, rule, actor, incarnation, event, record, state, due,"
        " deadline, after, dry_run, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (action.kind, action.event_id, action.change, action.hook, action.rule, action.actor,
         orjson.dumps(action.incarnation), orjson.dumps(dict(action.event), default=str),
         orjson.dumps(dict(action.record), default=str) if action.record is not None else None,
         state, action.due, action.deadline, action.after, int(action.dry_run), now, now))
    return int(cur.lastrowid or 0)


def insert_posting(c: sqlite3.Connection, action: NewAction, now: float) -> int:
    """An approval asked for now (the callback): inserted ``running`` and ``posting`` at once."""
    action_id = insert(c, action, now)
    c.execute("UPDATE actions SET state = 'running', phase = ?, attempts = 1 WHERE id = ?", (POSTING, action_id))
    return action_id


def rows(c: sqlite3.Connection, where: str = "", args: tuple[Any, ...] = ()) -> list[Action]:
    sql = _SELECT + (f" WHERE {where}" if where else "") + " ORDER BY id"
    return [Action.from_row(r) for r in c.execute(sql, args).fetchall()]


def get(c: sqlite3.Connection, action_id: int) -> Action | None:
    found = rows(c, "id = ?", (action_id,))
    return found[0] if found else None


def pending_of(c: sqlite3.Connection, event_id: str) -> list[Action]:
    """Actions of an event not yet taken by a worker."""
    return rows(c, "event_id = ? AND state IN ('planned', 'due')", (event_id,))


def finish(c: sqlite3.Connection, action_id: int, state: str, result: Mapping[str, Any] | None, now: float,
           *, only_from: tuple[str, ...] = OPEN_STATES) -> bool:
    """Move a row to a final state; False if it had already left ``only_from``."""
    assert state in FINAL_STATES, state
    marks = ",".join("?" * len(only_from))
    cur = c.execute(f"UPDATE actions SET state = ?, result = ?, updated = ? WHERE id = ? AND state IN ({marks})",
                    (state, orjson.dumps(dict(result or {}), default=str), now, action_id, *only_from))
    return cur.rowcount == 1


def promote(store: Store, now: float) -> int:
    """planned → due for rows whose time has come and whose prerequisite action is over."""
    finals = ",".join(f"'{s}'" for s in FINAL_STATES)
    with store.transaction() as c:
        return c.execute(
            f"UPDATE actions SET state = 'due', updated = ? WHERE state = 'planned' AND due <= ? AND "
            f"(after IS NULL OR after IN (SELECT id FROM actions WHERE state IN ({finals})))", (now, now)).rowcount


def claim(store: Store, now: float, kinds: tuple[str, ...] = WORKER_KINDS) -> Action | None:
    """Take the oldest due row of ``kinds``: it is ``running`` (committed) when this returns."""
    marks = ",".join("?" * len(kinds))
    with store.transaction() as c:
        row = c.execute(_SELECT + f" WHERE state = 'due' AND kind IN ({marks}) ORDER BY due, id LIMIT 1",
                        kinds).fetchone()
        if row is None:
            return None
        c.execute("UPDATE actions SET state = 'running', attempts = attempts + 1, updated = ? WHERE id = ?",
                  (now, row[0]))
    action = Action.from_row(row)
    return Action(**{**action.__dict__, "state": RUNNING, "attempts": action.attempts + 1})


def mark_posting(store: Store, action_id: int, now: float) -> None:
    """Committed right before an approval's POST: after a crash, IMDS is asked what happened."""
    with store.transaction() as c:
        c.execute("UPDATE actions SET phase = ?, updated = ? WHERE id = ?", (POSTING, now, action_id))


def release(store: Store, action_id: int, due: float, now: float) -> None:
    """A running row goes back to ``planned`` until ``due`` (interrupted by a stop, or retried later)."""
    with store.transaction() as c:
        c.execute("UPDATE actions SET state = 'planned', due = ?, updated = ? WHERE id = ? AND state = 'running'",
                  (due, now, action_id))


def tighten(store: Store, action_id: int, deadline: float, now: float) -> bool:
    """An open row's deadline moves earlier (never later); True when it moved."""
    with store.transaction() as c:
        return c.execute("UPDATE actions SET deadline = ?, updated = ? WHERE id = ? AND state IN "
                         "('planned', 'due', 'running') AND (deadline IS NULL OR deadline > ?)",
                         (deadline, now, action_id, deadline)).rowcount == 1


def recover(store: Store, now: float) -> int:
    """At start: rows a crash left ``running`` are due again (their phase says what may have happened)."""
    with store.transaction() as c:
        return c.execute("UPDATE actions SET state = 'due', updated = ? WHERE state = 'running'", (now,)).rowcount


def left_running(store: Store) -> list[Action]:
    """Rows a previous process left ``running`` (read at start, before anything of this process runs)."""
    with store.transaction() as c:
        return rows(c, "state = 'running'")


def make_due(store: Store, ids: list[int], now: float) -> int:
    """These ``running`` rows are due again (recovery, in two steps: see approval.runner)."""
    if not ids:
        return 0
    with store.transaction() as c:
        marks = ",".join("?" * len(ids))
        return c.execute(f"UPDATE actions SET state = 'due', updated = ? WHERE state = 'running' AND id IN ({marks})",
                         (now, *ids)).rowcount


def prune(store: Store, before: float) -> int:
    """Forget finished actions last changed before ``before`` (their audit records stay in the sinks)."""
    finals = ",".join(f"'{s}'" for s in FINAL_STATES)
    with store.transaction() as c:
        return c.execute(f"DELETE FROM actions WHERE state IN ({finals}) AND updated < ?", (before,)).rowcount


def next_due(store: Store) -> float | None:
    row = store.query("SELECT min(due) FROM actions WHERE state = 'planned'")
    return float(row[0][0]) if row and row[0][0] is not None else None


def counts(store: Store) -> dict[str, dict[str, int]]:
    """Actions by kind and state: ``{"hook": {"done": 3, "running": 1}, ...}`` (status, metrics)."""
    out: dict[str, dict[str, int]] = {}
    for kind, state, n in store.query("SELECT kind, state, count(*) FROM actions GROUP BY kind, state"):
        out.setdefault(str(kind), {})[str(state)] = int(n)
    return out


def outcomes(store: Store) -> dict[tuple[str, str], int]:
    """Finished actions by kind and outcome (the result's ``Outcome``, else the state): for metrics."""
    out: dict[tuple[str, str], int] = {}
    finals = ",".join(f"'{s}'" for s in FINAL_STATES)
    for kind, outcome, n in store.query(
            f"SELECT kind, coalesce(json_extract(CAST(result AS TEXT), '$.Outcome'), state), count(*) FROM actions "
            f"WHERE state IN ({finals}) GROUP BY 1, 2"):
        out[(str(kind), str(outcome))] = int(n)
    return out
