"""One bad audit never costs the others or a poll (issue 20, item 5).

A refused callback request may carry a number beyond 64 bits (``DocumentIncarnation: 2**70`` is a
valid JSON integer; the request is refused for another field), and its audit entry then cannot be
serialized. The inbox drain used to raise: every queued audit (legitimate ones included) was
dropped and the cycle's poll skipped. Each entry is now made safe on its own; one that still
fails is counted and set aside, never the batch.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import orjson
import requests

from forwarder.agent.poller import Poller
from forwarder.approval.approver import audit_entry
from forwarder.emulator import Emulator
from forwarder.emulator.model import VmProfile
from forwarder.imds.client import ImdsClient, RequestBudget
from forwarder.imds.identity import VmIdentity
from forwarder.records import RecordFactory
from forwarder.store.database import Store
from tests.agent import AgentProcess, callback_url, read_jsonl, wait_until, write_config
from tests.integration.test_callback_agent import SECRET, body_for, signed

API = "2020-07-01"
HUGE = 2**70


def bodies(store: Store) -> list[dict]:
    return [orjson.loads(b) for (b,) in store.query("SELECT body FROM records ORDER BY id")]


def test_one_unserializable_audit_costs_neither_the_others_nor_the_poll(tmp_path: Path) -> None:
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        imds = ImdsClient(emu.url, API, budget=RequestBudget())
        store = Store.open(tmp_path, fsync=False)
        stop = threading.Event()
        try:
            state = store.load_state()
            poller = Poller(imds, state, RecordFactory(VmIdentity(name="myVM"), API, sequence=state.sequence), store,
                            poll_interval=0.2, stop=stop, boot_id=lambda: None, boot_time=lambda: None)
            event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
            poller.submit_audit(audit_entry("refused", "callback", "unknown_event", EventIds=["a"], Client="1.2.3.4"))
            poller.submit_audit(audit_entry("refused", "callback", "invalid_body", DocumentIncarnation=HUGE,
                                            Detail="approver must be a string", Client="6.6.6.6",
                                            Hook={"nested": [float("nan"), "\udcff", HUGE, -HUGE]}))
            poller.submit_audit(audit_entry("refused", "callback", "unknown_event", EventIds=["b"], Client="1.2.3.5"))
            runner = threading.Thread(target=poller.run)
            runner.start()
            try:
                poller.wait_for_polls(3, 30)
            finally:
                stop.set()
                runner.join(10)
            records = bodies(store)
        finally:
            imds.close()
            store.close()
    audits = [r["data"] for r in records if r["type"].startswith("approval.")]
    scheduled = [r for r in records if r["type"].endswith("scheduled") and r["subject"] == event_id]
    print(f"audits kept: {len(audits)} of 3; cycle errors: {poller.stats.cycle_errors}")
    assert [a["Client"] for a in audits] == ["1.2.3.4", "6.6.6.6", "1.2.3.5"], "every audit, in order"
    bad = audits[1]
    assert bad["DocumentIncarnation"] == str(HUGE) and bad["Reason"] == "invalid_body"  # (the digits kept, as text)
    assert bad["Hook"]["nested"][2:] == [str(HUGE), str(-HUGE)]
    assert len(scheduled) == 1 and poller.stats.cycle_errors == 0, "the poll of that cycle was not skipped"
    sequences = [int(r["sequence"]) for r in records]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences))), "no sequence number lost"


def test_a_refused_callback_request_with_a_huge_number_is_audited_by_the_real_agent(tmp_path: Path) -> None:
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", extra=(
            '[approval.callback]\nlisten = "127.0.0.1:0"\nsecret_env = "CB_SECRET"\nrate_limit = 600\n'))
        agent = AgentProcess(config, tmp_path / "a.log", env={"CB_SECRET": SECRET})
        try:
            url = callback_url(agent)  # port 0: the OS picks, the agent's log says
            event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
            bad = json.dumps({"StartRequests": [{"EventId": event_id}], "DocumentIncarnation": HUGE, "approver": 5}).encode()
            assert requests.post(url, data=bad, headers=signed(bad), timeout=10).status_code == 400
            good = body_for(event_id, approver="alice", ResourceId=VmProfile("myVM").resource_id)  # names this VM
            assert requests.post(url, data=good, headers=signed(good), timeout=10).status_code == 200
            out = tmp_path / "out.jsonl"
            audits = wait_until(lambda: [r["data"] for r in read_jsonl(out) if r["type"].startswith("approval.")]
                                if len([r for r in read_jsonl(out) if r["type"].startswith("approval.")]) >= 2 else None,
                                30, "both audits")
        finally:
            assert agent.terminate() == 0
    assert {(a["Outcome"], a["Reason"]) for a in audits} == {("refused", "invalid_body"), ("approved", "approved")}
    (refused,) = [a for a in audits if a["Outcome"] == "refused"]
    assert refused["DocumentIncarnation"] == str(HUGE)
    assert "unexpected error in the poll cycle" not in agent.logs()
