"""A full garbage collection every few minutes, so the agent's memory levels off instead of climbing for an hour.

CPython collects the oldest generation only when the objects promoted into it since the last full
collection exceed a quarter of all long-lived ones. The agent's imports (the Azure SDKs, OpenTelemetry,
Apprise) leave a few hundred thousand long-lived objects, so garbage in reference cycles that outlived two
young collections (a batch held across retries, an exception and its traceback kept as a sink's last error)
waited about an hour at a few records a minute: a soak's Python heap grew ~10 KiB a minute until the first
full collection, and its RSS kept that high-water mark. A sweep every ``EVERY_S`` bounds that garbage to a
few minutes' worth; a full collection of the agent's heap takes tens of milliseconds.
"""
from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

EVERY_S = 300.0


class GcSweep:
    """Runs ``gc.collect()`` every ``every`` seconds until ``stop`` is set (a daemon thread)."""

    def __init__(self, stop: threading.Event, every: float = EVERY_S) -> None:
        self.stop = stop
        self.every = every
        self.runs = 0
        self.freed = 0  # unreachable objects found, over all sweeps
        self.swept = threading.Event()  # set after each sweep (tests wait on it)
        self._thread = threading.Thread(target=self._loop, name="gc-sweep", daemon=True)

    def start(self) -> GcSweep:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self.stop.wait(self.every):
            started = time.perf_counter()
            found = gc.collect()
            self.runs += 1
            self.freed += found
            log.debug("gc sweep: %d unreachable object(s) in %.1f ms", found, (time.perf_counter() - started) * 1000)
            self.swept.set()


__all__ = ["EVERY_S", "GcSweep"]
