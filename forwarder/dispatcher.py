"""One thread per sink: read from its journal cursor, send, retry, dead-letter, commit."""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from forwarder.deadletter import DeadLetters
from forwarder.journal import Entry, Journal, Reader
from forwarder.logutil import RateLimitedLog
from forwarder.retry import Backoff
from forwarder.sinkapi import Ok, Record, Reject, Retry, Sink

log = logging.getLogger(__name__)


@dataclass
class SinkStats:
    delivered: int = 0
    retries: int = 0
    dead_lettered: int = 0
    dead_by_reason: dict[str, int] | None = None
    last_error: str | None = None
    last_delivery_ms: int | None = None  # journal append time of the newest delivered record
    last_latency_ms: float | None = None
    pending_since_ms: int | None = None  # journal time of the oldest record being delivered


IDLE_WAIT = 60.0  # seconds a worker with nothing to do sleeps unless woken


class SinkWorker:
    """Delivers one sink's backlog in order; a slow or dead sink only delays itself."""

    def __init__(
        self,
        name: str,
        sink: Sink,
        reader: Reader,
        dead: DeadLetters,
        *,
        backoff: Backoff,
        halt: threading.Event,
        max_age: float | None = None,
        clock: Callable[[], float] = time.time,
        flush_interval: float = 0.5,
    ) -> None:
        self.name = name
        self.sink = sink
        self.reader = reader
        self.dead = dead
        self.backoff = backoff
        self.halt = halt
        self.max_age = max_age
        self._clock = clock
        self._flush_interval = flush_interval
        self._rng = random.Random()
        self._errors = RateLimitedLog(log)
        self.stats = SinkStats(dead_by_reason={})
        self.draining = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"sink-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        last_flush = time.monotonic()
        try:
            while not self.halt.is_set():
                entries = self.reader.read(max(1, self.sink.max_batch))
                if entries:
                    self._deliver(entries)
                elif self.draining.is_set():
                    break  # shutting down and nothing left
                else:
                    # Woken by every append and by close(); the timeout only matters for a cursor
                    # that still has to reach disk. An idle agent must not tick (README: performance).
                    self.reader.wait(self._flush_interval if self.reader.dirty else IDLE_WAIT)
                if time.monotonic() - last_flush >= self._flush_interval:
                    self.reader.flush()
                    self.reader.journal.collect()
                    last_flush = time.monotonic()
        except Exception:  # a sink bug must not kill delivery silently
            log.exception("sink %s: delivery thread crashed; its records stay in the journal", self.name)
        finally:
            self.reader.flush()

    def _expired(self, entries: list[Entry]) -> list[Entry]:
        if not self.max_age:
            return entries
        cutoff_ms = (self._clock() - self.max_age) * 1000
        old = [e for e in entries if e.appended_ms < cutoff_ms]
        if old:
            self._dead([Record.from_body(e.body) for e in old], "max_age_exceeded", f"older than {self.max_age:g}s")
        return [e for e in entries if e.appended_ms >= cutoff_ms]

    def _dead(self, records: Sequence[Record], reason: str, detail: str) -> None:
        self.dead.add(list(records), reason, detail)
        self.stats.dead_lettered += len(records)
        assert self.stats.dead_by_reason is not None
        self.stats.dead_by_reason[reason] = self.stats.dead_by_reason.get(reason, 0) + len(records)
        log.error("sink %s: %d record(s) moved to dead letters: %s %s", self.name, len(records), reason, detail)

    def _deliver(self, entries: list[Entry]) -> None:
        end = entries[-1].index + 1
        if self.stats.pending_since_ms is None:
            self.stats.pending_since_ms = entries[0].appended_ms
        attempt = 0
        while True:
            entries = self._expired(entries)
            if not entries:
                break
            records = [Record.from_body(e.body) for e in entries]
            result = self.sink.send(records)
            if isinstance(result, Ok):
                self.stats.delivered += len(records)
                self.stats.last_delivery_ms = entries[-1].appended_ms
                self.stats.last_latency_ms = self._clock() * 1000 - entries[-1].appended_ms
                self._errors.clear("send")
                break
            if isinstance(result, Reject):
                if len(entries) > 1:  # find the bad one(s): the rest must still arrive
                    for e in entries:
                        self._deliver([e])
                        if self.halt.is_set():
                            return
                    return
                self._dead(records, result.reason, result.detail)
                break
            assert isinstance(result, Retry)
            delay = self.backoff.delay(attempt, self._rng, result.delay)
            attempt += 1
            self.stats.retries += 1
            self.stats.last_error = result.reason
            self._errors.log(logging.WARNING, "send", "sink %s: %s; retrying %d record(s) in %.2fs", self.name, result.reason, len(records), delay)
            if self.halt.wait(delay):
                self.reader.rewind()
                return
        self.reader.commit(end)
        self.stats.pending_since_ms = None


class Dispatcher:
    """Starts a worker per sink and stops them with a bounded drain."""

    def __init__(
        self,
        journal: Journal,
        sinks: Mapping[str, Sink],
        deadletter_dir,
        *,
        backoff: Backoff | None = None,
        max_age: Mapping[str, float | None] | None = None,
    ) -> None:
        self.journal = journal
        self.sinks = dict(sinks)
        self.halt = threading.Event()
        backoff = backoff or Backoff()
        self.workers = {
            name: SinkWorker(
                name, sink, journal.reader(name), DeadLetters(deadletter_dir, name),
                backoff=backoff, halt=self.halt, max_age=(max_age or {}).get(name),
            )
            for name, sink in self.sinks.items()
        }

    def start(self) -> None:
        for w in self.workers.values():
            w.start()

    def append(self, records: Sequence[Record]) -> None:
        """Outbox protocol: durable in the journal when this returns."""
        self.journal.append([r.body for r in records])

    def snapshot(self) -> dict[str, object]:
        """Per-sink and journal figures for status.json."""
        now_ms = time.time() * 1000
        j = self.journal
        sinks = {}
        for name, w in self.workers.items():
            pending = w.stats.pending_since_ms
            sinks[name] = {
                "backlog": w.reader.backlog,
                "oldest_undelivered_age_s": round((now_ms - pending) / 1000, 3) if pending else None,
                "delivered": w.stats.delivered,
                "retries": w.stats.retries,
                "dead_lettered": w.stats.dead_lettered,
                "dead_by_reason": dict(w.stats.dead_by_reason or {}),
                "last_error": w.stats.last_error,
                "last_latency_ms": w.stats.last_latency_ms,
            }
        return {
            "journal": {
                "next_index": j.next_index,
                "oldest_index": j.oldest_index,
                "size_bytes": j.size_bytes(),
                "corrupt_skipped": dict(j.stats.corrupt_skipped),
                "dropped_full": dict(j.stats.dropped_full),
                "cursor_resets": dict(j.stats.cursor_resets),
                "torn_bytes_truncated": j.stats.torn_bytes_truncated,
                "append_failures": j.stats.append_failures,
            },
            "sinks": sinks,
        }

    def position(self) -> int:
        return self.journal.next_index

    def close(self, drain_timeout: float) -> None:
        """Let sinks drain for up to ``drain_timeout`` seconds, then stop them; cursors are flushed."""
        for w in self.workers.values():
            w.draining.set()
        self.journal.wake()
        deadline = time.monotonic() + drain_timeout
        for w in self.workers.values():
            w.thread.join(max(0.0, deadline - time.monotonic()))
        undelivered = {n: w.reader.backlog for n, w in self.workers.items() if w.thread.is_alive() or w.reader.backlog}
        self.halt.set()
        self.journal.wake()
        for w in self.workers.values():
            w.thread.join(5.0)
        for n, left in undelivered.items():
            if left:
                log.warning("sink %s: %d record(s) not delivered before shutdown; they stay in the journal", n, left)
        for sink in self.sinks.values():
            sink.close()
        self.journal.close()
