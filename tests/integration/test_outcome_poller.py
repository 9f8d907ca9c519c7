"""The poller's own evidence, end to end: ``Poller`` against the IMDS emulator, terminal records read
back from the store (issue 13).

The machine-level facts a test cannot change for real are the poller's hooks: ``boot_id`` and
``boot_time`` (what the kernel would say after a reboot, or that it says nothing), ``wallclock``
(a guest whose wall clock time sync stepped forward after a Freeze) and ``monotonic`` with the
stop event's wait (a guest whose monotonic clock counted the Freeze, so the agent's sleep ran
long). Everything else is real: HTTP to the emulator, the store, the record factory.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from forwarder.emulator import Emulator
from forwarder.imds.client import ImdsClient, RequestBudget
from forwarder.agent.poller import Poller
from forwarder.records import RecordFactory, utcnow
from forwarder.agent.service import resolve_identity
from forwarder.store.database import Store
from tests.agent import wait_until

API = "2020-07-01"
TERMINAL = ("scheduledevent.completed", "scheduledevent.canceled", "scheduledevent.ended")
CANCEL_EVIDENCE = ["gone_before_notbefore", "no_approval", "no_unseen_states", "no_reboot"]


@contextmanager
def poller_for(emu: Emulator, state_dir: Path, **hooks: Any) -> Iterator[Poller]:
    """One agent process's poller: its own client, the store in ``state_dir``, the saved state."""
    imds = ImdsClient(emu.url, API, budget=RequestBudget())
    store = Store.open(state_dir, fsync=False)
    try:
        state = store.load_state()
        factory = RecordFactory(resolve_identity(imds, state), API, sequence=state.sequence)
        hooks.setdefault("boot_id", lambda: None)
        hooks.setdefault("boot_time", lambda: None)
        yield Poller(imds, state, factory, store, poll_interval=hooks.pop("poll_interval", 0.5), **hooks)
    finally:
        imds.close()
        store.close()


def records(state_dir: Path) -> list[dict[str, Any]]:
    store = Store.open(state_dir, fsync=False)
    try:
        return [orjson.loads(body) for (body,) in store.query("SELECT body FROM records ORDER BY id")]
    finally:
        store.close()


def of(state_dir: Path, event_id: str, types: tuple[str, ...]) -> list[dict[str, Any]]:
    return [r for r in records(state_dir) if r["type"] in types and r.get("subject") == event_id]


def poll_until(poller: Poller, predicate: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    """Drive the poller by hand, one poll at a time, until ``predicate`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        poller.poll_once()
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # (pacing under the emulator's 5 requests/s, not synchronization)


def terminal(state_dir: Path, event_id: str) -> dict[str, Any]:
    (record,) = of(state_dir, event_id, TERMINAL)
    return record["data"]


# -- reboot evidence ----------------------------------------------------------------------------

def test_without_boot_id_a_cancel_seen_by_the_same_process_is_canceled(tmp_path: Path) -> None:
    """Windows, containers: no boot id, no boot time. The process itself is the evidence."""
    with Emulator() as emu:
        event = emu.schedule(type="Reboot", not_before="+15m")
        with poller_for(emu, tmp_path) as poller:
            poll_until(poller, lambda: of(tmp_path, event, ("scheduledevent.scheduled",)), "scheduled record")
            emu.cancel(event)
            poll_until(poller, lambda: of(tmp_path, event, TERMINAL), "terminal record")
    data = terminal(tmp_path, event)
    assert data["Outcome"] == "canceled" and data["Change"] == "canceled"
    assert data["Evidence"]["Used"] == CANCEL_EVIDENCE
    assert data["Evidence"]["Rebooted"] is False and data["Evidence"]["RebootedBy"] == "process"


def test_after_a_restart_the_first_sighting_by_the_new_process_counts(tmp_path: Path) -> None:
    """Restarted (no boot id or time): unknown until this process has seen the document itself."""
    with Emulator(rate_limit=None) as emu:  # (see _down_across)
        seen_again = emu.schedule(type="Reboot", not_before="+15m")
        with poller_for(emu, tmp_path) as poller:
            poll_until(poller, lambda: of(tmp_path, seen_again, ("scheduledevent.scheduled",)), "scheduled")
        with poller_for(emu, tmp_path) as poller:  # the agent restarted; the document is unchanged
            assert poller.evidence.rebooted is None
            poller.poll_once()
            assert poller.evidence.rebooted is False
            emu.cancel(seen_again)
            poll_until(poller, lambda: of(tmp_path, seen_again, TERMINAL), "terminal record")
        assert terminal(tmp_path, seen_again)["Outcome"] == "canceled"
        # Canceled while the agent is down, and nothing tells whether the machine rebooted: no guess.
        gone_while_down = emu.schedule(type="Reboot", not_before="+15m")
        with poller_for(emu, tmp_path) as poller:
            poll_until(poller, lambda: of(tmp_path, gone_while_down, ("scheduledevent.scheduled",)), "scheduled")
        emu.cancel(gone_while_down)
        with poller_for(emu, tmp_path) as poller:
            poll_until(poller, lambda: of(tmp_path, gone_while_down, TERMINAL), "terminal record")
    data = terminal(tmp_path, gone_while_down)
    assert data["Outcome"] == "unknown" and data["Change"] == "ended"
    assert data["Evidence"]["Rebooted"] is None and data["Evidence"]["RebootedBy"] is None


def _down_across(emu: Emulator, state_dir: Path, before: dict[str, Any], after: dict[str, Any],
                 ran: bool) -> dict[str, Any]:
    """The agent sees a Reboot of its VM Scheduled, is down while it runs (or is canceled), restarts.

    Each "process" has a fresh request budget, so the emulator of a test with several of them runs
    without its 5 requests/s limit: a 429 only made the poll retry a second later (the budget across
    processes is test_imds_budget's subject, not evidence's)."""
    event = emu.schedule(type="Reboot", not_before="+15m", resources=["vm-0", "other-vm"])
    with poller_for(emu, state_dir, **before) as poller:
        poll_until(poller, lambda: of(state_dir, event, ("scheduledevent.scheduled",)), "scheduled record")
    if ran:  # another VM of the set approves it: it starts at once, reboots this VM and ends
        emu.approve(event, "other-vm")
        emu.complete(event)
    else:
        emu.cancel(event)
    with poller_for(emu, state_dir, **after) as poller:
        poll_until(poller, lambda: of(state_dir, event, TERMINAL), "terminal record")
    return terminal(state_dir, event)


def test_restart_evidence_boot_id_then_boot_time(tmp_path: Path) -> None:
    booted = time.time() - 3600.0
    with Emulator(vms=["vm-0", "other-vm"], rate_limit=None) as emu:  # (see _down_across)
        cases = [
            # (first process, second process, did it run) -> (outcome, used, rebooted, rebooted by)
            ({"boot_id": lambda: "boot-a"}, {"boot_id": lambda: "boot-b"}, True,
             ("completed", ["rebooted"], True, "boot_id")),
            ({"boot_id": lambda: "boot-a"}, {"boot_id": lambda: "boot-a"}, False,
             ("canceled", CANCEL_EVIDENCE, False, "boot_id")),
            # No boot id: the boot time (/proc/stat btime) read again after the restart.
            ({"boot_time": lambda: booted}, {"boot_time": lambda: time.time() - 1.0}, True,
             ("completed", ["rebooted"], True, "boot_time")),
            ({"boot_time": lambda: booted}, {"boot_time": lambda: booted + 1.0}, False,
             ("canceled", CANCEL_EVIDENCE, False, "boot_time")),
            # It ran while the agent was down but this machine did not reboot: the jump came before
            # NotBefore, approved by another VM, so this VM does not guess.
            ({"boot_time": lambda: booted}, {"boot_time": lambda: booted}, True,
             ("unknown", [], False, "boot_time")),
        ]
        for i, (before, after, ran, expected) in enumerate(cases):
            data = _down_across(emu, tmp_path / str(i), before, after, ran)
            evidence = data["Evidence"]
            assert (data["Outcome"], evidence["Used"], evidence["Rebooted"], evidence["RebootedBy"]) == expected, i


# -- pause evidence -----------------------------------------------------------------------------

class Clocks:
    """The guest's clocks as the poller reads them: real time plus what a Freeze did to them."""

    def __init__(self) -> None:
        self.wall_ahead = 0.0  # seconds time sync stepped the wall clock forward
        self.mono_ahead = 0.0  # seconds the monotonic clock counted while the guest stood still

    def wall(self) -> datetime:
        return utcnow() + timedelta(seconds=self.wall_ahead)

    def mono(self) -> float:
        return time.monotonic() + self.mono_ahead


class FreezableStop(threading.Event):
    """The poller's stop event; ``freeze_next`` makes its next sleep a Freeze the monotonic clock counts."""

    def __init__(self, clocks: Clocks) -> None:
        super().__init__()
        self.clocks = clocks
        self.freeze_next = 0.0
        self.frozen = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        stopped = super().wait(timeout)
        if self.freeze_next and not stopped:
            self.clocks.mono_ahead += self.freeze_next
            self.clocks.wall_ahead += self.freeze_next
            self.freeze_next = 0.0
            self.frozen.set()
        return stopped


@contextmanager
def running(emu: Emulator, state_dir: Path, **hooks: Any) -> Iterator[Poller]:
    with poller_for(emu, state_dir, **hooks) as poller:
        thread = threading.Thread(target=poller.run, name="poller", daemon=True)
        thread.start()
        try:
            yield poller
        finally:
            poller.stop.set()
            thread.join(30)
            assert not thread.is_alive()


def _freeze_scheduled(emu: Emulator, state_dir: Path) -> str:
    event = emu.schedule(type="Freeze", not_before="+15m", duration=5)
    wait_until(lambda: of(state_dir, event, ("scheduledevent.scheduled",)), 20, "scheduled record")
    return event


def test_slow_answers_identity_refresh_and_heartbeats_are_no_freeze_pause(tmp_path: Path) -> None:
    """A canceled Freeze stays canceled however slow IMDS answers and whatever work runs between polls."""
    with Emulator() as emu:
        with running(emu, tmp_path, heartbeat=0.5, compute_refresh=0.5) as poller:
            event = _freeze_scheduled(emu, tmp_path)
            emu.inject_fault("slow", delay=3.0, path="scheduledevents", method="GET")
            emu.inject_fault("slow", delay=2.5, path="instance")  # the identity refresh
            wait_until(lambda: not emu.stats()["faults_pending"], 20, "both slow answers")
            polls = poller.stats.polls
            assert poller.wait_for_polls(polls + 2, 20)
            emu.cancel(event)
            wait_until(lambda: of(tmp_path, event, TERMINAL), 20, "terminal record")
        heartbeats = [r for r in records(tmp_path) if r["type"] == "forwarder.heartbeat"]
        assert heartbeats, "heartbeat commits ran between polls"
    data = terminal(tmp_path, event)
    assert data["Outcome"] == "canceled", data["Evidence"]
    assert data["Evidence"]["PauseSeconds"] < 1.0 and data["Evidence"]["Used"] == CANCEL_EVIDENCE


def test_a_freeze_the_wall_clock_shows_is_a_pause(tmp_path: Path) -> None:
    """The guest's monotonic clock stood still; time sync then stepped the wall clock 20 s forward."""
    clocks = Clocks()
    with Emulator() as emu:
        with running(emu, tmp_path, wallclock=clocks.wall) as poller:
            event = _freeze_scheduled(emu, tmp_path)
            clocks.wall_ahead += 20.0
            assert poller.wait_for_polls(poller.stats.polls + 2, 20)
            emu.cancel(event)  # from inside the VM a Freeze that ran is simply gone
            wait_until(lambda: of(tmp_path, event, TERMINAL), 20, "terminal record")
    data = terminal(tmp_path, event)
    assert data["Outcome"] == "completed" and data["Evidence"]["Used"] == ["paused"]
    assert 19.0 <= data["Evidence"]["PauseSeconds"] <= 21.0


def test_a_freeze_the_monotonic_clock_counts_is_a_pause(tmp_path: Path) -> None:
    """The guest's clocks both counted the Freeze: the agent's sleep between two polls ran 6 s long."""
    clocks = Clocks()
    stop = FreezableStop(clocks)
    with Emulator() as emu:
        with running(emu, tmp_path, monotonic=clocks.mono, stop=stop) as poller:
            event = _freeze_scheduled(emu, tmp_path)
            stop.freeze_next = 6.0
            assert stop.frozen.wait(20)
            assert poller.wait_for_polls(poller.stats.polls + 2, 20)
            emu.cancel(event)
            wait_until(lambda: of(tmp_path, event, TERMINAL), 20, "terminal record")
    data = terminal(tmp_path, event)
    assert data["Outcome"] == "completed" and data["Evidence"]["Used"] == ["paused"]
    assert 6.0 <= data["Evidence"]["PauseSeconds"] < 7.0
