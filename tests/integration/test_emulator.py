"""The IMDS emulator over real HTTP on loopback: protocol checks, per-version rendering, lifecycle, VMs."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import pytest

from tests.agent import poll_until as wait_until
import requests

from forwarder.emulator import SE_VERSIONS, Emulator
from tests.conftest import FIXTURES

SE = "/metadata/scheduledevents"
H = {"Metadata": "true"}
FREEZE_ID = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
FREEZE_DESC = "Virtual machine is being paused because of a memory-preserving Live Migration operation."
FIXED_NOW = datetime(2016, 9, 19, 18, 29, 47, tzinfo=timezone.utc)
RFC1123 = re.compile(r"^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d{2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} "
                     r"\d{2}:\d{2}:\d{2} GMT$")




@pytest.fixture
def http() -> Iterator[requests.Session]:
    s = requests.Session()
    s.trust_env = False  # never through a proxy (FACTS)
    yield s
    s.close()


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(vms=["WestNO_0", "WestNO_1"], rate_limit=None) as e:
        yield e


def get_doc(http: requests.Session, base: str, version: str = "2020-07-01") -> dict[str, Any]:
    r = http.get(base + SE, params={"api-version": version}, headers=H, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def post(http: requests.Session, base: str, body: Any, version: str = "2020-07-01",
         headers: dict[str, str] = H) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return http.post(base + SE, params={"api-version": version}, headers=headers, data=data, timeout=5)


# -- request validation ----------------------------------------------------------------------


def test_metadata_header_required_for_get_and_post(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Reboot")
    for headers in ({}, {"Metadata": "false"}):
        r = http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers=headers)
        assert r.status_code == 400
        assert "metadata header" in r.json()["error"].lower()
        r = post(http, emu.url, {"StartRequests": [{"EventId": event_id}]}, headers=headers)
        assert r.status_code == 400
    assert emu.stats()["events"][0]["EventStatus"] == "Scheduled"
    assert get_doc(http, emu.url)["Events"][0]["EventId"] == event_id  # header present: fine


def test_x_forwarded_for_is_rejected(emu: Emulator, http: requests.Session) -> None:
    r = http.get(emu.url + SE, params={"api-version": "2020-07-01"},
                 headers={**H, "X-Forwarded-For": "10.0.0.1"})
    assert r.status_code == 400
    assert "X-Forwarded-For" in r.json()["error"]


def test_duplicate_query_parameters_are_rejected(emu: Emulator, http: requests.Session) -> None:
    for query in ("api-version=2020-07-01&api-version=2020-07-01", "api-version=2020-07-01&format=json&format=json"):
        r = http.get(f"{emu.url}{SE}?{query}", headers=H)
        assert r.status_code == 400, query
        assert "more than once" in r.json()["error"]


def test_missing_api_version_lists_newest_versions(emu: Emulator, http: requests.Session) -> None:
    r = http.get(emu.url + SE, headers=H)
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"error", "newest-versions"}
    assert body["newest-versions"] == ["2024-07-09", "2020-07-01", "2019-08-01"]


@pytest.mark.parametrize("version", ["2018-01-01", "latest", "{latest}", "2020-07-02", ""])
def test_unknown_api_version_is_rejected(emu: Emulator, http: requests.Session, version: str) -> None:
    r = http.get(emu.url + SE, params={"api-version": version}, headers=H)
    assert r.status_code == 400
    assert r.json()["newest-versions"][0] == "2024-07-09"


def test_every_documented_version_answers(emu: Emulator, http: requests.Session) -> None:
    assert SE_VERSIONS == ("2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01",
                           "2019-08-01", "2020-07-01", "2024-07-09")
    for version in SE_VERSIONS:
        assert get_doc(http, emu.url, version) == {"DocumentIncarnation": 1, "Events": []}


def test_unknown_paths_are_404(emu: Emulator, http: requests.Session) -> None:
    for path in ("/metadata/foo", SE + "/extra", "/vm/nobody" + SE, "/", "/metadata"):
        r = http.get(emu.url + path, params={"api-version": "2020-07-01"}, headers=H)
        assert r.status_code == 404, path


def test_other_methods_are_405(emu: Emulator, http: requests.Session) -> None:
    for method in ("PUT", "DELETE", "PATCH"):
        r = http.request(method, emu.url + SE, params={"api-version": "2020-07-01"}, headers=H)
        assert r.status_code == 405
        assert r.headers["Allow"] == "GET, POST"
    r = http.post(emu.url + "/metadata/instance/compute", params={"api-version": "2021-02-01"}, headers=H)
    assert r.status_code == 405


# -- documents ----------------------------------------------------------------------------------


def test_documents_match_the_windows_seed_example_byte_for_byte_in_content(http: requests.Session) -> None:
    """The seed's four documents, reproduced exactly: same keys, same order, same values."""
    seed_now = datetime(2022, 4, 11, 22, 11, 58, tzinfo=timezone.utc)  # 15 minutes before the seed's NotBefore
    with Emulator(vms=["WestNO_0", "WestNO_1"], rate_limit=None, clock=lambda: seed_now) as emu:
        expected = [json.loads((FIXTURES / f"windows-2020-07-01-example-{i}.json").read_text()) for i in (1, 2, 3, 4)]
        docs = [get_doc(http, emu.url)]
        emu.schedule(id=FREEZE_ID, type="Freeze", resources=["WestNO_0", "WestNO_1"],
                     not_before="Mon, 11 Apr 2022 22:26:58 GMT", description=FREEZE_DESC, source="Platform",
                     duration=5)
        docs.append(get_doc(http, emu.url))
        assert post(http, emu.url, {"StartRequests": [{"EventId": FREEZE_ID}]}).status_code == 200
        docs.append(get_doc(http, emu.url))
        emu.complete(FREEZE_ID)
        docs.append(get_doc(http, emu.url))
    assert docs == expected
    for doc, want in zip(docs, expected):
        for got_ev, want_ev in zip(doc["Events"], want["Events"]):
            assert list(got_ev) == list(want_ev)  # key order as in the seed


def test_fields_per_api_version(http: requests.Session) -> None:
    with Emulator(vms=["vm1"], rate_limit=None, clock=lambda: FIXED_NOW) as emu:
        emu.schedule(id="E1", type="Freeze", description="d", source="User", duration=9, resources=["vm1", "vm2"])
        base = ["EventId", "EventStatus", "EventType", "ResourceType", "Resources", "NotBefore"]
        want = {
            "2017-03-01": base, "2017-08-01": base, "2017-11-01": base, "2019-01-01": base,
            "2019-04-01": base + ["Description"],
            "2019-08-01": base + ["Description", "EventSource"],
            "2020-07-01": base + ["Description", "EventSource", "DurationInSeconds"],
        }
        for version, keys in want.items():
            (ev,) = get_doc(http, emu.url, version)["Events"]
            assert list(ev) == keys, version
            if version == "2017-03-01":
                assert ev["Resources"] == ["_vm1", "_vm2"]
                assert ev["NotBefore"] == "2016-09-19T18:44:47Z"  # ISO, as the preview doc shows
            else:
                assert ev["Resources"] == ["vm1", "vm2"]
                assert ev["NotBefore"] == "Mon, 19 Sep 2016 18:44:47 GMT"
        (ev,) = get_doc(http, emu.url)["Events"]
        assert (ev["Description"], ev["EventSource"], ev["DurationInSeconds"]) == ("d", "User", 9)
        assert isinstance(get_doc(http, emu.url)["DocumentIncarnation"], int)


def test_minimum_notice_per_event_type(http: requests.Session) -> None:
    with Emulator(rate_limit=None, clock=lambda: FIXED_NOW, terminate_notice=600) as emu:
        notice = {"Freeze": 900, "Reboot": 900, "Redeploy": 600, "Preempt": 30, "Terminate": 600}
        for etype in notice:
            emu.schedule(id=etype, type=etype)
        for ev in get_doc(http, emu.url)["Events"]:
            assert RFC1123.match(ev["NotBefore"])
            got = parsedate_to_datetime(ev["NotBefore"]) - FIXED_NOW
            assert got == timedelta(seconds=notice[ev["EventType"]]), ev["EventType"]


def test_preempt_and_terminate_are_invisible_to_older_versions(emu: Emulator, http: requests.Session) -> None:
    emu.schedule(id="P", type="Preempt")
    emu.schedule(id="T", type="Terminate")
    emu.schedule(id="R", type="Reboot")

    def ids(version: str) -> list[str]:
        return [e["EventId"] for e in get_doc(http, emu.url, version)["Events"]]

    assert ids("2017-03-01") == ids("2017-08-01") == ["R"]
    assert ids("2017-11-01") == ["P", "R"]
    assert ids("2019-01-01") == ids("2020-07-01") == ["P", "T", "R"]
    # An event a version cannot see cannot be approved through it either.
    assert post(http, emu.url, {"StartRequests": [{"EventId": "T"}]}, version="2017-11-01").status_code == 400
    assert post(http, emu.url, {"StartRequests": [{"EventId": "T"}]}, version="2019-01-01").status_code == 200


def test_incarnation_goes_up_by_one_per_change(emu: Emulator, http: requests.Session) -> None:
    seen = [get_doc(http, emu.url)["DocumentIncarnation"]]
    assert get_doc(http, emu.url)["DocumentIncarnation"] == seen[0]  # reading changes nothing
    a = emu.schedule(type="Reboot", start_after=600)
    seen.append(get_doc(http, emu.url)["DocumentIncarnation"])
    b = emu.schedule(type="Redeploy", start_after=600)
    seen.append(get_doc(http, emu.url)["DocumentIncarnation"])
    emu.update(a, description="new text")
    seen.append(get_doc(http, emu.url)["DocumentIncarnation"])
    emu.update(a, description="new text")  # no visible change: no new document
    seen.append(get_doc(http, emu.url)["DocumentIncarnation"])
    emu.start_event(b)
    seen.append(get_doc(http, emu.url)["DocumentIncarnation"])
    emu.cancel(a)
    seen.append(get_doc(http, emu.url)["DocumentIncarnation"])
    assert seen == [1, 2, 3, 4, 4, 5, 6]


# -- approval ----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_incarnation", [False, True])
def test_post_start_request_moves_scheduled_to_started(emu: Emulator, http: requests.Session,
                                                        with_incarnation: bool) -> None:
    event_id = emu.schedule(type="Reboot", start_after=600, complete_after=600)
    doc = get_doc(http, emu.url)
    body: dict[str, Any] = {"StartRequests": [{"EventId": event_id}]}
    if with_incarnation:
        body = {"DocumentIncarnation": str(doc["DocumentIncarnation"]), **body}  # as the 2017 samples send it
    r = post(http, emu.url, body)
    assert r.status_code == 200
    after = get_doc(http, emu.url)
    assert after["DocumentIncarnation"] == doc["DocumentIncarnation"] + 1
    (ev,) = after["Events"]
    assert (ev["EventStatus"], ev["NotBefore"]) == ("Started", "")
    # Approving again (say, from another VM) is still a 200 and changes nothing.
    assert post(http, emu.url, body).status_code == 200
    assert get_doc(http, emu.url)["DocumentIncarnation"] == after["DocumentIncarnation"]
    reqs = emu.stats()["start_requests"]
    assert [r["event_ids"] for r in reqs] == [[event_id], [event_id]]
    assert reqs[0]["document_incarnation"] == (str(doc["DocumentIncarnation"]) if with_incarnation else None)
    assert emu.stats()["events"][0]["StartedBy"] == "approved by WestNO_0"


def test_post_rejects_unknown_ids_and_malformed_bodies(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Reboot", start_after=600)
    bad_bodies: list[Any] = [
        {"StartRequests": [{"EventId": "00000000-0000-0000-0000-000000000000"}]},
        {"StartRequests": [{"EventId": event_id}, {"EventId": "nope"}]},  # all or nothing
        "{not json", "", "[]", {"StartRequests": []}, {"StartRequests": {"EventId": event_id}},
        {"StartRequests": [{"Id": event_id}]}, {"StartRequests": [event_id]}, {"EventId": event_id},
    ]
    for body in bad_bodies:
        r = post(http, emu.url, body)
        assert r.status_code == 400, body
    assert get_doc(http, emu.url)["Events"][0]["EventStatus"] == "Scheduled"
    assert post(http, emu.url, {"StartRequests": [{"EventId": event_id.lower()}]}).status_code == 200


def test_approval_from_one_vm_starts_the_event_for_all(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Freeze", resources=["WestNO_0", "WestNO_1"], start_after=600)
    assert post(http, emu.vm_url("WestNO_1"), {"StartRequests": [{"EventId": event_id}]}).status_code == 200
    for base in (emu.url, emu.vm_url("WestNO_0"), emu.vm_url("WestNO_1")):
        assert get_doc(http, base)["Events"][0]["EventStatus"] == "Started"
    assert emu.stats()["events"][0]["Approvals"] == ["WestNO_1"]


def test_require_all_approvals_waits_for_every_resource(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Reboot", resources=["WestNO_0", "WestNO_1"], start_after=600,
                            require_all_approvals=True)
    assert post(http, emu.url, {"StartRequests": [{"EventId": event_id}]}).status_code == 200
    assert get_doc(http, emu.url)["Events"][0]["EventStatus"] == "Scheduled"
    assert post(http, emu.vm_url("WestNO_1"), {"StartRequests": [{"EventId": event_id}]}).status_code == 200
    assert get_doc(http, emu.url)["Events"][0]["EventStatus"] == "Started"


# -- lifecycle ---------------------------------------------------------------------------------


def test_auto_start_then_removal_after_duration(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Reboot", start_after=0.3, complete_after=0.3)
    assert get_doc(http, emu.url)["Events"][0]["EventStatus"] == "Scheduled"
    started = wait_until(lambda: [e for e in get_doc(http, emu.url)["Events"] if e["EventStatus"] == "Started"])
    assert started and started[0]["EventId"] == event_id and started[0]["NotBefore"] == ""
    assert wait_until(lambda: get_doc(http, emu.url)["Events"] == [])
    assert [h["change"] for h in emu.stats()["history"]] == ["scheduled", "started (not-before)", "completed"]


def test_default_start_is_at_not_before(http: requests.Session) -> None:
    with Emulator(rate_limit=None, time_scale=0.001) as emu:  # 15 min notice -> 0.9 s real
        emu.schedule(type="Freeze", duration=1)
        assert get_doc(http, emu.url)["Events"][0]["EventStatus"] == "Scheduled"
        assert wait_until(lambda: get_doc(http, emu.url)["Events"] == [], timeout=10)
        assert [h["change"] for h in emu.stats()["history"]][1] == "started (not-before)"


def test_cancel_removes_a_scheduled_event(emu: Emulator, http: requests.Session) -> None:
    keep = emu.schedule(type="Reboot", start_after=600)
    gone = emu.schedule(type="Redeploy", start_after=600)
    emu.cancel(gone)
    assert [e["EventId"] for e in get_doc(http, emu.url)["Events"]] == [keep]
    assert emu.stats()["history"][-1]["change"] == "canceled"
    with pytest.raises(KeyError):
        emu.cancel(gone)


def test_hardware_failure_appears_already_started(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Reboot", status="Started", complete_after=0.3)
    (ev,) = get_doc(http, emu.url)["Events"]
    assert (ev["EventId"], ev["EventStatus"], ev["NotBefore"]) == (event_id, "Started", "")
    assert post(http, emu.url, {"StartRequests": [{"EventId": event_id}]}).status_code == 200
    assert wait_until(lambda: get_doc(http, emu.url)["Events"] == [])
    assert [h["change"] for h in emu.stats()["history"]] == ["hardware-failure", "completed"]


def test_update_changes_not_before_description_and_resources(http: requests.Session) -> None:
    with Emulator(vms=["a"], rate_limit=None, clock=lambda: FIXED_NOW) as emu:
        event_id = emu.schedule(type="Reboot", start_after=600)
        inc = get_doc(http, emu.url)["DocumentIncarnation"]
        emu.update(event_id, not_before="+2d")
        emu.update(event_id, description="Host hardware degraded; migrating.")
        emu.update(event_id, resources=["a", "b"], duration=30)
        doc = get_doc(http, emu.url)
        (ev,) = doc["Events"]
        assert doc["DocumentIncarnation"] == inc + 3
        assert ev["NotBefore"] == "Wed, 21 Sep 2016 18:29:47 GMT"
        assert ev["Description"] == "Host hardware degraded; migrating."
        assert (ev["Resources"], ev["DurationInSeconds"]) == (["a", "b"], 30)
        assert get_doc(http, emu.vm_url("b"))["Events"][0]["EventId"] == event_id  # new VM reachable
        with pytest.raises(ValueError):
            emu.update(event_id, EventStatus="Started")  # status moves only by start/approval


# -- VMs ---------------------------------------------------------------------------------------


def test_each_vm_has_its_prefix_and_sees_the_availability_set_events(emu: Emulator, http: requests.Session) -> None:
    event_id = emu.schedule(type="Freeze", resources=["WestNO_0", "WestNO_1"], start_after=600)
    assert emu.vm_url("WestNO_1") == emu.url + "/vm/WestNO_1"
    docs = [get_doc(http, base) for base in (emu.url, emu.vm_url("WestNO_0"), emu.vm_url("WestNO_1"))]
    assert docs[0] == docs[1] == docs[2]
    assert docs[0]["Events"][0]["Resources"] == ["WestNO_0", "WestNO_1"]
    assert docs[0]["Events"][0]["EventId"] == event_id
    names = [http.get(base + "/metadata/instance/compute", params={"api-version": "2021-02-01"},
                      headers=H).json()["name"] for base in (emu.url, emu.vm_url("WestNO_1"))]
    assert names == ["WestNO_0", "WestNO_1"]  # the root prefix is the first VM
    requests_by_vm = emu.stats()["requests"]
    assert requests_by_vm["WestNO_0"]["GET"] == 3 and requests_by_vm["WestNO_1"]["GET"] == 2


def test_rate_limit_per_vm(http: requests.Session) -> None:
    with Emulator(vms=["a", "b"], rate_limit=5) as emu:
        codes = [http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers=H).status_code
                 for _ in range(8)]
        assert codes[:5] == [200] * 5 and 429 in codes[5:]
        assert http.get(emu.vm_url("b") + SE, params={"api-version": "2020-07-01"}, headers=H).status_code == 200
        # The window slides: within about a second the first VM is served again.
        assert wait_until(lambda: http.get(emu.url + SE, params={"api-version": "2020-07-01"},
                                           headers=H).status_code == 200, timeout=3, interval=0.25)
        assert emu.stats()["requests"]["a"]["by_status"]["429"] >= 1


def test_rate_limit_can_be_disabled(emu: Emulator, http: requests.Session) -> None:
    codes = {http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers=H).status_code for _ in range(20)}
    assert codes == {200}


def test_first_call_delay_applies_once_per_vm(http: requests.Session) -> None:
    with Emulator(vms=["a", "b"], rate_limit=None, first_call_delay=0.5) as emu:
        t0 = time.monotonic()
        get_doc(http, emu.url)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        get_doc(http, emu.url)
        second = time.monotonic() - t0
        assert first >= 0.5 and second < 0.4


# -- other endpoints ---------------------------------------------------------------------------


def test_instance_compute(http: requests.Session) -> None:
    vms = [{"name": "myss_3", "vm_scale_set_name": "myss", "zone": "2", "tags": {"role": "db"}}, "plain"]
    with Emulator(vms=vms, rate_limit=None) as emu:
        r = http.get(emu.url + "/metadata/instance/compute", params={"api-version": "2021-02-01"}, headers=H)
        assert r.status_code == 200
        c = r.json()
        for key in ("vmId", "name", "resourceId", "subscriptionId", "resourceGroupName", "location", "zone",
                    "vmScaleSetName"):
            assert isinstance(c[key], str), key
        assert c["osProfile"]["computerName"] == "myss000003"
        assert (c["name"], c["zone"], c["vmScaleSetName"]) == ("myss_3", "2", "myss")
        assert c["resourceId"].endswith("/virtualMachineScaleSets/myss/virtualMachines/3")
        assert c["tagsList"] == [{"name": "role", "value": "db"}]
        plain = http.get(emu.vm_url("plain") + "/metadata/instance/compute", params={"api-version": "2023-07-01"},
                         headers=H).json()
        assert (plain["zone"], plain["vmScaleSetName"], plain["osProfile"]["computerName"]) == ("", "", "plain")
        assert plain["vmId"] != c["vmId"]
        full = http.get(emu.url + "/metadata/instance", params={"api-version": "2021-02-01"}, headers=H).json()
        assert full["compute"] == c
        for params in ({}, {"api-version": "2017-03-01"}, {"api-version": "bogus"}):
            r = http.get(emu.url + "/metadata/instance/compute", params=params, headers=H)
            assert r.status_code == 400 and "newest-versions" in r.json()
        assert http.get(emu.url + "/metadata/instance/compute", params={"api-version": "2021-02-01"}).status_code == 400


def test_managed_identity_token(emu: Emulator, http: requests.Session) -> None:
    url = emu.url + "/metadata/identity/oauth2/token"
    params = {"api-version": "2018-02-01", "resource": "https://eventhubs.azure.net"}
    r = http.get(url, params=params, headers=H)
    assert r.status_code == 200
    tok = r.json()
    for key in ("access_token", "expires_in", "expires_on", "not_before", "resource", "token_type"):
        assert isinstance(tok[key], str) and tok[key], key
    assert tok["resource"] == "https://eventhubs.azure.net" and tok["token_type"] == "Bearer"
    assert int(tok["expires_on"]) > time.time()
    assert http.get(url, params=params).status_code == 400  # no Metadata header
    assert http.get(url, params={"api-version": "2018-02-01"}, headers=H).status_code == 400  # no resource
    http.get(emu.vm_url("WestNO_1") + "/metadata/identity/oauth2/token", params=params, headers=H)
    stats = emu.stats()
    assert stats["token_requests"] == 4
    assert stats["requests"]["WestNO_1"]["token"] == 1


def test_versions_endpoint(emu: Emulator, http: requests.Session) -> None:
    r = http.get(emu.url + "/metadata/versions", headers=H)
    assert r.status_code == 200
    versions = r.json()["apiVersions"]
    assert "2021-02-01" in versions and versions == sorted(versions)
    assert http.get(emu.url + "/metadata/versions").status_code == 400


def test_etag_and_if_none_match_when_enabled(http: requests.Session) -> None:
    with Emulator(rate_limit=None, etag=True) as emu:
        r = http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers=H)
        tag = r.headers["ETag"]
        r = http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers={**H, "If-None-Match": tag})
        assert (r.status_code, r.content) == (304, b"")
        emu.schedule(type="Reboot", start_after=600)
        r = http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers={**H, "If-None-Match": tag})
        assert r.status_code == 200 and r.headers["ETag"] != tag and r.json()["Events"]


def test_no_etag_by_default(emu: Emulator, http: requests.Session) -> None:
    r = http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers={**H, "If-None-Match": "*"})
    assert r.status_code == 200 and "ETag" not in r.headers


def test_stop_closes_keep_alive_connections(http: requests.Session) -> None:
    emu = Emulator(rate_limit=None).start()
    get_doc(http, emu.url)
    emu.stop()
    with pytest.raises(requests.ConnectionError):
        http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers=H, timeout=2)


# -- promises IMDS makes (issue 13) ---------------------------------------------------------------


def test_an_unapproved_event_starts_at_its_not_before_never_earlier(http: requests.Session) -> None:
    with Emulator(rate_limit=None) as emu:
        event_id = emu.schedule(type="Reboot", not_before="+1s", complete_after=600)
        (ev,) = get_doc(http, emu.url)["Events"]
        not_before = parsedate_to_datetime(ev["NotBefore"])
        assert wait_until(lambda: get_doc(http, emu.url)["Events"][0]["EventStatus"] == "Started", timeout=10)
        started = datetime.fromisoformat(emu.stats()["history"][-1]["time"])
        assert emu.stats()["history"][-1]["change"] == "started (not-before)" and started >= not_before
        # start_after is the shorthand for a NotBefore that close: the document shows when it will start.
        other = emu.schedule(type="Reboot", start_after=600)
        shown = next(e for e in get_doc(http, emu.url)["Events"] if e["EventId"] == other)["NotBefore"]
        assert 590 <= (parsedate_to_datetime(shown) - datetime.now(timezone.utc)).total_seconds() <= 601
        with pytest.raises(ValueError, match="not both"):
            emu.schedule(type="Reboot", not_before="+15m", start_after=4)
        with pytest.raises(ValueError, match="not both"):
            emu.update(other, not_before="+30m", start_after=4)
        assert event_id != other


def test_time_scale_shortens_not_before_itself(http: requests.Session) -> None:
    with Emulator(rate_limit=None, time_scale=0.01) as emu:  # 15 min notice -> 9 s, shown as such
        emu.schedule(type="Reboot")
        (ev,) = get_doc(http, emu.url)["Events"]
        notice = (parsedate_to_datetime(ev["NotBefore"]) - datetime.now(timezone.utc)).total_seconds()
        assert 7 <= notice <= 9


def test_incarnation_moves_only_for_changes_visible_at_the_requested_version(emu: Emulator,
                                                                              http: requests.Session) -> None:
    def incarnations() -> dict[str, int]:
        return {v: get_doc(http, emu.url, v)["DocumentIncarnation"] for v in ("2017-08-01", "2019-01-01", "2020-07-01")}

    before = incarnations()
    terminate = emu.schedule(type="Terminate", start_after=600)  # invisible before 2019-01-01
    after = incarnations()
    assert after == {"2017-08-01": before["2017-08-01"], "2019-01-01": before["2019-01-01"] + 1,
                     "2020-07-01": before["2020-07-01"] + 1}
    emu.update(terminate, duration=30)  # DurationInSeconds: visible from 2020-07-01 only
    assert incarnations() == {**after, "2020-07-01": after["2020-07-01"] + 1}
    before = incarnations()
    emu.schedule(type="Reboot", start_after=600)  # visible everywhere
    assert incarnations() == {v: i + 1 for v, i in before.items()}
    before = incarnations()
    emu.cancel(terminate)
    assert incarnations()["2017-08-01"] == before["2017-08-01"]
    assert incarnations()["2019-01-01"] == before["2019-01-01"] + 1


def _raw_exchange(sock: Any, request: bytes) -> bytes:
    """Send one request on a raw socket and read one answer (headers + Content-Length body)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _request(method: str, path: str, extra: str = "", body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    return (f"{method} {path} {version}\r\nHost: 169.254.169.254\r\nMetadata: true\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_connection_close_is_answered_and_honoured(emu: Emulator) -> None:
    """RFC 9112 9.6: the answer to a request with "Connection: close" says close, then the socket closes."""
    import socket

    path = SE + "?api-version=2020-07-01"
    for extra, version in (("Connection: close\r\n", "HTTP/1.1"), ("Connection: keep-alive, Close\r\n", "HTTP/1.1"),
                           ("", "HTTP/1.0")):
        with socket.create_connection(("127.0.0.1", emu.port), timeout=10) as sock:
            head = _raw_exchange(sock, _request("GET", path, extra, version=version))
            assert head.startswith(b"HTTP/1.1 200"), head
            assert re.search(rb"(?im)^connection: close\r?$", head), (extra, head)
            assert sock.recv(1) == b""  # closed by the server, not left for a keep-alive pool to reuse
    with socket.create_connection(("127.0.0.1", emu.port), timeout=10) as sock:
        head = _raw_exchange(sock, _request("GET", path))
        assert b"onnection: close" not in head  # a plain HTTP/1.1 request keeps its connection


def test_keep_alive_client_approves_on_a_reused_socket(emu: Emulator) -> None:
    """What Microsoft's Node sample does with Node's keep-alive agent: GET, then POST on the same socket."""
    import http.client

    event_id = emu.schedule(type="Reboot", start_after=600, complete_after=600)
    conn = http.client.HTTPConnection("127.0.0.1", emu.port, timeout=10)
    try:
        conn.request("GET", SE + "?api-version=2020-07-01", headers={"Metadata": "true", "If-None-Match": "0"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["Events"][0]["EventId"] == event_id
        sock = conn.sock
        assert sock is not None and not resp.will_close
        body = json.dumps({"StartRequests": [{"EventId": event_id}]})
        conn.request("POST", SE + "?api-version=2020-07-01", body=body,
                     headers={"Metadata": "true", "Content-Type": "application/json", "If-None-Match": "null"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and conn.sock is sock  # the same connection served the approval
    finally:
        conn.close()
    assert emu.stats()["events"][0]["EventStatus"] == "Started"


def test_token_endpoint_has_its_own_limits_20_per_second_and_5_concurrent(http: requests.Session) -> None:
    import threading

    url_params = {"api-version": "2018-02-01", "resource": "https://management.azure.com/"}
    with Emulator(rate_limit=5) as emu:
        url = emu.url + "/metadata/identity/oauth2/token"
        t0 = time.monotonic()
        codes = [http.get(url, params=url_params, headers=H).status_code for _ in range(24)]
        elapsed = time.monotonic() - t0
        assert codes[:20] == [200] * 20  # not the 5/s of Scheduled Events
        if elapsed < 1.0:
            assert 429 in codes[20:]
        # The Scheduled Events budget is separate: token requests did not use it up.
        assert http.get(emu.url + SE, params={"api-version": "2020-07-01"}, headers=H).status_code == 200
    with Emulator(rate_limit=None) as emu:
        url = emu.url + "/metadata/identity/oauth2/token"
        emu.inject_fault("slow", path="token", delay=30, count=5)  # five requests held in flight
        results: list[int | str] = []

        def held_request() -> None:
            try:
                results.append(requests.get(url, params=url_params, headers=H, timeout=60).status_code)
            except requests.ConnectionError as exc:  # what a held request gets when the emulator stops
                results.append(type(exc).__name__)

        held = [threading.Thread(target=held_request) for _ in range(5)]
        for t in held:
            t.start()
        try:
            assert wait_until(lambda: emu.stats()["tokens_in_flight"].get("myVM") == 5, timeout=20)
            r = http.get(url, params=url_params, headers=H, timeout=10)
            assert r.status_code == 429 and "concurrent" in r.json()["error"]
        finally:
            emu.stop()  # releases the held requests: their connections are closed, never answered
            for t in held:
                t.join(30)
        assert results == ["ConnectionError"] * 5  # not a 200 racing stop() cutting the connection
