"""The remote approver example (deploy/consumers/remote-approver): decisions, signing, the webhook
receiver, and end to end against the real agent's signed callback and the IMDS emulator."""
from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from forwarder.common.fleet_keys import as_secret
from tests.agent import callback_agent, closed_port, read_jsonl, wait_until, write_config
from tests.fleet import MASTER_SECRET, callback_secret, function_handlers, record, record_key, resource_id

import approver_client  # noqa: E402  (tests.fleet puts the app folder on sys.path)
import pipeline  # noqa: E402
from decide import Deduper, Policy, dedupe_key, should_approve, target_vm  # noqa: E402

# The leader WestNO_0's own callback secret, derived from the fleet master.
CALLBACK_SECRET = callback_secret("WestNO_0")
LEADER_ID = resource_id("WestNO_0")
WEBHOOK_SECRET = "whsec_" + "dGVzdC13ZWJob29rLXNlY3JldC0xMjM0NTY3OA=="
HAS_CALLBACK = importlib.util.find_spec("forwarder.approval.callback") is not None
HAS_FUNCTIONS = importlib.util.find_spec("azure.functions") is not None


# -- decide.py ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("rec", "expected"), [
    (record(source="User", etype="Reboot"), (True, "user_initiated")),
    (record(source="User", etype="Redeploy", duration=-1), (True, "user_initiated")),
    (record(duration=0), (True, "short_freeze")),
    (record(duration=8), (True, "short_freeze")),
    (record(duration=9), (False, "freeze_too_long")),
    (record(duration=-1), (False, "freeze_duration_unknown")),
    (record(duration=None), (False, "freeze_duration_unknown")),
    (record(etype="Reboot"), (False, "no_rule_matched")),
    (record(status="Started", source="User"), (False, "not_scheduled")),
    (record(rtype="scheduledevent.updated"), (True, "short_freeze")),
    (record(rtype="scheduledevent.started", status="Started"), (False, "not_a_scheduling_record")),
    (record(rtype="approval.approved"), (False, "not_a_scheduling_record")),
    (record(resources=[]), (False, "no_resources")),
])
def test_default_policy_is_the_seed_advanced_sample(rec, expected):
    assert should_approve(rec, Policy()) == expected


def test_policy_from_app_settings():
    policy = Policy.from_settings({"APPROVE_EVENT_TYPES": "Freeze, Reboot", "MAX_FREEZE_SECONDS": "30",
                                   "APPROVE_EVENT_SOURCES": ""})
    assert should_approve(record(duration=30), policy) == (True, "short_freeze")
    assert should_approve(record(source="User", etype="Reboot"), policy) == (False, "no_rule_matched")
    assert should_approve(record(source="User", etype="Redeploy"), Policy.from_settings(
        {"APPROVE_EVENT_TYPES": "Freeze,Reboot"})) == (False, "event_type_not_allowed")
    off = Policy.from_settings({"MAX_FREEZE_SECONDS": "off"})
    assert should_approve(record(duration=1), off) == (False, "no_rule_matched")
    assert should_approve(record(source="User", etype="Reboot"), off) == (True, "user_initiated")


def test_target_vm_is_the_leader_whoever_sent_the_record():
    names = [f"WestNO_{i}" for i in range(99, -1, -1)]
    assert target_vm(record(resources=names, seen_by="WestNO_57")) == "WestNO_0"
    assert target_vm(record(resources=["_vmB", "_VMa", "vmc"])) == "VMa"  # 2017-03-01 "_" prefix, any case
    assert target_vm(record(resources=["b", "_A"])) == "A"
    with pytest.raises(ValueError):
        target_vm(record(resources=[]))


def test_deduper_claims_once_releases_and_expires():
    now = [0.0]
    dedupe = Deduper(ttl=60, clock=lambda: now[0])
    assert dedupe.claim("EV-1:scheduled") and not dedupe.claim("EV-1:scheduled")
    dedupe.release("EV-1:scheduled")
    assert dedupe.claim("EV-1:scheduled")
    now[0] = 61
    assert dedupe.claim("EV-1:scheduled")
    vm = pipeline.VmIdentity.from_resource_id(resource_id("WestNO_0"))
    assert vm is not None  # the key: the authenticated VM + the signed EventId and change, never "eventkey"
    rec = {"type": "scheduledevent.scheduled", "eventkey": "OTHER:scheduled", "data": {"EventId": "X"}}
    assert dedupe_key(vm, rec) == resource_id("WestNO_0").lower() + "|x:scheduled"
    # Two different updates of one event are two changes; the same update twice is one.
    moved = {"type": "scheduledevent.updated", "data": {"EventId": "X", "NotBefore": "2026-11-27T10:00:00Z"}}
    later = {"type": "scheduledevent.updated", "data": {"EventId": "X", "NotBefore": "2026-11-27T11:00:00Z"}}
    assert dedupe_key(vm, moved) != dedupe_key(vm, later) and dedupe_key(vm, moved) == dedupe_key(vm, dict(moved))
    assert dedupe_key(vm, moved).startswith(resource_id("WestNO_0").lower() + "|x:updated:")


# -- approver_client.py against a callback of our own ---------------------------------------------

class FakeCallback:
    """A minimal /approvals endpoint: verifies with standardwebhooks, refuses replays, scriptable."""

    def __init__(self, secret: str = CALLBACK_SECRET, tls: Any = None) -> None:
        self.secret = secret
        self.requests: list[dict[str, Any]] = []
        self.script: list[int | str] = []  # answers consumed first: a status, or "drop"
        self.seen: set[str] = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append({"path": self.path, "headers": headers, "body": body})
                step = fake.script.pop(0) if fake.script else None
                if step == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(step, int):
                    return self._answer(step, {"status": "error", "reason": "scripted"})
                try:
                    Webhook(fake.secret).verify(body, headers, json_parse=False)
                except Exception:
                    return self._answer(401, {"status": "refused", "reason": "bad_signature"})
                if headers["webhook-id"] in fake.seen:
                    return self._answer(409, {"status": "refused", "reason": "replayed_id"})
                fake.seen.add(headers["webhook-id"])
                ids = [r["EventId"] for r in json.loads(body)["StartRequests"]]
                if any(i.startswith("UNKNOWN") for i in ids):
                    return self._answer(422, {"status": "refused", "reason": "unknown_event",
                                              "refused": {i: "unknown_event" for i in ids}})
                self._answer(200, {"status": "approved", "reason": "approved", "approved": ids})

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/approvals"
        if tls is not None:  # a trustme certificate for "localhost"
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
            self.url = f"https://localhost:{self.port}/approvals"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeCallback()
    yield server
    server.close()


NO_WAIT = {"sleep": lambda seconds: None}


def test_approve_sends_a_signed_body_the_independent_package_accepts(fake):
    answer = approver_client.approve(fake.url, CALLBACK_SECRET, ["EV-1", "EV-2"], "ops-func", "short_freeze",
                                     resource_id=LEADER_ID)
    assert answer["ok"] and answer["http_status"] == 200 and answer["approved"] == ["EV-1", "EV-2"]
    (req,) = fake.requests
    assert json.loads(req["body"]) == {"StartRequests": [{"EventId": "EV-1"}, {"EventId": "EV-2"}],
                                       "approver": "ops-func", "reason": "short_freeze", "ResourceId": LEADER_ID}
    assert req["headers"]["webhook-id"].startswith("msg_")
    assert abs(int(req["headers"]["webhook-timestamp"]) - datetime.now(timezone.utc).timestamp()) < 60


def test_approve_retries_5xx_and_dropped_connections_with_a_new_id_each_time(fake):
    fake.script = [503, "drop"]
    answer = approver_client.approve(fake.url, CALLBACK_SECRET, ["EV-1"], "a", "r", resource_id=LEADER_ID, **NO_WAIT)
    assert answer["ok"] and answer["attempts"] == 3
    assert len(fake.requests) == 3
    assert len({r["headers"]["webhook-id"] for r in fake.requests}) == 3
    assert len({r["body"] for r in fake.requests}) == 1  # serialized once, signed per attempt


@pytest.mark.parametrize(("event_id", "secret", "status", "reason"), [
    ("UNKNOWN-1", CALLBACK_SECRET, 422, "unknown_event"),
    ("EV-1", "whsec_" + "b3RoZXItc2VjcmV0LW9mLTMyLWJ5dGVzLWxvbmchIQ==", 401, "bad_signature"),
])
def test_refusals_are_final_and_not_retried(fake, event_id, secret, status, reason):
    answer = approver_client.approve(fake.url, secret, [event_id], "a", "r", resource_id=LEADER_ID, **NO_WAIT)
    assert (answer["ok"], answer["final"], answer["http_status"], answer["reason"]) == (False, True, status, reason)
    assert len(fake.requests) == 1


def test_a_reused_id_would_be_refused_as_replay(fake):
    """Why each attempt gets a new webhook-id: the same signed request twice is a 409."""
    fake.script = [409]
    answer = approver_client.approve(fake.url, CALLBACK_SECRET, ["EV-1"], "a", "r", resource_id=LEADER_ID, **NO_WAIT)
    assert answer["http_status"] == 409 and answer["final"] and len(fake.requests) == 1


def test_tls_is_verified_against_the_system_store_or_a_ca_bundle(tmp_path):
    trustme = pytest.importorskip("trustme")
    import ssl

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    server = FakeCallback(tls=context)
    try:
        untrusted = approver_client.approve(server.url, CALLBACK_SECRET, ["EV-1"], "a", "r", resource_id=LEADER_ID,
                                             attempts=1)
        assert (untrusted["ok"], untrusted["final"], untrusted["http_status"]) == (False, False, None)
        assert "SSLError" in untrusted["detail"]
        bundle = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(bundle))
        settings = pipeline.Settings.from_env({"CALLBACK_URL_TEMPLATE": server.url, "CALLBACK_CA_BUNDLE": str(bundle),
                                               "SEFWD_MASTER_SECRET": MASTER_SECRET})
        trusted = approver_client.approve(server.url, CALLBACK_SECRET, ["EV-1"], "a", "r", resource_id=LEADER_ID,
                                           verify=settings.verify)
        assert trusted["ok"] and len(server.requests) == 1
    finally:
        server.close()


def test_unreachable_callback_is_not_final():
    url = f"http://127.0.0.1:{closed_port()}/approvals"
    answer = approver_client.approve(url, CALLBACK_SECRET, ["EV-1"], "a", "r", resource_id=LEADER_ID, timeout=2,
                                     attempts=2, **NO_WAIT)
    assert (answer["ok"], answer["final"], answer["http_status"], answer["attempts"]) == (False, False, None, 2)


# -- pipeline.py: settings, one decision per eventkey, leader targeting, webhook receiver ---------

def settings_env(port: int, seen: Path, **extra: str) -> dict[str, str]:
    env = {"CALLBACK_URL_TEMPLATE": f"http://127.0.0.1:{port}/vm/{{vm_name}}/approvals",
           "SEFWD_MASTER_SECRET": MASTER_SECRET, "SEFWD_WEBHOOK_SECRET": WEBHOOK_SECRET,
           "SEEN_RECORDS_PATH": str(seen / "seen-records.db"),
           "APPROVER_NAME": "contoso-approver", "CALLBACK_ATTEMPTS": "2"}
    env.update(extra)
    return env


def test_settings_list_every_problem_and_format_urls():
    with pytest.raises(ValueError) as info:
        pipeline.Settings.from_env({"SEFWD_CALLBACK_SECRET": CALLBACK_SECRET, "SEFWD_MASTER_SECRET": "nope",
                                    "APPROVE_EVENT_TYPES": "Freeze,Nap", "CALLBACK_URLS": "[1]"})
    text = str(info.value)
    for name in ("CALLBACK_URLS", "CALLBACK_URL_TEMPLATE", "SEFWD_CALLBACK_SECRET", "SEFWD_MASTER_SECRET",
                 "APPROVE_EVENT_TYPES"):
        assert name in text
    s = pipeline.Settings.from_env({"CALLBACK_URL_TEMPLATE": "https://{vm_dns}.contoso.internal:8787/approvals",
                                    "CALLBACK_URLS": '{"_Odd_VM": "https://10.0.0.9:8787/approvals"}',
                                    "SEFWD_MASTER_SECRET": MASTER_SECRET})
    assert s.callback_url(pipeline.VmIdentity.from_resource_id(resource_id("WestNO_0"))) == \
        "https://westno-0.contoso.internal:8787/approvals"
    assert s.callback_url(pipeline.VmIdentity.from_resource_id(resource_id("odd_vm"))) == "https://10.0.0.9:8787/approvals"
    assert s.verify is True and s.approver_name == "remote-approver"
    # Each VM's callback secret is its own, derived from the one master.
    vm0 = pipeline.VmIdentity.from_resource_id(resource_id("WestNO_0"))
    vm1 = pipeline.VmIdentity.from_resource_id(resource_id("WestNO_1"))
    assert s.callback_secret(vm0) == CALLBACK_SECRET != s.callback_secret(vm1) == callback_secret("WestNO_1")


def test_a_set_wide_event_seen_by_100_vms_is_approved_once_on_the_leader(tmp_path):
    server = FakeCallback(callback_secret("vm000"))
    try:
        approver = pipeline.RemoteApprover(pipeline.Settings.from_env(settings_env(server.port, tmp_path)))
        names = [f"vm{i:03d}" for i in range(100)]
        copies = [record(resources=names[::-1], seen_by=name) for name in names[::-1]]
        outcomes = approver.handle_many(copies + [record(resources=names, seen_by="vm000")])
        # Only the leader's own record leads to an approval, on the leader; its second record is a duplicate.
        assert [o["decision"] for o in outcomes].count("approved") == 1
        assert [o["reason"] for o in outcomes].count("not_the_leader") == 99
        assert outcomes[-1]["decision"] == "duplicate"
        (req,) = server.requests
        assert req["path"] == "/vm/vm000/approvals"
        assert json.loads(req["body"])["approver"] == "contoso-approver"
        assert json.loads(req["body"])["ResourceId"] == resource_id("vm000")
    finally:
        server.close()


def test_a_transient_failure_lets_a_redelivery_try_again(fake, tmp_path):
    approver = pipeline.RemoteApprover(pipeline.Settings.from_env(settings_env(fake.port, tmp_path)))
    fake.script = [503, 503]  # both attempts of the first delivery fail
    rec = record(seen_by="WestNO_0")
    first, second = approver.handle_many([rec, dict(rec)])
    assert (first["decision"], first["http_status"]) == ("failed", 503)
    assert (second["decision"], second["target"]) == ("approved", "WestNO_0")
    assert len(fake.requests) == 3


def signed(body: bytes, secret: str = WEBHOOK_SECRET, content_type: str = "application/cloudevents+json") -> dict[str, str]:
    msg_id = "msg_" + uuid.uuid4().hex
    now = datetime.fromtimestamp(int(datetime.now(timezone.utc).timestamp()), tz=timezone.utc)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(msg_id, now, body.decode()),
            "Content-Type": content_type + "; charset=utf-8"}


def test_webhook_receiver_verifies_signatures_and_reads_single_and_batch(fake, tmp_path):
    approver = pipeline.RemoteApprover(pipeline.Settings.from_env(
        settings_env(fake.port, tmp_path, SEFWD_WEBHOOK_SECRET="whsec_" + "b2xkLXNlY3JldC1iZWluZy1yb3RhdGVkLW91dCEh " + WEBHOOK_SECRET)))
    single = json.dumps(record(event_id="EV-A")).encode()
    batch = json.dumps([record(event_id="EV-B"), record(etype="Reboot", event_id="EV-C")]).encode()
    forged = "whsec_" + "YXR0YWNrZXItZG9lcy1ub3Qta25vdy10aGUta2V5IQ=="
    bad = signed(single, forged)
    assert pipeline.handle_webhook(approver, single, bad)[0] == 401
    tampered = signed(single)
    assert pipeline.handle_webhook(approver, single.replace(b"EV-A", b"EV-Z"), tampered)[0] == 401
    assert pipeline.handle_webhook(approver, single, {"Content-Type": "application/cloudevents+json"})[0] == 401
    assert fake.requests == []
    assert pipeline.handle_webhook(approver, single, signed(single, content_type="text/plain"))[0] == 415
    assert pipeline.handle_webhook(approver, b"[1", signed(b"[1", content_type="application/cloudevents-batch+json"))[0] == 400
    status, answer = pipeline.handle_webhook(approver, single, signed(single))
    assert status == 200 and answer["outcomes"][0]["decision"] == "approved"
    status, answer = pipeline.handle_webhook(approver, batch, signed(batch, content_type="application/cloudevents-batch+json"))
    assert status == 200 and [o["decision"] for o in answer["outcomes"]] == ["approved", "skip"]
    assert [json.loads(r["body"])["StartRequests"] for r in fake.requests] == [[{"EventId": "EV-A"}], [{"EventId": "EV-B"}]]


# -- end to end: the real agent's callback and the IMDS emulator ----------------------------------

CALLBACK_SKIP = pytest.mark.skipif(
    not HAS_CALLBACK, reason="forwarder/approval/callback.py (the agent's signed callback server) is not there yet")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Emulator with two VMs; the real agent for the leader WestNO_0 with its callback on."""
    from forwarder.emulator import Emulator

    tmp = tmp_path_factory.mktemp("remote-approver")
    with Emulator(vms=["WestNO_0", "WestNO_1"], rate_limit=None) as emu:
        extra = ('[approval]\nscope = "self_or_leader"\n'
                 '[approval.callback]\nlisten = "127.0.0.1:0"\nsecret_env = "SEFWD_CALLBACK_SECRET"\n')
        config = write_config(tmp / "sefwd.toml", emu.vm_url("WestNO_0"), tmp / "state", extra=extra)
        # The VM's own keys only, derived from the fleet master (`sefwd keys derive`): records get sefwdauth.
        env = {"SEFWD_CALLBACK_SECRET": CALLBACK_SECRET, "SEFWD_AGENT_RECORD_KEY_ENV": "SEFWD_RECORD_KEY",
               "SEFWD_RECORD_KEY": as_secret(record_key("WestNO_0"))}
        with callback_agent(config, tmp / "agent.log", env) as (agent, url):
            yield {"emu": emu, "agent": agent, "out": tmp / "out.jsonl", "url": url}


def _scheduled_record(out: Path, event_id: str) -> dict[str, Any]:
    return wait_until(lambda: next((r for r in read_jsonl(out) if r["type"] == "scheduledevent.scheduled"
                                    and r["data"]["EventId"] == event_id), None), 20, f"the scheduled record of {event_id}")


def _status(emu: Any, event_id: str) -> str | None:
    return next((e["EventStatus"] for e in emu.document()["Events"] if e["EventId"] == event_id), None)


@CALLBACK_SKIP
def test_decide_and_sign_against_the_real_callback(live):
    emu, out = live["emu"], live["out"]
    event_id = emu.schedule(type="Freeze", duration=5, resources=["WestNO_1", "WestNO_0"],
                            start_after=600, complete_after=600)
    rec = _scheduled_record(out, event_id)
    assert should_approve(rec, Policy()) == (True, "short_freeze")
    assert target_vm(rec) == "WestNO_0"
    before = len(emu.stats()["start_requests"])
    forged = "whsec_" + "YXR0YWNrZXItZG9lcy1ub3Qta25vdy10aGUta2V5IQ=="
    refused = approver_client.approve(live["url"], forged, [event_id], "mallory", "short_freeze",
                                      resource_id=LEADER_ID, **NO_WAIT)
    assert (refused["http_status"], refused["final"], refused["attempts"]) == (401, True, 1), refused
    assert len(emu.stats()["start_requests"]) == before and _status(emu, event_id) == "Scheduled"
    answer = approver_client.approve(live["url"], CALLBACK_SECRET, [event_id], "contoso-approver", "short_freeze",
                                     resource_id=LEADER_ID)
    assert answer["ok"] and answer["reason"] == "approved" and answer["approved"] == [event_id], answer
    posts = emu.stats()["start_requests"][before:]
    assert [(p["vm"], p["event_ids"]) for p in posts] == [("WestNO_0", [event_id])]
    assert _status(emu, event_id) == "Started"
    again = approver_client.approve(live["url"], CALLBACK_SECRET, [event_id], "contoso-approver", "retry", resource_id=LEADER_ID)
    assert again["ok"] and again["reason"] == "already_approved", again
    assert len(emu.stats()["start_requests"]) == before + 1
    audit = wait_until(lambda: [r for r in read_jsonl(out) if r["type"] == "approval.approved"
                                and r["data"].get("EventId") == event_id], 20, "the approval.approved record")
    assert audit[0]["data"]["Actor"] == "callback" and audit[0]["data"]["Approver"] == "contoso-approver"


@CALLBACK_SKIP
@pytest.mark.skipif(not HAS_FUNCTIONS, reason="azure-functions is not installed")
def test_function_app_http_trigger_against_the_real_callback(live, monkeypatch, tmp_path):
    import azure.functions as func
    import function_app

    emu, out = live["emu"], live["out"]
    for name, value in settings_env(0, tmp_path, CALLBACK_URL_TEMPLATE=live["url"]).items():
        monkeypatch.setenv(name, value)
    function_app.get_approver.cache_clear()
    handler = function_handlers()["sefwd_webhook"]

    def call(body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        req = func.HttpRequest("POST", "https://approver.example/api/sefwd", headers=headers, body=body)
        resp = handler(req)
        return resp.status_code, json.loads(resp.get_body())

    user = emu.schedule(type="Reboot", source="User", resources=["WestNO_0", "WestNO_1"], start_after=600, complete_after=600)
    platform = emu.schedule(type="Reboot", source="Platform", resources=["WestNO_0"], start_after=600, complete_after=600)
    body = json.dumps([_scheduled_record(out, user), _scheduled_record(out, platform)]).encode()
    before = len(emu.stats()["start_requests"])
    forged = "whsec_" + "YXR0YWNrZXItZG9lcy1ub3Qta25vdy10aGUta2V5IQ=="
    assert call(body, signed(body, forged, "application/cloudevents-batch+json"))[0] == 401
    assert len(emu.stats()["start_requests"]) == before
    status, answer = call(body, signed(body, content_type="application/cloudevents-batch+json"))
    assert status == 200, answer
    assert [(o["decision"], o["reason"]) for o in answer["outcomes"]] == [("approved", "user_initiated"),
                                                                          ("skip", "no_rule_matched")]
    posts = emu.stats()["start_requests"][before:]
    assert [p["event_ids"] for p in posts] == [[user]]
    assert _status(emu, user) == "Started" and _status(emu, platform) == "Scheduled"
    # The same record again (a redelivery, or a replay by a reader of the stream): acted on once, nothing posted.
    status, answer = call(body, signed(body, content_type="application/cloudevents-batch+json"))
    assert status == 200 and answer["outcomes"][0]["decision"] == "replayed"
    assert len(emu.stats()["start_requests"]) == before + 1
    function_app.get_approver.cache_clear()
