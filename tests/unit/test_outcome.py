"""completed / canceled / unknown from evidence, over the documented sequences (issue 13)."""
from __future__ import annotations

import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.imds.differ import CANCELED, COMPLETED, GONE, diff
from forwarder.imds.document import Document, parse_document
from forwarder.imds.evidence import (
    BY_BOOT_TIME, BY_PROCESS, EvidenceTracker, evidence_from_dict, evidence_to_dict, read_boot_id, read_boot_time,
    rebooted_by_boot_time,
)
from forwarder.imds.outcome import (
    APPROVAL_ACCEPTED, CANCEL_MARGIN, GONE_BEFORE_NOT_BEFORE, INCARNATION_JUMP, NO_APPROVAL, NO_REBOOT,
    NO_UNSEEN_STATES, OUTCOMES, PAUSED, REBOOTED, SEEN_STARTED, UNKNOWN, EvidenceContext, fold, terminal_key,
)
from forwarder.imds.outcome import CANCELED as OUT_CANCELED
from forwarder.imds.outcome import COMPLETED as OUT_COMPLETED
from tests.conftest import examples

# The real capture (Azure/vm-scheduled-events README): seen 04:36:08, approved 04:36:08,
# gone 04:37:09, NotBefore 04:50:17, DocumentIncarnation 2 -> 4.
EVENT_ID = "4CAEA225-A741-474D-A72E-428C86FCD853"
NOT_BEFORE = "Thu, 22 Jul 2021 04:50:17 GMT"
APPROVED_AT = datetime(2021, 7, 22, 4, 36, 8, tzinfo=timezone.utc)
GONE_AT = datetime(2021, 7, 22, 4, 37, 9, tzinfo=timezone.utc)
DUE = datetime(2021, 7, 22, 4, 51, 0, tzinfo=timezone.utc)
THIS_VM = frozenset({"flatcar-vm1"})


def doc(incarnation: int | str | None, *events: dict) -> Document:
    return parse_document(orjson.dumps({"DocumentIncarnation": incarnation, "Events": list(events)}))


def ev(status: str = "Scheduled", event_type: str = "Reboot", event_id: str = EVENT_ID, **extra: object) -> dict:
    return {"EventId": event_id, "EventStatus": status, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": ["flatcar-vm1"], "NotBefore": NOT_BEFORE if status == "Scheduled" else "",
            "Description": "", "EventSource": "User", "DurationInSeconds": -1, **extra}


def ended(before: Document, after: Document, context: EvidenceContext):
    (change,) = diff(before, after, context.now, context)
    assert change.outcome is not None
    return change


def test_early_approval_then_vanish_with_incarnation_jump_2_to_4_is_completed() -> None:
    ctx = EvidenceContext(now=GONE_AT, approvals={EVENT_ID.lower(): APPROVED_AT}, vm_names=THIS_VM)
    change = ended(doc(2, ev()), doc(4), ctx)
    assert change.kind == COMPLETED
    assert change.outcome.used == (APPROVAL_ACCEPTED, INCARNATION_JUMP)
    data = change.outcome.to_data()
    assert data["Outcome"] == "completed" and data["Evidence"]["UnseenStates"] == 1
    assert data["Evidence"]["ApprovedAt"] == "2021-07-22T04:36:08Z"
    assert data["Evidence"]["SecondsBeforeNotBefore"] == 788.0


def test_the_same_vanish_without_approval_is_unknown_not_canceled() -> None:
    """Another VM may have approved it: the jump says states were missed, not that it ran."""
    change = ended(doc(2, ev()), doc(4), EvidenceContext(now=GONE_AT, vm_names=THIS_VM))
    assert (change.kind, change.outcome.outcome, change.outcome.used) == (GONE, UNKNOWN, ())


def test_incarnation_jump_while_due_is_completed() -> None:
    change = ended(doc(2, ev()), doc(5), EvidenceContext(now=DUE, vm_names=THIS_VM))
    assert change.kind == COMPLETED and change.outcome.used == (INCARNATION_JUMP,)


def test_a_jump_is_never_explained_away_by_other_visible_changes() -> None:
    """2 -> 4 adding one event and removing another: one document step can hold both changes, so
    a document was unseen (it may have shown the removed event Started): no cancel (issue 20)."""
    other = ev(event_id="OTHER")
    changes = diff(doc(2, ev()), doc(4, other), GONE_AT, EvidenceContext(now=GONE_AT, vm_names=THIS_VM))
    (gone,) = [c for c in changes if c.event.event_id == EVENT_ID]
    assert gone.kind == GONE and gone.outcome.facts["UnseenStates"] == 1


def test_reboot_while_started_is_completed_with_both_pieces_of_evidence() -> None:
    ctx = EvidenceContext(now=DUE, rebooted=True, vm_names=THIS_VM)
    change = ended(doc(3, ev("Started")), doc(4), ctx)
    assert change.kind == COMPLETED and change.outcome.used == (SEEN_STARTED, REBOOTED)


def test_reboot_of_this_vm_while_scheduled_is_completed_only_for_types_that_reboot_it() -> None:
    ctx = EvidenceContext(now=GONE_AT, rebooted=True, vm_names=THIS_VM)
    for event_type in ("Reboot", "Redeploy", "Preempt", "Terminate"):
        change = ended(doc(2, ev(event_type=event_type)), doc(3), ctx)
        assert change.kind == COMPLETED and change.outcome.used == (REBOOTED,), event_type
    assert ended(doc(2, ev(event_type="Freeze")), doc(3), ctx).kind == GONE
    # A reboot of this VM says nothing about an event of other VMs.
    elsewhere = ev(Resources=["other-vm"])
    assert ended(doc(2, elsewhere), doc(3), ctx).kind == GONE
    # Not knowing our own name, the reboot is not used.
    assert ended(doc(2, ev()), doc(3), EvidenceContext(now=GONE_AT, rebooted=True)).kind == GONE


def test_freeze_pause_is_completed() -> None:
    freeze = ev(event_type="Freeze", DurationInSeconds=5)
    ctx = EvidenceContext(now=GONE_AT, pause_seconds=4.5, vm_names=THIS_VM)
    change = ended(doc(2, freeze), doc(3), ctx)
    assert change.kind == COMPLETED and change.outcome.used == (PAUSED,)
    assert change.outcome.facts["PauseSeconds"] == 4.5
    # A short hiccup is no pause, and no proof of a cancel either.
    assert ended(doc(2, freeze), doc(3), EvidenceContext(now=GONE_AT, pause_seconds=0.2, vm_names=THIS_VM)).kind \
        == CANCELED


def test_cancellation_well_before_not_before_is_canceled_with_its_evidence() -> None:
    change = ended(doc(2, ev()), doc(3), EvidenceContext(now=GONE_AT, vm_names=THIS_VM))
    assert change.kind == CANCELED
    assert change.outcome.used == (GONE_BEFORE_NOT_BEFORE, NO_APPROVAL, NO_UNSEEN_STATES, NO_REBOOT)
    assert change.removal_reason == "gone_before_notbefore"


def test_no_removal_reason_contradicts_the_outcome() -> None:
    """Issue 20, item 9: RemovalReason names where the event was, never a conclusion."""
    approved = EvidenceContext(now=GONE_AT, approvals={EVENT_ID.lower(): APPROVED_AT}, vm_names=THIS_VM)
    completed = ended(doc(2, ev()), doc(3), approved)
    unknown = ended(doc(2, ev()), doc(3), EvidenceContext(now=GONE_AT, rebooted=None))
    assert (completed.kind, unknown.kind) == (COMPLETED, GONE)
    for change in (completed, unknown):
        assert change.removal_reason == "gone_before_notbefore" and "cancel" not in change.removal_reason


def test_one_step_that_removes_an_event_and_updates_another_after_a_hidden_started_is_no_cancel() -> None:
    """Issue 20, item 2: 2 -> 4 hides a document (A Started, approved by another VM); the step to 4
    removes A and updates B: two visible changes, yet one document was never seen."""
    other = ev(event_id="B0000000-0000-0000-0000-00000000000B")
    moved = {**other, "NotBefore": "Thu, 22 Jul 2021 05:10:17 GMT"}
    ctx = EvidenceContext(now=GONE_AT, vm_names=THIS_VM)
    changes = diff(doc(2, ev(), other), doc(4, moved), GONE_AT, ctx)
    gone = [c for c in changes if c.outcome is not None]
    assert [c.kind for c in changes if c.outcome is None] == ["updated"]
    assert len(gone) == 1 and gone[0].kind == GONE and gone[0].outcome.outcome == UNKNOWN
    assert gone[0].outcome.facts["UnseenStates"] == 1
    # The same two changes in a step of exactly one: no document unseen, the cancel stands.
    (one_step,) = [c for c in diff(doc(2, ev(), other), doc(3, moved), GONE_AT, ctx) if c.outcome is not None]
    assert one_step.kind == CANCELED and one_step.outcome.facts["UnseenStates"] == 0


def test_a_step_larger_than_one_means_unseen_documents_whatever_changed() -> None:
    ctx = EvidenceContext(now=GONE_AT, vm_names=THIS_VM)
    many = [ev(event_id=f"{i:08d}-0000-0000-0000-000000000000") for i in range(5)]
    # Five events gone in a step of 3: no count of visible changes explains the unseen documents away.
    changes = diff(doc(2, *many), doc(5), GONE_AT, ctx)
    assert {c.kind for c in changes} == {GONE} and {c.outcome.facts["UnseenStates"] for c in changes} == {2}
    # The incarnation did not move although the document changed: nothing can be told.
    (same,) = diff(doc(2, ev()), doc(2), GONE_AT, ctx)
    assert same.kind == GONE and same.outcome.facts["UnseenStates"] is None


def test_no_cancel_without_knowing_enough() -> None:
    near = datetime(2021, 7, 22, 4, 50, 17, tzinfo=timezone.utc) - timedelta(seconds=CANCEL_MARGIN - 1)
    cases = [
        (doc(2, ev()), doc(3), EvidenceContext(now=near)),  # too close to NotBefore
        (doc(2, ev()), doc(3), EvidenceContext(now=GONE_AT, rebooted=None)),  # reboot unknown (restart, no boot id)
        (doc("a", ev()), doc("b"), EvidenceContext(now=GONE_AT)),  # opaque incarnations: a jump can't be excluded
        (doc(7, ev()), doc(2), EvidenceContext(now=GONE_AT)),  # the counter went back: no telling
        (doc(2, ev()), doc(3), EvidenceContext(now=DUE)),  # gone after NotBefore, no jump: ran or canceled
    ]
    for before, after, ctx in cases:
        assert ended(before, after, ctx).kind == GONE


def test_agent_down_across_the_whole_event() -> None:
    """Saved document: Scheduled at incarnation 2. The agent restarts (same boot) after NotBefore: 2 -> 5."""
    tracker = evidence_from_dict({"format": 1, "seen_boot_id": "boot-a", "approvals": {}}, "boot-a")
    change = ended(doc(2, ev()), doc(5), tracker.context(DUE, ["flatcar-vm1"]))
    assert change.kind == COMPLETED and change.outcome.used == (INCARNATION_JUMP,)
    # Down across it and rebooted by it (a Reboot of this VM): the boot id tells.
    tracker = evidence_from_dict({"format": 1, "seen_boot_id": "boot-a", "approvals": {}}, "boot-b")
    change = ended(doc(2, ev()), doc(3), tracker.context(GONE_AT, ["flatcar-vm1"]))
    assert change.kind == COMPLETED and change.outcome.used == (REBOOTED,)


def test_an_approval_recorded_by_sefwd_approve_survives_a_restart() -> None:
    tracker = EvidenceTracker("boot-a", "boot-a")
    tracker.approval_accepted([EVENT_ID], APPROVED_AT)  # the audit entry the CLI spooled
    saved = orjson.loads(orjson.dumps(evidence_to_dict(tracker)))
    restored = evidence_from_dict(saved, "boot-a")
    assert restored.rebooted is False
    change = ended(doc(2, ev()), doc(3), restored.context(GONE_AT, ["flatcar-vm1"]))
    assert change.kind == COMPLETED and change.outcome.used == (APPROVAL_ACCEPTED,)


def test_tracker_pause_boot_id_and_bad_saved_evidence(tmp_path: Path) -> None:
    t0 = datetime(2021, 7, 22, 4, 36, 0, tzinfo=timezone.utc)
    tracker = EvidenceTracker("b", "b")
    tracker.observe_poll(100.0, t0)
    tracker.observe_sleep(1.0, 1.02)  # woke up 20 ms late: scheduling noise
    tracker.observe_poll(101.0, t0 + timedelta(seconds=1))
    assert tracker.pause_seconds < 0.1
    tracker.observe_poll(102.0, t0 + timedelta(seconds=6))  # wall clock ran 5 s, monotonic 1 s
    assert tracker.pause_seconds == 4.0
    tracker.observe_sleep(1.0, 7.0)  # asked for 1 s, slept 7 s on the monotonic clock
    tracker.observe_poll(110.0, t0 + timedelta(seconds=14))
    assert tracker.pause_seconds == 6.0
    tracker.document_committed()
    assert tracker.pause_seconds == 0.0
    for bad in (None, [], {"format": 99}, "x"):
        assert evidence_from_dict(bad, "b").rebooted is None  # unknown: never a cancel
    junk = evidence_from_dict({"format": 1, "seen_boot_id": 7, "approvals": {"x": "not a time", "y": 3},
                               "seen_boot_time": "1", "seen_at": True}, "b", 1000.0)
    assert junk.approvals == {} and junk.rebooted is None and junk.seen_boot_time is None and junk.seen_at is None
    path = tmp_path / "boot_id"
    path.write_text("0b9c6d2e-6f5c-4b8e-9a55-5a0a3f7a1e21\n")
    assert read_boot_id(path) == "0b9c6d2e-6f5c-4b8e-9a55-5a0a3f7a1e21"
    assert read_boot_id(tmp_path / "missing") is None


def test_slow_work_between_polls_is_no_pause() -> None:
    """A 4 s IMDS answer, then a 3 s identity refresh and a heartbeat commit: both clocks ran, nothing overslept."""
    t0 = datetime(2021, 7, 22, 4, 36, 0, tzinfo=timezone.utc)
    tracker = EvidenceTracker(None, None)
    tracker.observe_poll(100.0, t0)
    tracker.observe_sleep(1.0, 1.0)
    tracker.observe_poll(101.0, t0 + timedelta(seconds=1))  # this request takes 4 s, then 3 s of work
    tracker.observe_sleep(0.0, 0.001)  # the fixed-rate loop is behind: it does not sleep at all
    tracker.observe_poll(108.0, t0 + timedelta(seconds=8))
    assert tracker.pause_seconds < 0.01


def test_a_document_this_process_saw_means_no_reboot_without_boot_id_or_boot_time() -> None:
    tracker = evidence_from_dict({"format": 1, "seen_boot_id": None, "approvals": {}}, None, None)
    assert tracker.rebooted is None and tracker.rebooted_by is None
    assert tracker.document_seen(1000.0) is True and tracker.document_seen(1001.0) is False
    assert tracker.rebooted is False and tracker.rebooted_by == BY_PROCESS
    change = ended(doc(2, ev()), doc(3), tracker.context(GONE_AT, ["flatcar-vm1"]))
    assert change.kind == CANCELED and change.outcome.facts["RebootedBy"] == "process"


def test_boot_time_tells_a_reboot_where_there_is_no_boot_id(tmp_path: Path) -> None:
    booted, seen = 1_700_000_000.0, 1_700_003_600.0  # the document was seen an hour after boot
    saved = {"format": 1, "seen_boot_id": None, "seen_boot_time": booted, "seen_at": seen, "approvals": {}}
    same = evidence_from_dict(saved, None, booted + 1.0)  # /proc/stat btime read again, 1 s of rounding
    assert (same.rebooted, same.rebooted_by) == (False, BY_BOOT_TIME)
    again = evidence_from_dict(saved, None, seen + 120.0)  # booted two minutes after the sighting
    assert (again.rebooted, again.rebooted_by) == (True, BY_BOOT_TIME)
    change = ended(doc(2, ev()), doc(3), again.context(GONE_AT, ["flatcar-vm1"]))
    assert change.kind == COMPLETED and change.outcome.used == (REBOOTED,)
    assert change.outcome.facts["RebootedBy"] == "boot_time"
    stepped = evidence_from_dict(saved, None, booted - 600.0)  # the wall clock was stepped back: no telling
    assert stepped.rebooted is None
    assert rebooted_by_boot_time(seen - 30.0, booted, seen) is None  # moved, but not past the sighting
    assert rebooted_by_boot_time(None, booted, seen) is None
    # A boot id, when there is one, decides before the boot time.
    assert evidence_from_dict({**saved, "seen_boot_id": "a"}, "a", seen + 120.0).rebooted is False
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nintr 5\nbtime 1700000000\nprocesses 9\n")
    assert read_boot_time(stat) == 1_700_000_000.0
    assert read_boot_time(tmp_path / "missing") is None or sys.platform == "win32"
    if Path("/proc/stat").is_file():
        assert read_boot_time() is not None and read_boot_time() <= time.time()  # type: ignore[operator]


def test_saved_evidence_keeps_the_boot_of_the_last_sighting() -> None:
    tracker = evidence_from_dict({"format": 1, "seen_boot_id": "boot-a", "seen_boot_time": 10.0, "seen_at": 50.0,
                                  "approvals": {}}, "boot-b", 500.0)
    assert tracker.rebooted is True
    tracker.document_seen(900.0)  # this process, at boot-b, saw the same document again
    saved = evidence_to_dict(tracker)
    assert (saved["seen_boot_id"], saved["seen_boot_time"], saved["seen_at"]) == ("boot-b", 500.0, 900.0)
    assert evidence_from_dict(saved, "boot-b", 500.0).rebooted is False  # a later restart, no reboot


def test_terminal_key_is_the_same_whatever_the_outcome() -> None:
    assert terminal_key(EVENT_ID) == f"{EVENT_ID}:ended"


@given(st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=8))
@settings(max_examples=examples(200), deadline=None)
def test_fold_completed_beats_unknown_beats_canceled(outcomes: list[str]) -> None:
    folded = fold(outcomes)
    if OUT_COMPLETED in outcomes:
        assert folded == OUT_COMPLETED
    elif UNKNOWN in outcomes:
        assert folded == UNKNOWN
    else:
        assert folded == OUT_CANCELED
    assert fold(reversed(outcomes)) == folded  # order of arrival does not matter


@given(st.booleans(), st.booleans(), st.integers(0, 3), st.sampled_from([None, False, True]),
       st.floats(0, 10), st.integers(-3600, 3600), st.sampled_from(["Freeze", "Reboot", "Redeploy", "Preempt",
                                                                      "Terminate"]))
@settings(max_examples=examples(300), deadline=None)
def test_canceled_only_with_all_the_evidence(started: bool, approved: bool, unseen: int, rebooted: bool | None,
                                             pause: float, ahead: int, event_type: str) -> None:
    not_before = GONE_AT + timedelta(seconds=ahead)
    event = doc(2, ev("Started" if started else "Scheduled", event_type,
                      NotBefore="" if started else not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"))).events[0]
    ctx = EvidenceContext(now=GONE_AT, approvals={EVENT_ID.lower(): APPROVED_AT} if approved else {},
                          rebooted=rebooted, pause_seconds=pause, vm_names=THIS_VM)
    from forwarder.imds.outcome import decide

    outcome = decide(event, ctx, unseen)
    if outcome.outcome == OUT_CANCELED:
        assert not started and not approved and unseen == 0 and rebooted is False and ahead >= CANCEL_MARGIN
    if started or approved:
        assert outcome.outcome == OUT_COMPLETED
    assert outcome.outcome == OUT_COMPLETED or not any(
        u in outcome.used for u in (SEEN_STARTED, APPROVAL_ACCEPTED, REBOOTED, PAUSED, INCARNATION_JUMP))
