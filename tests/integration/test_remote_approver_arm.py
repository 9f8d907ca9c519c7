"""The remote approver's ARM route (deploy/consumers/remote-approver/arm_route.py), end to end:
emulator with two VMs -> one real agent per VM -> Event Hubs peer -> the approver's decision code ->
ARM acknowledge (azure-mgmt-core, managed identity from the emulator) -> IMDS shows Started -> the
agent records the outcome with evidence of the external approval. The agents sign their records with
their own per-VM keys (sefwdauth); the ARM route decides exactly like the callback route
(pipeline.RemoteApprover). Plus the abuse cases: a record speaks only for its own VM, and a forged,
other-VM-signed, unsigned or replayed record never reaches ARM."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peers.eventhubs_peer import EventHubsPeer
from forwarder.common.fleet_keys import RECORD_PURPOSE, as_secret, derive_key
from forwarder.common.record_auth import sign_record
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config
from tests.arm import ArmCerts, arm_certs, arm_emulator, event_status, resource_id
from tests.fleet import MASTER, MASTER_SECRET, function_handlers, now_text

APP_DIR = Path(__file__).resolve().parents[2] / "deploy" / "consumers" / "remote-approver"
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

import arm_route  # noqa: E402
from decide import Deduper  # noqa: E402
from pipeline import records_from_event_bodies  # noqa: E402

_UNAVAILABLE = EventHubsPeer.available()
pytestmark = pytest.mark.timeout(180)
VMS = ("vm-a", "vm-b")


@pytest.fixture
def certs(tmp_path: Path) -> ArmCerts:
    return arm_certs(tmp_path / "tls")


@pytest.fixture
def identity(monkeypatch: pytest.MonkeyPatch):
    """The Function's managed identity: azure-identity asks the emulator's token endpoint."""
    for name in [n for n in os.environ if n.startswith(("AZURE_", "IDENTITY_", "MSI_"))]:
        monkeypatch.delenv(name)

    def use(emu: Any) -> None:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)
    return use


def approver_for(emu: Any, certs: ArmCerts, seen: Path, **env: str) -> arm_route.ArmRemoteApprover:
    settings = arm_route.ArmSettings.from_env({"APPROVAL_ROUTE": "arm", "ARM_ENDPOINT": emu.arm_url,
                                               "ARM_CA_BUNDLE": str(certs.ca), "ARM_RETRIES": "2",
                                               "SEFWD_MASTER_SECRET": MASTER_SECRET,
                                               "SEEN_RECORDS_PATH": str(seen / "seen-records.db"), **env})
    return arm_route.ArmRemoteApprover(settings)


def record_key(rid: str) -> bytes:
    """The record key of the VM with resource ID ``rid`` (`sefwd keys derive`), from the test fleet's master."""
    return derive_key(MASTER, RECORD_PURPOSE, rid)


def key_env(rid: str) -> dict[str, str]:
    return {"SEFWD_AGENT_RECORD_KEY_ENV": "SEFWD_RECORD_KEY", "SEFWD_RECORD_KEY": as_secret(record_key(rid))}


def record_of(out: Path, rtype: str, event_id: str) -> dict[str, Any] | None:
    return next((r for r in read_jsonl(out) if r["type"] == rtype and r["subject"] == event_id), None)


@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"eventhubs peer unavailable: {_UNAVAILABLE}")
def test_stream_to_arm_approval_to_started_to_outcome_with_external_approval_evidence(tmp_path, certs, identity):
    with arm_emulator(certs, vms=list(VMS)) as emu, EventHubsPeer(log=tmp_path / "peer.log") as peer:
        identity(emu)
        agents, outs = {}, {}
        try:
            for vm in VMS:
                (tmp_path / vm).mkdir()
                outs[vm] = tmp_path / vm / "out.jsonl"
                sinks = (f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{outs[vm]}"\n'
                         f'[[sinks]]\ntype = "eventhubs"\nname = "hub"\nconnection_string_env = "EH_CONN"\n'
                         f'timeout = "3s"\n')
                config = write_config(tmp_path / vm / "sefwd.toml", emu.vm_url(vm), tmp_path / vm / "state",
                                      sinks=sinks)
                agents[vm] = AgentProcess(config, tmp_path / vm / "agent.log",
                                          env={"EH_CONN": peer.connection_string(), **key_env(resource_id(emu, vm))})
            for vm, agent in agents.items():
                assert agent.alive() or agent.proc.wait(30) is None, agent.logs()
            mine = emu.schedule(type="Reboot", source="User", resources=["vm-a"], start_after=900, complete_after=600)
            theirs = emu.schedule(type="Reboot", source="Platform", resources=["vm-b"], start_after=900)
            # The stream: each agent reports every event of the document (each VM sees both), from its own VM.
            events = peer.wait_events(4, 60, lambda got: sum('"scheduledevent.scheduled"' in e["body"] for e in got) >= 4)
            records = [r for r in records_from_event_bodies(e["body"].encode() for e in events)
                       if r["type"] == "scheduledevent.scheduled"]
            assert sorted((r["subject"], r["source"].rpartition("/")[2]) for r in records) == sorted(
                (event, vm) for event in (mine, theirs) for vm in VMS)
            approver = approver_for(emu, certs, tmp_path)
            outcomes = {(o["EventId"], o["id"]): o for o in approver.handle_many(records)}
            assert {o["decision"] for o in outcomes.values()} != {"untrusted"} and approver.untrusted == 0
            by = {(r["subject"], r["source"].rpartition("/")[2]): outcomes[(r["subject"], r["id"])] for r in records}
            assert (by[mine, "vm-a"]["decision"], by[mine, "vm-a"]["reason"]) == ("approved", "user_initiated")
            assert by[mine, "vm-a"]["target"] == "virtualMachines/vm-a" and by[mine, "vm-a"]["http_status"] == 200
            assert by[mine, "vm-a"]["vm"] == resource_id(emu, "vm-a") and by[mine, "vm-a"]["route"] == "arm"
            # vm-b's copy of vm-a's event: vm-b does not speak for vm-a.
            assert (by[mine, "vm-b"]["decision"], by[mine, "vm-b"]["reason"]) == ("skip", "not_this_vm")
            assert {by[theirs, vm]["decision"] for vm in VMS} == {"skip"}  # the policy leaves a platform reboot alone
            assert event_status(emu, mine) == "Started" and event_status(emu, theirs) == "Scheduled"
            (post,) = emu.stats()["start_requests"]
            assert (post["vm"], post["via"], post["event_ids"]) == ("vm-a", "arm", [mine])
            for vm in VMS:  # both agents see it start long before NotBefore, approved by neither of them
                started = wait_until(lambda: record_of(outs[vm], "scheduledevent.started", mine), 30, "started record")
                assert started["data"]["EarlyStart"]["ApprovedBy"] == "elsewhere"
            emu.complete(mine)
            done = wait_until(lambda: record_of(outs["vm-a"], "scheduledevent.completed", mine), 30, "completed record")
            assert done["data"]["Outcome"] == "completed"
            assert done["data"]["Evidence"]["Used"] == ["seen_started", "approved_elsewhere"]
            # The terminal record travels the same stream; the approver folds the fleet's outcome.
            def terminal_records() -> list[dict[str, Any]]:
                return [r for r in records_from_event_bodies(e["body"].encode() for e in peer.events())
                        if r["type"] == "scheduledevent.completed"]
            wait_until(lambda: len(terminal_records()) == 2, 30, "both terminal records on the hub")
            terminal = terminal_records()
            assert {r["data"]["Evidence"]["Used"][-1] for r in terminal} == {"approved_elsewhere"}  # vm-b too
            folded = approver.handle_many(terminal)
            # Each VM's report moves only its own outcome, and only of an event that names it: vm-b is not in it.
            by_vm = {r["source"].rpartition("/")[2]: o for r, o in zip(terminal, folded)}
            assert (by_vm["vm-a"]["decision"], by_vm["vm-a"]["outcome"]) == ("outcome", "completed")
            assert (by_vm["vm-b"]["decision"], by_vm["vm-b"]["reason"]) == ("skip", "not_this_vm")
            assert approver.handle(terminal[0])["decision"] in ("duplicate", "skip")  # a redelivery changes nothing
            for agent in agents.values():
                assert agent.terminate() == 0
        finally:
            for agent in agents.values():
                if agent.alive():
                    agent.kill()


# -- a VM speaks only for itself ----------------------------------------------------------------

def scheduled_record(emu: Any, vm: str, event_id: str, resources: list[str], *, signer: str | None = None,
                     time: str | None = None) -> dict[str, Any]:
    """The record VM ``vm``'s agent makes, signed with ``signer``'s key (default: its own; "" unsigned)."""
    rid = resource_id(emu, vm)
    rec = {"specversion": "1.0", "id": f"rec-{event_id}-{vm}", "type": "scheduledevent.scheduled", "source": rid,
           "subject": event_id, "eventkey": f"{event_id}:scheduled", "time": time or now_text(),
           "data": {"EventId": event_id, "EventType": "Reboot", "EventSource": "User", "EventStatus": "Scheduled",
                    "Resources": resources, "Vm": {"Name": vm, "ResourceId": rid}}}
    signer = vm if signer is None else signer
    return sign_record(record_key(resource_id(emu, signer)), rec) if signer else rec


def test_a_record_cannot_approve_another_vms_event_or_name_another_target(tmp_path, certs, identity):
    with arm_emulator(certs, vms=["vm-a", "vm-b", {"name": "ss_4", "vm_scale_set_name": "ss"}]) as emu:
        identity(emu)
        approver = approver_for(emu, certs, tmp_path)
        theirs = emu.schedule(type="Reboot", source="User", resources=["vm-b"], start_after=900)
        # vm-a's record about vm-b's event: vm-a may not approve it (its Resources do not name vm-a).
        claim = scheduled_record(emu, "vm-a", theirs, ["vm-b"])
        assert (approver.handle(claim)["decision"], approver.handle(claim)["reason"]) == ("skip", "not_this_vm")
        # Resources edited to name vm-a: ARM is asked on vm-a's own resource only, and vm-b's event is
        # not an event of vm-a there: refused, nothing starts.
        lying = scheduled_record(emu, "vm-a", theirs, ["vm-a"])
        outcome = approver.handle(lying)
        assert (outcome["decision"], outcome["http_status"], outcome["answer"]) == ("refused", 404, "arm_404_NotFound")
        # A source that is not the VM that signed (a path trick): never acted on.
        forged = scheduled_record(emu, "vm-b", theirs, ["vm-b"])
        forged["source"] = forged["source"].replace("vm-b", "vm-b/../vm-a")
        assert (approver.handle(forged)["decision"], approver.handle(forged)["reason"]) == ("untrusted", "unauthenticated")
        assert event_status(emu, theirs) == "Scheduled" and emu.stats()["start_requests"] == []
        # A scale-set instance is acknowledged on its scale set; every path component is escaped.
        instance = emu.schedule(type="Reboot", source="User", resources=["ss_4"], start_after=900)
        outcome = approver.handle(scheduled_record(emu, "ss_4", instance, ["ss_4"]))
        assert (outcome["decision"], outcome["target"]) == ("approved", "virtualMachineScaleSets/ss")
        assert outcome["vm"] == resource_id(emu, "ss_4") and "/virtualMachineScaleSets/ss/virtualMachines/" in outcome["vm"]
        assert event_status(emu, instance) == "Started"
    target = arm_route.target_of("/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/a?b#c")
    assert target.path("E/../x").endswith("/virtualMachines/a%3Fb%23c/providers/Microsoft.Maintenance/"
                                          "scheduledevents/E%2F..%2Fx/acknowledge")


def test_forged_other_vm_signed_altered_stale_or_replayed_records_never_reach_arm(tmp_path, certs, identity):
    """Abuse: a stream sender (any VM with Data Sender, or a local process using its identity) tries
    to get vm-a's event approved through the ARM route without vm-a's record key."""
    with arm_emulator(certs, vms=["vm-a", "vm-b"]) as emu:
        identity(emu)
        approver = approver_for(emu, certs, tmp_path)
        event = emu.schedule(type="Reboot", source="Platform", resources=["vm-a"], start_after=900)
        other_master = sign_record(derive_key(b"another-fleet-master-secret!", RECORD_PURPOSE, resource_id(emu, "vm-a")),
                                   scheduled_record(emu, "vm-a", event, ["vm-a"], signer=""))
        altered = scheduled_record(emu, "vm-a", event, ["vm-b"])
        altered["data"]["Resources"] = ["vm-a"]  # signed by vm-a, then a claim changed in transit
        untrusted = [
            scheduled_record(emu, "vm-a", event, ["vm-a"], signer=""),  # unsigned
            scheduled_record(emu, "vm-a", event, ["vm-a"], signer="vm-b"),  # vm-b's key, vm-a's source
            other_master,  # a key of another fleet
            altered,
        ]
        outcomes = approver.handle_many(untrusted)
        assert [(o["decision"], o["reason"]) for o in outcomes] == [("untrusted", "unauthenticated")] * 4
        assert approver.untrusted == 4
        # vm-b's own, validly signed record naming vm-a's event: vm-b speaks only for itself.
        by_b = approver.handle(scheduled_record(emu, "vm-b", event, ["vm-a"]))
        assert (by_b["decision"], by_b["reason"]) == ("skip", "not_this_vm")
        # vm-a's genuine record, but hours old (captured and sent again later): stale.
        old = scheduled_record(emu, "vm-a", event, ["vm-a"], time="2026-01-01T00:00:00Z")
        old["id"] = "rec-old"
        stale = approver.handle(sign_record(record_key(resource_id(emu, "vm-a")), {k: v for k, v in old.items()
                                                                                  if k != "sefwdauth"}))
        assert (stale["decision"], stale["reason"]) == ("skip", "stale_record")
        assert emu.stats()["arm_requests"] == [] and emu.stats()["start_requests"] == []
        assert event_status(emu, event) == "Scheduled"
        # The same event in vm-a's genuine record (its policy: user-initiated) is approved once; a
        # replay of that record, even to a restarted approver (empty memory, same durable cache), is not.
        user_event = emu.schedule(type="Reboot", source="User", resources=["vm-a"], start_after=900)
        genuine = scheduled_record(emu, "vm-a", user_event, ["vm-a"])
        assert approver.handle(genuine)["decision"] == "approved"
        approver.seen.close()
        restarted = approver_for(emu, certs, tmp_path)
        assert restarted.handle(copy.deepcopy(genuine))["decision"] == "replayed"
        assert [(r["status"], user_event in r["path"]) for r in emu.stats()["arm_requests"]] == [(200, True)]


def test_throttling_releases_the_key_so_a_later_copy_retries(tmp_path, certs, identity):
    with arm_emulator(certs, vms=["vm-a"]) as emu:
        identity(emu)
        approver = approver_for(emu, certs, tmp_path, ARM_RETRIES="1")
        event = emu.schedule(type="Reboot", source="User", resources=["vm-a"], start_after=900)
        emu.inject_fault("status", status=429, retry_after="0.1", count=2, path="arm")
        record = scheduled_record(emu, "vm-a", event, ["vm-a"])
        first = approver.handle(record)
        assert (first["decision"], first["http_status"]) == ("failed", 429)
        again = approver.handle(copy.deepcopy(record))  # a redelivery of the same record: not a replay yet
        assert again["decision"] == "approved" and event_status(emu, event) == "Started"
        assert approver.handle(copy.deepcopy(record))["decision"] == "replayed"  # once it was acted on
        assert [r["status"] for r in emu.stats()["arm_requests"]] == [429, 429, 200]


def test_settings_and_route_selection(tmp_path):
    assert arm_route.route({}) == "callback" and arm_route.route({"APPROVAL_ROUTE": "ARM"}) == "arm"
    with pytest.raises(ValueError, match="APPROVAL_ROUTE"):
        arm_route.route({"APPROVAL_ROUTE": "ssh"})
    with pytest.raises(ValueError) as info:
        arm_route.ArmSettings.from_env({"ARM_ENDPOINT": "http://x", "ARM_RETRIES": "-1", "ARM_CA_BUNDLE": "/nope.pem",
                                        "SEFWD_WEBHOOK_SECRET": "nope"})
    for problem in ("must be https://", "ARM_RETRIES", "ARM_CA_BUNDLE: no file", "SEFWD_WEBHOOK_SECRET",
                    "SEFWD_MASTER_SECRET is required"):  # the ARM route acts on authenticated records only
        assert problem in str(info.value)
    settings = arm_route.ArmSettings.from_env({"AZURE_CLIENT_ID": "1111", "DRY_RUN": "true",
                                               "SEFWD_MASTER_SECRET": MASTER_SECRET,
                                               "SEEN_RECORDS_PATH": str(tmp_path / "seen.db")})
    assert settings.endpoint == "https://management.azure.com" and settings.managed_identity_client_id == "1111"
    assert settings.masters == (MASTER,)
    dry = arm_route.ArmRemoteApprover(settings, deduper=Deduper())
    rid = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-a"
    rec = {"id": "r1", "type": "scheduledevent.scheduled", "source": rid, "eventkey": "E:scheduled", "time": now_text(),
           "data": {"EventId": "E", "EventType": "Reboot", "EventSource": "User", "EventStatus": "Scheduled",
                    "Resources": ["vm-a"], "Vm": {"ResourceId": rid}}}
    assert dry.handle(rec)["decision"] == "untrusted"  # unsigned
    outcome = dry.handle(sign_record(record_key(rid), rec))
    assert (outcome["decision"], outcome["target"]) == ("dry_run", "virtualMachines/vm-a")  # no client, no token


@pytest.mark.skipif(__import__("importlib").util.find_spec("azure.functions") is None, reason="azure-functions missing")
def test_function_app_selects_the_route(monkeypatch, tmp_path):
    import function_app

    monkeypatch.setenv("APPROVAL_ROUTE", "arm")
    monkeypatch.setenv("SEFWD_MASTER_SECRET", MASTER_SECRET)
    monkeypatch.setenv("SEEN_RECORDS_PATH", str(tmp_path / "seen.db"))
    function_app.get_approver.cache_clear()
    try:
        assert isinstance(function_app.get_approver(), arm_route.ArmRemoteApprover)
    finally:
        function_app.get_approver.cache_clear()


@pytest.mark.skipif(__import__("importlib").util.find_spec("azure.functions") is None, reason="azure-functions missing")
def test_the_event_hubs_trigger_on_the_arm_route_acts_only_on_authenticated_records(tmp_path, certs, identity,
                                                                                   monkeypatch):
    """The Function's own Event Hubs binding with APPROVAL_ROUTE=arm, bodies as the hub delivers
    them: a sender with Data Sender rights but without vm-a's key gets no ARM request sent."""
    import json

    import azure.functions as func
    import function_app

    with arm_emulator(certs, vms=["vm-a", "vm-b"]) as emu:
        identity(emu)
        for name, value in {"APPROVAL_ROUTE": "arm", "ARM_ENDPOINT": emu.arm_url, "ARM_CA_BUNDLE": str(certs.ca),
                            "SEFWD_MASTER_SECRET": MASTER_SECRET,
                            "SEEN_RECORDS_PATH": str(tmp_path / "seen.db")}.items():
            monkeypatch.setenv(name, value)
        function_app.get_approver.cache_clear()
        try:
            handler = function_handlers()["sefwd_eventhub"]
            event = emu.schedule(type="Reboot", source="Platform", resources=["vm-a"], start_after=900)
            forged = [scheduled_record(emu, "vm-a", event, ["vm-a"], signer="vm-b"),
                      scheduled_record(emu, "vm-a", event, ["vm-a"], signer="")]
            handler([func.EventHubEvent(body=json.dumps(r).encode()) for r in forged])
            assert emu.stats()["arm_requests"] == [] and function_app.get_approver().untrusted == 2
            assert event_status(emu, event) == "Scheduled"
            mine = emu.schedule(type="Reboot", source="User", resources=["vm-a"], start_after=900)
            genuine = scheduled_record(emu, "vm-a", mine, ["vm-a"])
            handler([func.EventHubEvent(body=json.dumps(genuine).encode())] * 2)  # delivered twice: acted on once
            assert [(r["status"], mine in r["path"]) for r in emu.stats()["arm_requests"]] == [(200, True)]
            assert event_status(emu, mine) == "Started" and event_status(emu, event) == "Scheduled"
        finally:
            function_app.get_approver.cache_clear()


@pytest.mark.skipif(__import__("importlib").util.find_spec("azure.functions") is None, reason="azure-functions missing")
def test_the_approve_endpoint_decides_exactly_like_the_event_hubs_trigger(tmp_path, certs, identity, monkeypatch):
    """``sefwd_approve`` (the Logic App's way in, function key): the caller is not trusted for the
    records; they go through the same approver, replay cache included, as the Event Hubs trigger's."""
    import json

    import azure.functions as func
    import function_app

    def post(body: bytes, content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
        response = function_handlers()["sefwd_approve"](func.HttpRequest(
            "POST", "https://approver.example/api/approve", headers={"Content-Type": content_type}, body=body))
        return response.status_code, json.loads(response.get_body())

    with arm_emulator(certs, vms=["vm-a", "vm-b"]) as emu:
        identity(emu)
        monkeypatch.delenv("SEFWD_MASTER_SECRET", raising=False)
        function_app.get_approver.cache_clear()
        try:
            assert post(b"{}") == (500, {"error": "misconfigured"})  # no master: nothing is decided at all
            for name, value in {"APPROVAL_ROUTE": "arm", "ARM_ENDPOINT": emu.arm_url, "ARM_CA_BUNDLE": str(certs.ca),
                                "SEFWD_MASTER_SECRET": MASTER_SECRET,
                                "SEEN_RECORDS_PATH": str(tmp_path / "seen.db")}.items():
                monkeypatch.setenv(name, value)
            function_app.get_approver.cache_clear()
            assert post(b"not json")[0] == 400 and post(b"[1]")[0] == 400
            assert post(b"{}", "text/plain")[0] == 415
            mine = emu.schedule(type="Reboot", source="User", resources=["vm-a"], start_after=900)
            forged = [scheduled_record(emu, "vm-a", mine, ["vm-a"], signer="vm-b"),
                      scheduled_record(emu, "vm-a", mine, ["vm-a"], signer="")]
            status, answer = post(json.dumps(forged).encode())
            assert status == 200 and [(o["decision"], o["reason"]) for o in answer["outcomes"]] == [
                ("untrusted", "unauthenticated")] * 2
            assert emu.stats()["arm_requests"] == [] and event_status(emu, mine) == "Scheduled"
            genuine = scheduled_record(emu, "vm-a", mine, ["vm-a"])
            status, answer = post(json.dumps(genuine).encode(), "application/cloudevents+json")
            (outcome,) = answer["outcomes"]
            assert (status, outcome["decision"], outcome["vm"], outcome["target"]) == (
                200, "approved", resource_id(emu, "vm-a"), "virtualMachines/vm-a")
            # The same record from the hub afterwards (the Function's own trigger): the same cache, acted on once.
            function_handlers()["sefwd_eventhub"]([func.EventHubEvent(body=json.dumps(genuine).encode())])
            assert [(r["status"], mine in r["path"]) for r in emu.stats()["arm_requests"]] == [(200, True)]
            assert event_status(emu, mine) == "Started"
        finally:
            function_app.get_approver.cache_clear()


def test_a_scale_set_instance_cannot_get_another_instances_event_acknowledged_on_their_scale_set(tmp_path, certs,
                                                                                                  identity):
    """The reproduced High weakness: root on ss_0, with only ss_0's record key and ss_5's EventId (it
    travels in every record), signs a record claiming the event names ss_0 and is user-initiated. ARM
    accepts any member's event on the scale set, so the route must read the event from the platform
    (Resource Graph) first: ss_5's platform reboot stays Scheduled, and only ss_5's own record moves it."""
    with arm_emulator(certs, vms=[{"name": "ss_0", "vm_scale_set_name": "ss"},
                                  {"name": "ss_5", "vm_scale_set_name": "ss"}]) as emu:
        identity(emu)
        approver = approver_for(emu, certs, tmp_path)
        theirs = emu.schedule(type="Reboot", source="Platform", resources=["ss_5"], start_after=900)
        lie = scheduled_record(emu, "ss_0", theirs, ["ss_0"])  # ss_0's own key, its own source: authentic, and a lie
        outcome = approver.handle(lie)
        assert (outcome["decision"], outcome["answer"]) == ("refused", "platform_does_not_name_this_vm"), outcome
        assert outcome["vm"] == resource_id(emu, "ss_0") and outcome["target"] == "virtualMachineScaleSets/ss"
        assert event_status(emu, theirs) == "Scheduled" and emu.stats()["start_requests"] == []
        assert [r["path"].rpartition("/")[2] for r in emu.stats()["arm_requests"]] == ["resources"]  # read, no ack
        # ss_5's genuine record of its own user-initiated event: the platform confirms, ARM acknowledges once.
        mine = emu.schedule(type="Reboot", source="User", resources=["ss_5"], start_after=900)
        genuine = approver.handle(scheduled_record(emu, "ss_5", mine, ["ss_5"]))
        assert (genuine["decision"], genuine["target"]) == ("approved", "virtualMachineScaleSets/ss"), genuine
        assert event_status(emu, mine) == "Started" and event_status(emu, theirs) == "Scheduled"
        assert [(p["vm"], p["via"], p["event_ids"]) for p in emu.stats()["start_requests"]] == [("ss_5", "arm", [mine])]
        # An event naming both: ss_5 claims to be alone in it (so its own leader); the platform's list
        # makes ss_0 the leader, as the agents' callbacks would: not acknowledged on ss_5's word either.
        both = emu.schedule(type="Reboot", source="User", resources=["ss_0", "ss_5"], start_after=900)
        follower = approver.handle(scheduled_record(emu, "ss_5", both, ["ss_5"]))
        assert (follower["decision"], follower["answer"]) == ("refused", "platform_names_another_leader"), follower
        assert event_status(emu, both) == "Scheduled"


def test_on_a_scale_set_no_platform_answer_means_no_acknowledgement_and_a_later_copy_retries(tmp_path, certs,
                                                                                                identity):
    with arm_emulator(certs, vms=[{"name": "ss_0", "vm_scale_set_name": "ss"},
                                  {"name": "ss_5", "vm_scale_set_name": "ss"}]) as emu:
        identity(emu)
        approver = approver_for(emu, certs, tmp_path, ARM_RETRIES="0")
        mine = emu.schedule(type="Reboot", source="User", resources=["ss_5"], start_after=900)
        record = scheduled_record(emu, "ss_5", mine, ["ss_5"])
        emu.inject_fault("status", status=503, count=1, path="arm")  # Resource Graph unavailable
        first = approver.handle(record)
        assert (first["decision"], first["answer"], first["http_status"]) == ("failed", "resource_graph_503", 503)
        assert event_status(emu, mine) == "Scheduled" and emu.stats()["start_requests"] == []
        # An EventId the platform has no record of (yet): not acknowledged, not final either.
        unknown = approver.handle(scheduled_record(emu, "ss_5", "5B3C4D2E-0000-4000-8000-000000000001", ["ss_5"]))
        assert (unknown["decision"], unknown["answer"]) == ("failed", "platform_has_no_such_event")
        # An id that is not a plain Azure name is never spliced into a query.
        odd = approver.handle(scheduled_record(emu, "ss_5", "x' or 1==1 //", ["ss_5"]))
        assert (odd["decision"], odd["answer"]) == ("refused", "not_a_plain_identifier")
        again = approver.handle(copy.deepcopy(record))  # the redelivery: confirmed, acknowledged
        assert again["decision"] == "approved" and event_status(emu, mine) == "Started"
        assert not [r for r in emu.stats()["arm_requests"] if r["path"].endswith("/acknowledge") and r["status"] != 200]
