"""The IMDS request budget across processes: the agent plus `sefwd approve` never get a 429.

IMDS allows 5 requests/s per VM on Scheduled Events and instance metadata together (the emulator
enforces it with a sliding one-second window). The agent keeps to 4 per window of 1.1 s, a
one-shot command to the 1 that remains, and concurrent `sefwd approve` commands take turns
(docs/imds-transport.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from forwarder.emulator import Emulator
from forwarder.errors import ImdsError
from forwarder.imds.client import BUDGET_WINDOW, ImdsClient, RequestBudget
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config
from tests.integration.test_cli import sefwd

VM = "myVM"


def _throttled(emu: Emulator) -> int:
    return int(emu.stats()["requests"].get(VM, {}).get("by_status", {}).get("429", 0))


def test_the_agent_at_its_minimum_interval_and_sefwd_approve(tmp_path: Path) -> None:
    with Emulator(vms=[VM]) as emu:
        config = write_config(tmp_path / "c.toml", emu.vm_url(VM), tmp_path / "state", poll_interval="500ms")
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            wait_until(lambda: read_jsonl(tmp_path / "out.jsonl"), 60, "agent up")
            events = [emu.schedule(type="Reboot", resources=[VM], not_before="+15m") for _ in range(2)]
            wait_until(lambda: sum(r["type"] == "scheduledevent.scheduled" for r in read_jsonl(tmp_path / "out.jsonl"))
                       == 2, 30, "both scheduled")
            started = time.monotonic()
            done = [sefwd("approve", event_id, "--config", str(config)) for event_id in events]
            took = time.monotonic() - started
            wait_until(lambda: sum(r["type"] == "approval.approved" for r in read_jsonl(tmp_path / "out.jsonl")) == 2,
                       30, "both audit records")
        finally:
            assert agent.terminate() == 0
        for result in done:
            assert result.returncode == 0, result.stderr[-2000:]
        # The agent saved its identity: each approval is one GET and one POST, a window apart.
        assert took >= 2 * BUDGET_WINDOW * 0.9
        assert [p["event_ids"] for p in emu.stats()["start_requests"]] == [[e] for e in events]
        assert _throttled(emu) == 0


def test_the_agents_whole_budget_and_two_concurrent_one_shot_commands(tmp_path: Path) -> None:
    """Worst case: the agent spends all 4 requests of every window while two `sefwd approve` and a
    `sefwd once` run at the same time (each: instance metadata, the document, and the POST)."""
    with Emulator(vms=[VM]) as emu:
        events = [emu.schedule(type="Reboot", resources=[VM], not_before="+15m") for _ in range(2)]
        config = write_config(tmp_path / "c.toml", emu.vm_url(VM), tmp_path / "state")
        (tmp_path / "state").mkdir()  # (an installed agent's state dir exists: the commands meet there)
        budget = RequestBudget()  # the agent's: 4 per window, shared by all its clients
        stop = threading.Event()
        sent = {"ok": 0, "throttled": 0}

        def agent_at_full_budget() -> None:
            with ImdsClient(emu.vm_url(VM), "2020-07-01", budget=budget, stop=stop) as client:
                while not stop.is_set():
                    try:
                        client.scheduled_events()
                        sent["ok"] += 1
                    except ImdsError as exc:
                        if exc.status == 429:
                            sent["throttled"] += 1

        threads = [threading.Thread(target=agent_at_full_budget, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: budget.waited > 0, 10, "the agent's budget exhausted")
            commands = [_spawn("approve", events[0], "--config", str(config)),
                        _spawn("approve", events[1], "--config", str(config)),
                        _spawn("once", "--config", str(config))]
            results = [(c.returncode, out, err) for c in commands for out, err in [c.communicate(timeout=120)]]
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
        for rc, _, err in results:
            assert rc == 0, err[-2000:]
        assert sorted(e for p in emu.stats()["start_requests"] for e in p["event_ids"]) == sorted(events)
        assert sent["ok"] >= 8 and sent["throttled"] == 0
        assert _throttled(emu) == 0


def _spawn(*args: str) -> subprocess.Popen[str]:
    """``sefwd ARGS`` in the background, the way ``tests.integration.test_cli.sefwd`` runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-m", "forwarder", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))


def test_sefwd_approve_retries_a_throttled_or_failed_document_read_within_the_budget(tmp_path: Path) -> None:
    """One 429 (IMDS's 5/s is shared with the agent), a 503, a dropped connection and a 410 before the
    document: `sefwd approve` still approves, each retry waiting its turn in the one-shot budget.

    Two drops: the transport sends a request once more at once when a kept-alive connection closes
    unanswered (the server dropped an idle connection), in the next slot of the budget; the second drop, on a
    new connection, is the connection error the approval's read retries."""
    # The emulator allows 1 request/s: the one-shot command's share, so a retry sent early is a 429 more.
    with Emulator(vms=[VM], rate_limit=1) as emu:
        event = emu.schedule(type="Reboot", resources=[VM], not_before="+15m")
        config = write_config(tmp_path / "c.toml", emu.vm_url(VM), tmp_path / "state")
        for fault in ({"kind": "status", "status": 429, "retry_after": "0"}, {"kind": "status", "status": 503},
                      {"kind": "drop"}, {"kind": "drop"}, {"kind": "status", "status": 410}):
            emu.inject_fault(**fault, path="scheduledevents", method="GET")
        started = time.monotonic()
        result = sefwd("approve", event, "--config", str(config))
        took = time.monotonic() - started
        stats = emu.stats()
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"approved {event}" in result.stdout
    assert stats["faults_pending"] == [] and [p["event_ids"] for p in stats["start_requests"]] == [[event]]
    counts = stats["requests"][VM]
    # instance metadata, 5 failed reads and the good one, the POST: nothing more, and no 429 but the injected one.
    assert counts["by_endpoint"] == {"instance": 1, "scheduledevents": 7}, counts
    assert counts["by_status"].get("429") == 1, counts
    # 8 turns of the budget (each drop takes its own: the resend after the first too) at 1 per window: at least
    # 7 windows apart.
    assert took >= 7 * BUDGET_WINDOW * 0.95


def test_a_request_that_reached_imds_late_keeps_its_slot_until_a_window_after_it_ended() -> None:
    """A request held up on its way (a loaded VM, here the emulator's slow answer before it counts the
    request) must not share an IMDS second with the next window's requests. The emulator allows exactly
    the budget (4 per second) here, so one request too many is a 429; the window counted from the
    request's send (the code before) got one every time the slow request came first."""
    with Emulator(vms=[VM], rate_limit=4) as emu:
        emu.inject_fault(kind="slow", delay="500ms", path="scheduledevents", method="GET")
        budget = RequestBudget()  # 4 per window
        stop = threading.Event()
        answered: list[int] = []
        failures: list[ImdsError] = []
        go = threading.Barrier(4)

        def poller() -> None:
            with ImdsClient(emu.vm_url(VM), "2020-07-01", budget=budget, stop=stop) as client:
                go.wait(30)
                while not stop.is_set():
                    try:
                        client.scheduled_events()
                        answered.append(1)
                    except ImdsError as exc:
                        if not stop.is_set():  # (a request cut short by the test's end is no failure)
                            failures.append(exc)

        threads = [threading.Thread(target=poller, daemon=True) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: len(answered) >= 12 or failures, 60, "three windows of requests")
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
        assert emu.stats()["faults_pending"] == []
        assert failures == [] and _throttled(emu) == 0
