"""Refused callback requests are audited once per reason and client per window, with a count."""
from __future__ import annotations

import threading

from forwarder.approval.refusals import RefusalAggregator


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusal(reason: str, client: str) -> dict[str, object]:
    return {"Outcome": "refused", "Reason": reason, "Client": client}


def test_first_refusal_at_once_the_rest_as_one_count_per_window():
    got: list[dict[str, object]] = []
    clock = Clock()
    agg = RefusalAggregator(got.append, threading.Event(), window=60, clock=clock)
    for port in range(100):  # one client, many connections
        agg.submit(refusal("bad_signature", f"10.0.0.1:{port}"))
    agg.submit(refusal("bad_signature", "[::1]:5"))
    assert [(g["Client"], g["Count"]) for g in got] == [("10.0.0.1:0", 1), ("[::1]:5", 1)]
    clock.now += 30
    agg.flush()
    assert len(got) == 2  # the window is still open
    clock.now += 31
    agg.flush()
    assert got[-1]["Count"] == 99 and got[-1]["Reason"] == "bad_signature" and len(got) == 3
    agg.submit(refusal("bad_signature", "10.0.0.1:7"))  # a new window opens with an immediate record
    assert got[-1]["Count"] == 1 and len(got) == 4


def test_rate_limited_requests_are_only_counted_and_other_outcomes_pass_through():
    got: list[dict[str, object]] = []
    agg = RefusalAggregator(got.append, threading.Event(), window=60, clock=Clock())
    for _ in range(500):
        agg.submit(refusal("rate_limited", "10.0.0.2:1"))
    agg.submit({"Outcome": "approved", "Reason": "approved"})
    assert got == [{"Outcome": "approved", "Reason": "approved"}]
    agg.flush(force=True)
    assert got[-1]["Count"] == 500 and got[-1]["Reason"] == "rate_limited"
    agg.flush(force=True)
    assert len(got) == 2
