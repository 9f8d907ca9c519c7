"""Refused callback requests are audited at most once per reason and client per window, with a count."""
from __future__ import annotations

import threading

from forwarder.approval.refusals import RefusalAggregator, client_group


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusal(reason: str, client: str) -> dict[str, object]:
    return {"Outcome": "refused", "Reason": reason, "Client": client}


def counts(got: list[dict[str, object]]) -> list[tuple[object, object]]:
    return [(g["Client"], g["Count"]) for g in got]


def test_one_record_per_reason_and_client_per_window_the_first_at_once_later_ones_counted_into_the_next():
    got: list[dict[str, object]] = []
    clock = Clock()
    agg = RefusalAggregator(got.append, threading.Event(), window=60, clock=clock)
    for port in range(100):  # one client, many connections
        agg.submit(refusal("bad_signature", f"10.0.0.1:{port}"))
    agg.submit(refusal("missing_headers", "10.0.0.1:7"))  # another reason: its own record
    agg.submit(refusal("bad_signature", "[::1]:5"))
    assert counts(got) == [("10.0.0.1:0", 1), ("10.0.0.1:7", 1), ("[::1]:5", 1)]
    clock.now += 30
    agg.flush()
    assert len(got) == 3  # the window since the first record is still open
    clock.now += 30
    agg.flush()
    assert counts(got[3:]) == [("10.0.0.1:99", 99)]  # the rest of the window, one record, at its end
    for port in range(10):  # the next window: counted, not written at once
        agg.submit(refusal("bad_signature", f"10.0.0.1:{port}"))
    clock.now += 59
    agg.flush()
    assert len(got) == 4
    clock.now += 1
    agg.flush()
    assert counts(got[4:]) == [("10.0.0.1:9", 10)]
    clock.now += 61  # a quiet window: the key is forgotten, the next refusal is written at once
    agg.flush()
    agg.submit(refusal("bad_signature", "10.0.0.1:1"))
    assert counts(got[5:]) == [("10.0.0.1:1", 1)]
    tallied = [g["Count"] for g in got if g["Reason"] == "bad_signature" and str(g["Client"]).startswith("10.")]
    assert sum(tallied) == 100 + 10 + 1  # type: ignore[arg-type]  # every refusal counted once


def test_a_refusal_after_the_window_ended_carries_the_count_held_since_the_last_record():
    got: list[dict[str, object]] = []
    clock = Clock()
    agg = RefusalAggregator(got.append, threading.Event(), window=60, clock=clock)
    for _ in range(5):
        agg.submit(refusal("bad_signature", "10.0.0.1:1"))
    clock.now += 61  # the window ended with no flush in between (the flush runs every 5 s)
    agg.submit(refusal("bad_signature", "10.0.0.1:2"))
    assert counts(got) == [("10.0.0.1:1", 1), ("10.0.0.1:2", 5)]
    agg.flush(force=True)
    assert len(got) == 2


def test_ipv6_clients_are_grouped_by_64_as_the_connection_cap_groups_them():
    assert client_group("[2001:db8:1:2::a]:5") == client_group("[2001:db8:1:2:ffff::1]:9") == "2001:db8:1:2::/64"
    assert client_group("[2001:db8:1:3::a]:5") == "2001:db8:1:3::/64"
    assert client_group("[::ffff:10.0.0.1]:5") == client_group("10.0.0.1:6") == "10.0.0.1"
    assert client_group("unknown") == "unknown"
    got: list[dict[str, object]] = []
    agg = RefusalAggregator(got.append, threading.Event(), window=60, clock=Clock())
    for i in range(50):  # one host rotating through its /64
        agg.submit(refusal("bad_signature", f"[2001:db8:1:2::{i:x}]:{1000 + i}"))
    agg.submit(refusal("bad_signature", "[2001:db8:1:3::1]:1"))
    assert counts(got) == [("[2001:db8:1:2::0]:1000", 1), ("[2001:db8:1:3::1]:1", 1)]
    agg.flush(force=True)
    assert counts(got[2:]) == [("[2001:db8:1:2::31]:1049", 49)]


def test_rate_limited_requests_are_only_counted_and_other_outcomes_pass_through():
    got: list[dict[str, object]] = []
    clock = Clock()
    agg = RefusalAggregator(got.append, threading.Event(), window=60, clock=clock)
    for _ in range(500):
        agg.submit(refusal("rate_limited", "10.0.0.2:1"))
    agg.submit({"Outcome": "approved", "Reason": "approved"})
    assert got == [{"Outcome": "approved", "Reason": "approved"}]
    clock.now += 60
    agg.flush()
    assert got[-1]["Count"] == 500 and got[-1]["Reason"] == "rate_limited"
    agg.submit(refusal("rate_limited", "10.0.0.2:1"))  # never at once, even after a window
    assert len(got) == 2
    agg.flush(force=True)  # stopping writes what is counted
    assert got[-1]["Count"] == 1 and len(got) == 3
    agg.flush(force=True)
    assert len(got) == 3
