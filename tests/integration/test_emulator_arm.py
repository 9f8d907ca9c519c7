"""The emulator's Azure Resource Manager side: the Microsoft.Maintenance acknowledgement contract
(REST spec ScheduledEvents_Acknowledge / _AcknowledgeList), its refusals, and that an ARM
acknowledgement is the same engine path as a StartRequests POST. Requests come from `requests`
(an independent client); `tests/integration/test_approve_arm.py` drives it with the Azure SDK."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from forwarder.emulator import Emulator
from tests.arm import ArmCerts, arm_certs, arm_emulator, event_status, resource_id

pytestmark = pytest.mark.timeout(60)
VERSION = "2023-10-01-preview"
LIST_VERSION = "2025-10-01-preview"


@pytest.fixture
def certs(tmp_path: Path) -> ArmCerts:
    return arm_certs(tmp_path / "tls")


@pytest.fixture
def emu(certs: ArmCerts):
    with arm_emulator(certs, vms=["vm-0", "vm-1", {"name": "ss_0", "vm_scale_set_name": "ss"}]) as emulator:
        yield emulator


def token(emu: Emulator, resource: str = "https://management.azure.com/", vm: str = "vm-0") -> str:
    answer = requests.get(f"{emu.vm_url(vm)}/metadata/identity/oauth2/token",
                          params={"api-version": "2018-02-01", "resource": resource}, headers={"Metadata": "true"},
                          timeout=5)
    answer.raise_for_status()
    return str(answer.json()["access_token"])


def post(emu: Emulator, certs: ArmCerts, path: str, *, bearer: str | None, version: str | None = VERSION,
         body: Any = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
    params = {"api-version": version} if version is not None else {}
    return requests.post(emu.arm_url + path, params=params, headers=headers, json=body, verify=str(certs.ca), timeout=5)


def ack_path(emu: Emulator, vm: str, event_id: str) -> str:
    return f"{resource_id(emu, vm)}/providers/Microsoft.Maintenance/scheduledevents/{event_id}/acknowledge"


def test_an_acknowledgement_starts_the_event_exactly_as_start_requests_would(emu, certs):
    via_arm = emu.schedule(resources=["vm-0"])
    via_imds = emu.schedule(resources=["vm-1"])
    answer = post(emu, certs, ack_path(emu, "vm-0", via_arm), bearer=token(emu))
    assert answer.status_code == 200 and answer.json() == {"value": "Successfully Approved"}
    assert answer.headers["x-ms-request-id"]
    imds = requests.post(f"{emu.vm_url('vm-1')}/metadata/scheduledevents", params={"api-version": "2020-07-01"},
                         headers={"Metadata": "true"}, json={"StartRequests": [{"EventId": via_imds}]}, timeout=5)
    assert imds.status_code == 200
    events = {e["EventId"]: e for e in emu.stats()["events"]}
    assert events[via_arm]["EventStatus"] == events[via_imds]["EventStatus"] == "Started"
    assert events[via_arm]["StartedBy"] == "approved by vm-0" and events[via_imds]["StartedBy"] == "approved by vm-1"
    assert [(r["vm"], r["via"]) for r in emu.stats()["start_requests"]] == [("vm-0", "arm"), ("vm-1", "imds")]
    history = [h["change"] for h in emu.stats()["history"]]
    assert history.count("started (approved by vm-0)") == 1


@pytest.mark.parametrize(("bearer", "code"), [
    (None, "AuthenticationFailed"),
    ("emulator-token.vm-0.999", "InvalidAuthenticationToken"),
    ("forged", "InvalidAuthenticationToken"),
])
def test_no_valid_bearer_token_is_401_and_nothing_starts(emu, certs, bearer, code):
    event = emu.schedule(resources=["vm-0"])
    answer = post(emu, certs, ack_path(emu, "vm-0", event), bearer=bearer)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == code
    assert answer.headers["WWW-Authenticate"].startswith("Bearer ")
    assert event_status(emu, event) == "Scheduled" and emu.stats()["start_requests"] == []


def test_a_token_for_another_resource_is_401_wrong_audience(emu, certs):
    event = emu.schedule(resources=["vm-0"])
    answer = post(emu, certs, ack_path(emu, "vm-0", event), bearer=token(emu, "https://vault.azure.net"))
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "InvalidAuthenticationTokenAudience"
    assert event_status(emu, event) == "Scheduled"


def test_an_event_of_another_vm_is_not_found_on_this_vm(emu, certs):
    theirs = emu.schedule(resources=["vm-1"])
    answer = post(emu, certs, ack_path(emu, "vm-0", theirs), bearer=token(emu))
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "NotFound"
    assert event_status(emu, theirs) == "Scheduled"


def test_wrong_resource_types_unknown_resources_and_api_versions(emu, certs):
    event = emu.schedule(resources=["ss_0"])
    bearer = token(emu)
    instance = ack_path(emu, "ss_0", event)  # the spec has no scale-set-instance form
    answer = post(emu, certs, instance, bearer=bearer)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "InvalidResourceType"
    disk = instance.replace("virtualMachineScaleSets/ss/virtualMachines/0", "disks/d0")
    assert post(emu, certs, disk, bearer=bearer).json()["error"]["code"] == "InvalidResourceType"
    missing = ack_path(emu, "vm-0", event).replace("/virtualMachines/vm-0/", "/virtualMachines/nope/")
    answer = post(emu, certs, missing, bearer=bearer)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "ResourceNotFound"
    scale_set = instance.replace("/virtualMachines/0/", "/")
    assert post(emu, certs, scale_set, bearer=bearer, version=None).json()["error"]["code"] == "MissingApiVersionParameter"
    assert post(emu, certs, scale_set, bearer=bearer, version="2020-01-01").json()["error"]["code"] == \
        "InvalidApiVersionParameter"
    assert event_status(emu, event) == "Scheduled"
    assert post(emu, certs, scale_set, bearer=bearer).status_code == 200
    assert event_status(emu, event) == "Started"


def test_the_list_form_acknowledges_several_and_answers_207_for_the_unknown(emu, certs):
    first, second = emu.schedule(resources=["vm-0"]), emu.schedule(resources=["vm-0", "vm-1"])
    path = f"{resource_id(emu, 'vm-0')}/providers/Microsoft.Maintenance/scheduledevents"
    bearer = token(emu)
    assert post(emu, certs, path, bearer=bearer, version=VERSION).json()["error"]["code"] == "InvalidApiVersionParameter"
    assert post(emu, certs, path, bearer=bearer, version=LIST_VERSION, body={"value": []}).status_code == 400
    answer = post(emu, certs, path, bearer=bearer, version=LIST_VERSION, body={"value": [first, "unknown-id"]})
    assert answer.status_code == 207
    error = answer.json()["error"]
    assert error["code"] == "MultiStatusResponse"
    assert error["details"] == [{"target": "unknown-id", "code": "NotFound", "message": error["details"][0]["message"]}]
    assert event_status(emu, first) == "Started" and event_status(emu, second) == "Scheduled"
    answer = post(emu, certs, path, bearer=bearer, version=LIST_VERSION, body={"value": [second]})
    assert answer.status_code == 200 and event_status(emu, second) == "Started"


def test_throttling_is_injectable_with_retry_after(emu, certs):
    event = emu.schedule(resources=["vm-0"])
    emu.inject_fault("status", status=429, retry_after="7", path="arm")
    bearer = token(emu)
    answer = post(emu, certs, ack_path(emu, "vm-0", event), bearer=bearer)
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "7"
    assert answer.json()["error"]["code"] == "TooManyRequests"
    assert post(emu, certs, ack_path(emu, "vm-0", event), bearer=bearer).status_code == 200


def test_plain_http_is_not_served_on_the_arm_port(emu):
    with pytest.raises(requests.ConnectionError):
        requests.post(emu.arm_url.replace("https://", "http://") + "/subscriptions/x", timeout=5)
    assert emu.stats()["arm_requests"] == []


def test_without_a_certificate_there_is_no_arm_side():
    with Emulator(vms=["vm-0"]) as emulator:
        with pytest.raises(RuntimeError, match="arm_tls"):
            emulator.arm_url  # noqa: B018 - the property raises
        assert "arm_requests" not in emulator.stats()


def test_sefwd_emulator_serves_arm_with_arm_tls(certs, tmp_path):
    import os
    import re
    import subprocess
    import sys

    from tests.agent import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "forwarder", "emulator", "--listen", "127.0.0.1:0", "--vm", "vm-0",
                             "--arm-tls", str(certs.cert), str(certs.key)], stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))
    try:
        assert proc.stderr is not None
        lines = []
        while not any("Azure Resource Manager at" in line for line in lines):
            lines.append(proc.stderr.readline())
            assert lines[-1], f"the emulator exited: {lines}"
        arm = re.search(r"Azure Resource Manager at (https://127\.0\.0\.1:\d+) ", lines[-1])
        assert arm and any("IMDS emulator at http://127.0.0.1:" in line for line in lines)
        answer = requests.post(arm.group(1) + "/subscriptions/s/resourcegroups/rg/providers/Microsoft.Compute/"
                               "virtualMachines/vm-0/providers/Microsoft.Maintenance/scheduledevents/E/acknowledge",
                               params={"api-version": VERSION}, verify=str(certs.ca), timeout=5)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "AuthenticationFailed"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_rbac_grants_limit_each_identity_to_its_scopes(emu, certs):
    event_a, event_b = emu.schedule(resources=["vm-0"]), emu.schedule(resources=["vm-1"])
    group = resource_id(emu, "vm-0").rpartition("/providers/")[0]  # /subscriptions/S/resourceGroups/RG
    emu.arm_grants = {"vm-0": (resource_id(emu, "vm-1").upper(),), "vm-1": (group + "-other",)}
    denied = post(emu, certs, ack_path(emu, "vm-0", event_a), bearer=token(emu, vm="vm-0"))
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "AuthorizationFailed"
    assert "Microsoft.Maintenance/scheduledevents/acknowledge/action" in denied.json()["error"]["message"]
    # A prefix of the name is no scope: "…/resourceGroups/RG-other" does not cover "…/resourceGroups/RG".
    assert post(emu, certs, ack_path(emu, "vm-1", event_b), bearer=token(emu, vm="vm-1")).status_code == 403
    assert event_status(emu, event_a) == event_status(emu, event_b) == "Scheduled"
    assert post(emu, certs, ack_path(emu, "vm-1", event_b), bearer=token(emu, vm="vm-0")).status_code == 200
    emu.arm_grants = {"vm-1": (group,)}  # the role on the resource group
    assert post(emu, certs, ack_path(emu, "vm-0", event_a), bearer=token(emu, vm="vm-1")).status_code == 200
    assert event_status(emu, event_a) == event_status(emu, event_b) == "Started"


# -- Azure Resource Graph: the platform's own record of an event --------------------------------------

GRAPH = "/providers/Microsoft.ResourceGraph/resources"


def graph(emu: Emulator, certs: ArmCerts, query: str, *, bearer: str | None = None, version: str = "2022-10-01",
          subscriptions: list[str] | None = None) -> requests.Response:
    body = {"subscriptions": subscriptions or [], "query": query, "options": {"resultFormat": "objectArray"}}
    return post(emu, certs, GRAPH, bearer=bearer if bearer is not None else token(emu), version=version, body=body)


def test_resource_graph_lists_each_event_on_the_vm_or_scale_set_its_resources_belong_to(emu, certs):
    shared = emu.schedule(resources=["vm-1", "ss_0"], type="Reboot", source="Platform")
    rows = graph(emu, certs, "maintenanceresources | where type =~ 'microsoft.maintenance/scheduledevents'").json()
    assert rows["count"] == rows["totalRecords"] == 2 and rows["resultTruncated"] == "false"
    by_id = {r["id"]: r for r in rows["data"]}
    ss_row = next(r for r in rows["data"] if "/virtualMachineScaleSets/ss/" in r["id"])
    assert ss_row["id"] == resource_id(emu, "ss_0").rpartition("/virtualMachines/")[0] + (
        f"/providers/microsoft.maintenance/scheduledevents/{shared}")
    assert f"{resource_id(emu, 'vm-1')}/providers/microsoft.maintenance/scheduledevents/{shared}" in by_id
    props = ss_row["properties"]
    assert (props["EventId"], props["Resources"], props["EventStatus"], props["EventType"]) == (
        shared, ["vm-1", "ss_0"], "Scheduled", "Reboot")
    assert ss_row["type"] == "microsoft.maintenance/scheduledevents" and ss_row["name"] == shared
    # The one query form it evaluates: `where <type|id|name> =~ '<literal>'`, any case, quotes escaped.
    one = graph(emu, certs, f"maintenanceresources | where type =~ 'microsoft.maintenance/scheduledevents' "
                            f"| where id =~ '{ss_row['id'].upper()}' | project id, properties").json()
    assert [r["id"] for r in one["data"]] == [ss_row["id"]]
    assert graph(emu, certs, "maintenanceresources | where name =~ 'it\\'s not there'").json()["data"] == []
    assert graph(emu, certs, "maintenanceresources", subscriptions=["00000000-0000-0000-0000-000000000000"]).json()[
        "data"] == []
    emu.complete(shared)
    assert graph(emu, certs, "maintenanceresources").json()["data"] == []  # gone with the event


def test_resource_graph_refuses_what_it_cannot_answer_and_needs_a_token(emu, certs):
    assert graph(emu, certs, "resources | where type =~ 'microsoft.compute/virtualmachines'").status_code == 400
    assert graph(emu, certs, "maintenanceresources | extend x = 1").status_code == 400
    assert graph(emu, certs, "maintenanceresources", version="2019-04-01").json()["error"]["code"] == (
        "InvalidApiVersionParameter")
    assert graph(emu, certs, "maintenanceresources", bearer="forged").status_code == 401


def test_resource_graph_leaves_out_rows_the_caller_has_no_grant_on(certs):
    vms = ["vm-0", {"name": "ss_0", "vm_scale_set_name": "ss"}]
    with arm_emulator(certs, vms=vms, arm_grants={"vm-0": ["/subscriptions/none"]}) as emu:
        emu.schedule(resources=["ss_0"])
        assert graph(emu, certs, "maintenanceresources").json()["data"] == []
