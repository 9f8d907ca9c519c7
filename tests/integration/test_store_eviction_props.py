"""Property: under the size cap no scheduled event is evicted while a lower-priority record is
kept, every eviction is counted for the sink that had not delivered it, and ids never go back."""
from __future__ import annotations

import tempfile
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forwarder.sinkapi import Record
from forwarder.store.database import Store, priority_of
from tests.conftest import examples

TYPES = ("scheduledevent.scheduled", "scheduledevent.completed", "forwarder.heartbeat", "approval.refused",
         "forwarder.started")
batches = st.lists(st.lists(st.tuples(st.sampled_from(TYPES), st.integers(100, 3000)), min_size=1, max_size=6),
                   min_size=1, max_size=25)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_eviction_order_and_accounting(plan):
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(Path(tmp), fsync=False, max_size=12_000)
        store.sinks = ("down",)
        store.cursor("down")
        n = 0
        committed: dict[int, str] = {}
        for batch in plan:
            records = []
            for rtype, pad in batch:
                records.append(Record.from_dict({"id": f"r{n}", "type": rtype, "n": n, "pad": "x" * pad}))
                committed[n] = rtype
                n += 1
            before = {orjson.loads(e.body)["n"] for e in store.read("down", 0, 10_000)}
            store.commit(records)
            kept = {orjson.loads(e.body)["n"]: e for e in store.read("down", 0, 10_000)}
            evicted = (before | {orjson.loads(r.body)["n"] for r in records}) - set(kept)
            if any(priority_of(committed[i]) == 2 for i in evicted):
                # A scheduled event goes only when nothing of lower priority is left to go first.
                assert all(priority_of(committed[i]) == 2 for i in kept)
            assert store.size <= 12_000 or not evicted or len(kept) <= len(records)
        lost = store.losses().get("down", {}).get("evicted_size_cap", 0)
        assert lost + len(kept) == n, "every record is kept or counted as evicted"
        assert list(kept) == sorted(kept) and [e.index for e in kept.values()] == sorted(e.index for e in kept.values())
        store.close()
