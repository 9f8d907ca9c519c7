"""CloudEvents records: shape, deterministic ids, sequence, eventkey."""
from __future__ import annotations

from datetime import datetime, timezone

import orjson

from forwarder.imds.differ import diff
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.records import RecordFactory, event_key
from tests.conftest import FIXTURES

WHEN = datetime(2022, 4, 11, 22, 20, 0, 123000, tzinfo=timezone.utc)
VM = VmIdentity(
    vm_id="02aab8a4-74ef-476e-8182-f6d2ba4166a6", name="WestNO_0", computer_name="westno0",
    resource_id="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/WestNO_0",
    subscription_id="s", resource_group_name="rg", location="norwaywest", zone="", vm_scale_set_name="",
)


def seed(i):
    return parse_document((FIXTURES / f"windows-2020-07-01-example-{i}.json").read_bytes())


def factory(seq=0, vm=VM):
    return RecordFactory(vm, "2020-07-01", sequence=seq, clock=lambda: WHEN)


def test_scheduled_record_shape():
    (rec,) = factory().for_changes(diff(seed(1), seed(2), WHEN), seed(2))
    e = orjson.loads(rec.body)
    assert rec.id == e["id"] and rec.type == "scheduledevent.scheduled"
    assert e["specversion"] == "1.0"
    assert e["source"] == VM.resource_id
    assert e["subject"] == "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
    assert e["time"] == "2022-04-11T22:20:00.123Z"
    assert e["datacontenttype"] == "application/json"
    assert e["sequence"] == "00000000000000000001"
    assert e["eventkey"] == "C7061BAC-AFDC-4513-B24B-AA5F13A16123:scheduled"
    d = e["data"]
    assert d["EventType"] == "Freeze" and d["EventStatus"] == "Scheduled"
    assert d["NotBefore"] == "2022-04-11T22:26:58.000Z"
    assert d["NotBeforeRaw"] == "Mon, 11 Apr 2022 22:26:58 GMT"
    assert d["Resources"] == ["WestNO_0", "WestNO_1"]
    assert d["DurationInSeconds"] == 5 and d["EventSource"] == "Platform"
    assert d["Change"] == "scheduled" and d["PreviousStatus"] is None and d["ChangedFields"] == []
    assert d["DocumentIncarnation"] == 2 and d["AffectsThisVm"] is True and d["ApiVersion"] == "2020-07-01"
    assert d["Initial"] is False and d["RemovalReason"] is None
    assert d["Vm"]["VmId"] == VM.vm_id and d["Vm"]["Name"] == "WestNO_0" and d["Vm"]["Location"] == "norwaywest"


def test_started_and_completed_records():
    (started,) = factory(1).for_changes(diff(seed(2), seed(3), WHEN), seed(3))
    d = started.to_dict()["data"]
    assert started.type == "scheduledevent.started"
    assert d["PreviousStatus"] == "Scheduled" and d["NotBefore"] is None and d["NotBeforeRaw"] == ""
    assert d["ChangedFields"] == ["EventStatus", "NotBefore"]
    (completed,) = factory(2).for_changes(diff(seed(3), seed(4), WHEN), seed(4))
    d = completed.to_dict()["data"]
    assert completed.type == "scheduledevent.completed"
    assert d["RemovalReason"] == "ended" and d["DocumentIncarnation"] == 4 and d["EventStatus"] == "Started"


def test_ids_are_stable_across_restarts_and_differ_per_vm_kind_incarnation():
    changes = diff(seed(1), seed(2), WHEN)
    first = factory().for_changes(changes, seed(2))[0]
    later = RecordFactory(VM, "2020-07-01", sequence=0, clock=lambda: datetime.now(timezone.utc)).for_changes(changes, seed(2))[0]
    assert first.id == later.id
    other_vm = VmIdentity(vm_id="other", name="WestNO_1")
    assert factory(vm=other_vm).for_changes(changes, seed(2))[0].id != first.id
    started = factory().for_changes(diff(seed(2), seed(3), WHEN), seed(3))[0]
    assert started.id != first.id


def test_eventkey_is_the_same_on_every_vm():
    changes = diff(seed(2), seed(3), WHEN)
    a = factory(vm=VM).for_changes(changes, seed(3))[0].to_dict()
    b = factory(vm=VmIdentity(vm_id="other", name="WestNO_1")).for_changes(changes, seed(3))[0].to_dict()
    assert a["eventkey"] == b["eventkey"] == "C7061BAC-AFDC-4513-B24B-AA5F13A16123:started"
    assert a["id"] != b["id"]


def test_updated_eventkeys_differ_per_update():
    base = {"EventId": "e", "EventStatus": "Scheduled", "Resources": ["vm"], "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT"}
    d1 = parse_document(orjson.dumps({"DocumentIncarnation": 1, "Events": [base]}))
    d2 = parse_document(orjson.dumps({"DocumentIncarnation": 2, "Events": [{**base, "NotBefore": "Mon, 11 Apr 2022 23:00:00 GMT"}]}))
    d3 = parse_document(orjson.dumps({"DocumentIncarnation": 3, "Events": [{**base, "NotBefore": "Mon, 11 Apr 2022 23:30:00 GMT"}]}))
    k1 = event_key(diff(d1, d2, WHEN)[0])
    k2 = event_key(diff(d2, d3, WHEN)[0])
    assert k1.startswith("e:updated:") and k2.startswith("e:updated:") and k1 != k2


def test_sequence_counts_up_and_lifecycle_records():
    f = factory(41)
    rec = f.lifecycle("heartbeat", {"Polls": 3})
    e = rec.to_dict()
    assert e["type"] == "forwarder.heartbeat" and e["sequence"] == "00000000000000000042"
    assert e["data"]["Polls"] == 3 and e["data"]["Vm"]["VmId"] == VM.vm_id
    assert "eventkey" not in e
    assert f.lifecycle("started", {}).to_dict()["sequence"] == "00000000000000000043"


def test_source_fallbacks_and_affects_this_vm():
    assert VmIdentity(vm_id="abc").source == "/vm/abc"
    assert VmIdentity(computer_name="h").source == "/host/h"
    vm = VmIdentity(vm_id="abc", name="FrontEnd_IN_0")
    assert vm.affected_by(["_FrontEnd_IN_0", "_BackEnd_IN_0"]) is True  # 2017-03-01 underscore prefix
    assert vm.affected_by(["BackEnd_IN_0"]) is False
    assert VmIdentity().affected_by(["x"]) is None
    assert vm.is_leader(["FrontEnd_IN_0", "BackEnd_IN_0"]) is False
    assert VmIdentity(name="BackEnd_IN_0").is_leader(["FrontEnd_IN_0", "BackEnd_IN_0"]) is True


def test_identity_from_compute():
    vm = VmIdentity.from_compute({
        "vmId": "id", "name": "myss_3", "osProfile": {"computerName": "myss000003"}, "resourceId": "/r",
        "subscriptionId": "s", "resourceGroupName": "rg", "location": "westeurope", "zone": "1",
        "vmScaleSetName": "myss", "tagsList": [],
    })
    assert vm.computer_name == "myss000003" and vm.vm_scale_set_name == "myss" and vm.zone == "1"
    assert vm.affected_by(["myss_3"]) is True
