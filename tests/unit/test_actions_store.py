"""The actions table on a real store: planned → due → running → a final state, counted by kind and outcome."""
from __future__ import annotations

from pathlib import Path

from forwarder.store import actions as rows
from forwarder.store.actions import NewAction
from forwarder.store.database import Store


def new(kind: str = rows.HOOK, due: float = 100.0, after: int | None = None) -> NewAction:
    return NewAction(kind=kind, event_id="E1", change="scheduled", event={"EventId": "E1"}, due=due, hook="scheduled",
                     after=after, record={"id": "r"})


def test_the_life_of_an_action(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    with store.transaction() as c:
        hook = rows.insert(c, new(), 50.0)
        approve = rows.insert(c, new(rows.APPROVE, due=100.0, after=hook), 50.0)
        later = rows.insert(c, new(due=1000.0), 50.0)
    assert rows.claim(store, 60.0) is None  # nothing due yet
    assert rows.promote(store, 100.0) == 1  # the hook; the approval waits for it, the last for its time
    taken = rows.claim(store, 101.0)
    assert taken is not None and (taken.id, taken.state, taken.attempts, taken.record) == (hook, "running", 1, {"id": "r"})
    assert rows.claim(store, 101.0) is None
    assert rows.promote(store, 102.0) == 0  # the approval still waits for the running hook
    with store.transaction() as c:
        assert rows.finish(c, hook, rows.DONE, {"Outcome": "ran", "Reason": "hook_ok"}, 103.0)
        assert not rows.finish(c, hook, rows.FAILED, {}, 104.0)  # a final state is final
    assert rows.promote(store, 104.0) == 1
    step = rows.claim(store, 104.0)
    assert step is not None and step.id == approve
    rows.mark_posting(store, approve, 105.0)
    assert rows.recover(store, 106.0) == 1  # a crash: running → due, the phase kept
    again = rows.claim(store, 107.0)
    assert again is not None and (again.id, again.phase, again.attempts) == (approve, rows.POSTING, 2)
    rows.release(store, approve, 200.0, 108.0)
    assert rows.next_due(store) == 200.0
    with store.transaction() as c:
        assert rows.finish(c, later, rows.SUPERSEDED, {"Outcome": "superseded"}, 109.0, only_from=(rows.PLANNED, rows.DUE))
    assert rows.counts(store) == {"hook": {"done": 1, "superseded": 1}, "approve": {"planned": 1}}
    assert rows.outcomes(store) == {("hook", "ran"): 1, ("hook", "superseded"): 1}
    store.close()
