"""Salvage carries everything or counts what it did not (issue 20, item 3).

A damaged ``state.db`` is salvaged table by table, whatever tables it has: the pending
`sefwd approve` audits (inbox), the approvals, the webhook-id replay cache, the loss counters,
the outcome evidence, and any table added later (here a ``later_rows`` table the schema does not know, as another part of
the agent may add). A table that cannot be copied is named in ``UncountedTables`` with its row
count where readable. A lost replay cache must not reopen a replay window: callback requests
signed before the salvage are refused (they are stale once the tolerance has passed).
Real SQLite files, a real callback server, real HTTP.
"""
from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path

import orjson
import requests

from forwarder.approval.callback import CallbackServer, Verdict
from forwarder.approval.seen_ids import ReplayCache
from forwarder.approval.settings import CallbackSettings
from forwarder.common.signing import generate_secret, parse_secret, sign_headers
from forwarder.sinkapi import Record
from forwarder.store.database import DB_FILE, SavedState, Store
from forwarder.store.recovery import open_agent_store

EVIDENCE = {"format": 1, "seen_boot_id": "boot-a", "approvals": {"e-1": "2026-11-24T00:00:00Z"}}


def full_store(state: Path) -> dict[str, int]:
    """A store with a row in every table (and a table the salvage code has never heard of), then a
    garbage sequence counter so the next start sets it aside and salvages it."""
    store = Store.open(state)
    base = store.load_state().sequence
    store.commit([Record.from_dict({"id": "r1", "type": "scheduledevent.scheduled", "sequence": str(base + 1)})],
                 SavedState(sequence=base + 1, document='{"DocumentIncarnation": 1, "Events": []}', evidence=EVIDENCE))
    store.advance("hook", 1, [(b'{"id": "d1", "type": "t"}', "http_400", "refused")], now="2026-11-24T00:00:00Z")
    store.inbox_add({"Outcome": "approved", "Actor": "cli", "Reason": "approved", "EventIds": ["e-1"]})
    store.add_approvals(["E-1", "E-2"])
    store.add_webhook_id("digest-1", time.time() + 600)
    store.count_loss("hook", "evicted_size_cap", 7)
    with store.transaction() as c:
        c.execute("CREATE TABLE later_rows(id INTEGER PRIMARY KEY, event_id TEXT NOT NULL, action TEXT, state TEXT)")
        c.execute("CREATE INDEX later_rows_event ON later_rows(event_id)")
        c.executemany("INSERT INTO later_rows(event_id, action, state) VALUES (?, ?, ?)",
                      [("E-1", "hook", "done"), ("E-2", "approve", "pending")])
        c.execute("UPDATE meta SET value = 'garbage' WHERE key = 'sequence'")
    counts = {t: store.query(f"SELECT count(*) FROM {t}")[0][0]
              for t in ("inbox", "approvals", "webhook_ids", "losses", "later_rows")}
    store.close()
    return counts


def test_every_table_is_salvaged_and_none_left_silently(tmp_path: Path) -> None:
    state = tmp_path / "state"
    before = full_store(state)
    store, loss = open_agent_store(state)
    try:
        assert loss is not None
        after = {t: rows(store, t) for t in before}
        lost = {t: before[t] - after[t] for t in before if after[t] < before[t]}
        print(f"rows dropped without a word: {sum(lost.values())} in {sorted(lost)}; UncountedTables {loss.uncounted}")
        evidence = orjson.loads(store.meta().get("evidence") or b"{}")
        approvals = {r[0] for r in store.query("SELECT event_id FROM approvals")}
        later_rows = store.query("SELECT event_id, action, state FROM later_rows ORDER BY id")
        indexes = {r[0] for r in store.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
        losses = store.losses()
    finally:
        store.close()
    assert lost == {} and loss.uncounted == []
    assert evidence == EVIDENCE, "the outcome evidence is salvaged with the state"
    assert approvals == {"e-1", "e-2"}
    assert later_rows == [("E-1", "hook", "done"), ("E-2", "approve", "pending")] and "later_rows_event" in indexes
    assert losses["hook"] == {"evicted_size_cap": 7} and losses["*"] == {"database_damaged": 1}


def rows(store: Store, table: str) -> int:
    """Rows in ``table`` (0 when the salvage did not even create it); the inbox's announcement not counted."""
    found = store.query("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))[0][0]
    n = store.query(f"SELECT count(*) FROM {table}")[0][0] if found else 0
    return n - 1 if table == "inbox" else n  # (the forwarder.data_lost announcement waits in the inbox too)


def _page_size(db: Path) -> int:
    return int.from_bytes(db.read_bytes()[16:18], "big") or 65536


def test_a_table_that_cannot_be_copied_is_named_with_its_row_count_where_readable(tmp_path: Path) -> None:
    state = tmp_path / "state"
    full_store(state)
    db = state / DB_FILE
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'approvals'").fetchone()[0]
    conn.close()
    size = _page_size(db)
    data = bytearray(db.read_bytes())
    data[(root - 1) * size: root * size] = b"\x99" * size  # the approvals table's only page destroyed
    db.write_bytes(bytes(data))
    store, loss = open_agent_store(state)
    try:
        assert loss is not None
        copied = {t: store.query(f"SELECT count(*) FROM {t}")[0][0] for t in ("webhook_ids", "later_rows", "losses")}
    finally:
        store.close()
    print(f"UncountedTables {loss.uncounted}, UncountedRows {loss.uncounted_rows}")
    # Its rows are gone, but their number is still readable (from the primary key's index).
    assert loss.uncounted == ["approvals"] and loss.uncounted_rows == {"approvals": 2}
    assert loss.record_data()["UncountedRows"] == loss.uncounted_rows
    assert copied == {"webhook_ids": 1, "later_rows": 2, "losses": 2}, "the other tables are still salvaged"


def test_a_lost_replay_cache_reopens_no_replay_window(tmp_path: Path) -> None:
    """A request accepted before the damage, replayed after the salvage with a cache that lost it."""
    state = tmp_path / "state"
    secret = generate_secret()
    settings = CallbackSettings(host="127.0.0.1", port=0, keys=(parse_secret(secret),), tolerance=300.0)
    body = orjson.dumps({"StartRequests": [{"EventId": "E-1"}]})
    headers = {**sign_headers(parse_secret(secret), f"msg_{uuid.uuid4().hex}", body, now=time.time() - 5),
               "content-type": "application/json"}
    decided: list[str] = []

    def serve() -> int:
        server = CallbackServer(settings, lambda r: (decided.append(r.event_ids[0]), Verdict(200, {}))[1],
                                lambda a: None, state / DB_FILE).start()
        try:
            return requests.post(server.url + "/approvals", data=body, headers=headers, timeout=10).status_code
        finally:
            server.stop()

    full_store(state)
    assert serve() == 200  # accepted, its id remembered in webhook_ids
    conn = sqlite3.connect(state / DB_FILE, isolation_level=None)
    conn.execute("DROP TABLE webhook_ids")  # the cache is gone (as a destroyed page would make it) ...
    conn.execute("UPDATE meta SET value = 'garbage' WHERE key = 'sequence'")  # ... and the database damaged
    conn.close()
    store, loss = open_agent_store(state)
    store.close()
    assert loss is not None and ReplayCache  # (the callback reopens the salvaged database)
    status = serve()  # the same signed request, replayed within the tolerance
    print(f"replayed request after the salvage answered {status}; approvals decided: {len(decided)}")
    assert status == 409 and decided == ["E-1"], "the replay must be refused"
    # A request signed after the salvage is accepted.
    headers.update(sign_headers(parse_secret(secret), f"msg_{uuid.uuid4().hex}", body, now=time.time() + 1))
    assert serve() == 200 and len(decided) == 2
