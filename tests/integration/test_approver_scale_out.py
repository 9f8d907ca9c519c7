"""The remote approver scaled out: replay claims, de-duplication keys and outcome folds shared through an
Azure Storage table (deploy/consumers/shared/fleet_state.py, azure-data-tables) on Azurite, the Azure
Storage emulator from npm (tests/peers/azurite/install.sh). Real SDK client, real emulator, real
approver processes; a missing Azurite fails the suite when SEFWD_REQUIRE_PEERS is set (CI)."""
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
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers.approval_receiver import ApprovalReceiver
from benchmarks.peers.azurite_peer import AzuritePeer
from tests.azurite import PYTESTMARK, azurite, table_name  # noqa: F401  (azurite: a fixture)
from tests.fleet import APP_DIR, MASTER_SECRET, callback_secret, record

sys.path.insert(0, str(APP_DIR.parent / "shared"))
import fleet_state  # noqa: E402
import pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "approver_worker.py"
pytestmark = PYTESTMARK


def state(azurite: AzuritePeer, table: str, owner: str | None = None, now: list[float] | None = None) -> Any:
    opened = fleet_state.TableState.open(connection_string=azurite.connection_string, table=table)
    if owner is not None or now is not None:
        opened = fleet_state.TableState(opened.table, owner=owner, clock=(lambda: now[0]) if now else time.time)
    return opened


# -- fleet_state: the table semantics ----------------------------------------------------------------

def test_a_claim_is_taken_once_released_only_by_its_owner_and_taken_over_after_its_lease(azurite):
    table, now = table_name(), [1000.0]
    mine = state(azurite, table, "instance-a", now).claims("seen", lease=60, retention=3600)
    theirs = state(azurite, table, "instance-b", now).claims("seen", lease=60, retention=3600)
    key = "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/vm-a|rec-1"  # "/" is fine
    assert mine.claim(key) and not mine.claim(key) and not theirs.claim(key)  # pending under a live lease
    theirs.release(key)  # not theirs to give back
    assert not theirs.claim(key)
    now[0] += 61  # instance-a was killed mid-claim: its lease ran out
    assert theirs.claim(key) and not mine.claim(key)
    mine.release(key)  # a late release of the old owner does not undo the take-over
    theirs.settle(key)
    now[0] += 3000
    assert not mine.claim(key) and not theirs.claim(key)  # settled: acted on, until the retention ends
    now[0] += 601
    assert mine.claim(key)  # expired: a record this old is refused as stale before it gets here anyway
    theirs.release("never-claimed")  # nothing to release: no error


def test_concurrent_claims_of_one_key_give_exactly_one_owner(azurite):
    table = table_name()
    instances = [state(azurite, table, f"instance-{i}").claims("dedupe", lease=600, retention=3600) for i in range(8)]
    keys = [f"vm|EV-{n}:scheduled" for n in range(10)]
    won: Counter[str] = Counter()
    lock = threading.Lock()
    start = threading.Barrier(len(instances))

    def run(claims: Any) -> None:
        start.wait()
        for key in keys:
            if claims.claim(key):
                with lock:
                    won[key] += 1
    threads = [threading.Thread(target=run, args=(c,)) for c in instances]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert won == Counter({key: 1 for key in keys})


def test_folds_keep_the_strongest_value_across_instances_and_report_each_change_once(azurite):
    table = table_name()
    a, b = state(azurite, table, "a").folds("outcome"), state(azurite, table, "b").folds("outcome")
    assert a.fold("vm|EV", "canceled", 0) == ("canceled", True)
    assert b.fold("vm|EV", "canceled", 0) == ("canceled", False)
    assert b.fold("vm|EV", "completed", 2) == ("completed", True)
    assert a.fold("vm|EV", "unknown", 1) == ("completed", False)
    results: list[tuple[str, bool]] = []
    threads = [threading.Thread(target=lambda f=f, r=r: results.append(f.fold("vm|EV2", ("canceled", "unknown", "completed")[r], r)))
               for f in (a, b) for r in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert a.fold("vm|EV2", "canceled", 0) == ("completed", False)
    assert [value for value, changed in results if changed].count("completed") == 1


def test_purge_deletes_the_rows_past_their_retention_and_no_decision_changes(azurite):
    """Table Storage keeps rows until deleted (lifecycle policies are for blobs): the purge deletes the rows
    whose Expires passed, and only those, so a key means the same before and after it."""
    table, now = table_name(), [1000.0]
    shared = state(azurite, table, "a", now)
    claims, folds = shared.claims("seen", lease=60, retention=3600), shared.folds("outcome", retention=3600)
    assert claims.claim("settled-early")
    claims.settle("settled-early")                      # expires at 4600
    assert claims.claim("left-pending")                 # a killed instance's claim: expires at 1000+60+3600
    assert folds.fold("vm|EV", "completed", 2) == ("completed", True)  # expires at 4600
    # A row an older version wrote (no Expires): purged LEGACY_AGE after its At.
    shared.table.create_entity({"PartitionKey": "zz", "RowKey": "legacy", "Namespace": "seen", "Key": "old",
                                "State": "settled", "At": 1000.0})
    # A damaged one (Expires a string): never matched as expired, purged as a legacy row.
    shared.table.create_entity({"PartitionKey": "zz", "RowKey": "damaged", "Namespace": "seen", "Key": "odd",
                                "State": "settled", "At": 1000.0, "Expires": "soon"})
    now[0] = 3000.0
    assert claims.claim("settled-late")
    claims.settle("settled-late")                       # expires at 6600
    assert shared.purge() == 0

    now[0] = 4601.0
    keys = ("settled-early", "left-pending", "settled-late")
    before = {k: claims.status(k) for k in keys}
    assert before == {"settled-early": None, "left-pending": "pending", "settled-late": "settled"}
    assert folds.fold("vm|EV", "canceled", 0) == ("canceled", True)  # expired: a new fold (expires at 8201)
    assert shared.purge() == 1  # settled-early
    now[0] = 4661.0
    assert shared.purge() == 1  # left-pending, its lease and retention over
    assert {k: claims.status(k) for k in keys} == {**before, "left-pending": None}
    assert not claims.claim("settled-late")  # still acted on: its row stays until 6600
    keys = sorted(e["Key"] for e in shared.table.list_entities())
    assert keys == ["odd", "old", "settled-late", "vm|EV"]
    assert shared.purge(now=1000.0 + fleet_state.LEGACY_AGE + 1) == 4  # (the legacy rows, and the rest expired)
    assert list(shared.table.list_entities()) == []
    assert claims.claim("settled-early")  # a key forgotten is free again, as when its retention ran out


def test_settings_choose_the_backend_and_list_every_problem(tmp_path, azurite):
    base = {"CALLBACK_URL_TEMPLATE": "https://{vm_name}.example/approvals", "SEFWD_MASTER_SECRET": MASTER_SECRET,
            "SEEN_RECORDS_PATH": str(tmp_path / "seen.db")}
    assert pipeline.Settings.from_env(base).state_backend == "sqlite"  # one instance, the default
    with pytest.raises(ValueError) as info:
        pipeline.Settings.from_env({**base, "STATE_BACKEND": "table", "STATE_TABLE_NAME": "no-dashes",
                                    "STATE_LEASE_SECONDS": "0"})
    for problem in ("STATE_TABLE_ENDPOINT", "STATE_TABLE_NAME", "STATE_LEASE_SECONDS"):
        assert problem in str(info.value)
    with pytest.raises(ValueError, match="must be https://"):
        pipeline.Settings.from_env({**base, "STATE_BACKEND": "table", "STATE_TABLE_ENDPOINT": "http://acct.table.x"})
    settings = pipeline.Settings.from_env({**base, "STATE_BACKEND": "table", "STATE_TABLE_NAME": table_name(),
                                           "STATE_TABLE_CONNECTION": azurite.connection_string})
    assert azurite.connection_string not in repr(settings)  # the account key never reaches a log line
    approver = pipeline.RemoteApprover(settings)
    try:
        assert isinstance(approver.seen, fleet_state.TableClaims) and isinstance(approver.outcomes, fleet_state.TableFolds)
        assert not (tmp_path / "seen.db").exists()
    finally:
        approver.close()


# -- four approver processes, one killed mid-claim ---------------------------------------------------

@pytest.mark.slow
def test_four_approvers_on_one_stream_approve_each_event_exactly_once_even_when_one_is_killed_mid_claim(
        tmp_path, azurite):
    events = [f"EV-{n:02d}" for n in range(12)]
    records = []
    for n, event in enumerate(events):  # each event names two VMs; both report it, the first is its leader
        pair = [f"vm{2 * n:02d}", f"vm{2 * n + 1:02d}"]
        records += [record("Reboot", "User", -1, resources=pair, seen_by=vm, event_id=event) for vm in pair]
    hold = records[0]  # the leader's record of EV-00: worker 0 is killed while sending its approval
    feeds = []
    for worker in range(4):  # the same stream to every instance: duplicates and redeliveries, each its order
        copy = records * 2
        random.Random(worker).shuffle(copy)
        if worker == 0:
            copy.insert(0, hold)
        feeds.append(tmp_path / f"feed{worker}.jsonl")
        feeds[-1].write_text("".join(json.dumps(r) + "\n" for r in copy))
    receiver = ApprovalReceiver(secret_of=callback_secret, hold=events[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(APP_DIR))),
           "SEFWD_MASTER_SECRET": MASTER_SECRET,
           "CALLBACK_URL_TEMPLATE": receiver.url_template,
           "CALLBACK_ATTEMPTS": "1", "CALLBACK_TIMEOUT_SECONDS": "120", "STATE_BACKEND": "table",
           "STATE_TABLE_CONNECTION": azurite.connection_string, "STATE_TABLE_NAME": table_name(),
           # The lease: long enough that no live instance is overtaken between its claim and its settle however
           # loaded the machine (an approval twice), short enough to wait out for the killed one's claim.
           "STATE_LEASE_SECONDS": "15"}

    def start(worker: int, out: str) -> subprocess.Popen[bytes]:
        # Each instance its own local files, as on separate machines: only the table is shared.
        local = {"SEEN_RECORDS_PATH": str(tmp_path / f"{out}.local.db")}
        return subprocess.Popen([sys.executable, str(WORKER), str(feeds[worker]), str(tmp_path / out)],
                                env={**env, **local}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    workers = [start(0, "out0.jsonl")]
    try:
        assert receiver.held.wait(60), "worker 0 never sent the approval of EV-00"
        workers += [start(n, f"out{n}.jsonl") for n in range(1, 4)]  # the others, on the same stream
        workers[0].send_signal(signal.SIGKILL)  # mid-claim: claimed, approval in flight, never settled
        workers[0].wait(30)
        receiver.release.set()
        for proc in workers[1:]:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err.decode()[-2000:]
        # The killed instance's partition goes to another instance, which reads it again from the last
        # checkpoint (a redelivery); once the dead owner's lease ran out, its claim is taken over.
        deadline = time.monotonic() + 90
        while (hold["data"]["Resources"][0], events[0]) not in receiver.approved:
            assert time.monotonic() < deadline, "the approval cut short by the kill was never sent again"
            takeover = start(0, "takeover.jsonl")
            _, err = takeover.communicate(timeout=120)
            assert takeover.returncode == 0, err.decode()[-2000:]
        assert receiver.bad == 0
        expected = {(f"vm{2 * n:02d}", event): 1 for n, event in enumerate(events)}
        assert dict(receiver.approved) == expected  # exactly one approval per event, on its leader; none lost
        outcomes = [json.loads(line) for out in tmp_path.glob("*.jsonl") if out.name.startswith(("out", "takeover"))
                    for line in out.read_text().splitlines()]
        approved = Counter(o["EventId"] for o in outcomes if o["decision"] == "approved")
        assert approved == Counter({event: 1 for event in events})
        assert {o["decision"] for o in outcomes} <= {"approved", "replayed", "duplicate", "skip"}
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        receiver.close()


@pytest.mark.slow
def test_the_benchmark_prints_and_writes_its_figures(tmp_path):
    out = tmp_path / "approver_state.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.approver_state", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())["results"]["approver_state"]["figures"]
    assert set(figures["records_per_s"]) == {"sqlite_1", "table_1", "table_2", "table_4"}
    assert all(rate > 0 for rate in figures["records_per_s"].values())
    assert figures["decisions"]["table_4"]["approved"] == figures["events"]  # once per event, over 4 instances
    assert "records/s" in proc.stdout and "scaling" in proc.stdout


@pytest.mark.skipif(__import__("importlib").util.find_spec("azure.functions") is None, reason="azure-functions missing")
def test_the_function_app_on_the_table_backend_shares_its_decisions_between_instances(tmp_path, azurite, monkeypatch):
    """The Function's own HTTP handler with STATE_BACKEND=table: a second instance (a fresh approver, its
    own empty local files) knows what the first decided — the record is `replayed`, another record of
    the same change `duplicate`, the outcome not reported twice."""
    import azure.functions as func
    import function_app

    from tests.fleet import function_handlers

    receiver = ApprovalReceiver(secret_of=callback_secret)
    settings = {"SEFWD_MASTER_SECRET": MASTER_SECRET, "CALLBACK_URL_TEMPLATE": receiver.url_template,
                "STATE_BACKEND": "table", "STATE_TABLE_CONNECTION": azurite.connection_string,
                "STATE_TABLE_NAME": table_name(), "APPROVAL_ROUTE": "callback"}
    for name, value in settings.items():
        monkeypatch.setenv(name, value)

    def instance(n: int) -> Any:
        monkeypatch.setenv("SEEN_RECORDS_PATH", str(tmp_path / f"instance{n}" / "seen.db"))
        function_app.get_approver.cache_clear()
        return lambda rec: json.loads(function_handlers()["sefwd_approve"](func.HttpRequest(
            "POST", "https://approver.example/api/approve", headers={"Content-Type": "application/json"},
            body=json.dumps(rec).encode())).get_body())["outcomes"][0]
    try:
        genuine = record("Reboot", "User", -1, resources=["vm-a"], seen_by="vm-a", event_id="EV-F")
        first = instance(1)
        assert first(genuine)["decision"] == "approved"
        second = instance(2)
        assert second(genuine)["decision"] == "replayed"
        assert second(record("Reboot", "User", -1, resources=["vm-a"], seen_by="vm-a", event_id="EV-F"))[
            "decision"] == "duplicate"  # the same change in another record: one approval per change
        ended = record("Reboot", "User", -1, resources=["vm-a"], seen_by="vm-a", event_id="EV-F",
                       rtype="scheduledevent.completed")
        assert second(ended)["decision"] == "outcome"
        assert instance(3)(ended)["decision"] == "duplicate"
        assert dict(receiver.approved) == {("vm-a", "EV-F"): 1} and receiver.bad == 0
        assert not any((tmp_path / f"instance{n}" / "seen.db").exists() for n in (1, 2, 3))
        # The hourly timer purges the table: nothing is past its retention yet, so every row stays.
        rows = len(list(function_app.get_approver().state.table.list_entities()))
        assert rows >= 3
        function_handlers()["sefwd_purge"](None)
        assert len(list(function_app.get_approver().state.table.list_entities())) == rows
    finally:
        function_app.get_approver.cache_clear()
        receiver.close()
