"""Approvals the agent did not make (issue 23): ``early_start`` on Scheduled -> Started, the
``approved_elsewhere`` evidence, and its persistence in the saved evidence."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import orjson

from forwarder.imds.differ import COMPLETED, STARTED, diff
from forwarder.imds.document import Document, parse_document
from forwarder.imds.evidence import MAX_APPROVALS, EvidenceTracker, evidence_from_dict, evidence_to_dict
from forwarder.imds.outcome import (
    APPROVAL_ACCEPTED, APPROVED_ELSEWHERE, CANCEL_MARGIN, SEEN_STARTED, EvidenceContext, decide,
)

EVENT_ID = "4CAEA225-A741-474D-A72E-428C86FCD853"
NOT_BEFORE = datetime(2021, 7, 22, 4, 50, 17, tzinfo=timezone.utc)
SEEN_AT = datetime(2021, 7, 22, 4, 36, 9, tzinfo=timezone.utc)


def doc(incarnation: int, status: str | None) -> Document:
    events = [] if status is None else [{
        "EventId": EVENT_ID, "EventStatus": status, "EventType": "Reboot", "ResourceType": "VirtualMachine",
        "Resources": ["vm-0"], "NotBefore": "Thu, 22 Jul 2021 04:50:17 GMT" if status == "Scheduled" else "",
        "Description": "", "EventSource": "User", "DurationInSeconds": -1}]
    return parse_document(orjson.dumps({"DocumentIncarnation": incarnation, "Events": events}))


def started(now: datetime, incarnations: tuple[int, int] = (2, 3), **context: object):
    (change,) = diff(doc(incarnations[0], "Scheduled"), doc(incarnations[1], "Started"), now,
                     EvidenceContext(now=now, **context))  # type: ignore[arg-type]
    assert change.kind == STARTED
    return change


def test_an_early_start_without_our_approval_was_approved_elsewhere() -> None:
    change = started(SEEN_AT)
    assert change.early_start == {"ApprovedBy": "elsewhere", "SecondsBeforeNotBefore": 848.0}


def test_an_early_start_we_approved_is_ours() -> None:
    change = started(SEEN_AT, approvals={EVENT_ID.lower(): SEEN_AT - timedelta(seconds=1)})
    assert change.early_start is not None and change.early_start["ApprovedBy"] == "this_vm"


def test_no_early_start_near_not_before_or_after_unseen_states() -> None:
    assert started(NOT_BEFORE - timedelta(seconds=CANCEL_MARGIN - 1)).early_start is None  # clock skew margin
    assert started(NOT_BEFORE + timedelta(seconds=5)).early_start is None
    # A document was missed: NotBefore may have moved earlier there, so nothing is claimed.
    assert started(SEEN_AT, incarnations=(2, 4)).early_start is None


def test_the_terminal_record_says_approved_elsewhere_and_our_approval_wins() -> None:
    last = doc(3, "Started").events[0]
    gone = SEEN_AT + timedelta(minutes=2)
    elsewhere = EvidenceContext(now=gone, approved_elsewhere={EVENT_ID.lower(): SEEN_AT})
    outcome = decide(last, elsewhere, 0)
    assert outcome.outcome == COMPLETED and outcome.used == (SEEN_STARTED, APPROVED_ELSEWHERE)
    assert outcome.facts["ApprovedElsewhereAt"] == "2021-07-22T04:36:09Z"
    both = EvidenceContext(now=gone, approvals={EVENT_ID.lower(): SEEN_AT}, approved_elsewhere={EVENT_ID.lower(): SEEN_AT})
    outcome = decide(last, both, 0)
    assert outcome.used == (SEEN_STARTED, APPROVAL_ACCEPTED) and outcome.facts["ApprovedElsewhereAt"] is None


def test_approved_elsewhere_survives_a_restart_and_junk_is_dropped() -> None:
    tracker = EvidenceTracker("boot-1", "boot-1")
    tracker.approval_seen_elsewhere([EVENT_ID], SEEN_AT)
    tracker.approval_seen_elsewhere([EVENT_ID], SEEN_AT + timedelta(hours=1))  # the first sighting stays
    saved = orjson.loads(orjson.dumps(evidence_to_dict(tracker)))
    restored = evidence_from_dict(saved, "boot-1")
    assert restored.approved_elsewhere == {EVENT_ID.lower(): SEEN_AT}
    assert restored.context(SEEN_AT, ["vm-0"]).approved_elsewhere == {EVENT_ID.lower(): SEEN_AT}
    saved["approved_elsewhere"] = {"a": "not a time", "b": "2021-07-22T04:36:09", 7: "x", "c": SEEN_AT.isoformat()}
    assert evidence_from_dict(saved, "boot-1").approved_elsewhere == {"c": SEEN_AT}  # naive times dropped too
    saved["approved_elsewhere"] = ["not", "a", "map"]
    assert evidence_from_dict(saved, "boot-1").approved_elsewhere == {}
    del saved["approved_elsewhere"]  # saved by an older agent
    assert evidence_from_dict(saved, "boot-1").approved_elsewhere == {}


def test_the_remembered_set_is_bounded() -> None:
    tracker = EvidenceTracker(None, None)
    for i in range(MAX_APPROVALS + 10):
        tracker.approval_seen_elsewhere([f"E{i}"], SEEN_AT + timedelta(seconds=i))
    assert len(tracker.approved_elsewhere) == MAX_APPROVALS and "e0" not in tracker.approved_elsewhere


def test_vanished_between_polls_after_an_approval_elsewhere_is_no_cancel() -> None:
    (change,) = diff(doc(2, "Scheduled"), doc(4, None), SEEN_AT, EvidenceContext(now=SEEN_AT, rebooted=False))
    assert change.outcome is not None and change.outcome.outcome != "canceled"
