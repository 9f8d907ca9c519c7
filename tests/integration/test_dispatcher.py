"""Per-sink delivery from the store: ordering, retry, rejects, dead letters, isolation, drain, faults."""
from __future__ import annotations

import threading
import time

import orjson
import pytest

from forwarder.delivery.dispatcher import Dispatcher
from forwarder.common.retry import Backoff
from forwarder.sinkapi import Ok, Record, Reject, Retry
from forwarder.store.database import Store


def recs(n, start=0):
    return [Record.from_dict({"id": f"id-{i}", "type": "t", "n": i}) for i in range(start, start + n)]


class ScriptedSink:
    """A real Sink implementation whose answers a test scripts (a peer, not a mock of our code)."""

    def __init__(self, max_batch=10, answer=None, gate: threading.Event | None = None):
        self.max_batch = max_batch
        self.answer = answer or (lambda batch, calls: Ok())
        self.gate = gate
        self.got: list[int] = []
        self.calls = 0
        self.cond = threading.Condition()
        self.closed = False

    def send(self, batch):
        if self.gate is not None:
            self.gate.wait()
        with self.cond:
            self.calls += 1
            result = self.answer(batch, self.calls)
            if isinstance(result, Ok):
                self.got += [r.to_dict()["n"] for r in batch]
                self.cond.notify_all()
            return result

    def wait_for(self, n, timeout=20):
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.got) < n and time.monotonic() < deadline:
                self.cond.wait(0.2)
            return len(self.got) >= n

    def close(self):
        self.closed = True


FAST = Backoff(initial=0.01, maximum=0.05)


def make(tmp_path, sinks, **kw):
    d = Dispatcher(Store.open(tmp_path), sinks, backoff=FAST, **kw)
    d.start()
    return d


def shut(d, timeout=5.0):
    d.close(timeout)
    d.store.close()


def test_in_order_after_transient_failures(tmp_path):
    sink = ScriptedSink(answer=lambda b, c: Retry("http_503") if c % 3 else Ok())
    d = make(tmp_path, {"s": sink})
    for i in range(0, 50, 5):
        d.store.commit(recs(5, i))
    assert sink.wait_for(50)
    assert sink.got == list(range(50))
    d.close(5)
    assert sink.closed


def test_dead_sink_does_not_delay_another(tmp_path):
    gate = threading.Event()
    stuck = ScriptedSink(gate=gate)
    ok = ScriptedSink()
    d = make(tmp_path, {"stuck": stuck, "ok": ok})
    d.store.commit(recs(20))
    assert ok.wait_for(20)
    assert stuck.got == []
    gate.set()
    assert stuck.wait_for(20)
    d.close(5)


def test_reject_in_a_batch_dead_letters_only_the_bad_record(tmp_path):
    def answer(batch, calls):
        ns = [r.to_dict()["n"] for r in batch]
        return Reject("http_400", "bad record 7") if 7 in ns else Ok()

    sink = ScriptedSink(answer=answer)
    d = make(tmp_path, {"s": sink})
    d.store.commit(recs(15))
    assert sink.wait_for(14)
    d.close(5)
    assert sink.got == [n for n in range(15) if n != 7]
    (letter,) = Store.open(tmp_path).dead_letters("s")
    assert letter.reason == "http_400" and letter.record.id == "id-7" and "bad record 7" in letter.detail


def test_max_age_moves_old_records_to_dead_letters(tmp_path):
    store = Store.open(tmp_path, clock=lambda: time.time() - 3600)  # records committed "an hour ago"
    store.commit(recs(3))
    store.close()
    sink = ScriptedSink()
    d = make(tmp_path, {"s": sink}, max_age={"s": 60})
    d.store.commit(recs(2, 3))
    assert sink.wait_for(2)
    d.close(5)
    assert sink.got == [3, 4]
    assert [dl.reason for dl in Store.open(tmp_path).dead_letters("s")] == ["max_age_exceeded"] * 3


def test_close_drains_then_halts_a_hanging_sink_and_keeps_its_records(tmp_path):
    hanging = ScriptedSink(answer=lambda b, c: Retry("timeout"))
    d = make(tmp_path, {"h": hanging})
    d.store.commit(recs(5))
    t0 = time.monotonic()
    d.close(0.5)
    assert time.monotonic() - t0 < 10
    store = Store.open(tmp_path)
    assert [orjson.loads(e.body)["n"] for e in store.read("h", store.cursor("h"), 10)] == [0, 1, 2, 3, 4]


def test_cursor_survives_restart_without_redelivery(tmp_path):
    sink = ScriptedSink()
    d = make(tmp_path, {"s": sink})
    d.store.commit(recs(10))
    assert sink.wait_for(10)
    d.close(5)
    again = ScriptedSink()
    d = make(tmp_path, {"s": again})
    d.store.commit(recs(1, 10))
    assert again.wait_for(1)
    d.close(5)
    assert again.got == [10]


def test_idle_workers_sleep_until_woken_yet_deliver_and_stop_at_once(tmp_path):
    # Idle workers wait up to IDLE_WAIT (a minute) so an idle agent does not tick; an append wakes
    # them for delivery, close() wakes them to stop, and a delivery's cursor is committed with it.
    sinks = {name: ScriptedSink() for name in ("a", "b")}
    d = make(tmp_path, sinks)
    other = Store.open(tmp_path)  # another connection, as `sefwd status` would read it

    def flushed(n: int) -> None:  # every cursor committed past the n-th record: the workers are idle
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(other.backlog(name, other.cursor(name)) == 0 for name in sinks):
                return
            time.sleep(0.05)
        raise AssertionError(f"cursors not committed at {n} within 10 s")

    d.store.commit(recs(3))
    assert all(s.wait_for(3, timeout=10) for s in sinks.values())
    flushed(3)
    d.store.commit(recs(2, 3))  # the workers are idle now: the append alone must wake them
    assert all(s.wait_for(5, timeout=10) for s in sinks.values())
    flushed(5)
    t0 = time.monotonic()
    d.close(5)
    assert time.monotonic() - t0 < 3  # not the minute an idle worker would otherwise sleep
    assert not any(w.thread.is_alive() for w in d.workers.values())


class Crash(BaseException):
    """Not an Exception: gets past the worker's own guard, so only the supervisor can help."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sink_that_raises_is_retried_and_a_dead_worker_is_restarted(tmp_path):
    def answer(batch, calls):
        if calls == 1:
            raise RuntimeError("sink bug")
        if calls == 2:
            raise Crash()
        return Ok()

    sink = ScriptedSink(answer=answer)
    d = make(tmp_path, {"s": sink}, supervise_every=0.1)
    d.store.commit(recs(5))
    assert sink.wait_for(5)
    assert sink.got == list(range(5))
    figures = d.snapshot()["sinks"]["s"]
    assert figures["restarts"] == 1 and figures["store_errors"] >= 1 and "sink bug" in str(figures["last_error"])
    shut(d)


def test_a_sink_failing_for_long_is_reported_stuck_and_recovers(tmp_path):
    state = {"down": True}
    sink = ScriptedSink(answer=lambda b, c: Retry("http_503") if state["down"] else Ok())
    d = make(tmp_path, {"s": sink}, stuck_after=0.3)
    d.store.commit(recs(3))
    deadline = time.monotonic() + 20
    while not d.snapshot()["sinks"]["s"]["stuck"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.snapshot()["sinks"]["s"]["stuck"] is True and d.snapshot()["sinks"]["s"]["backlog"] == 3
    state["down"] = False
    assert sink.wait_for(3)
    assert d.snapshot()["sinks"]["s"]["stuck"] is False
    shut(d)
