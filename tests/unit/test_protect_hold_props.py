"""The hold's invariants over random sequences of events (this VM's and others', overlapping, moved,
started early, gone) and restarts, on a real store, with a worker that takes the rows as the agent's does:

- a leave never starts before its hold's enter is over, nor for a hold whose enter never began;
- a leave never starts while an event of the committed document holds this VM;
- an enter never runs for another VM's event;
- at most one enter and one leave per hold; the next hold's enter never overtakes the last leave;
- and once everything has run, a VM no event holds is back (every begun enter has its leave).
"""
from __future__ import annotations

import tempfile
from email.utils import formatdate
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.protect import hold
from forwarder.protect.settings import ProtectConfig
from forwarder.protect.worker import HoldWorker
from forwarder.store import actions as rows
from forwarder.store.actions import ENTER, LEAVE
from forwarder.store.database import Store

VM = VmIdentity(name="myVM")
CONFIG = ProtectConfig(enter="drain", leave="undo", at=300.0, settle=30.0)
KINDS = (ENTER, LEAVE)
T0 = 1_800_000_000.0

change = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(["myVM", "myVM", "other", ""]), st.sampled_from(["Reboot", "Freeze"]),
              st.sampled_from([0, 200, 600, 1200])),
    st.tuples(st.just("gone"), st.integers(0, 9)),
    st.tuples(st.just("move"), st.integers(0, 9), st.sampled_from([0, 100, 900])),
    st.tuples(st.just("start"), st.integers(0, 9)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("tick"), st.sampled_from([1, 29, 31, 400, 900])),
)
# After each change, what the worker does meanwhile: nothing, take a row, end it, or both.
work = st.sampled_from([(), ("begin",), ("ok",), ("fail",), ("begin", "ok"), ("begin", "fail")])
step = st.tuples(change, work)


class World:
    """IMDS (the events), the committed document, the store and one hold worker, on a fake clock."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.now = T0
        self.events: dict[str, dict[str, Any]] = {}
        self.owner: dict[str, str] = {}
        self.incarnation = 0
        self.serial = 0
        self.running: rows.Action | None = None
        self.began: dict[int, list[int]] = {}  # hold (enter id) -> leave rows ever begun
        self.enters_begun: set[int] = set()

    def document(self) -> Any:
        return parse_document({"DocumentIncarnation": self.incarnation, "Events": list(self.events.values())})

    def commit(self, started: tuple[str, ...] = ()) -> None:
        self.incarnation += 1
        with self.store.transaction() as c:
            hold.plan(c, self.document(), VM, CONFIG, now=self.now, started=started)

    def pick(self, n: int) -> str | None:
        ids = sorted(self.events)
        return ids[n % len(ids)] if ids else None

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "add":
            _, who, etype, notice = op
            self.serial += 1
            event_id = f"E{self.serial}"
            self.events[event_id] = {
                "EventId": event_id, "EventType": etype, "ResourceType": "VirtualMachine",
                "Resources": [who] if who else [], "EventStatus": "Scheduled",
                "NotBefore": formatdate(self.now + notice, usegmt=True), "Description": "", "EventSource": "Platform",
                "DurationInSeconds": -1}
            self.owner[event_id] = who
            self.commit()
        elif kind == "gone" and (gone := self.pick(op[1])) is not None:
            del self.events[gone]
            self.commit()
        elif kind == "move" and (moved := self.pick(op[1])) is not None and \
                self.events[moved]["EventStatus"] == "Scheduled":
            self.events[moved]["NotBefore"] = formatdate(self.now + op[2], usegmt=True)
            self.commit()
        elif kind == "start" and (started := self.pick(op[1])) is not None and \
                self.events[started]["EventStatus"] == "Scheduled":
            self.events[started].update(EventStatus="Started", NotBefore="")
            self.commit(started=(started,))
        elif kind == "restart":
            self.running = None  # the process is gone (kill -9): its row stays running until the start
            HoldWorker.recover(self.store, self.now)
            self.commit()  # (the start's reconcile on the saved document; then the first poll)
        elif kind == "tick":
            self.now += op[1]

    def work(self, what: str) -> None:
        if what == "begin" and self.running is None:
            rows.promote(self.store, self.now)
            action = rows.claim(self.store, self.now, kinds=KINDS)
            if action is not None:
                self.check_begin(action)
                self.running = action
        elif what in ("ok", "fail") and self.running is not None:
            with self.store.transaction() as c:
                rows.finish(c, self.running.id, rows.DONE if what == "ok" else rows.FAILED, {}, self.now)
            self.running = None

    def check_begin(self, action: rows.Action) -> None:
        with self.store.transaction() as c:
            if action.kind == ENTER:
                for event_id in action.event.get("EventIds") or []:
                    assert self.owner[event_id] in ("myVM", ""), f"enter for another VM's event {event_id}"
                if action.after is not None:
                    previous = rows.get(c, action.after)
                    assert previous is not None and previous.state in rows.FINAL_STATES, "enter overtook the last leave"
                self.enters_begun.add(action.id)
                return
            enter = rows.get(c, action.after) if action.after is not None else None
            assert enter is not None and enter.state in (rows.DONE, rows.FAILED), f"leave before enter was over: {enter}"
            assert enter.id in self.enters_begun, "leave for a hold whose enter never began"
            held = hold.held_events(self.document(), VM, CONFIG)
            assert not held, f"leave while {[e.event_id for e in held]} hold the VM"
            begun = self.began.setdefault(enter.id, [])
            if action.id not in begun:
                begun.append(action.id)
            assert len(begun) == 1, f"two leaves for hold {enter.id}"

    def settle(self) -> None:
        """Let everything due run to its end (the clock far ahead, every transition succeeding)."""
        for _ in range(50):
            self.now += 7200
            self.work("begin")
            if self.running is None:
                return
            self.work("ok")
        raise AssertionError("the hold's rows never came to rest")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=30))
def test_the_hold_invariants_over_random_events_and_restarts(ops):
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(Path(tmp), fsync=False)
        try:
            world = World(store)
            for op, then in ops:
                world.apply(op)
                for what in then:
                    world.work(what)
            world.settle()
            with store.transaction() as c:
                current = hold.current(c, False)
                ours = hold.held_events(world.document(), VM, CONFIG)
                enters = rows.rows(c, "kind = ?", (ENTER,))
                leaves = rows.rows(c, "kind = ? AND state != ?", (LEAVE, rows.SUPERSEDED))
            if not ours:  # nothing holds the VM: every hold whose enter began is left
                assert current is None or not current.open
                for enter in enters:
                    if enter.id in world.enters_begun:
                        assert [leave.state in (rows.DONE, rows.FAILED) for leave in leaves
                                if leave.after == enter.id] == [True]
            else:  # held: the VM is out of service, by exactly one open hold
                assert current is not None and current.open and current.enter.state in (rows.DONE, rows.FAILED)
                assert {e.event_id for e in ours} <= set(current.event_ids)
        finally:
            store.close()
