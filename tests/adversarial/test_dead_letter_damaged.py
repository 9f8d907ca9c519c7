"""One damaged dead letter never blocks the others (issue 20, item 4): ``sefwd deadletter list``
shows it with its reason and its raw bytes (bounded), ``replay`` sends the rest and keeps it.
Real SQLite, the real CLI in a subprocess, a real HTTP receiver."""
from __future__ import annotations

import uuid
from pathlib import Path

import orjson

from benchmarks.peers.webhook_receiver import WebhookReceiver
from forwarder.store.database import Store
from tests.agent import write_config
from tests.integration.test_cli import sefwd

DAMAGED = [b"\x00\xff not json at all", b'{"type": "scheduledevent.scheduled"}', b"[1, 2, 3]", b"\xfe" * 100_000]


def _letters(state: Path) -> set[str]:
    good = {str(uuid.uuid4()) for _ in range(3)}
    bodies = [orjson.dumps({"specversion": "1.0", "id": i, "source": "/vm/t", "type": "scheduledevent.scheduled",
                            "subject": "E1", "time": "2026-11-24T00:00:00.000Z", "data": {}}) for i in sorted(good)]
    store = Store.open(state)
    try:  # the damaged ones first: a replay that stops at the first would deliver nothing
        store.advance("hook", 0, [(body, "http_400", "refused") for body in DAMAGED + bodies], now="2026-11-24T00:00:00Z")
    finally:
        store.close()
    return good


def test_damaged_dead_letters_are_listed_and_kept_while_the_rest_are_replayed(tmp_path: Path) -> None:
    with WebhookReceiver(default=200) as rx:
        config = write_config(tmp_path / "c.toml", "http://127.0.0.1:9", tmp_path / "state",
                              sinks=f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{rx.url}"\n')
        good = _letters(tmp_path / "state")
        listed = sefwd("deadletter", "list", "hook", "--json", "--config", str(config))
        text = sefwd("deadletter", "list", "--config", str(config))
        replayed = sefwd("deadletter", "replay", "hook", "--config", str(config))
        delivered = {r.json()["id"] for r in rx.requests if r.body}
    print(f"dead letters listed: {len(listed.stdout.splitlines())} of {len(DAMAGED) + 3}; "
          f"replayed: {len(delivered)} of 3")
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = [orjson.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == len(DAMAGED) + 3
    damaged = [r for r in rows if r.get("damaged")]
    assert len(damaged) == len(DAMAGED) and all(r["reason"] == "http_400" and r["record"] is None for r in damaged)
    assert all(len(r["raw"]) <= 1024 and r["raw_bytes"] >= 9 for r in damaged)
    assert damaged[0]["raw"] == "\x00\\xff not json at all"  # (undecodable bytes as \\xNN)
    assert text.returncode == 0 and text.stdout.count("\tdamaged\t") == len(DAMAGED), text.stderr[-2000:]
    assert delivered == good, replayed.stderr[-2000:]
    assert replayed.returncode == 1 and f"still dead {len(DAMAGED)}" in replayed.stderr
    store = Store.open(tmp_path / "state")
    try:
        kept = store.dead_letters("hook")
    finally:
        store.close()
    assert sorted(bytes(d.raw) for d in kept) == sorted(DAMAGED), "the damaged dead letters are kept, unchanged"
