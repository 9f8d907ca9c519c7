"""The platform-events consumer scaled out: its reconciliation state in an Azure Storage table
(deploy/consumers/platform-events/reconcile_table.py on deploy/consumers/shared/fleet_state.py) on Azurite,
the Azure Storage emulator from npm (tests/peers/azurite/install.sh). Real SDK client, real emulator, the
Function app in several processes; a missing Azurite fails the suite when SEFWD_REQUIRE_PEERS is set (CI)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers.azurite_peer import AzuritePeer
from benchmarks.peers.webhook_receiver import ReceivedRequest, WebhookReceiver
from tests.azurite import PYTESTMARK, azurite, table_name  # noqa: F401  (azurite: a fixture)
from tests.integration import test_platform_events as pe

from reconcile import Reconciler  # noqa: E402  (test_platform_events put the app's directory on sys.path)
from reconcile_state import BUSY, DONE, TAKEN, SqliteState, state_from_env  # noqa: E402
from reconcile_table import TableReconcileState  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "platform_events_worker.py"
pytestmark = PYTESTMARK


def table_state(azurite: AzuritePeer, table: str, owner: str, clock: Any = time.time, lease: float = 60.0) -> TableReconcileState:
    return TableReconcileState.open(connection_string=azurite.connection_string, table=table, owner=owner,
                                    clock=clock, lease=lease)


# -- the table state on its own ----------------------------------------------------------------------

def test_a_decision_is_taken_once_released_by_its_owner_and_taken_over_after_its_lease(azurite: AzuritePeer) -> None:
    table, now = table_name(), [1000.0]
    a, b = (table_state(azurite, table, owner, lambda: now[0]) for owner in ("a", "b"))
    assert a.claim("EV-1", "missed|vm1") == TAKEN and not a.has("EV-1", "other")
    assert b.claim("EV-1", "missed|vm1") == BUSY and b.has("EV-1", "missed|vm1")
    b.release("EV-1", "missed|vm1")  # not b's: nothing changes
    assert b.claim("EV-1", "missed|vm1") == BUSY
    a.release("EV-1", "missed|vm1")
    assert b.claim("EV-1", "missed|vm1") == TAKEN
    now[0] += 61  # b died holding it: its lease ran out
    assert a.claim("EV-1", "missed|vm1") == TAKEN
    a.settle("EV-1", "missed|vm1")
    assert b.claim("EV-1", "missed|vm1") == DONE and a.claim("EV-1", "missed|vm1") == DONE


@pytest.mark.parametrize("backend", ["table", "sqlite"])
def test_an_instance_takes_back_its_own_decision_once_its_lease_ran_out(azurite: AzuritePeer, backend: str) -> None:
    """Its release failed (the storage blipped): a single instance must not be stuck with it."""
    now = [1000.0]
    state = (table_state(azurite, table_name(), "a", lambda: now[0]) if backend == "table"
             else SqliteState(lease=60.0, clock=lambda: now[0]))
    assert state.claim("EV-1", "reported|vm1") == TAKEN
    assert state.claim("EV-1", "reported|vm1") == BUSY  # the same decision in flight on another thread
    now[0] += 61
    assert state.claim("EV-1", "reported|vm1") == TAKEN


def test_concurrent_updates_from_several_instances_lose_nothing(azurite: AzuritePeer) -> None:
    table = table_name()
    instances = [table_state(azurite, table, f"i{n}") for n in range(6)]
    start = threading.Barrier(len(instances))

    def work(state: TableReconcileState, n: int) -> None:
        start.wait()
        for _ in range(5):
            state.update("EV-1", "report|vm", lambda v: {"count": (v or {"count": 0})["count"] + 1,
                                                         "seen": sorted({*(v or {}).get("seen", []), n})})
    threads = [threading.Thread(target=work, args=(state, n)) for n, state in enumerate(instances)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert instances[0].rows("EV-1") == {"report|vm": {"count": 30, "seen": list(range(6))}}
    big = {"resources": [f"vmss_{n:05d}" for n in range(20000)]}  # > one property's 32K characters
    instances[1].update("EV-1", "platform", lambda _: big)
    assert instances[2].rows("EV-1", "platform") == {"platform": big}
    assert set(instances[2].rows("EV-1", "report|")) == {"report|vm"} and instances[2].rows("EV-2") == {}


def test_open_events_keep_the_earliest_due_and_a_stale_reschedule_fails(azurite: AzuritePeer) -> None:
    table = table_name()
    a, b = table_state(azurite, table, "a"), table_state(azurite, table, "b")
    a.set_open("EV-1", 200.0)
    b.set_open("EV-1", 300.0)  # later: the earlier check stays
    assert a.due(199.0) == [] and [e for e, _ in a.due(200.0)] == ["EV-1"]
    (_, token), = a.due(250.0)
    b.set_open("EV-1", 220.0)  # b took a decision meanwhile: a's view of the row is stale
    assert a.reschedule("EV-1", token, None) is False and [e for e, _ in a.due(250.0)] == ["EV-1"]
    (_, token), = a.due(250.0)
    assert a.reschedule("EV-1", token, 400.0) and a.due(399.0) == []
    (_, token), = a.due(400.0)
    assert a.reschedule("EV-1", token, None) and a.due(10_000.0) == []


def test_settings_choose_the_backend_and_name_every_problem(tmp_path: Path, azurite: AzuritePeer) -> None:
    sqlite = state_from_env({"RECONCILE_STATE_PATH": str(tmp_path / "r.db")})
    assert isinstance(sqlite, SqliteState) and sqlite.lease == 120.0
    sqlite.close()
    with pytest.raises(ValueError) as info:
        state_from_env({"STATE_BACKEND": "table", "STATE_TABLE_NAME": "no-dashes", "STATE_LEASE_SECONDS": "0"})
    for problem in ("STATE_TABLE_ENDPOINT", "STATE_TABLE_NAME", "STATE_LEASE_SECONDS"):
        assert problem in str(info.value)
    with pytest.raises(ValueError, match="must be https://"):
        state_from_env({"STATE_BACKEND": "table", "STATE_TABLE_ENDPOINT": "http://acct.table.example"})
    with pytest.raises(ValueError, match="STATE_BACKEND must be one of sqlite, table"):
        state_from_env({"STATE_BACKEND": "cosmos"})
    table = state_from_env({"STATE_BACKEND": "table", "STATE_TABLE_CONNECTION": azurite.connection_string,
                            "STATE_TABLE_NAME": table_name(), "STATE_LEASE_SECONDS": "30"})
    assert isinstance(table, TableReconcileState) and table.lease == 30.0
    table.close()


# -- the reconciler on the table, in one process -----------------------------------------------------

def test_reconciliation_on_the_table_matches_the_single_instance_one(azurite: AzuritePeer) -> None:
    """The single-instance scenario of test_platform_events, on a table shared by two reconcilers that
    take turns: each record once, whichever instance sees the input."""
    clock, emitted = pe.Clock(), list[dict[str, Any]]()
    table = table_name()
    one, two = (Reconciler(table_state(azurite, table, owner, clock), emitted.extend, missed_after=60.0, clock=clock)
                for owner in ("one", "two"))
    T0 = pe.T0
    one.agent_records([pe.agent_record("vmss_0", "scheduled", T0 - timedelta(seconds=1))])
    assert pe.deliver(two, pe.grid_event(grid_id="G1"))[0] == 200
    assert pe.deliver(one, pe.grid_event(grid_id="G1"))[1]["duplicates"] == 1
    one.agent_records([pe.agent_record("vmss_1", "scheduled", T0 + timedelta(seconds=2))])
    clock.now += 61
    assert one.tick() + two.tick() == 1 and one.tick() + two.tick() == 0
    two.agent_records([pe.agent_record("vmss_2", "scheduled", T0 + timedelta(seconds=70))])
    one.agent_records([pe.agent_record("vmss_0", "canceled", T0 + timedelta(seconds=80), outcome="canceled")])
    two.agent_records([pe.agent_record("vmss_1", "ended", T0 + timedelta(seconds=80), outcome="completed")])
    pe.deliver(one, pe.grid_event("Scheduled", change="canceled", grid_id="G2", when=T0 + timedelta(seconds=85)))
    pe.deliver(two, pe.grid_event(grid_id="G1"))  # a late retry of the first delivery: changes nothing
    two.agent_records([pe.agent_record("vmss_2", "ended", T0 + timedelta(seconds=90), outcome="unknown")])
    assert Counter(r["type"] for r in emitted) == {"scheduledevent.scheduled": 1, "scheduledevent.canceled": 1,
                                                   "fleet.reported": 3, "fleet.missed": 1, "fleet.outcome": 3}
    assert [r["data"]["Vm"]["Name"] for r in emitted if r["type"] == "fleet.missed"] == ["vmss_2"]
    assert [r["data"]["Late"] for r in emitted if r["type"] == "fleet.reported"] == [False, False, True]
    outcomes = {r["data"]["Vm"]["Name"]: (r["data"]["PlatformStatus"], r["data"]["Agrees"])
                for r in emitted if r["type"] == "fleet.outcome"}
    assert outcomes == {"vmss_0": ("Canceled", True), "vmss_1": ("Canceled", False), "vmss_2": ("Canceled", None)}


def test_a_failed_output_releases_the_decisions_and_the_retry_makes_them(azurite: AzuritePeer) -> None:
    clock, sent, failing = pe.Clock(), list[dict[str, Any]](), [True]

    def emit(records: list[dict[str, Any]]) -> None:
        if failing[0]:
            raise OSError("hub unreachable")
        sent.extend(records)

    table = table_name()
    one, two = (Reconciler(table_state(azurite, table, owner, clock), emit, missed_after=60.0, clock=clock)
                for owner in ("one", "two"))
    one.agent_records([pe.agent_record("vmss_0", "scheduled", pe.T0)])
    assert pe.deliver(one, pe.grid_event(grid_id="G1"))[0] == 503
    failing[0] = False
    assert pe.deliver(two, pe.grid_event(grid_id="G1"))[1]["records"] == 2  # the other instance, at once
    assert [r["type"] for r in sent] == ["scheduledevent.scheduled", "fleet.reported"]


# -- the Function app in several processes, one killed mid-claim -------------------------------------

EVENTS = ("EV-A", "EV-B")


def _streams(now: datetime) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(the agents' `scheduled` records, the Event Grid deliveries of `Scheduled` and of `Canceled`, and
    the agents' terminal records) of two events naming three VMs; vmss_2's agent is down."""
    reports, scheduled, ended = [], [], []
    for event in EVENTS:
        scheduled.append({"grid": [pe.grid_event(event_id=event, grid_id=f"{event}-G1", when=now)]})
        ended.append({"grid": [pe.grid_event("Scheduled", event_id=event, change="canceled", grid_id=f"{event}-G2",
                                             when=now + timedelta(seconds=1))]})
        reports += [{"agents": [pe.agent_record(vm, "scheduled", now + timedelta(seconds=0.5), event_id=event)]}
                    for vm in ("vmss_0", "vmss_1")]
        ended += [{"agents": [pe.agent_record("vmss_0", "canceled", now + timedelta(seconds=2), event_id=event,
                                              outcome="canceled")]},
                  {"agents": [pe.agent_record("vmss_1", "ended", now + timedelta(seconds=2), event_id=event,
                                              outcome="completed")]}]
    return reports, scheduled, ended


def test_instances_fed_the_same_deliveries_emit_each_record_once_even_when_one_is_killed_mid_claim(
        tmp_path: Path, azurite: AzuritePeer) -> None:
    sink: list[dict[str, Any]] = []
    lock, held, release = threading.Lock(), threading.Event(), threading.Event()
    in_flight: list[dict[str, Any]] = []

    def collector(request: ReceivedRequest) -> int:
        if request.path.startswith("/hold"):  # instance 0's output: it hangs there until it is killed
            in_flight.extend(request.json())
            held.set()
            release.wait(60)
            return 503
        with lock:
            sink.extend(request.json())
        return 200

    reports, scheduled, ended = _streams(datetime.now(timezone.utc))
    feeds = []
    for worker in range(3):
        if worker == 0:  # the reports, then EV-A's first delivery: claims the record and two fleet.reported
            steps = reports + scheduled[:1]
        else:  # everything, every Event Grid delivery twice, each its own order within a phase
            first, second = reports + scheduled * 2, ended + [s for s in ended if "grid" in s]
            random.Random(worker).shuffle(first)
            random.Random(worker).shuffle(second)
            steps = first + second + [{"tick": True}]
        feeds.append(tmp_path / f"feed{worker}.jsonl")
        feeds[-1].write_text("".join(json.dumps(s) + "\n" for s in steps))
    tick_feed = tmp_path / "tick.jsonl"
    tick_feed.write_text(json.dumps({"tick": True}) + "\n")
    with WebhookReceiver(collector) as server:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "STATE_BACKEND": "table",
               "STATE_TABLE_CONNECTION": azurite.connection_string, "STATE_TABLE_NAME": table_name(),
               # The lease: long enough that no live instance is overtaken between its claim and its settle
               # however loaded the machine (2 s was, once: a record twice), short enough to wait out.
               "STATE_LEASE_SECONDS": "15", "MISSED_AFTER_SECONDS": "3", "PLATFORM_OUTPUT": "http"}

        def start(feed: Path, output: str) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, str(WORKER), str(feed)], cwd=ROOT,
                                    env={**env, "PLATFORM_OUTPUT_URL": server.url_for(output)},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        workers = [start(feeds[0], "/hold")]
        try:
            assert held.wait(90), "instance 0 never sent its first records"
            # What instance 0 claimed and was sending when it died (never acknowledged, never settled):
            assert {(r["type"], r["data"]["Vm"]["Name"] if r["type"].startswith("fleet.") else "") for r in in_flight} >= {
                ("fleet.reported", "vmss_0"), ("fleet.reported", "vmss_1"), ("scheduledevent.scheduled", "")}
            workers += [start(feeds[n], "/out") for n in (1, 2)]
            workers[0].send_signal(signal.SIGKILL)  # mid-claim: claimed, records in flight, never settled
            workers[0].wait(30)
            release.set()
            answers: Counter[int] = Counter()
            for proc in workers[1:]:
                out, err = proc.communicate(timeout=120)
                assert proc.returncode == 0, err.decode()[-3000:]  # every delivery taken in the end
                answers.update(json.loads(line)["status"] for line in out.decode().splitlines())
            assert set(answers) <= {200, 503} and answers[200] == 2 * 2 * 2 * len(EVENTS)  # 2 instances x 2 copies x 2 deliveries per event

            def per_event() -> Counter[tuple[str, str, str]]:
                with lock:
                    return Counter((r["subject"], r["type"], r["data"]["Vm"]["Name"] if r["type"].startswith("fleet.") else "")
                                   for r in sink)
            expected = Counter({(event, kind, vm): 1 for event in EVENTS for kind, vm in (
                ("scheduledevent.scheduled", ""), ("scheduledevent.canceled", ""), ("fleet.reported", "vmss_0"),
                ("fleet.reported", "vmss_1"), ("fleet.missed", "vmss_2"), ("fleet.outcome", "vmss_0"),
                ("fleet.outcome", "vmss_1"))})
            # The dead instance's decisions wait for its lease; then the timer (another instance) makes them.
            deadline = time.monotonic() + 120
            while per_event() != expected:
                assert time.monotonic() < deadline and all(n == 1 for n in per_event().values()), per_event()
                ticker = start(tick_feed, "/out")
                _, err = ticker.communicate(timeout=60)
                assert ticker.returncode == 0, err.decode()[-3000:]
            ticker = start(tick_feed, "/out")  # one more turn: nothing left to say
            assert ticker.wait(60) == 0
        finally:
            release.set()
            for proc in workers:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    assert per_event() == expected  # exactly one record of each kind per event, none lost
    with lock:
        assert len({r["id"] for r in sink}) == len(sink)
        outcomes = {(r["subject"], r["data"]["Vm"]["Name"]): r["data"]["Agrees"] for r in sink if r["type"] == "fleet.outcome"}
    assert outcomes == {(e, "vmss_0"): True for e in EVENTS} | {(e, "vmss_1"): False for e in EVENTS}


@pytest.mark.parametrize("backend", ["table", "sqlite"])
def test_the_timer_forgets_what_is_past_the_retention_at_most_hourly(azurite: AzuritePeer, backend: str) -> None:
    """Neither store expires anything by itself (Table Storage has no TTL): the minute timer's tick purges
    once an hour, and a delivery retried after the retention is an event seen anew, as documented."""
    from reconcile_state import DEFAULT_RETENTION

    clock, emitted = pe.Clock(), list[dict[str, Any]]()
    state = (table_state(azurite, table_name(), "one", clock) if backend == "table"
             else SqliteState(clock=clock))
    reconciler = Reconciler(state, emitted.extend, missed_after=60.0, clock=clock)
    assert reconciler.tick() == 0  # the first tick purges (nothing yet)
    assert pe.deliver(reconciler, pe.grid_event(grid_id="G1"))[1]["records"] == 1
    clock.now += 61
    assert reconciler.tick() == 3  # fleet.missed for each VM the event names: none reported it
    assert pe.deliver(reconciler, pe.grid_event(grid_id="G1"))[1]["duplicates"] == 1
    assert reconciler.purge_when_due() == 0  # within the hour: not even a round trip
    clock.now += DEFAULT_RETENTION - 3600
    assert reconciler.purge_when_due() == 0  # an hour later: purged, nothing old enough
    assert pe.deliver(reconciler, pe.grid_event(grid_id="G1"))[1]["duplicates"] == 1
    clock.now += 3600 + 1
    assert reconciler.purge_when_due() > 0  # the event's decisions and observations
    assert reconciler.purge_when_due() == 0
    assert pe.deliver(reconciler, pe.grid_event(grid_id="G1"))[1]["duplicates"] == 0  # seen anew
    state.close()
