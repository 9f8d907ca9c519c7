"""The maintenance state: a pure function of the committed documents and the clock."""
from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timedelta, timezone

import pytest

from forwarder.agent.maintenance import (
    MAINTENANCE, SERVING, SETTLING, MaintenancePolicy, MaintenanceTracker, StateFile, default_state_file,
    pending_counts, write_atomically,
)
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=timezone.utc)
VM = VmIdentity(vm_id="1", name="web-0", computer_name="web-0")


def rfc1123(moment: datetime) -> str:
    return moment.strftime("%a, %d %b %Y %H:%M:%S GMT")


def doc(*events: dict, incarnation: int = 1):
    full = []
    for i, e in enumerate(events):
        full.append({"EventId": e.get("id", f"E{i}"), "EventType": e.get("type", "Reboot"),
                     "ResourceType": "VirtualMachine", "Resources": e.get("resources", ["web-0"]),
                     "EventStatus": e.get("status", "Scheduled"),
                     "NotBefore": rfc1123(e["nb"]) if e.get("nb") else "", "Description": "", "EventSource": "Platform",
                     "DurationInSeconds": -1})
    return parse_document({"DocumentIncarnation": incarnation, "Events": full})


def tracker(**policy) -> MaintenanceTracker:
    return MaintenanceTracker(MaintenancePolicy(**policy), lambda: VM, clock=lambda: T0)


def test_no_event_is_serving_and_a_scheduled_event_is_maintenance_at_once():
    t = tracker()
    assert t.observe(doc(), T0).state == SERVING
    view = t.observe(doc({"nb": T0 + timedelta(minutes=15)}, incarnation=2), T0)
    assert view.state == MAINTENANCE and view.event.event_id == "E0" and view.seconds_left == 900
    body = view.as_dict()
    assert body == {"state": "maintenance", "EventId": "E0", "EventType": "Reboot", "EventStatus": "Scheduled",
                    "NotBefore": "2026-11-26T12:15:00.000Z", "seconds_left": 900, "until": "2026-11-26T12:15:00.000Z",
                    "DocumentIncarnation": 2}


def test_lead_opens_the_window_at_notbefore_minus_lead_by_the_clock_alone():
    t = tracker(lead=120.0)
    d = doc({"nb": T0 + timedelta(minutes=10)})
    before = t.observe(d, T0)
    assert before.state == SERVING and before.event.event_id == "E0" and before.seconds_left == 480
    assert before.changes_at <= T0 + timedelta(seconds=1)
    assert t.view(T0 + timedelta(seconds=479)).state == SERVING
    assert t.view(T0 + timedelta(seconds=480)).state == MAINTENANCE
    # Started opens it whatever the lead says; so does a Scheduled event without NotBefore.
    assert t.observe(doc({"status": "Started"}), T0).state == MAINTENANCE
    assert tracker(lead=120.0).observe(doc({"nb": None}), T0).state == MAINTENANCE


def test_ended_event_settles_then_serves():
    t = tracker(settle=60.0)
    t.observe(doc({"status": "Started"}), T0)
    ended = t.observe(doc(incarnation=2), T0 + timedelta(seconds=5))
    assert ended.state == SETTLING and ended.event.event_id == "E0" and ended.as_dict()["EventStatus"] == "Ended"
    assert ended.until == T0 + timedelta(seconds=65)
    assert t.view(T0 + timedelta(seconds=64)).state == SETTLING
    assert t.view(T0 + timedelta(seconds=65)).state == SERVING
    # Settle 0: serving as soon as the event is gone.
    z = tracker(settle=0.0)
    z.observe(doc({"status": "Started"}), T0)
    assert z.observe(doc(), T0).state == SERVING


def test_event_gone_before_its_window_opened_does_not_settle():
    t = tracker(lead=60.0, settle=60.0)
    t.observe(doc({"nb": T0 + timedelta(hours=2)}), T0)
    assert t.observe(doc(incarnation=2), T0 + timedelta(minutes=1)).state == SERVING


def test_only_configured_types_affecting_this_vm_count():
    t = tracker()
    assert t.observe(doc({"type": "Freeze"}), T0).state == SERVING  # not a default type
    assert t.observe(doc({"resources": ["web-1"]}, incarnation=2), T0).state == SERVING
    assert t.observe(doc({"resources": ["web-1", "WEB-0"]}, incarnation=3), T0).state == MAINTENANCE
    every = tracker(event_types=None)
    assert every.observe(doc({"type": "Freeze"}), T0).state == MAINTENANCE
    assert every.observe(doc({"type": "SomethingNew"}, incarnation=2), T0).state == MAINTENANCE


def test_an_unknown_own_name_counts_as_affected():
    t = MaintenanceTracker(MaintenancePolicy(), lambda: VmIdentity(), clock=lambda: T0)
    assert t.observe(doc({"resources": ["web-1"]}), T0).state == MAINTENANCE


def test_started_wins_over_scheduled_and_maintenance_over_settling():
    t = tracker(settle=60.0)
    t.observe(doc({"id": "A", "status": "Started"}, {"id": "B", "nb": T0 + timedelta(minutes=5)}), T0)
    assert t.view(T0).event.event_id == "A"
    view = t.observe(doc({"id": "B", "nb": T0 + timedelta(minutes=5)}, incarnation=2), T0)
    assert view.state == MAINTENANCE and view.event.event_id == "B"  # A settles meanwhile, B decides
    view = t.observe(doc(incarnation=3), T0 + timedelta(seconds=1))
    assert view.state == SETTLING and view.until == T0 + timedelta(seconds=61)


def test_an_event_that_comes_back_is_tracked_again_not_settling():
    t = tracker(settle=60.0)
    d1 = doc({"status": "Started"})
    t.observe(d1, T0)
    t.observe(doc(incarnation=2), T0)
    assert t.observe(doc({"status": "Started"}, incarnation=3), T0).state == MAINTENANCE


def test_same_document_object_is_not_re_read():
    calls = []
    t = MaintenanceTracker(MaintenancePolicy(), lambda: calls.append(1) or VM, clock=lambda: T0)
    d = doc({"status": "Started"})
    t.observe(d, T0)
    t.observe(d, T0 + timedelta(seconds=1))
    assert len(calls) == 1


def test_pending_counts_have_fixed_keys_and_bounded_values():
    d = doc({"id": "A"}, {"id": "B", "type": "Freeze", "status": "Started", "resources": ["web-9"]},
            {"id": "C", "type": "Weird", "status": "Odd"})
    counts = pending_counts(d, VM)
    assert len(counts) == 42 == len(pending_counts(None, VM))
    assert counts[("Reboot", "Scheduled", "true")] == 1
    assert counts[("Freeze", "Started", "false")] == 1
    assert counts[("other", "other", "true")] == 1
    assert sum(counts.values()) == 3


def test_seconds_to_not_before_is_the_earliest_affecting_this_vm():
    t = tracker()
    t.observe(doc({"id": "A", "nb": T0 + timedelta(minutes=10)}, {"id": "B", "nb": T0 + timedelta(minutes=2),
                                                                  "resources": ["web-1"]},
                  {"id": "C", "type": "Freeze", "nb": T0 + timedelta(minutes=5)}), T0)
    assert t.seconds_to_not_before(T0) == 300.0  # C (any type), not B (another VM)
    t.observe(doc(incarnation=2), T0)
    assert t.seconds_to_not_before(T0) is None


def test_state_file_is_replaced_atomically_and_rewritten_when_due(tmp_path):
    path = tmp_path / "run" / "maintenance.json"
    sf = StateFile(path, refresh=10.0)
    t = tracker()
    t.add_listener(sf)
    t.observe(doc({"status": "Started"}), T0)
    first = json.loads(path.read_text())
    assert first["state"] == "maintenance" and first["EventId"] == "E0"
    assert first["written_at"] == "2026-11-26T12:00:00.000Z" and first["stale_after"] == "2026-11-26T12:00:30.000Z"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    inode = os.stat(path).st_ino
    t.observe(t._snap.document, T0 + timedelta(seconds=5))  # same state, not due: untouched
    assert os.stat(path).st_ino == inode
    t.observe(t._snap.document, T0 + timedelta(seconds=10))  # due: a new file, renamed over
    assert os.stat(path).st_ino != inode
    assert json.loads(path.read_text())["written_at"] == "2026-11-26T12:00:10.000Z"
    assert [p.name for p in path.parent.iterdir()] == ["maintenance.json"]  # no temp file left
    sf.remove()
    assert not path.exists()


def test_state_file_write_failure_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    sf = StateFile(blocker / "maintenance.json", refresh=10.0)  # its directory is a file
    t = tracker()
    t.add_listener(sf)
    assert t.observe(doc(), T0).state == SERVING
    assert "cannot write the state file" in caplog.text


def test_write_atomically_leaves_no_temp_file_on_failure(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    with pytest.raises(OSError):
        write_atomically(target, b"{}")  # a directory cannot be replaced by a file
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and not list(target.iterdir())


def test_default_state_file(tmp_path):
    assert str(default_state_file(tmp_path, is_root=True)) == "/run/sefwd/maintenance.json"
    if not os.access("/run/sefwd", os.W_OK):
        assert default_state_file(tmp_path, is_root=False) == tmp_path / "maintenance.json"


def test_a_link_planted_at_the_state_file_is_replaced_never_followed(tmp_path):
    """A local user who can write the directory plants a symlink where the state file goes: the
    agent replaces the link (rename does not follow it) and leaves its target alone."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "maintenance.json").symlink_to(victim)
    sf = StateFile(run / "maintenance.json", refresh=10.0)
    t = tracker()
    t.add_listener(sf)
    t.observe(doc(), T0)
    assert victim.read_text() == "precious"
    assert not (run / "maintenance.json").is_symlink()
    assert json.loads((run / "maintenance.json").read_text())["state"] == "serving"
    (run / "maintenance.json").unlink()
    (run / "maintenance.json").symlink_to(victim)
    sf.remove()  # removes the link, not what it points to
    assert victim.read_text() == "precious"
