"""Hand records to the sinks. The poller only knows the ``Outbox`` protocol."""
from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

from forwarder.retry import Backoff
from forwarder.sinkapi import Ok, Record, Reject, Retry, Sink

log = logging.getLogger(__name__)


class Outbox(Protocol):
    """Takes records; when ``append`` returns they are safe (delivered or durable). Raises if not."""

    def append(self, records: Sequence[Record]) -> None: ...

    def close(self, drain_timeout: float) -> None: ...


class DirectOutbox:
    """Delivers synchronously to every sink, retrying transient failures until ``stop``.

    Used without a journal: a slow sink holds up the poller, so this suits stdout/file only.
    """

    def __init__(self, sinks: Mapping[str, Sink], stop: threading.Event, backoff: Backoff | None = None) -> None:
        self.sinks = dict(sinks)
        self._stop = stop
        self._backoff = backoff or Backoff(initial=0.2, maximum=5.0)
        self._rng = random.Random()
        self.rejected: dict[str, int] = {name: 0 for name in self.sinks}

    def append(self, records: Sequence[Record]) -> None:
        for name, sink in self.sinks.items():
            for start in range(0, len(records), max(1, sink.max_batch)):
                self._deliver(name, sink, records[start : start + sink.max_batch])

    def _deliver(self, name: str, sink: Sink, batch: Sequence[Record]) -> None:
        attempt = 0
        while True:
            result = sink.send(batch)
            if isinstance(result, Ok):
                return
            if isinstance(result, Reject):
                self.rejected[name] += len(batch)
                log.error("sink %s rejected %d record(s): %s %s", name, len(batch), result.reason, result.detail)
                return
            assert isinstance(result, Retry)
            delay = self._backoff.delay(attempt, self._rng, result.delay)
            attempt += 1
            log.warning("sink %s: %s; retrying in %.1fs", name, result.reason, delay)
            if self._stop.wait(delay):
                raise InterruptedError(f"stopped while sink {name} was retrying")

    def close(self, drain_timeout: float) -> None:
        for sink in self.sinks.values():
            sink.close()
