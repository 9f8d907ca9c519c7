"""Hostile values in an IMDS document: each is bounded (raw kept) or refused, never a crash later."""
from __future__ import annotations

import logging
from datetime import datetime, timezone

import orjson
import pytest

from forwarder.imds.differ import diff
from forwarder.imds.document import EXTRA_DEPTH_MAX, EXTRA_FIELD_MAX, TRUNCATED, parse_document, warn_once
from forwarder.errors import DocumentError
from forwarder.imds.identity import VmIdentity
from forwarder.common.logs import OnceLog
from forwarder.records import RecordFactory

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)
BIG = 123456789012345678901234567890


def records_of(body: bytes) -> list[dict]:
    """The whole downstream path: parse, diff, records, serialized bytes, a heartbeat."""
    document = parse_document(body)
    factory = RecordFactory(VmIdentity(vm_id="v", name="myVM"), "2020-07-01", clock=lambda: NOW)
    out = [orjson.loads(r.body) for r in factory.for_changes(diff(None, document, NOW), document)]
    factory.lifecycle("heartbeat", {"DocumentIncarnation": document.incarnation})
    return out


def test_duration_wider_than_64_bits_is_dropped_with_its_raw_text():
    (rec,) = records_of(b'{"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "DurationInSeconds": %d}]}' % BIG)
    assert rec["data"]["DurationInSeconds"] is None
    assert rec["data"]["DurationInSecondsRaw"] in (str(BIG), "1.2345678901234568e+29")  # JSON parsers read it as a float


@pytest.mark.parametrize("value", [1e300, -2, 10**12, "99999999999999"])
def test_duration_beyond_what_imds_sends_is_dropped(value):
    (rec,) = records_of(orjson.dumps({"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "DurationInSeconds": value}]}))
    assert rec["data"]["DurationInSeconds"] is None and rec["data"]["DurationInSecondsRaw"]


@pytest.mark.parametrize("value", [-1, 0, 5, 3600, "10"])
def test_duration_the_platform_sends_is_kept(value):
    (rec,) = records_of(orjson.dumps({"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "DurationInSeconds": value}]}))
    assert rec["data"]["DurationInSeconds"] == int(value) and "DurationInSecondsRaw" not in rec["data"]


def test_incarnation_wider_than_64_bits_becomes_an_opaque_text():
    (rec,) = records_of(b'{"DocumentIncarnation": %d, "Events": [{"EventId": "E1"}]}' % BIG)
    assert rec["data"]["DocumentIncarnation"] in (str(BIG), "1.2345678901234568e+29")


def test_incarnation_text_too_long_is_a_bad_document():
    with pytest.raises(DocumentError, match="DocumentIncarnation"):
        parse_document(orjson.dumps({"DocumentIncarnation": "x" * 1000, "Events": []}))


@pytest.mark.parametrize("raw", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00",
                                 "0100-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "Mon, 19 Sep 99999 18:29:47 GMT"])
def test_not_before_outside_the_representable_range_is_null_with_the_raw_kept(raw):
    (rec,) = records_of(orjson.dumps({"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "NotBefore": raw}]}))
    assert rec["data"]["NotBefore"] is None and rec["data"]["NotBeforeRaw"] == raw


@pytest.mark.parametrize(("raw", "why"), [
    ("0001-01-01T00:00:00+01:00", "leaves the representable date range when converted to UTC"),
    ("0100-01-01T00:00:00Z", "is outside the years 1970-9000"),
    ("next tuesday", "is neither an RFC 1123 nor an ISO 8601 time"),
])
def test_a_dropped_not_before_is_logged_once_saying_what_was_wrong(caplog, raw, why):
    warn_once.clear()
    body = orjson.dumps({"DocumentIncarnation": 1, "Events": [{"EventId": "NB-1", "NotBefore": raw}]})
    with caplog.at_level("WARNING", logger="forwarder.imds.document"):
        for _ in range(3):  # the same document at every poll (and the saved one at a restart)
            assert parse_document(body).events[0].not_before is None
    lines = [r.getMessage() for r in caplog.records if "NotBefore" in r.getMessage()]
    assert lines == [f"Events[0] (EventId NB-1): NotBefore {raw!r} {why}; NotBefore is null, the text kept as "
                     "NotBeforeRaw"], lines
    caplog.clear()
    # Another event with the same text, or the same event with another text, is a new problem.
    parse_document(orjson.dumps({"DocumentIncarnation": 2, "Events": [
        {"EventId": "NB-1", "NotBefore": raw + " "}, {"EventId": "NB-2", "NotBefore": raw}]}))
    assert len([r for r in caplog.records if "NotBefore" in r.getMessage()]) == 2


def test_a_refused_document_reports_no_bounded_values(caplog):
    warn_once.clear()
    body = orjson.dumps({"DocumentIncarnation": 1, "Events": [{"EventId": "NB-3", "NotBefore": "0001-01-01T00:00:00Z"},
                                                              {"EventId": "NB-3"}]})
    with caplog.at_level("WARNING", logger="forwarder.imds.document"), pytest.raises(DocumentError, match="twice"):
        parse_document(body)
    assert "NotBefore" not in caplog.text


def test_duration_and_incarnation_bounds_are_logged_once(caplog):
    warn_once.clear()
    body = b'{"DocumentIncarnation": 18446744073709551617, "Events": [{"EventId": "D-1", "DurationInSeconds": 10000000000}]}'
    with caplog.at_level("WARNING", logger="forwarder.imds.document"):
        parse_document(body)
        parse_document(body)
    text = [r.getMessage() for r in caplog.records]
    assert len(text) == 2, text
    assert "DocumentIncarnation" in text[0] and "wider than 64 bits" in text[0]  # (orjson reads it as a float)
    assert "Events[0] (EventId D-1): DurationInSeconds 10000000000 is beyond what IMDS sends" in text[1]


def test_once_log_bounds_its_memory_and_its_rate(caplog):
    now = [0.0]
    once = OnceLog(logging.getLogger("test.once"), keep=3, burst=2, interval=60, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="test.once"):
        assert once.warning("a", "A") and not once.warning("a", "A again")
        assert once.warning("b", "B")
        assert not once.warning("c", "C") and not once.warning("d", "D")  # the burst of 2 a minute is spent
        now[0] = 61.0
        assert once.warning("e", "E")  # says how many were held back
        assert once.warning("a", "A is new again")  # remembers only the 3 most recent keys (c, d, e)
    assert [r.getMessage() for r in caplog.records] == [
        "A", "B", "E (2 similar warning(s) held back before this one)", "A is new again"]


def test_deeply_nested_unknown_field_is_kept_truncated_and_marked(caplog):
    warn_once.clear()
    body = b'{"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "Future": ' + b"[" * 300 + b"]" * 300 + b"}]}"
    (rec,) = records_of(body)
    kept = rec["data"]["Extra"]["Future"]
    depth = 0
    while isinstance(kept, list):
        kept, depth = kept[0], depth + 1
    assert kept == TRUNCATED and depth == EXTRA_DEPTH_MAX
    assert "Future" in caplog.text and "truncated" in caplog.text


def test_unknown_field_with_huge_numbers_and_size_is_bounded():
    body = orjson.dumps({"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "Blob": "x" * 100_000}]})
    body = body.replace(b'"EventId"', b'"Num": %d, "EventId"' % BIG)
    (rec,) = records_of(body)
    extra = rec["data"]["Extra"]
    assert isinstance(extra["Num"], (str, float))  # serializable whatever the parser made of it
    assert extra["Blob"].endswith(TRUNCATED) and len(extra["Blob"]) <= EXTRA_FIELD_MAX + len(TRUNCATED)


@pytest.mark.parametrize("body, words", [
    (b'{"DocumentIncarnation": 1, "Events": null}', "got null"),
    (b'{"DocumentIncarnation": 1, "Events": {}}', "got dict"),
    (b'{"DocumentIncarnation": 1, "Events": "none"}', "got str"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "E\\r\\nX: 1"}]}', "control"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "' + b"A" * 300 + b'"}]}', "at most 256"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "   "}]}', "non-empty"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "Resources": [1]}]}', "Resources"),
    (b'{"DocumentIncarnation": 1, "Events": [{"EventId": "\\ud800"}]}', "not JSON"),
])
def test_bad_documents_are_refused_with_a_clear_reason(body, words):
    with pytest.raises(DocumentError, match=words):
        parse_document(body)


def test_unsigned_64_bit_integers_are_kept_as_text():
    body = b'{"DocumentIncarnation": 18446744073709551615, "Events": [{"EventId": "E1", "DurationInSeconds": 18446744073709551615, "N": 18446744073709551615}]}'
    (rec,) = records_of(body)
    assert rec["data"]["DocumentIncarnation"] == "18446744073709551615"
    assert rec["data"]["DurationInSecondsRaw"] == "18446744073709551615"
    assert rec["data"]["Extra"]["N"] == "18446744073709551615"
