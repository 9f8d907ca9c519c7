"""The Logic App's ARM approval branch (deploy/consumers/logic-app/workflow.json, ``Approve_via_ARM``)
end to end, with the real remote-approver Function code behind it: the workflow's own expressions
(the Workflow Definition Language interpreter of test_deploy_fold) build the request of
``Ask_the_remote_approver`` from a record as the hub delivers it; that request goes to the
Function's ``sefwd_approve`` handler (as the Functions host indexes it) with APPROVAL_ROUTE=arm,
which verifies the record's ``sefwdauth``, decides with the same code as its Event Hubs trigger
and acknowledges on the emulator's ARM side with its managed identity; the workflow then shows the
Function's answer. Abuse first: a stream sender without the VM's record key gets no ARM request
sent, whatever the record claims; the workflow itself never builds an ARM request."""
from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from forwarder.common.fleet_keys import RECORD_PURPOSE, derive_key
from forwarder.common.record_auth import sign_record
from forwarder.imds.differ import diff
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.records import RecordFactory
from tests.arm import ArmCerts, arm_certs, arm_emulator, event_status
from tests.fleet import MASTER, MASTER_SECRET, function_handlers
from tests.unit.test_deploy_fold import PARAMETERS, LogicApp, Run, Table, _workflow

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(
    __import__("importlib").util.find_spec("azure.functions") is None, reason="azure-functions missing")]

APPROVER_URL = "https://approver.example/api/approve"
FUNCTION_KEY = "the-function-key"


def branch() -> dict[str, Any]:
    return dict(_workflow()["definition"]["actions"]["Approve_via_ARM"])


def run_for(record: dict[str, Any] | bytes, **parameters: Any) -> Run:
    """A run of the workflow for one Event Hubs message carrying ``record`` (or raw bytes)."""
    body = record if isinstance(record, bytes) else orjson.dumps(record)
    run = LogicApp(Table()).start({})
    run.trigger_body = {"ContentData": base64.b64encode(body).decode()}
    run.outputs["Record"] = run.value(_workflow()["definition"]["actions"]["Record"]["inputs"])
    run.parameters = {**PARAMETERS, "approveViaArm": True, "approverUrl": APPROVER_URL,
                      "approverFunctionKey": FUNCTION_KEY, **parameters}
    return run


def asks(run: Run) -> bool:
    return run.condition(branch()["expression"])


def through_the_workflow(record: dict[str, Any] | bytes, **parameters: Any) -> dict[str, Any] | None:
    """The branch as Logic Apps runs it, its HTTP action delivered to the Function's own handler;
    the ``Approval_outcome`` the run shows (None when the branch does not run)."""
    import azure.functions as func

    run = run_for(record, **parameters)
    if not asks(run):
        return None
    actions = branch()["actions"]
    ask = actions["Ask_the_remote_approver"]
    inputs = run.value(ask["inputs"])
    assert ask["runtimeConfiguration"] == {"secureData": {"properties": ["inputs"]}}  # the key stays out of run history
    assert inputs["method"] == "POST" and inputs["uri"] == APPROVER_URL
    assert inputs["headers"]["x-functions-key"] == FUNCTION_KEY  # the host checks it (AuthLevel.FUNCTION)
    response = function_handlers()["sefwd_approve"](func.HttpRequest(
        inputs["method"], inputs["uri"], headers=inputs["headers"], body=inputs["body"].encode()))
    assert response.status_code == 200, response.get_body()
    run.bodies["Ask_the_remote_approver"] = json.loads(response.get_body())
    run.outputs["Approval_outcome"] = run.value(actions["Approval_outcome"]["inputs"])
    outcome: dict[str, Any] = run.outputs["Approval_outcome"]
    assert run.condition(actions["Approval_failed"]["expression"]) == (outcome["decision"] == "failed")
    return outcome


def scheduled(identity: dict[str, Any], event_id: str, resources: list[str], source: str = "User",
              signer: str | None = None) -> dict[str, Any]:
    """The scheduledevent.scheduled record the agent of this VM writes (its first poll), signed with
    the record key of ``signer`` (a resource ID; default the VM's own)."""
    doc = parse_document(orjson.dumps({"DocumentIncarnation": 1, "Events": [{
        "EventId": event_id, "EventStatus": "Scheduled", "EventType": "Reboot", "ResourceType": "VirtualMachine",
        "Resources": resources, "NotBefore": "Tue, 24 Nov 2026 12:00:00 GMT", "Description": "",
        "EventSource": source, "DurationInSeconds": -1}]}))
    vm = VmIdentity.from_compute(identity)
    key = derive_key(MASTER, RECORD_PURPOSE, signer or identity["resourceId"])
    (record,) = RecordFactory(vm, "2020-07-01", key=key).for_changes(diff(None, doc, doc.events[0].not_before), doc)  # type: ignore[arg-type]
    signed = record.to_dict()
    assert signed["sefwdauth"].startswith("v1,")
    return signed


@pytest.fixture
def certs(tmp_path: Path) -> ArmCerts:
    return arm_certs(tmp_path / "tls")


@pytest.fixture
def function_app_on_arm(tmp_path: Path, certs: ArmCerts, monkeypatch: pytest.MonkeyPatch):
    """The Function's app settings for the ARM route against ``emu``; its identity from the emulator."""
    import function_app

    for name in [n for n in os.environ if n.startswith(("AZURE_", "IDENTITY_", "MSI_"))]:
        monkeypatch.delenv(name)

    def configure(emu: Any) -> None:
        for name, value in {"APPROVAL_ROUTE": "arm", "ARM_ENDPOINT": emu.arm_url, "ARM_CA_BUNDLE": str(certs.ca),
                            "ARM_RETRIES": "1", "SEFWD_MASTER_SECRET": MASTER_SECRET,
                            "AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url,
                            "SEEN_RECORDS_PATH": str(tmp_path / "seen.db")}.items():
            monkeypatch.setenv(name, value)
        function_app.get_approver.cache_clear()
    yield configure
    function_app.get_approver.cache_clear()


def test_forged_unsigned_or_other_vm_records_through_the_logic_app_reach_no_arm(certs, function_app_on_arm):
    """Abuse: a stream sender (any VM with Data Sender, or a process using its identity) without
    vm-a's record key tries to get vm-a's event approved through the Logic App."""
    with arm_emulator(certs, vms=["vm-a", "vm-b"]) as emu:
        function_app_on_arm(emu)
        vms = emu.stats()["vms"]
        event = emu.schedule(resources=["vm-a"], source="Platform", type="Reboot", start_after=900)
        genuine = scheduled(vms["vm-a"], event, ["vm-a"], source="Platform")  # the policy would skip it
        unsigned = dict({k: v for k, v in genuine.items() if k != "sefwdauth"}, data=dict(genuine["data"], EventSource="User"))
        claimed = dict(genuine, data=dict(genuine["data"], EventSource="User"))  # a claim changed after signing
        by_b = scheduled(vms["vm-a"], event, ["vm-a"], signer=vms["vm-b"]["resourceId"])  # vm-b's key, vm-a's source
        other_fleet = sign_record(derive_key(b"another-fleet-master-secret!", RECORD_PURPOSE, vms["vm-a"]["resourceId"]),
                                  unsigned)
        tricks = []
        for bad in ("/../vm-a", "?x=1", "#f", "%2Fvm-a"):  # vm-b's own key, a source that reaches vm-a
            trick = scheduled(vms["vm-b"], event, ["vm-a"])
            trick["source"] += bad
            tricks.append(trick)
        for record in (unsigned, claimed, by_b, other_fleet, *tricks):
            outcome = through_the_workflow(record)
            assert outcome is not None and (outcome["decision"], outcome["reason"]) == ("untrusted", "unauthenticated")
            assert "vm" not in outcome and "target" not in outcome
        # vm-b's own genuine record about vm-a's event: vm-b speaks only for itself.
        outcome = through_the_workflow(scheduled(vms["vm-b"], event, ["vm-a"], source="User"))
        assert outcome is not None and (outcome["decision"], outcome["reason"]) == ("skip", "not_this_vm")
        assert outcome["vm"] == vms["vm-b"]["resourceId"]  # the authenticated identity, reported back
        assert emu.stats()["arm_requests"] == [] and emu.stats()["start_requests"] == []
        assert event_status(emu, event) == "Scheduled"


def test_a_genuine_record_through_the_logic_app_is_approved_once_on_its_own_vm(certs, function_app_on_arm):
    with arm_emulator(certs, vms=["vm-a", {"name": "ss_3", "vm_scale_set_name": "ss"}]) as emu:
        function_app_on_arm(emu)
        vms = emu.stats()["vms"]
        for vm, target in (("vm-a", "virtualMachines/vm-a"), ("ss_3", "virtualMachineScaleSets/ss")):
            event = emu.schedule(resources=[vm], source="User", type="Reboot", start_after=900)
            genuine = scheduled(vms[vm], event, [vm])
            outcome = through_the_workflow(genuine)
            assert outcome is not None and (outcome["decision"], outcome["reason"]) == ("approved", "user_initiated")
            assert (outcome["vm"], outcome["target"], outcome["http_status"]) == (vms[vm]["resourceId"], target, 200)
            assert event_status(emu, event) == "Started"
            # The same message again (a second consumer run, a resubmitted run, a replay): acted on once.
            again = through_the_workflow(genuine)
            assert again is not None and again["decision"] == "replayed"
            assert [r["status"] for r in emu.stats()["arm_requests"] if event in r["path"]] == [200]
        assert [(p["via"], p["vm"]) for p in emu.stats()["start_requests"]] == [("arm", "vm-a"), ("arm", "ss_3")]


def test_through_the_logic_app_one_scale_set_instance_cannot_start_anothers_event(certs, function_app_on_arm):
    """The High weakness through the Logic App's branch: ss_0 signs, with its own key, a record that
    claims ss_5's platform reboot names ss_0 and is user-initiated. The Function reads the event from
    the platform (Resource Graph) before acknowledging on the scale set: nothing is acknowledged."""
    with arm_emulator(certs, vms=[{"name": "ss_0", "vm_scale_set_name": "ss"},
                                  {"name": "ss_5", "vm_scale_set_name": "ss"}]) as emu:
        function_app_on_arm(emu)
        vms = emu.stats()["vms"]
        theirs = emu.schedule(resources=["ss_5"], source="Platform", type="Reboot", start_after=900)
        outcome = through_the_workflow(scheduled(vms["ss_0"], theirs, ["ss_0"], source="User"))
        assert outcome is not None and outcome["decision"] == "refused", outcome
        assert (outcome["vm"], outcome["target"]) == (vms["ss_0"]["resourceId"], "virtualMachineScaleSets/ss")
        assert event_status(emu, theirs) == "Scheduled" and emu.stats()["start_requests"] == []
        assert not [r for r in emu.stats()["arm_requests"] if r["path"].endswith("/acknowledge")]
        # ss_5's own record of its own event is confirmed by the platform and approved.
        mine = emu.schedule(resources=["ss_5"], source="User", type="Reboot", start_after=900)
        outcome = through_the_workflow(scheduled(vms["ss_5"], mine, ["ss_5"]))
        assert outcome is not None and outcome["decision"] == "approved", outcome
        assert event_status(emu, mine) == "Started" and event_status(emu, theirs) == "Scheduled"


def test_the_branch_is_opt_in_and_never_builds_an_arm_request_itself():
    identity = {"vmId": "1", "name": "vm-a", "resourceId":
                "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-a"}
    good = scheduled(identity, "E1", ["vm-a"])
    assert asks(run_for(good))
    assert asks(run_for(dict(good, type="scheduledevent.updated")))
    assert not asks(run_for(good, approveViaArm=False))  # opt-in
    assert not asks(run_for(dict(good, type="scheduledevent.started")))  # nothing to decide: no call
    # The record goes to the Function byte for byte (the bytes its sefwdauth covers), never re-serialized.
    raw = b'{"type": "scheduledevent.scheduled",  "id": "x"}'
    inputs = run_for(raw).value(branch()["actions"]["Ask_the_remote_approver"]["inputs"])
    assert inputs["body"] == raw.decode()
    # No action of the workflow talks to ARM or acknowledges anything: only the Function does.
    text = json.dumps(_workflow()["definition"])
    for needle in ("Microsoft.Maintenance", "acknowledge?", "//management.azure.com", "armEndpoint", "Arm_target"):
        assert needle not in text, needle
    actions = branch()["actions"]
    assert set(actions) == {"Ask_the_remote_approver", "Approval_outcome", "Approval_failed"}
    assert actions["Ask_the_remote_approver"]["inputs"]["uri"] == "@parameters('approverUrl')"
    assert _workflow()["definition"]["parameters"]["approverFunctionKey"]["type"] == "SecureString"
