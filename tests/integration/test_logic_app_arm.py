"""The Logic App's ARM approval branch (deploy/consumers/logic-app/workflow.json, ``Arm_target`` and
``Approve_via_ARM``), run by the Workflow Definition Language interpreter of test_deploy_fold on
records from sefwd's own record factory (signed with the VM's own record key, as a fleet with
remote approval runs: the branch must accept the ``sefwdauth`` attribute it cannot verify), and the
acknowledgement it builds sent to the emulator's ARM side with a managed-identity token: the guard
lets a record name only its own VM as the target."""
from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
import requests

from forwarder.common.fleet_keys import RECORD_PURPOSE, derive_key
from forwarder.imds.differ import diff
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.records import RecordFactory
from tests.arm import ArmCerts, arm_certs, arm_emulator, event_status
from tests.fleet import MASTER
from tests.unit.test_deploy_fold import PARAMETERS, LogicApp, Run, Table, _workflow

pytestmark = pytest.mark.timeout(60)


def run_for(record: dict[str, Any], **parameters: Any) -> Run:
    run = LogicApp(Table()).start(record)
    run.parameters = {**PARAMETERS, "approveViaArm": True, "armEndpoint": "https://arm.example",
                      "armAudience": "https://management.azure.com/", **parameters}
    run.functions.update({
        "contains": lambda a, b: b in a, "toLower": lambda s: s.lower(), "startsWith": lambda a, b: a.startswith(b),
        "substring": lambda s, start, length: s[start:start + length], "lastIndexOf": lambda s, x: s.rfind(x),
        "split": lambda s, sep: s.split(sep), "length": len, "concat": lambda *xs: "".join(str(x) for x in xs),
        "workflow": lambda: {"run": {"name": "run-1"}}, "encodeUriComponent": lambda s: quote(str(s), safe=""),
    })
    actions = _workflow()["definition"]["actions"]
    for name in ("Source_parts", "Arm_target"):
        run.outputs[name] = run.value(actions[name]["inputs"])
    return run


def approves(run: Run) -> bool:
    return run.condition(_workflow()["definition"]["actions"]["Approve_via_ARM"]["expression"])


def ack_uri(run: Run) -> str:
    branch = _workflow()["definition"]["actions"]["Approve_via_ARM"]["actions"]
    inputs = run.value(branch["Acknowledge_through_ARM"]["inputs"])
    assert inputs["method"] == "POST" and inputs["authentication"]["type"] == "ManagedServiceIdentity"
    assert inputs["authentication"]["audience"] == "https://management.azure.com/"
    return str(inputs["uri"])


def scheduled(identity: dict[str, Any], event_id: str, resources: list[str], source: str = "User") -> dict[str, Any]:
    """The scheduledevent.scheduled record the agent of this VM writes (its first poll)."""
    doc = parse_document(orjson.dumps({"DocumentIncarnation": 1, "Events": [{
        "EventId": event_id, "EventStatus": "Scheduled", "EventType": "Reboot", "ResourceType": "VirtualMachine",
        "Resources": resources, "NotBefore": "Tue, 24 Nov 2026 12:00:00 GMT", "Description": "",
        "EventSource": source, "DurationInSeconds": -1}]}))
    vm = VmIdentity.from_compute(identity)
    key = derive_key(MASTER, RECORD_PURPOSE, identity["resourceId"])
    (record,) = RecordFactory(vm, "2020-07-01", key=key).for_changes(diff(None, doc, doc.events[0].not_before), doc)  # type: ignore[arg-type]
    signed = record.to_dict()
    assert signed["sefwdauth"].startswith("v1,")
    return signed


@pytest.fixture
def certs(tmp_path: Path) -> ArmCerts:
    return arm_certs(tmp_path / "tls")


def test_the_workflow_acknowledges_a_vm_and_a_scale_set_instance_on_the_emulator(certs):
    with arm_emulator(certs, vms=["vm-a", {"name": "ss_3", "vm_scale_set_name": "ss"}]) as emu:
        vms = emu.stats()["vms"]
        token = requests.get(f"{emu.url}/metadata/identity/oauth2/token", headers={"Metadata": "true"}, timeout=5,
                             params={"api-version": "2018-02-01", "resource": "https://management.azure.com/"}).json()
        for vm in ("vm-a", "ss_3"):
            event = emu.schedule(resources=[vm], source="User", type="Reboot")
            run = run_for(scheduled(vms[vm], event, [vm]), armEndpoint=emu.arm_url)
            assert approves(run), vm
            uri = ack_uri(run)
            if vm == "ss_3":
                assert "/virtualMachineScaleSets/ss/providers/Microsoft.Maintenance/" in uri
            answer = requests.post(uri, headers={"Authorization": f"Bearer {token['access_token']}"},
                                   verify=str(certs.ca), timeout=5)
            assert answer.status_code == 200 and answer.json() == {"value": "Successfully Approved"}
            assert event_status(emu, event) == "Started"


def test_the_guard_lets_a_vm_speak_only_for_itself():
    identity = {"vmId": "1", "name": "vm-a", "resourceId":
                "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-a"}
    good = scheduled(identity, "E1", ["vm-a"])
    assert approves(run_for(good))
    assert not approves(run_for(good, approveViaArm=False))  # opt-in
    assert not approves(run_for(scheduled(identity, "E1", ["vm-b"])))  # not this VM's event (AffectsThisVm false)
    assert not approves(run_for(scheduled(identity, "E1", ["vm-a"], source="Platform")))  # the policy: user-initiated
    claims = dict(good, source=good["source"].replace("vm-a", "vm-b"))
    assert not approves(run_for(claims))  # source and data.Vm disagree
    for bad in ("/../vm-b", "?x=1", "#f", "%2Fvm-b", "/virtualMachines/vm-b", " x"):
        forged = dict(good, source=good["source"] + bad)
        forged["data"] = dict(good["data"], Vm=dict(good["data"]["Vm"], ResourceId=forged["source"]))
        assert not approves(run_for(forged)), bad
    base = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/"
    for rid in (base + "disks/vm-a", base + "virtualMachineScaleSets/vm-a", base + "virtualMachines/",
                base.replace("/rg/", "//") + "virtualMachines/vm-a", base + "virtualMachineScaleSets/ss/virtualMachines/",
                base.replace("Microsoft.Compute", "Microsoft.Storage") + "virtualMachines/vm-a"):
        assert not approves(run_for(scheduled(dict(identity, resourceId=rid), "E1", ["vm-a"]))), rid
    assert ack_uri(run_for(scheduled(identity, "E/../1", ["vm-a"]))).endswith(
        "/virtualMachines/vm-a/providers/Microsoft.Maintenance/scheduledevents/E%2F..%2F1/acknowledge"
        "?api-version=2023-10-01-preview")


def test_the_approval_is_claimed_once_and_released_on_failure():
    branch = _workflow()["definition"]["actions"]["Approve_via_ARM"]["actions"]
    assert branch["Claim_approval"]["retryPolicy"] == {"type": "none"}
    assert branch["Acknowledge_through_ARM"]["runAfter"] == {"Claim_approval": ["Succeeded"]}
    assert branch["Release_approval_claim"]["runAfter"] == {"Acknowledge_through_ARM": ["Failed", "TimedOut"]}
    identity = {"name": "vm-a", "resourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-a"}
    run = run_for(scheduled(identity, "E1", ["vm-a"]))
    claim = run.value(branch["Claim_approval"]["inputs"])
    table = Table()
    assert table.request("POST", claim["uri"].replace("acct.table.core.windows.net/outcomes", "acct.table.core.windows.net/outcomes"),
                         claim["headers"], claim["body"])[0] == 204
    assert table.request("POST", claim["uri"], claim["headers"], claim["body"])[0] == 409  # another copy
    release = run.value(branch["Release_approval_claim"]["inputs"])
    assert release["uri"].endswith("(PartitionKey='E1',RowKey='E1%3Aarm-approval')") and release["method"] == "DELETE"
