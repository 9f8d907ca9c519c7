"""A sink's health as the dispatcher reports it (issue 32): ok, failing since (latest error, count),
dead-lettering; degraded after the window or at the first dead letter; ok again after a delivery."""
from __future__ import annotations

import threading

from forwarder.agent.sink_health import describe_sink_health
from forwarder.agent.status import format_status, health
from forwarder.common.retry import Backoff
from forwarder.delivery.dispatcher import Dispatcher
from forwarder.sinkapi import Ok, Record, Reject, Result, Retry
from forwarder.store.database import Store
from tests.agent import wait_until

FAST = Backoff(initial=0.01, maximum=0.05)


class SwitchSink:
    """A sink whose answer the test sets: a peer of the dispatcher, not a mock of it."""

    max_batch = 1

    def __init__(self) -> None:
        self.answer: Result = Ok()
        self.delivered = 0
        self.lock = threading.Lock()

    def send(self, batch: list[Record]) -> Result:
        with self.lock:
            if isinstance(self.answer, Ok):
                self.delivered += len(batch)
            return self.answer

    def close(self) -> None:
        pass


def records(n: int, start: int = 0) -> list[Record]:
    return [Record.from_dict({"id": f"id-{i}", "type": "t", "n": i}) for i in range(start, start + n)]


def sink_health(d: Dispatcher) -> dict:
    return d.snapshot()["sinks"]["pager"]["health"]  # type: ignore[index]


def test_failing_then_degraded_after_the_window_with_the_latest_error_then_ok(tmp_path):
    sink = SwitchSink()
    sink.answer = Retry("connection_error")
    d = Dispatcher(Store.open(tmp_path), {"pager": sink}, backoff=FAST, stuck_after=0.5)
    d.start()
    try:
        d.store.commit(records(1))
        failing = wait_until(lambda: sink_health(d)["state"] == "failing" and sink_health(d), 10, "failing")
        assert failing["degraded"] is False and failing["failing_since"]
        sink.answer = Retry("http_503")
        degraded = wait_until(lambda: (h := sink_health(d))["degraded"] and h["last_error"] == "http_503" and h,
                              10, "degraded past the window, with the latest error")
        assert degraded["state"] == "failing" and degraded["errors"] >= 2
        text = describe_sink_health(degraded)
        assert text.startswith("failing since ") and "latest error http_503" in text
        sink.answer = Ok()
        wait_until(lambda: sink.delivered == 1, 10, "the delivery")
        recovered = wait_until(lambda: sink_health(d)["state"] == "ok" and sink_health(d), 10, "ok again")
        assert recovered["degraded"] is False and recovered["errors"] == 0 and recovered["last_error"] is None
    finally:
        d.close(5)
        d.store.close()


def test_a_refused_record_makes_the_sink_dead_lettering_at_once_until_a_delivery(tmp_path):
    sink = SwitchSink()
    sink.answer = Reject("http_400", "bad request")
    d = Dispatcher(Store.open(tmp_path), {"pager": sink}, backoff=FAST, stuck_after=3600)
    d.start()
    try:
        d.store.commit(records(2))
        h = wait_until(lambda: (h := sink_health(d))["state"] == "dead_lettering" and h["errors"] == 2 and h, 10,
                       "dead-lettering")
        assert h["degraded"] is True and h["last_error"] == "http_400"  # at once, not after the window
        report = {"running": True, "agent": {"imds": {}, "sinks": d.snapshot()["sinks"]}, "backlog": {},
                  "dead_letters": {"pager": 2}, "lost": {}, "actions": {}, "state_dir": str(tmp_path)}
        state, reasons = health(report)
        assert state == "degraded" and reasons == [f"sink pager is {describe_sink_health(h)}"]
        page = format_status(report)
        assert "sink pager: dead-lettering since" in page and "[DEGRADED]" in page and "latest error http_400" in page
        assert "None" not in page
        sink.answer = Ok()
        d.store.commit(records(1, 2))
        wait_until(lambda: sink_health(d)["state"] == "ok", 10, "ok after a delivery")
    finally:
        d.close(5)
        d.store.close()
