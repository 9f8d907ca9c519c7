"""One worker per sink: read from its cursor in the store, send, retry, dead-letter, advance.

No exception ends delivery: a failed store read or cursor write is retried with backoff, and a
supervisor restarts a worker thread that died anyway.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from forwarder.common.logs import RateLimitedLog
from forwarder.records import rfc3339, utcnow
from forwarder.common.retry import Backoff
from forwarder.delivery.filters import RecordFilter
from forwarder.sinkapi import Ok, Record, Reject, Retry, Sink
from forwarder.store.database import Entry, Store

log = logging.getLogger(__name__)

IDLE_WAIT = 60.0  # seconds a worker with nothing to do sleeps unless woken
# A sink failing this long (or dead-lettering, or its worker dead) makes the agent degraded: the
# shortest notice a VM gets is 30 s (Spot/Preempt), so an alert must not wait longer ([agent] degraded_after).
STUCK_AFTER = 30.0
SUPERVISE_EVERY = 5.0
COLLECT_EVERY = 2.0  # delivered records are deleted in batches, not after every send


@dataclass
class SinkStats:
    delivered: int = 0
    retries: int = 0
    dead_lettered: int = 0
    dead_by_reason: dict[str, int] = field(default_factory=dict)
    filtered: int = 0  # held back by the sink's filter: the cursor passed them unsent
    filtered_by_reason: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    last_latency_ms: float | None = None
    pending_since_ms: int | None = None  # store time of the oldest record being delivered
    failing_since: float | None = None  # monotonic: first failure (sink or store) of the current streak
    failing_since_wall: str | None = None  # the same moment, RFC 3339, for people
    errors: int = 0  # failures (retries, refusals, store faults) since the last delivery
    dead_lettering: bool = False  # a record went to dead letters and none was delivered since

    def failed(self, error: str) -> None:
        """One failure of the current streak: the latest error is the one shown."""
        self.last_error = error
        self.errors += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            self.failing_since_wall = rfc3339(utcnow())

    def succeeded(self) -> None:
        self.failing_since = self.failing_since_wall = None
        self.errors = 0
        self.dead_lettering = False
    store_errors: int = 0
    restarts: int = 0


class SinkWorker:
    """Delivers one sink's backlog in order; a slow or dead sink only delays itself."""

    def __init__(self, name: str, sink: Sink, store: Store, *, backoff: Backoff, halt: threading.Event,
                 max_age: float | None = None, clock: Callable[[], float] = time.time,
                 stuck_after: float = STUCK_AFTER, record_filter: RecordFilter | None = None) -> None:
        self.name = name
        self.record_filter = record_filter
        self.sink = sink
        self.store = store
        self.backoff = backoff
        self.halt = halt
        self.max_age = max_age
        self.stuck_after = stuck_after
        self._clock = clock
        self._rng = random.Random()
        self._errors = RateLimitedLog(log)
        self.stats = SinkStats()
        self.draining = threading.Event()
        self.cursor = 0
        self.position = 0
        self._loaded = False
        self.thread = self._thread()

    def _thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"sink-{self.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def restart(self) -> None:
        """Called by the supervisor for a thread that died: resume from the committed cursor."""
        self.stats.restarts += 1
        log.error("sink %s: delivery thread died; restarting it (restart %d)", self.name, self.stats.restarts)
        self.thread = self._thread()
        self.thread.start()

    def _run(self) -> None:
        failures = 0
        collected = time.monotonic()
        while not self.halt.is_set():
            try:
                if not self._loaded:
                    self.cursor = self.position = self.store.cursor(self.name)
                    self._loaded = True
                entries = self.store.read(self.name, self.position, max(1, self.sink.max_batch))
                failures = 0
                if entries:
                    self._deliver(entries)
                elif self.draining.is_set():
                    break  # shutting down and nothing left
                else:
                    # Woken by every commit and by close(), which sets draining or halt first.
                    self.store.wait(self.position, IDLE_WAIT, unless=(self.draining, self.halt))
                if time.monotonic() - collected >= COLLECT_EVERY:
                    collected = time.monotonic()
                    self.store.collect()
            except Exception as exc:  # a store fault or a sink bug must not end delivery
                failures += 1
                self.position = self.cursor
                self.stats.store_errors += 1
                self.stats.failed(f"{type(exc).__name__}: {exc}")
                delay = self.backoff.delay(failures - 1, self._rng)
                self._errors.log(logging.ERROR, "store", "sink %s: %s; retrying in %.2fs", self.name, self.stats.last_error, delay)
                if self.halt.wait(delay):
                    break

    def _expired(self, pairs: list[tuple[Entry, Record]]) -> tuple[list[tuple[Entry, Record]], list[Entry]]:
        if not self.max_age:
            return pairs, []
        cutoff_ms = (self._clock() - self.max_age) * 1000
        return [p for p in pairs if p[0].appended_ms >= cutoff_ms], [e for e, _ in pairs if e.appended_ms < cutoff_ms]

    def _filtered(self, pairs: list[tuple[Entry, Record]]) -> tuple[list[tuple[Entry, Record]], dict[str, int]]:
        """The records this sink is to be sent, and how many its filter held back, by reason."""
        if self.record_filter is None:
            return pairs, {}
        kept: list[tuple[Entry, Record]] = []
        held: dict[str, int] = {}
        for pair in pairs:
            reason = self.record_filter.reason(pair[1])
            if reason is None:
                kept.append(pair)
            else:
                held[reason] = held.get(reason, 0) + 1
        return kept, held

    def _commit(self, end: int, dead: Sequence[tuple[bytes, str, str]] = ()) -> None:
        """Advance the cursor (with any dead letters) durably; retried until it works or we halt."""
        attempt = 0
        while True:
            try:
                self.store.advance(self.name, end, dead, rfc3339(utcnow()) or "")
                break
            except Exception as exc:
                self.stats.store_errors += 1
                self.stats.failed(f"{type(exc).__name__}: {exc}")
                delay = self.backoff.delay(attempt, self._rng)
                attempt += 1
                self._errors.log(logging.ERROR, "cursor", "sink %s: cannot save its cursor: %s; retrying in %.2fs",
                                 self.name, exc, delay)
                if self.halt.wait(delay):
                    return  # not committed: the next start delivers these again (duplicates, not loss)
        self._errors.clear("cursor")
        self.cursor = max(self.cursor, end)
        for _, reason, _ in dead:
            self.stats.dead_by_reason[reason] = self.stats.dead_by_reason.get(reason, 0) + 1
        if dead:
            self.stats.dead_lettered += len(dead)
            self.stats.dead_lettering = True
            log.error("sink %s: %d record(s) moved to dead letters: %s", self.name, len(dead),
                      ", ".join(sorted({f"{r} {d}".strip() for _, r, d in dead})))

    def _deliver(self, entries: list[Entry]) -> None:
        end = entries[-1].index + 1
        if self.stats.pending_since_ms is None:
            self.stats.pending_since_ms = entries[0].appended_ms
        dead: list[tuple[bytes, str, str]] = []
        parsed = []
        for e in entries:
            try:
                parsed.append((e, Record.from_body(e.body)))
            except (ValueError, KeyError, TypeError):  # damaged on disk: set aside and counted, not retried forever
                dead.append((e.body, "record_damaged", "the stored record is not a readable CloudEvent"))
        wanted, held = self._filtered(parsed)  # held back records advance the cursor unsent, never dead letters
        readable, old = self._expired(wanted)
        dead += [(e.body, "max_age_exceeded", f"older than {self.max_age:g}s") for e in old]
        if readable and not self._send(readable, dead):
            self.position = self.cursor  # halted mid-retry: read again from the cursor next time
            return
        self._commit(end, dead)
        for reason, n in held.items():
            self.stats.filtered_by_reason[reason] = self.stats.filtered_by_reason.get(reason, 0) + n
            self.stats.filtered += n
        self.position = end
        self.stats.pending_since_ms = None

    def _send(self, batch: list[tuple[Entry, Record]], dead: list[tuple[bytes, str, str]]) -> bool:
        """Send until Ok or Reject (appending rejects to ``dead``); False when halted."""
        attempt = 0
        records = [r for _, r in batch]
        while True:
            result = self.sink.send(records)
            if isinstance(result, Ok):
                self.stats.delivered += len(records)
                self.stats.last_latency_ms = self._clock() * 1000 - batch[-1][0].appended_ms
                self.stats.succeeded()
                self._errors.clear("send")
                return True
            if isinstance(result, Reject):
                if len(batch) > 1:  # find the bad one(s): the rest must still arrive
                    return all(self._send([pair], dead) for pair in batch)
                dead.append((batch[0][1].body, result.reason, result.detail))
                self.stats.failed(result.reason)  # a refusal is the latest error too (a 400 is no success)
                return True
            assert isinstance(result, Retry)
            delay = self.backoff.delay(attempt, self._rng, result.delay)
            attempt += 1
            self.stats.retries += 1
            self.stats.failed(result.reason)
            self._errors.log(logging.WARNING, "send", "sink %s: %s; retrying %d record(s) in %.2fs", self.name, result.reason, len(records), delay)
            if self.halt.wait(delay):
                return False

    def stuck(self) -> bool:
        """Degraded: a dead thread, dead-lettering, or failing for longer than ``stuck_after``."""
        since = self.stats.failing_since
        return not self.thread.is_alive() and not self.halt.is_set() or self.stats.dead_lettering or (
            since is not None and time.monotonic() - since > self.stuck_after)

    def health(self) -> dict[str, object]:
        """``ok``, ``failing`` (since when, the latest error, how many) or ``dead_lettering``; and degraded."""
        stats = self.stats
        if stats.dead_lettering:
            state = "dead_lettering"
        elif stats.failing_since is not None:
            state = "failing"
        elif not self.thread.is_alive() and not self.halt.is_set():
            state = "worker_dead"
        else:
            state = "ok"
        return {"state": state, "failing_since": stats.failing_since_wall, "errors": stats.errors,
                "last_error": stats.last_error if state != "ok" else None, "degraded": self.stuck(),
                "degraded_after_s": self.stuck_after}


class Dispatcher:
    """Delivers what the store holds: a worker per sink, and a supervisor that restarts dead ones.

    It only reads the store; records are committed through ``forwarder.store.outbox.StoreOutbox``.
    """

    def __init__(self, store: Store, sinks: Mapping[str, Sink], *, backoff: Backoff | None = None,
                 max_age: Mapping[str, float | None] | None = None, stuck_after: float = STUCK_AFTER,
                 supervise_every: float = SUPERVISE_EVERY,
                 filters: Mapping[str, RecordFilter | None] | None = None, halt: threading.Event | None = None) -> None:
        self.store = store
        self.sinks = dict(sinks)
        store.sinks = tuple(self.sinks)
        self.halt = halt or threading.Event()  # set when delivery ends; the agent gives its sinks the same event
        backoff = backoff or Backoff()
        self.workers = {
            name: SinkWorker(name, sink, store, backoff=backoff, halt=self.halt, max_age=(max_age or {}).get(name),
                             stuck_after=stuck_after, record_filter=(filters or {}).get(name))
            for name, sink in self.sinks.items()
        }
        self._supervise_every = supervise_every
        self._supervisor = threading.Thread(target=self._supervise, name="sink-supervisor", daemon=True)

    def start(self) -> None:
        for w in self.workers.values():
            w.start()
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self.halt.wait(self._supervise_every):
            for w in self.workers.values():
                if not w.thread.is_alive() and not w.draining.is_set() and not self.halt.is_set():
                    w.restart()

    def snapshot(self) -> dict[str, object]:
        """Per-sink and store figures for status and metrics."""
        now_ms = time.time() * 1000
        try:
            losses = self.store.losses()
        except Exception:  # a failing disk must not take the status report and metrics down too
            losses = {}
        sinks = {}
        for name, w in self.workers.items():
            pending = w.stats.pending_since_ms
            try:
                backlog = self.store.backlog(name, w.cursor)
            except Exception:
                backlog = None
            sinks[name] = {
                "backlog": backlog,
                "oldest_undelivered_age_s": round((now_ms - pending) / 1000, 3) if pending else None,
                "delivered": w.stats.delivered,
                "retries": w.stats.retries,
                "dead_lettered": w.stats.dead_lettered,
                "dead_by_reason": dict(w.stats.dead_by_reason),
                "filtered": w.stats.filtered,
                "filtered_by_reason": dict(w.stats.filtered_by_reason),
                "lost": losses.get(name, {}),
                "last_error": w.stats.last_error,
                "last_latency_ms": w.stats.last_latency_ms,
                "store_errors": w.stats.store_errors,
                "restarts": w.stats.restarts,
                "stuck": w.stuck(),
                "health": w.health(),
            }
        return {
            "store": {
                "path": str(self.store.path),
                "next_index": self.store.next_index,
                "size_bytes": self.store.size,
                "max_size_bytes": self.store.max_size,
                "append_failures": self.store.append_failures,
                "lost": losses,
            },
            "sinks": sinks,
        }

    def close(self, drain_timeout: float) -> None:
        """Let sinks drain for up to ``drain_timeout`` seconds, then stop them."""
        for w in self.workers.values():
            w.draining.set()
        self.store.wake()
        deadline = time.monotonic() + drain_timeout
        for w in self.workers.values():
            w.thread.join(max(0.0, deadline - time.monotonic()))
        self.halt.set()
        self.store.wake()
        for w in self.workers.values():
            w.thread.join(5.0)
        for name, w in self.workers.items():
            try:
                left = self.store.backlog(name, w.cursor)
            except Exception:
                left = 0
            if left:
                log.warning("sink %s: %d record(s) not delivered before shutdown; they stay in the store", name, left)
        for sink in self.sinks.values():
            sink.close()
