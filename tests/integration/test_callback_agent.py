"""The signed approval callback of a real agent: every bad request is refused, audited, and never
reaches IMDS; a valid request signed by the independent `standardwebhooks` package is one POST."""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import orjson
import pytest
import requests
from standardwebhooks.webhooks import Webhook

from forwarder.emulator import Emulator
from forwarder.emulator.model import VmProfile
from forwarder.common.signing import generate_secret, parse_secret, sign_headers
from tests.agent import AgentProcess, callback_url, read_jsonl, wait_until, write_config

SECRET = generate_secret()
# The agent's VM (WestNO_0): a signed approval must name it (a captured one for another VM is refused).
MINE = VmProfile("WestNO_0").resource_id


def start_agent(config, log) -> tuple[AgentProcess, str]:
    """The agent, and its callback URL once listening (it binds port 0)."""
    proc = AgentProcess(config, log, env={"CB_SECRET": SECRET})
    return proc, callback_url(proc)


@pytest.fixture
def agent(tmp_path):
    """Each test has its own agent (and emulator): no test depends on what another did."""
    tmp = tmp_path
    with Emulator(vms=["WestNO_0", "WestNO_1", "zzz"], rate_limit=None) as emu:
        config = write_config(tmp / "c.toml", emu.vm_url("WestNO_0"), tmp / "state", extra=(
            '[approval.callback]\n'
            'listen = "127.0.0.1:0"\nsecret_env = "CB_SECRET"\nmax_body = "4KiB"\nrate_limit = 600\n'
            'client_timeout = "1s"\n'
        ))
        proc, url = start_agent(config, tmp / "a.log")
        wait_until(lambda: read_jsonl(tmp / "out.jsonl"), 60, "agent up")
        state = {"emu": emu, "url": url, "out": tmp / "out.jsonl", "proc": proc, "config": config, "tmp": tmp}
        yield state
        if state["proc"].alive():
            state["proc"].terminate()


def body_for(*ids: str, **extra: object) -> bytes:
    return orjson.dumps({"StartRequests": [{"EventId": i} for i in ids], "ResourceId": MINE, **extra})


def signed(body: bytes, *, key: bytes | None = None, msg_id: str | None = None, now: float | None = None) -> dict[str, str]:
    headers = sign_headers(key or parse_secret(SECRET), msg_id or f"msg_{uuid.uuid4().hex}", body, now=now)
    headers["content-type"] = "application/json"
    return headers


def audits(out, n_before: int):
    return [r for r in read_jsonl(out) if r["type"].startswith("approval.")][n_before:]


def count_audits(out) -> int:
    return len([r for r in read_jsonl(out) if r["type"].startswith("approval.")])


def post_refused(agent, body: bytes, headers: dict[str, str], status: int, reason: str) -> None:
    """A request the callback must refuse: its answer says why, and nothing is posted to IMDS."""
    posts = len(agent["emu"].stats()["start_requests"])
    answer = requests.post(agent["url"], data=body, headers=headers, timeout=10)
    assert answer.status_code == status, answer.text
    assert answer.json()["reason"].startswith(reason), answer.text
    assert len(agent["emu"].stats()["start_requests"]) == posts, "no IMDS POST for a refused request"


def refused(agent, body: bytes, headers: dict[str, str], status: int, reason: str, *, repeat: bool = False) -> None:
    """A refusal is audited at once when it is the first of its reason from this client in the
    window; a ``repeat`` is only counted, into one record at the end of the window (or at stop)."""
    before = count_audits(agent["out"])
    posts = len(agent["emu"].stats()["start_requests"])
    post_refused(agent, body, headers, status, reason)
    if repeat:
        return
    new = wait_until(lambda: audits(agent["out"], before), 30, f"audit of {reason}")
    assert [a["type"] for a in new] == ["approval.refused"]
    assert new[0]["data"]["Actor"] == "callback" and new[0]["data"]["Reason"].startswith(reason)
    assert len(agent["emu"].stats()["start_requests"]) == posts, "no IMDS POST for a refused request"


def test_bad_requests_are_refused_audited_and_never_posted(agent):
    emu, out = agent["emu"], agent["out"]
    event = emu.schedule(type="Freeze", duration=5, resources=["WestNO_0", "WestNO_1"], start_after=600)
    other_vm = emu.schedule(type="Reboot", resources=["zzz"], start_after=600)
    started = emu.schedule(type="Reboot", resources=["WestNO_0"], status="Started")
    wait_until(lambda: {event, other_vm, started} <= {r.get("subject") for r in read_jsonl(out)}, 30, "events seen")
    before = count_audits(out)
    posts = len(emu.stats()["start_requests"])
    audited: list[str] = []  # the reasons audited at once, in order (a repeat is only counted)

    def refused_now(body: bytes, headers: dict[str, str], status: int, reason: str, *, repeat: bool = False) -> None:
        # Every request is answered at once; their audits are awaited together below (each would
        # otherwise wait for the poll turn that commits it: 0.5 s apiece).
        post_refused(agent, body, headers, status, reason)
        if not repeat:
            audited.append(reason)

    good = body_for(event, approver="tests")
    refused_now(good, {**signed(good), "webhook-signature": "v1,AAAA"}, 401, "bad_signature")
    refused_now(good, signed(good, key=parse_secret(generate_secret())), 401, "bad_signature", repeat=True)
    for missing in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        headers = signed(good)
        del headers[missing]
        refused_now(good, headers, 401, "missing_headers", repeat=missing != "webhook-id")
    refused_now(good, signed(good, now=time.time() - 600), 401, "stale_timestamp")
    refused_now(good, signed(good, now=time.time() + 600), 401, "future_timestamp")
    big = body_for(event, reason="x" * 5000)
    refused_now(big, signed(big), 413, "body_too_large")
    bad_json = b'{"StartRequests": [{"EventId": '
    refused_now(bad_json, signed(bad_json), 400, "malformed_json")
    unknown = body_for("00000000-0000-0000-0000-000000000000")
    refused_now(unknown, signed(unknown), 422, "unknown_event")
    not_mine = body_for(other_vm)
    refused_now(not_mine, signed(not_mine), 422, "out_of_scope")
    body = body_for(started)
    refused_now(body, signed(body), 422, "already_started")
    # One record each, at once, for the first refusal of each reason; none (yet) for a repeat.
    new = wait_until(lambda: a if len(a := audits(out, before)) >= len(audited) else None, 30,
                     f"audits of {audited}")
    assert [a["type"] for a in new] == ["approval.refused"] * len(audited), new
    assert len(new) == len(audited) and all(a["data"]["Reason"].startswith(reason) for a, reason in zip(new, audited)), \
        ([a["data"]["Reason"] for a in new], audited)
    assert all(a["data"]["Actor"] == "callback" for a in new)
    assert len(emu.stats()["start_requests"]) == posts, "no IMDS POST for a refused request"
    assert agent["proc"].terminate() == 0
    # Stopping flushed the refusals counted since their first record: one record each, with a count.
    counted: dict[str, int] = {}
    for r in read_jsonl(out):
        if r["type"] == "approval.refused":
            counted[r["data"]["Reason"]] = counted.get(r["data"]["Reason"], 0) + (r["data"]["Count"] or 1)
    assert counted["bad_signature"] == 2 and counted["missing_headers"] == 3, counted


def test_a_signed_approval_for_another_vm_or_for_no_vm_is_refused_and_audited(agent):
    """Issue 21: an approval validly signed for VM B (captured, replayed to A) never approves on A."""
    emu = agent["emu"]
    event = emu.schedule(type="Freeze", duration=5, resources=["WestNO_0", "WestNO_1"], start_after=600)
    wait_until(lambda: any(r.get("subject") == event for r in read_jsonl(agent["out"])), 30, "event seen")
    other = body_for(event, ResourceId=VmProfile("WestNO_1").resource_id)
    refused(agent, other, signed(other), 403, "wrong_vm")
    anonymous = orjson.dumps({"StartRequests": [{"EventId": event}]})
    refused(agent, anonymous, signed(anonymous), 422, "no_target_vm")
    assert next(e["EventStatus"] for e in emu.document()["Events"] if e["EventId"] == event) == "Scheduled"
    # The same VM named in another case is this VM (resource ids are case-insensitive).
    mine = body_for(event, ResourceId=MINE.upper())
    answer = requests.post(agent["url"], data=mine, headers=signed(mine), timeout=10)
    assert answer.status_code == 200 and answer.json()["approved"] == [event], answer.text


def test_standardwebhooks_signed_request_is_one_post_and_replay_is_refused(agent):
    emu = agent["emu"]
    event = emu.schedule(type="Freeze", duration=5, resources=["WestNO_0", "WestNO_1"], start_after=600)
    wait_until(lambda: any(r.get("subject") == event for r in read_jsonl(agent["out"])), 30, "event seen")
    payload = body_for(event, approver="change-board", reason="ticket 42").decode()
    msg_id = f"msg_{uuid.uuid4().hex}"
    signature = Webhook(SECRET).sign(msg_id, datetime.now(timezone.utc), payload)
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(int(time.time())), "webhook-signature": signature,
               "content-type": "application/json"}
    posts_before = len(emu.stats()["start_requests"])
    answer = requests.post(agent["url"], data=payload, headers=headers, timeout=10)
    assert answer.status_code == 200 and answer.json()["approved"] == [event]
    posts = emu.stats()["start_requests"][posts_before:]
    assert [p["event_ids"] for p in posts] == [[event]]
    wait_until(lambda: any(r["type"] == "approval.approved" and r["subject"] == event for r in read_jsonl(agent["out"])),
               30, "approval audited")
    refused(agent, payload.encode(), headers, 409, "replayed_id")
    again = body_for(event)
    answer = requests.post(agent["url"], data=again, headers=signed(again), timeout=10)
    assert answer.status_code == 200 and answer.json()["already_approved"] == [event]
    assert len(emu.stats()["start_requests"]) == posts_before + 1
    approved = [r for r in read_jsonl(agent["out"]) if r["type"] == "approval.approved" and r["subject"] == event]
    assert approved[0]["data"]["Approver"] == "change-board" and approved[0]["data"]["Actor"] == "callback"


def test_replay_cache_survives_a_restart(agent, tmp_path):
    emu = agent["emu"]
    event = emu.schedule(type="Freeze", duration=5, resources=["WestNO_0"], start_after=600)
    wait_until(lambda: any(r.get("subject") == event for r in read_jsonl(agent["out"])), 30, "event seen")
    body = body_for(event)
    headers = signed(body)
    assert requests.post(agent["url"], data=body, headers=headers, timeout=10).status_code == 200
    wait_until(lambda: any(r["type"] == "approval.approved" and r["subject"] == event for r in read_jsonl(agent["out"])),
               30, "approval audited")
    assert agent["proc"].terminate() == 0
    agent["proc"], agent["url"] = start_agent(agent["config"], agent["tmp"] / "a2.log")
    refused(agent, body, headers, 409, "replayed_id")
