"""The platform's own record of every event (Event Grid) beside the agents' stream: consumer, reconciliation, emulator side."""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers.webhook_receiver import ReceivedRequest, Reply, WebhookReceiver
from forwarder.common.fleet_keys import RECORD_PURPOSE, as_secret, derive_key
from forwarder.common.record_auth import sign_record
from forwarder.common.signing import generate_secret, parse_secret
from forwarder.emulator import Emulator
from forwarder.emulator.eventgrid import EVENT_TYPE, EventGridPublisher, render
from forwarder.emulator.model import Event, VmProfile
from forwarder.records import record_id as agents_record_id
from sinks.la_schema import COLUMNS, to_row
from tests.agent import AgentProcess, wait_until, write_config

APP_DIR = Path(__file__).resolve().parents[2] / "deploy" / "consumers" / "platform-events"
# Appended, not first: the remote approver's tests share this process and import their own
# ``function_app`` by name; this app's is loaded from its file (_function_app), never by name.
if str(APP_DIR) not in sys.path:
    sys.path.append(str(APP_DIR))

import platform_events  # noqa: E402
import streamauth  # noqa: E402  (the remote approver's verifier, linked into the consumer)
from reconcile import Reconciler, vm_name  # noqa: E402
from reconcile_state import SqliteState  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SCALE_SET = "vmss"
VMS = [VmProfile(f"{SCALE_SET}_{i}", vm_scale_set_name=SCALE_SET) for i in range(3)]
PROFILES = {vm.name: vm for vm in VMS}
T0 = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)
MASTER_SECRET = "whsec_" + "cGxhdGZvcm0tZXZlbnRzLXRlc3QtbWFzdGVyLWtleSE="
MASTER = parse_secret(MASTER_SECRET)


def signed(record: dict[str, Any], signer: str) -> dict[str, Any]:
    """``record`` with the sefwdauth of VM ``signer``'s key (derived from the fleet master)."""
    return sign_record(derive_key(MASTER, RECORD_PURPOSE, PROFILES[signer].resource_id), record)


def grid_event(status: str = "Scheduled", *, event_id: str = "EV-1", resources: list[str] | None = None,
               change: str = "scheduled", when: datetime = T0, grid_id: str | None = None) -> dict[str, Any]:
    ev = Event(id=event_id, type="Reboot", resources=resources or [vm.name for vm in VMS], status=status,
               not_before=T0 + timedelta(minutes=15), description="Host server is undergoing maintenance.",
               source="Platform", duration=-1)
    return render(change, ev, when, PROFILES, grid_id=grid_id)


def agent_record(vm: str, kind: str, when: datetime, *, event_id: str = "EV-1", outcome: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"EventId": event_id, "EventType": "Reboot", "Change": kind,
                            "Vm": {"Name": vm, "ResourceId": PROFILES[vm].resource_id}}
    if outcome:
        data["Outcome"] = outcome
    return {"specversion": "1.0", "id": f"{vm}-{kind}", "type": f"scheduledevent.{kind}",
            "source": PROFILES[vm].resource_id, "time": when.isoformat().replace("+00:00", "Z"), "data": data}


class Clock:
    def __init__(self) -> None:
        self.now = T0.timestamp()

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def emitted() -> list[dict[str, Any]]:
    return []


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def reconciler(emitted: list[dict[str, Any]], clock: Clock) -> Reconciler:
    return Reconciler(SqliteState(), emitted.extend, missed_after=60.0, clock=clock)


def deliver(reconciler: Reconciler, *events: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return reconciler.handle_delivery(json.dumps(list(events)).encode(), {"aeg-event-type": "Notification"})


# -- the consumer on its own -------------------------------------------------------------------------
def test_validation_handshake_answers_the_code(reconciler: Reconciler) -> None:
    body = json.dumps([{"id": "v", "eventType": platform_events.VALIDATION_TYPE, "eventTime": "2026-11-27T12:00:00Z",
                        "data": {"validationCode": "512d38b6-c7b8-40c8-89fe-f46f9e9622b6"}}]).encode()
    assert reconciler.handle_delivery(body, {"aeg-event-type": "SubscriptionValidation"}) == \
        (200, {"validationResponse": "512d38b6-c7b8-40c8-89fe-f46f9e9622b6"})


@pytest.mark.parametrize("body, fragment", [
    (b"not json", "not JSON"),
    (b'[{"id": "x", "eventType": "Microsoft.EventGrid.SubscriptionValidationEvent", "data": {}}]', "validationCode"),
    (json.dumps([{"id": "x", "eventType": EVENT_TYPE, "eventTime": "2026-11-27T12:00:00Z", "data": {}}]).encode(), "EventId"),
    (b"[1, 2]", "JSON object"),
])
def test_bad_deliveries_are_refused_with_a_reason_and_nothing_emitted(
        reconciler: Reconciler, emitted: list[dict[str, Any]], body: bytes, fragment: str) -> None:
    status, answer = reconciler.handle_delivery(body, {})
    assert status == 400 and fragment in answer["error"] and emitted == []


def test_a_platform_event_becomes_a_record_of_the_agents_schema(reconciler: Reconciler, emitted: list[dict[str, Any]]) -> None:
    assert deliver(reconciler, grid_event(grid_id="G1"))[0] == 200
    (rec,) = emitted
    resource = f"/subscriptions/{VMS[0].subscription_id}/resourceGroups/myResourceGroup/providers/Microsoft.Compute/virtualMachineScaleSets/{SCALE_SET}"
    assert rec["source"] == "platform:" + resource and rec["type"] == "scheduledevent.scheduled"
    assert rec["eventkey"] == "EV-1:scheduled" and rec["subject"] == "EV-1"
    # A stable id made as forwarder.records makes the agents' (no DocumentIncarnation; a digest of the fields).
    digest = platform_events._digest(grid_event()["data"]["resourceInfo"]["properties"])
    assert rec["id"] == agents_record_id("platform:" + resource, "EV-1", "scheduled", None, digest)
    data = rec["data"]
    assert data["NotBefore"] == "2026-11-27T12:15:00.000Z" and data["NotBeforeRaw"] == "Fri, 27 Nov 2026 12:15:00 GMT"
    assert data["Platform"]["EventGridId"] == "G1" and data["ApiVersion"] == "2024-07-01"
    # The instances' ids rebuilt from Resources, as the page says (a Flexible-style VM id).
    assert data["Platform"]["VmResourceIds"]["vmss_2"] == \
        f"/subscriptions/{VMS[0].subscription_id}/resourceGroups/myResourceGroup/providers/Microsoft.Compute/virtualMachines/vmss_2"
    row = to_row(rec)  # the Log Analytics sink takes it as it is
    assert set(row) == {name for name, _ in COLUMNS} and row["EventType"] == "Reboot"
    assert row["Source"].startswith("platform:") and row["Change"] == "scheduled"


def test_the_published_sample_converts() -> None:
    """The sample payload of Microsoft's "Scheduled Events in Event Grid" page (placeholders filled in)."""
    sub, group = "8d10da13-8125-4ba9-a717-bf7490507b3d", "rg-name"
    resource = f"/subscriptions/{sub}/resourceGroups/{group}/providers/Microsoft.Compute/virtualMachineScaleSets/vmss-name"
    event_resource = f"{resource}/providers/microsoft.maintenance/scheduledevents/3da1b9aa-5204-4335-8c33-c54e315dcffe"
    sample = {
        "id": "3da1b9aa-5204-4335-8c33-c54e315dcffe", "topic": f"/subscriptions/{sub}", "subject": event_resource,
        "data": {"resourceInfo": {"id": event_resource, "name": "3da1b9aa-5204-4335-8c33-c54e315dcffe",
                                  "type": "microsoft.maintenance/scheduledEvents", "location": "eastus",
                                  "properties": {"DurationInSeconds": 5, "Description": "Virtual machine is being paused "
                                                 "because of a memory-preserving Live Migration operation.",
                                                 "EventId": "3da1b9aa-5204-4335-8c33-c54e315dcffe",
                                                 "EventSource": "Platform", "EventStatus": "Started", "EventType": "Freeze",
                                                 "NotBefore": "Mon, 19 Sep 2025 18:29:47 GMT",
                                                 "Resources": ["myvmss_1", "myvmss_2"], "ResourceType": "VirtualMachine"}},
                 "apiVersion": "2024-07-01"},
        "eventType": "Microsoft.ResourceNotifications.MaintenanceResources.ScheduledEventEmitted",
        "dataVersion": "3.0", "metadataVersion": "1", "eventTime": "2017-06-26T18:41:00.9584103Z"}
    event = platform_events.scheduled_event(sample)
    rec = platform_events.platform_record(event, "started")
    assert rec["time"] == "2017-06-26T18:41:00.958Z" and rec["source"] == "platform:" + resource
    assert rec["data"]["Platform"]["VmResourceIds"] == {
        name: f"/subscriptions/{sub}/resourceGroups/{group}/providers/Microsoft.Compute/virtualMachines/{name}"
        for name in ("myvmss_1", "myvmss_2")}
    assert rec["data"]["Vm"]["VmScaleSetName"] == "vmss-name" and rec["data"]["DurationInSeconds"] == 5
    assert set(to_row(rec)) == {name for name, _ in COLUMNS}


def test_duplicates_by_event_grid_id_make_no_second_record_and_kinds_follow_the_status(
        reconciler: Reconciler, emitted: list[dict[str, Any]]) -> None:
    first = grid_event(grid_id="G1")
    assert deliver(reconciler, first, first)[1]["duplicates"] == 1
    assert deliver(reconciler, first)[1]["duplicates"] == 1
    deliver(reconciler, grid_event(grid_id="G2"))  # Scheduled again: an update
    deliver(reconciler, grid_event("Started", change="started", grid_id="G3"))
    deliver(reconciler, grid_event("Started", change="completed", grid_id="G4"))
    assert [r["type"] for r in emitted] == ["scheduledevent.scheduled", "scheduledevent.updated",
                                            "scheduledevent.started", "scheduledevent.completed"]
    assert emitted[-1]["eventkey"] == "EV-1:ended" and emitted[-1]["data"]["Outcome"] == "completed"
    assert len({r["id"] for r in emitted}) == 4


def test_a_failed_output_loses_nothing_the_retry_delivers_it(clock: Clock) -> None:
    sent: list[dict[str, Any]] = []
    failing = [True]

    def emit(records: list[dict[str, Any]]) -> None:
        if failing[0]:
            raise OSError("hub unreachable")
        sent.extend(records)

    reconciler = Reconciler(SqliteState(), emit, missed_after=60.0, clock=clock)
    assert deliver(reconciler, grid_event(grid_id="G1"))[0] == 503  # Event Grid delivers again
    failing[0] = False
    assert deliver(reconciler, grid_event(grid_id="G1")) == (200, {"received": 1, "records": 1, "duplicates": 0,
                                                                   "ignored": 0})
    assert [r["type"] for r in sent] == ["scheduledevent.scheduled"]


def test_reconciliation_reported_missed_and_outcomes(reconciler: Reconciler, emitted: list[dict[str, Any]],
                                                     clock: Clock) -> None:
    reconciler.agent_records([agent_record("vmss_0", "scheduled", T0 - timedelta(seconds=1))])  # before the platform's
    deliver(reconciler, grid_event(grid_id="G1"))
    reconciler.agent_records([agent_record("vmss_1", "scheduled", T0 + timedelta(seconds=2))])
    clock.now += 59
    assert reconciler.tick() == 0  # not yet
    clock.now += 2
    assert reconciler.tick() == 1 and reconciler.tick() == 0
    missed = [r for r in emitted if r["type"] == "fleet.missed"]
    assert [r["data"]["Vm"]["Name"] for r in missed] == ["vmss_2"]
    assert missed[0]["data"]["Vm"]["ResourceId"].endswith("/providers/Microsoft.Compute/virtualMachines/vmss_2")
    reported = {r["data"]["Vm"]["Name"]: r["data"] for r in emitted if r["type"] == "fleet.reported"}
    assert reported["vmss_0"]["DetectionSeconds"] == -1.0 and reported["vmss_1"]["DetectionSeconds"] == 2.0
    # vmss_2's agent comes back late: reported, marked late; then the platform cancels.
    reconciler.agent_records([agent_record("vmss_2", "scheduled", T0 + timedelta(seconds=70))])
    assert [r["data"]["Late"] for r in emitted if r["type"] == "fleet.reported"] == [False, False, True]
    reconciler.agent_records([agent_record("vmss_0", "canceled", T0 + timedelta(seconds=80), outcome="canceled"),
                              agent_record("vmss_1", "ended", T0 + timedelta(seconds=80), outcome="completed")])
    assert not [r for r in emitted if r["type"] == "fleet.outcome"]  # the platform has not said yet
    deliver(reconciler, grid_event("Scheduled", change="canceled", grid_id="G2"))
    reconciler.agent_records([agent_record("vmss_2", "ended", T0 + timedelta(seconds=90), outcome="unknown")])
    outcomes = {r["data"]["Vm"]["Name"]: r["data"] for r in emitted if r["type"] == "fleet.outcome"}
    assert {vm: (o["PlatformStatus"], o["Outcome"], o["Agrees"]) for vm, o in outcomes.items()} == {
        "vmss_0": ("Canceled", "canceled", True), "vmss_1": ("Canceled", "completed", False),
        "vmss_2": ("Canceled", "unknown", None)}
    assert outcomes["vmss_1"]["Reason"] == "disagree"
    for rec in emitted:  # every record the reconciler makes fits the Log Analytics table
        assert set(to_row(rec)) == {name for name, _ in COLUMNS}


def test_with_a_master_secret_only_signed_records_count_and_for_the_vm_that_signed(
        emitted: list[dict[str, Any]], clock: Clock) -> None:
    verify = lambda record: streamauth.verify(record, [MASTER])  # noqa: E731
    reconciler = Reconciler(SqliteState(), emitted.extend, missed_after=60.0, clock=clock, verify=verify)
    deliver(reconciler, grid_event(grid_id="G1"))
    honest = signed(agent_record("vmss_0", "scheduled", T0 + timedelta(seconds=1)), "vmss_0")
    # vmss_1 tries to report for vmss_2 (its name in data.Vm), and an unsigned record claims vmss_2 too.
    forged = signed({**agent_record("vmss_2", "scheduled", T0), "source": PROFILES["vmss_1"].resource_id}, "vmss_1")
    unsigned = agent_record("vmss_2", "scheduled", T0)
    reconciler.agent_records([honest, forged, unsigned])
    clock.now += 61
    reconciler.tick()
    assert reconciler.refused == 1  # the unsigned one; the forged one counts, but for vmss_1 (who signed it)
    assert sorted(r["data"]["Vm"]["Name"] for r in emitted if r["type"] == "fleet.reported") == ["vmss_0", "vmss_1"]
    assert [r["data"]["Vm"]["Name"] for r in emitted if r["type"] == "fleet.missed"] == ["vmss_2"]
    assert vm_name(PROFILES["vmss_2"].resource_id) == "vmss_2"
    assert vm_name("/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/web-1") == "web-1"


def test_emulator_event_grid_side_validates_first_then_delivers_with_duplicates() -> None:
    seen: list[tuple[str, Any]] = []

    def subscriber(request: ReceivedRequest) -> Reply:
        events = request.json()
        seen.append((request.header("aeg-event-type") or "", events))
        if events[0]["eventType"] == platform_events.VALIDATION_TYPE:
            return Reply(200, {"Content-Type": "application/json"},
                         json.dumps({"validationResponse": events[0]["data"]["validationCode"]}).encode())
        return Reply(200)

    with WebhookReceiver(subscriber) as hook, Emulator(vms=VMS) as emu:
        publisher = emu.publish_to(hook.url_for("/events"), duplicates=2)
        event_id = emu.schedule(type="Reboot", resources=["vmss_0", "vmss_1"], not_before="+20m")
        emu.cancel(event_id)
        wait_until(lambda: publisher.stats.delivered >= 3, 20, "three deliveries")
    kinds = [k for k, _ in seen]
    assert kinds[0] == "SubscriptionValidation" and set(kinds[1:]) == {"Notification"}
    delivered = [events[0] for _, events in seen[1:]]
    statuses = [e["data"]["resourceInfo"]["properties"]["EventStatus"] for e in delivered]
    assert statuses == ["Scheduled", "Canceled", "Canceled"]  # the second event delivered twice
    assert delivered[1]["id"] == delivered[2]["id"] and delivered[0]["id"] != delivered[1]["id"]
    assert delivered[0]["subject"].endswith(f"/virtualMachineScaleSets/{SCALE_SET}/providers/microsoft.maintenance/scheduledevents/{event_id}")
    assert delivered[0]["dataVersion"] == "3.0" and delivered[0]["data"]["apiVersion"] == "2024-07-01"


def test_nothing_is_delivered_to_an_endpoint_that_never_validates() -> None:
    with WebhookReceiver(Reply(200, body=b"{}")) as hook, Emulator(vms=VMS[:1]) as emu:
        publisher = EventGridPublisher(hook.url_for("/events"), emu.platform.vms, retry=0.01, max_attempts=3)
        publisher.start()
        emu.platform.listeners.append(publisher)
        emu.schedule(type="Reboot")
        wait_until(lambda: hook.count >= 3, 10, "three validation attempts")
        publisher.stop()
        assert publisher.stats.validated is False and publisher.stats.delivered == 0
        assert all(r.json()[0]["eventType"] == platform_events.VALIDATION_TYPE for r in hook.requests)


# -- end to end: emulator -> three agents (one stopped) and Event Grid -> the Function -> one sink --------
def _function_app() -> Any:
    spec = importlib.util.spec_from_file_location("platform_events_function_app", APP_DIR / "function_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def function_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    pytest.importorskip("azure.functions")
    app = _function_app()
    yield app
    app.get_reconciler.cache_clear()


def test_end_to_end_missed_names_the_stopped_vm_and_a_cancel_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   function_app: Any) -> None:
    import azure.functions as func

    handlers = {f.get_function_name(): f.get_user_function() for f in function_app.app.get_functions()}
    sink_lock = threading.Lock()
    sink: list[dict[str, Any]] = []  # the one sink both sources land in

    def collector(request: ReceivedRequest) -> int:
        records = request.json()
        records = records if isinstance(records, list) else [records]
        with sink_lock:
            sink.extend(records)
        if request.path.startswith("/agents"):
            # The consumer reads the agents' hub too (its own consumer group): one event per record.
            handlers["platform_events_agents"]([func.EventHubEvent(body=json.dumps(r).encode()) for r in records])
        return 200

    def endpoint(request: ReceivedRequest) -> Reply:
        answer = handlers["platform_events_webhook"](func.HttpRequest(
            "POST", "https://app.example/api/platform-events", headers=request.headers, body=request.body))
        return Reply(answer.status_code, {"Content-Type": "application/json"}, answer.get_body())

    secret = generate_secret()
    agents: dict[str, AgentProcess] = {}
    with WebhookReceiver(collector) as sink_server, WebhookReceiver(endpoint) as app_server, Emulator(vms=VMS) as emu:
        monkeypatch.setenv("PLATFORM_OUTPUT", "http")
        monkeypatch.setenv("PLATFORM_OUTPUT_URL", sink_server.url_for("/platform"))
        monkeypatch.setenv("RECONCILE_STATE_PATH", str(tmp_path / "reconcile.db"))
        monkeypatch.setenv("MISSED_AFTER_SECONDS", "4")
        monkeypatch.setenv("SEFWD_MASTER_SECRET", MASTER_SECRET)  # agents' records are verified
        try:
            for vm in VMS:
                config = write_config(tmp_path / f"{vm.name}.toml", emu.vm_url(vm.name), tmp_path / vm.name / "state",
                                      sinks=f'[[sinks]]\ntype = "webhook"\nname = "hook"\n'
                                            f'url = "{sink_server.url_for("/agents/" + vm.name)}"\nsecret_env = "HOOK_SECRET"\n')
                key = as_secret(derive_key(MASTER, RECORD_PURPOSE, vm.resource_id))  # `sefwd keys derive`
                agents[vm.name] = AgentProcess(config, tmp_path / f"{vm.name}.log", env={
                    "HOOK_SECRET": secret, "SEFWD_AGENT_RECORD_KEY_ENV": "RECORD_KEY", "RECORD_KEY": key})
            wait_until(lambda: {r["data"]["Vm"]["Name"] for r in list(sink) if r["type"] == "forwarder.started"}
                       == set(PROFILES), 60, "three agents started")
            assert agents["vmss_2"].terminate() == 0  # its agent is down from now on
            publisher = emu.publish_to(app_server.url_for("/api/platform-events"), duplicates=1)  # every event twice
            event_id = emu.schedule(type="Reboot", resources=list(PROFILES), not_before="+20m")
            wait_until(lambda: {r["data"]["Vm"]["Name"] for r in list(sink)
                                if r["type"] == "scheduledevent.scheduled" and not r["source"].startswith("platform:")}
                       == {"vmss_0", "vmss_1"}, 30, "both live agents reported the event")

            def missed() -> list[dict[str, Any]]:
                handlers["platform_events_missed"](None)  # the timer trigger's turn
                return [r for r in list(sink) if r["type"] == "fleet.missed"]

            flagged = wait_until(missed, 30, "fleet.missed")
            emu.cancel(event_id)

            def outcomes() -> dict[str, dict[str, Any]]:
                return {r["data"]["Vm"]["Name"]: r["data"] for r in list(sink) if r["type"] == "fleet.outcome"}

            found = wait_until(lambda: len(outcomes()) == 2 and outcomes(), 30, "the outcomes compared")
            wait_until(lambda: publisher.stats.delivered >= 4, 20, "every delivery (duplicates too)")
        finally:
            for agent in agents.values():
                if agent.alive():
                    agent.terminate()
    assert publisher.stats.validated and publisher.stats.duplicates == 2
    assert [r["data"]["Vm"]["Name"] for r in flagged] == ["vmss_2"]  # exactly the stopped VM
    platform_time = datetime.fromisoformat(flagged[0]["data"]["PlatformTime"].replace("Z", "+00:00"))
    assert datetime.fromisoformat(flagged[0]["time"].replace("Z", "+00:00")) - platform_time >= timedelta(seconds=4)
    assert flagged[0]["data"]["Vm"]["ResourceId"].endswith("/virtualMachines/vmss_2")
    assert {vm: (o["PlatformStatus"], o["Outcome"], o["Agrees"]) for vm, o in found.items()} == {
        "vmss_0": ("Canceled", "canceled", True), "vmss_1": ("Canceled", "canceled", True)}
    platform = [r for r in sink if r["source"].startswith("platform:") and r["type"].startswith("scheduledevent.")]
    # Two platform events, each delivered twice by Event Grid: two records, no more.
    assert [r["type"] for r in platform] == ["scheduledevent.scheduled", "scheduledevent.canceled"]
    assert {r["eventkey"] for r in platform} == {f"{event_id}:scheduled", f"{event_id}:ended"}
    agents_keys = {r["eventkey"] for r in sink if r["type"].startswith("scheduledevent.")
                   and not r["source"].startswith("platform:")}
    assert {f"{event_id}:scheduled", f"{event_id}:ended"} <= agents_keys  # the same keys from both sources
    reported = [r["data"] for r in sink if r["type"] == "fleet.reported"]
    assert {d["Vm"]["Name"] for d in reported} == {"vmss_0", "vmss_1"}
    assert all(-5 < d["DetectionSeconds"] < 5 for d in reported)
    assert function_app.get_reconciler().refused == 0  # every agent record was signed and verified


@pytest.mark.parametrize("args, fragment", [
    (["--eventgrid-url", "ftp://127.0.0.1/x"], "--eventgrid-url: must be an http(s) URL"),
    (["--max-api-version", "2024-07-10"], "--max-api-version: must be one of"),
])
def test_emulator_cli_refuses_bad_event_grid_and_version_options(args: list[str], fragment: str) -> None:
    import subprocess

    from tests.agent import ROOT

    done = subprocess.run([sys.executable, "-m", "forwarder", "emulator", "--listen", "127.0.0.1:0", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0 and fragment in done.stderr, done.stderr


def test_event_hubs_output_sends_the_records_to_the_agents_hub(tmp_path: Path) -> None:
    """PLATFORM_OUTPUT=eventhubs with the real azure-eventhub client against the project's AMQP peer."""
    import os

    from benchmarks.peers.eventhubs_peer import EventHubsPeer

    why = EventHubsPeer.available()
    if why is not None:
        if os.environ.get("SEFWD_REQUIRE_PEERS"):
            raise RuntimeError(f"the Event Hubs test peer is required here (SEFWD_REQUIRE_PEERS) but {why}")
        pytest.skip(f"eventhubs peer unavailable: {why}")
    pytest.importorskip("azure.eventhub")
    from outputs import output_from_env

    with EventHubsPeer(log=tmp_path / "peer.log") as peer:
        emit = output_from_env({"PLATFORM_OUTPUT": "eventhubs", "EVENTHUB_NAME": peer.hub,
                                "EVENTHUB_CONNECTION": peer.connection_string(entity=False)})
        reconciler = Reconciler(SqliteState(), emit, missed_after=60.0)
        assert deliver(reconciler, grid_event(grid_id="G1"), grid_event("Started", change="started", grid_id="G2"))[0] == 200
        got = peer.wait_events(5)  # and a fleet.missed per VM: emitted at T0, long before this test
    records = [json.loads(e["body"]) for e in got]
    assert [r["type"] for r in records if r["type"].startswith("scheduledevent.")] == \
        ["scheduledevent.scheduled", "scheduledevent.started"]
    assert all(r["source"].startswith("platform:") for r in records)


def test_event_grid_trigger_function_takes_the_same_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          function_app: Any) -> None:
    """The Event Grid trigger binding (the host validated the subscription): same record, duplicates dropped,
    a failed output raised so that Event Grid delivers again."""
    import azure.functions as func

    sent: list[dict[str, Any]] = []
    refuse = [True]

    def collector(request: ReceivedRequest) -> int:
        if refuse[0]:
            return 503
        sent.extend(request.json())
        return 200

    with WebhookReceiver(collector) as sink_server:
        monkeypatch.setenv("PLATFORM_OUTPUT", "http")
        monkeypatch.setenv("PLATFORM_OUTPUT_URL", sink_server.url_for("/platform"))
        monkeypatch.setenv("RECONCILE_STATE_PATH", str(tmp_path / "reconcile.db"))
        handler = {f.get_function_name(): f.get_user_function() for f in function_app.app.get_functions()}["platform_events_grid"]
        grid = grid_event(grid_id="G1")
        event = func.EventGridEvent(id=grid["id"], data=grid["data"], topic=grid["topic"], subject=grid["subject"],
                                    event_type=grid["eventType"], event_time=T0, data_version=grid["dataVersion"])
        with pytest.raises(RuntimeError, match="not handled"):
            handler(event)  # the output refused: Event Grid will deliver it again
        refuse[0] = False
        handler(event)
        handler(event)  # a duplicate delivery
    assert [r["type"] for r in sent if r["type"].startswith("scheduledevent.")] == ["scheduledevent.scheduled"]
    assert sent[0]["data"]["Platform"]["EventGridId"] == "G1" and sent[0]["time"] == "2026-11-27T12:00:00.000Z"
    # Emitted long ago (T0) and no agent ever reported it: every named VM missed it, each said once.
    assert sorted(r["data"]["Vm"]["Name"] for r in sent if r["type"] == "fleet.missed") == sorted(PROFILES)
