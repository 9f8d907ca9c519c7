"""Per-sink delivery from the journal: ordering, retry, rejects, dead letters, isolation, drain."""
from __future__ import annotations

import threading
import time

import orjson

from forwarder.deadletter import DeadLetters
from forwarder.dispatcher import Dispatcher
from forwarder.journal import Journal
from forwarder.retry import Backoff
from forwarder.sinkapi import Ok, Record, Reject, Retry


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
    d = Dispatcher(Journal(tmp_path / "j"), sinks, tmp_path / "dl", backoff=FAST, **kw)
    d.start()
    return d


def test_in_order_after_transient_failures(tmp_path):
    sink = ScriptedSink(answer=lambda b, c: Retry("http_503") if c % 3 else Ok())
    d = make(tmp_path, {"s": sink})
    for i in range(0, 50, 5):
        d.append(recs(5, i))
    assert sink.wait_for(50)
    assert sink.got == list(range(50))
    d.close(5)
    assert sink.closed


def test_dead_sink_does_not_delay_another(tmp_path):
    gate = threading.Event()
    stuck = ScriptedSink(gate=gate)
    ok = ScriptedSink()
    d = make(tmp_path, {"stuck": stuck, "ok": ok})
    d.append(recs(20))
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
    d.append(recs(15))
    assert sink.wait_for(14)
    d.close(5)
    assert sink.got == [n for n in range(15) if n != 7]
    (letter,) = list(DeadLetters(tmp_path / "dl", "s"))
    assert letter.reason == "http_400" and letter.record.id == "id-7" and "bad record 7" in letter.detail


def test_max_age_moves_old_records_to_dead_letters(tmp_path):
    journal = Journal(tmp_path / "j", clock=lambda: time.time() - 3600)  # records appended "an hour ago"
    journal.append([r.body for r in recs(3)])
    journal.close()
    sink = ScriptedSink()
    d = Dispatcher(Journal(tmp_path / "j"), {"s": sink}, tmp_path / "dl", backoff=FAST, max_age={"s": 60})
    d.start()
    d.append(recs(2, 3))
    assert sink.wait_for(2)
    d.close(5)
    assert sink.got == [3, 4]
    assert [dl.reason for dl in DeadLetters(tmp_path / "dl", "s")] == ["max_age_exceeded"] * 3


def test_close_drains_then_halts_a_hanging_sink_and_keeps_its_records(tmp_path):
    hanging = ScriptedSink(answer=lambda b, c: Retry("timeout"))
    d = make(tmp_path, {"h": hanging})
    d.append(recs(5))
    t0 = time.monotonic()
    d.close(0.5)
    assert time.monotonic() - t0 < 10
    j = Journal(tmp_path / "j")
    r = j.reader("h")
    assert [orjson.loads(e.body)["n"] for e in r.read(10)] == [0, 1, 2, 3, 4]


def test_cursor_survives_restart_without_redelivery(tmp_path):
    sink = ScriptedSink()
    d = make(tmp_path, {"s": sink})
    d.append(recs(10))
    assert sink.wait_for(10)
    d.close(5)
    again = ScriptedSink()
    d = make(tmp_path, {"s": again})
    d.append(recs(1, 10))
    assert again.wait_for(1)
    d.close(5)
    assert again.got == [10]


def test_idle_workers_sleep_until_woken_yet_deliver_and_stop_at_once(tmp_path):
    # Idle workers wait up to IDLE_WAIT (a minute) so an idle agent does not tick; an append wakes
    # them for delivery, close() wakes them to stop, and a moved cursor still reaches disk promptly.
    sinks = {name: ScriptedSink() for name in ("a", "b")}
    d = make(tmp_path, sinks)

    def flushed(n: int) -> None:  # every cursor on disk at n: from then on the workers are idle
        cursors = [tmp_path / "j" / "cursors" / f"{name}.cursor" for name in sinks]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(c.exists() and orjson.loads(c.read_bytes())["next"] == n for c in cursors):
                return
            time.sleep(0.05)
        raise AssertionError(f"cursors not flushed at {n} within 10 s")  # not at IDLE_WAIT, a minute later

    d.append(recs(3))
    assert all(s.wait_for(3, timeout=10) for s in sinks.values())
    flushed(3)
    d.append(recs(2, 3))  # the workers are idle now: the append alone must wake them
    assert all(s.wait_for(5, timeout=10) for s in sinks.values())
    flushed(5)
    t0 = time.monotonic()
    d.close(5)
    assert time.monotonic() - t0 < 3  # not the minute an idle worker would otherwise sleep
    assert not any(w.thread.is_alive() for w in d.workers.values())
