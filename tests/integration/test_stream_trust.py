"""Issue 21 item 1, "a VM speaks only for itself in the stream": each test reproduces one weakness
the security review found, against the real agent, the IMDS emulator and the real Function code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from standardwebhooks.webhooks import Webhook

from forwarder.common.fleet_keys import as_secret
from forwarder.common.record_auth import ATTRIBUTE
from forwarder.common.signing import generate_secret, parse_secret
from forwarder.emulator import Emulator
from forwarder.imds.differ import diff
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity as AgentVm
from forwarder.records import RecordFactory
from tests.agent import callback_agent, read_jsonl, wait_until, write_config
from tests.fleet import MASTER, MASTER_SECRET, callback_secret, function_handlers, record, record_key, resource_id

import approver_client  # noqa: E402  (tests.fleet puts the app folder on sys.path)
import pipeline  # noqa: E402
import streamauth  # noqa: E402
from decide import VmIdentity, authenticated_vm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WEBHOOK_SECRET = generate_secret()


class Recorder:
    """A real HTTP server that records every request and answers like a callback that approved."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                rec.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                     "body": body})
                ids = [r["EventId"] for r in json.loads(body).get("StartRequests", [])]
                raw = json.dumps({"status": "approved", "reason": "approved", "approved": ids}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    server = Recorder()
    yield server
    server.close()


def settings(template: str, tmp: Path, **extra: str) -> pipeline.Settings:
    env = {"CALLBACK_URL_TEMPLATE": template, "SEFWD_MASTER_SECRET": MASTER_SECRET,
           "SEFWD_WEBHOOK_SECRET": WEBHOOK_SECRET, "SEEN_RECORDS_PATH": str(tmp / "seen-records.db"),
           "CALLBACK_ATTEMPTS": "1", "CALLBACK_TIMEOUT_SECONDS": "5"}
    env.update(extra)
    return pipeline.Settings.from_env(env)


# -- the authenticator: the agent signs, the reference verifier checks ----------------------------

def test_every_record_the_agent_makes_verifies_and_any_change_or_other_key_breaks_it():
    vm = AgentVm(vm_id="1", name="WestNO_0", computer_name="WestNO_0", resource_id=resource_id("WestNO_0"))
    factory = RecordFactory(vm, "2020-07-01", key=record_key("WestNO_0"))
    doc = parse_document(json.dumps({"DocumentIncarnation": 2, "Events": [{
        "EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["WestNO_0"],
        "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", "Description": "Hôte — ✓",
        "EventSource": "Platform", "DurationInSeconds": -1}]}).encode())
    made = [*factory.for_changes(diff(None, doc, datetime.now(timezone.utc)), doc),
            factory.approval({"Outcome": "approved", "EventId": "E1", "Actor": "policy"}),
            factory.lifecycle("heartbeat", {"Uptime": 1.5})]
    for rec in made:
        parsed = json.loads(rec.body)  # what a consumer gets: the bytes the sinks send
        assert parsed[ATTRIBUTE].startswith("v1,")
        assert streamauth.verify(parsed, [MASTER]) and authenticated_vm(parsed, [MASTER]) == \
            VmIdentity.from_resource_id(resource_id("WestNO_0"))
        assert not streamauth.verify(parsed, [parse_secret(generate_secret())]), "another fleet's master"
    forged = json.loads(made[0].body)
    forged["data"]["EventSource"] = "User"
    assert not streamauth.verify(forged, [MASTER])
    # Unsigned: an agent without [agent] record_key_* (or an old one): untrusted, never acted on.
    assert ATTRIBUTE not in json.loads(RecordFactory(vm, "2020-07-01").lifecycle("heartbeat", {}).body)


def test_sefwd_keys_derive_gives_each_vm_only_its_own_keys(tmp_path):
    master_file = tmp_path / "master.secret"
    master_file.write_text(MASTER_SECRET + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}

    def sefwd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "forwarder", "keys", *args], capture_output=True, text=True,
                              env={**env, "PYTHONPATH": str(ROOT), "FLEET_MASTER": MASTER_SECRET}, timeout=60)

    vm0 = resource_id("WestNO_0")
    out = sefwd("derive", "--master-file", str(master_file), "--resource-id", vm0.upper())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == as_secret(record_key("WestNO_0")) != as_secret(record_key("WestNO_1"))
    both = json.loads(sefwd("derive", "--master-env", "FLEET_MASTER", "--resource-id", vm0, "--json").stdout)
    assert both["callback_secret"] == callback_secret("WestNO_0") == streamauth.callback_secret(MASTER, vm0)
    assert MASTER_SECRET not in out.stdout + json.dumps(both)
    bad = sefwd("derive", "--master-file", str(tmp_path / "none"), "--resource-id", vm0)
    assert bad.returncode == 2 and "cannot read" in bad.stderr
    new = sefwd("new-master")
    assert new.returncode == 0 and len(parse_secret(new.stdout.strip())) == 32


# -- the remote approver against the real agent (WestNO_0) and the emulator ------------------------

@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """WestNO_0 runs the real agent with its own keys and the callback on; WestNO_1 is the attacker's
    VM: its root holds WestNO_1's keys (and the fleet's shared webhook/Event Hubs sender rights)."""
    tmp = tmp_path_factory.mktemp("stream-trust")
    with Emulator(vms=["WestNO_0", "WestNO_1"], rate_limit=None) as emu:
        extra = ('[approval.callback]\nlisten = "127.0.0.1:0"\nsecret_env = "SEFWD_CALLBACK_SECRET"\n'
                 'rate_limit = 600\n')
        config = write_config(tmp / "sefwd.toml", emu.vm_url("WestNO_0"), tmp / "state", extra=extra)
        key_file = tmp / "record.key"  # as the VM extension writes it from protectedSettings
        key_file.write_text(as_secret(record_key("WestNO_0")))
        env = {"SEFWD_CALLBACK_SECRET": callback_secret("WestNO_0"), "SEFWD_AGENT_RECORD_KEY_FILE": str(key_file)}
        with callback_agent(config, tmp / "agent.log", env) as (agent, url):
            yield {"emu": emu, "out": tmp / "out.jsonl", "url": url, "agent": agent}


def _own_record(out: Path, event_id: str) -> dict[str, Any]:
    return wait_until(lambda: next((r for r in read_jsonl(out) if r["type"] == "scheduledevent.scheduled"
                                    and r["data"]["EventId"] == event_id), None), 30, f"the record of {event_id}")


def _status(emu: Any, event_id: str) -> str | None:
    return next((e["EventStatus"] for e in emu.document()["Events"] if e["EventId"] == event_id), None)


def _webhook(approver: pipeline.RemoteApprover, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Through the Function's HTTP receiver, signed with the fleet's (shared) webhook secret."""
    body = json.dumps(records).encode()
    msg_id = "msg_" + uuid.uuid4().hex
    now = datetime.fromtimestamp(int(datetime.now(timezone.utc).timestamp()), tz=timezone.utc)
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": Webhook(WEBHOOK_SECRET).sign(msg_id, now, body.decode()),
               "Content-Type": "application/cloudevents-batch+json"}
    status, answer = pipeline.handle_webhook(approver, body, headers)
    assert status == 200, answer
    return answer["outcomes"]


def test_a_vm_cannot_get_another_vms_platform_reboot_approved(fleet, tmp_path):
    """The review's reproduction: WestNO_1 forges WestNO_0's record of a Platform reboot as User."""
    emu = fleet["emu"]
    approver = pipeline.RemoteApprover(settings(fleet["url"], tmp_path))
    event = emu.schedule(type="Reboot", source="Platform", resources=["WestNO_0"], start_after=600, complete_after=600)
    real = _own_record(fleet["out"], event)
    assert streamauth.verify(real, [MASTER])  # the agent signs with its own key
    before = len(emu.stats()["start_requests"])

    def forge(signer: str, claim: str | None) -> dict[str, Any]:
        rec = record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_1", event_id=event,
                     signer=signer, claim=claim)
        return rec

    outcomes = _webhook(approver, [
        forge("WestNO_1", "WestNO_0"),       # B's key, A's identity
        forge("", "WestNO_0"),               # no authenticator at all
        {**real, "data": {**real["data"], "EventSource": "User"}},  # A's real record, one field changed
        forge("WestNO_1", None),             # B speaks for itself, about A's event
    ])
    assert [(o["decision"], o["reason"]) for o in outcomes] == [
        ("untrusted", "unauthenticated"), ("untrusted", "unauthenticated"), ("untrusted", "unauthenticated"),
        ("skip", "not_this_vm")]
    assert approver.untrusted == 3
    assert len(emu.stats()["start_requests"]) == before and _status(emu, event) == "Scheduled"
    # The control: the same approver approves WestNO_0's own, unaltered record of a user reboot.
    user = emu.schedule(type="Reboot", source="User", resources=["WestNO_0"], start_after=600, complete_after=600)
    (ok,) = _webhook(approver, [_own_record(fleet["out"], user)])
    assert (ok["decision"], ok["reason"], ok["target"]) == ("approved", "user_initiated", "WestNO_0"), ok
    assert [p["event_ids"] for p in emu.stats()["start_requests"][before:]] == [[user]]


def test_a_resources_name_never_steers_the_approval_to_an_attacker(recorder, tmp_path):
    """`attacker.host/#` in Resources went into the URL template; now the target is the VM that
    authenticated the record, and every template component is percent-escaped."""
    legit = Recorder()
    try:
        approver = pipeline.RemoteApprover(settings("http://{vm_name}/approvals", tmp_path, CALLBACK_URLS=json.dumps(
            {resource_id("WestNO_1"): f"http://127.0.0.1:{legit.port}/approvals"})))
        evil = f"127.0.0.1:{recorder.port}/#"
        outcomes = approver.handle_many([
            # The injected name sorts first: it would be the leader; WestNO_1 is not, so nothing is sent.
            record("Reboot", "User", -1, resources=[evil, "WestNO_1"], seen_by="WestNO_1", event_id="EV-A"),
            # WestNO_1 sorts first: the approval goes to WestNO_1's registered URL, whatever else is listed.
            record("Reboot", "User", -1, resources=["WestNO_1", f"zz{evil}"], seen_by="WestNO_1", event_id="EV-B"),
        ])
        assert [(o["decision"], o["reason"]) for o in outcomes] == [("skip", "not_the_leader"),
                                                                   ("approved", "user_initiated")]
        (sent,) = legit.requests
        assert json.loads(sent["body"])["ResourceId"] == resource_id("WestNO_1")
    finally:
        legit.close()
    assert recorder.requests == []
    # A name from an authenticated identity is escaped too: it stays one host label (which does not resolve).
    odd = pipeline.VmIdentity("/subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/virtualMachines/x",
                              evil, "s", "r")
    url = settings("http://{vm_name}/approvals/{vm_lower}", tmp_path).callback_url(odd)
    assert url == f"http://127.0.0.1%3A{recorder.port}%2F%23/approvals/127.0.0.1%3A{recorder.port}%2F%23"


def test_an_approval_captured_for_one_vm_is_refused_by_another(fleet, recorder):
    """The approver signs each approval with the target VM's own derived secret and names the VM:
    the request captured at WestNO_1's address is worthless at WestNO_0's callback."""
    emu = fleet["emu"]
    event = emu.schedule(type="Freeze", duration=5, resources=["WestNO_0", "WestNO_1"], start_after=600,
                         complete_after=600)
    _own_record(fleet["out"], event)
    url = f"http://127.0.0.1:{recorder.port}/approvals"
    answer = approver_client.approve(url, callback_secret("WestNO_1"), [event], "approver", "short_freeze",
                                     resource_id=resource_id("WestNO_1"), attempts=1)
    assert answer["ok"]
    (captured,) = recorder.requests
    before = len(emu.stats()["start_requests"])
    replay = requests.post(fleet["url"], data=captured["body"], timeout=10, headers={
        k: v for k, v in captured["headers"].items() if k.startswith("webhook-") or k == "content-type"})
    assert (replay.status_code, replay.json()["reason"]) == (401, "bad_signature"), replay.text
    assert len(emu.stats()["start_requests"]) == before and _status(emu, event) == "Scheduled"
    wait_until(lambda: any(r["type"] == "approval.refused" and r["data"]["Reason"] == "bad_signature"
                           for r in read_jsonl(fleet["out"])), 30, "the refusal audited")


def test_a_replayed_record_is_acted_on_once_across_restarts(recorder, tmp_path):
    """A reader of the stream re-sends a captured record after the Function restarted: the durable
    id cache (SEEN_RECORDS_PATH) answers "replayed"; only fresh records are acted on at all."""
    template = f"http://127.0.0.1:{recorder.port}/{{vm_name}}/approvals"
    rec = record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0")
    first = pipeline.RemoteApprover(settings(template, tmp_path))
    assert first.handle(rec)["decision"] == "approved"
    first.seen.close()
    restarted = pipeline.RemoteApprover(settings(template, tmp_path))  # a new process: empty in-memory de-duplication
    assert restarted.handle(json.loads(json.dumps(rec)))["decision"] == "replayed"
    old = (datetime.now(timezone.utc) - timedelta(hours=2)).isoformat().replace("+00:00", "Z")
    stale = record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0", event_id="EV-2", time=old)
    assert (restarted.handle(stale)["decision"], restarted.handle(stale)["reason"]) == ("skip", "stale_record")
    assert [r["path"] for r in recorder.requests] == ["/WestNO_0/approvals"]


# A process holding a claim in the replay cache: it claims the key, says so, and holds it until its
# stdin closes or it is killed; it never settles (as a process killed between claiming and sending).
_CLAIMER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from seen_records import SeenRecords
assert SeenRecords(Path(sys.argv[2]), retention=9000).claim(sys.argv[3])
print("claimed", flush=True)
sys.stdin.read()
"""


def _claimer(tmp_path: Path, key: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _CLAIMER, str(Path(pipeline.__file__).parent),
                             str(tmp_path / "seen-records.db"), key],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    return proc


def test_an_approval_cut_short_by_a_kill_is_sent_by_the_next_copy_of_the_record(recorder, tmp_path):
    """The consumer claims a record in its replay cache, then is killed before the approval went out:
    the redelivered record must be acted on (the claim's owner is gone), not answered "replayed"
    for an approval that was never sent; once acted on, it is a replay again, also after a restart."""
    template = f"http://127.0.0.1:{recorder.port}/{{vm_name}}/approvals"
    rec = record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0")
    killed = _claimer(tmp_path, f"{resource_id('WestNO_0').lower()}|{rec['id']}")
    killed.kill()
    killed.wait(30)
    assert recorder.requests == []
    restarted = pipeline.RemoteApprover(settings(template, tmp_path))
    assert restarted.handle(rec)["decision"] == "approved"
    assert [r["path"] for r in recorder.requests] == ["/WestNO_0/approvals"]
    assert restarted.handle(json.loads(json.dumps(rec)))["decision"] == "replayed"
    restarted.seen.close()
    again = pipeline.RemoteApprover(settings(template, tmp_path))
    assert again.handle(json.loads(json.dumps(rec)))["decision"] == "replayed"
    assert len(recorder.requests) == 1


def test_a_claim_held_by_a_live_process_is_a_replay_until_that_process_is_gone(recorder, tmp_path):
    """Two consumers sharing the cache: while one is sending (its claim pending, its process alive)
    the other's copy answers "replayed"; if the first dies without an answer, the next copy acts."""
    template = f"http://127.0.0.1:{recorder.port}/{{vm_name}}/approvals"
    rec = record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0")
    holder = _claimer(tmp_path, f"{resource_id('WestNO_0').lower()}|{rec['id']}")
    other = pipeline.RemoteApprover(settings(template, tmp_path))
    try:
        assert other.handle(rec)["decision"] == "replayed"
        assert recorder.requests == []
    finally:
        assert holder.stdin is not None
        holder.stdin.close()  # the holder exits without settling
        holder.wait(30)
    assert other.handle(json.loads(json.dumps(rec)))["decision"] == "approved"
    assert len(recorder.requests) == 1


def test_a_replay_cache_from_before_pending_claims_keeps_its_keys_as_acted_on(tmp_path):
    import sqlite3

    from seen_records import SeenRecords

    path = tmp_path / "seen-records.db"
    with sqlite3.connect(path) as db:  # the file as the previous version wrote it
        db.execute("CREATE TABLE seen (key TEXT PRIMARY KEY, at REAL NOT NULL)")
        db.execute("INSERT INTO seen VALUES ('vm|old-record', ?)", (datetime.now(timezone.utc).timestamp(),))
    seen = SeenRecords(path, retention=9000)
    assert not seen.claim("vm|old-record")
    assert seen.claim("vm|new-record") and not seen.claim("vm|new-record")
    seen.close()


def test_a_damaged_owner_in_the_replay_cache_is_taken_over_not_trusted_or_raised(tmp_path):
    """Owner values no live process on this host can have (a damaged or hand-edited file): the claim is
    taken over; a value that names no host of ours is waited out for the lease, then taken over."""
    import socket
    import sqlite3

    from seen_records import SeenRecords

    path = tmp_path / "seen-records.db"
    seen = SeenRecords(path, retention=9000, clock=lambda: 1000.0, lease=600)
    host = socket.gethostname()
    owners = {"huge": f"{host}|{10**30}|1", "zero": f"{host}|0|1", "text": f"{host}|abc|", "empty": "",
              "pipes": "||||", "elsewhere": "another-host|1|1"}
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO seen (key, at, owner) VALUES (?, ?, ?)",
                       [(f"vm|{name}", 900.0, owner) for name, owner in owners.items()])
    taken = {name: seen.claim(f"vm|{name}") for name in owners}
    assert taken == {"huge": True, "zero": True, "text": False, "empty": False, "pipes": False, "elsewhere": False}
    later = SeenRecords(path, retention=9000, clock=lambda: 1000.0 + 600, lease=600)
    assert [later.claim(f"vm|{name}") for name in ("text", "empty", "pipes", "elsewhere")] == [True] * 4
    seen.close()
    later.close()


def test_the_event_hubs_trigger_acts_only_on_authenticated_records(recorder, tmp_path, monkeypatch):
    """The Function's own Event Hubs binding (function_app.sefwd_eventhub) with bodies as the hub
    delivers them: a sender with Data Sender rights but without WestNO_0's key gets nothing sent."""
    func = pytest.importorskip("azure.functions")
    import function_app

    env = {"CALLBACK_URL_TEMPLATE": f"http://127.0.0.1:{recorder.port}/{{vm_name}}/approvals",
           "SEFWD_MASTER_SECRET": MASTER_SECRET, "SEEN_RECORDS_PATH": str(tmp_path / "seen.db"), "CALLBACK_ATTEMPTS": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    function_app.get_approver.cache_clear()
    try:
        handler = function_handlers()["sefwd_eventhub"]
        forged = [record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_1", claim="WestNO_0"),
                  record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0", signer="")]
        handler([func.EventHubEvent(body=json.dumps(r).encode()) for r in forged])
        assert recorder.requests == [] and function_app.get_approver().untrusted == 2
        genuine = record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0")
        handler([func.EventHubEvent(body=json.dumps(genuine).encode())] * 2)  # delivered twice: acted on once
        assert [r["path"] for r in recorder.requests] == ["/WestNO_0/approvals"]
    finally:
        function_app.get_approver.cache_clear()


def test_on_the_callback_route_one_scale_set_instance_cannot_start_anothers_event(tmp_path):
    """The High weakness on the callback route: root on ss_0 signs, with ss_0's own key, a record that
    claims ss_5's platform reboot names ss_0 and is user-initiated. The approval can only go to ss_0's
    own callback (the target comes from the authenticated identity), whose agent re-reads its own IMDS
    and refuses an event that does not name ss_0: ss_5's event stays Scheduled."""
    from forwarder.common.fleet_keys import CALLBACK_PURPOSE, RECORD_PURPOSE, derive_key
    from forwarder.common.record_auth import sign_record

    with Emulator(vms=[{"name": "ss_0", "vm_scale_set_name": "ss"}, {"name": "ss_5", "vm_scale_set_name": "ss"}],
                  rate_limit=None) as emu:
        rid = emu.stats()["vms"]["ss_0"]["resourceId"]
        extra = ('[approval.callback]\nlisten = "127.0.0.1:0"\nsecret_env = "SEFWD_CALLBACK_SECRET"\n'
                 'rate_limit = 600\n')
        config = write_config(tmp_path / "sefwd.toml", emu.vm_url("ss_0"), tmp_path / "state", extra=extra)
        env = {"SEFWD_CALLBACK_SECRET": as_secret(derive_key(MASTER, CALLBACK_PURPOSE, rid))}
        with callback_agent(config, tmp_path / "agent.log", env) as (_agent, url):
            approver = pipeline.RemoteApprover(settings("http://unused.invalid/{vm_name}", tmp_path,
                                                        CALLBACK_URLS=json.dumps({rid: url})))
            theirs = emu.schedule(type="Reboot", source="Platform", resources=["ss_5"], start_after=600)
            lie = {"specversion": "1.0", "id": str(uuid.uuid4()), "type": "scheduledevent.scheduled", "source": rid,
                   "time": datetime.now(timezone.utc).isoformat(), "subject": theirs,
                   "data": {"EventId": theirs, "EventType": "Reboot", "EventSource": "User", "EventStatus": "Scheduled",
                            "Resources": ["ss_0"], "Vm": {"Name": "ss_0", "ResourceId": rid}}}
            outcome = approver.handle(sign_record(derive_key(MASTER, RECORD_PURPOSE, rid), lie))
            assert (outcome["decision"], outcome["target"], outcome["http_status"]) == ("refused", "ss_0", 422), outcome
            assert _status(emu, theirs) == "Scheduled" and emu.stats()["start_requests"] == []


def test_one_vms_records_move_only_that_vms_outcome_and_keys(recorder, tmp_path):
    """The reproduced Low weakness, two VMs with their own keys: WestNO_1 (a) reports an outcome for
    WestNO_0's EventId first, and (b) takes "<WestNO_0's EventId>:scheduled" as the eventkey of a bogus
    approvable event of its own. WestNO_0's genuine records must still fold and be approved."""
    template = f"http://127.0.0.1:{recorder.port}/{{vm_name}}/approvals"
    approver = pipeline.RemoteApprover(settings(template, tmp_path))
    victim = "EV-VICTIM"

    def terminal(seen_by: str, rtype: str, outcome: str, resources: list[str], event_id: str = victim) -> dict[str, Any]:
        rec = record("Reboot", "Platform", -1, resources=resources, seen_by=seen_by, rtype=rtype, event_id=event_id,
                     signer="")
        rec["data"]["Outcome"] = outcome
        return _sign(seen_by, rec)

    # (a) WestNO_1's "completed" for WestNO_0's event, naming only WestNO_0 (the truth) or itself (a lie).
    honest_names = approver.handle(terminal("WestNO_1", "scheduledevent.completed", "completed", ["WestNO_0"]))
    assert (honest_names["decision"], honest_names["reason"]) == ("skip", "not_this_vm")
    lie = approver.handle(terminal("WestNO_1", "scheduledevent.completed", "completed", ["WestNO_1"]))
    assert lie["decision"] == "outcome" and lie["vm"] == resource_id("WestNO_1")  # its own row, nobody else's
    real = approver.handle(terminal("WestNO_0", "scheduledevent.canceled", "canceled", ["WestNO_0"]))
    assert (real["decision"], real["outcome"]) == ("outcome", "canceled"), real  # not "duplicate" of the lie
    # (b) A bogus, approvable event of WestNO_1 carrying WestNO_0's eventkey is approved on WestNO_1 only...
    bogus = record("Reboot", "User", -1, resources=["WestNO_1"], seen_by="WestNO_1", event_id="EV-BOGUS", signer="")
    bogus["eventkey"] = f"{victim}:scheduled"
    assert approver.handle(_sign("WestNO_1", bogus))["decision"] == "approved"
    # ...and WestNO_0's genuine, approvable record of its own event is approved, not answered "duplicate".
    genuine = approver.handle(record("Reboot", "User", -1, resources=["WestNO_0"], seen_by="WestNO_0", event_id=victim))
    assert (genuine["decision"], genuine["target"]) == ("approved", "WestNO_0"), genuine
    assert sorted(r["path"] for r in recorder.requests) == ["/WestNO_0/approvals", "/WestNO_1/approvals"]


def _sign(vm: str, rec: dict[str, Any]) -> dict[str, Any]:
    from forwarder.common.record_auth import sign_record

    return sign_record(record_key(vm), {k: v for k, v in rec.items() if k != ATTRIBUTE})
