"""Give freed heap memory back to the OS now and then (glibc's ``malloc_trim``), so that a long run's
resident memory follows what the agent uses rather than what it once used.

Why: the C side of the agent (SQLite, OpenSSL, the sinks' HTTP stacks) frees memory in the middle of
glibc's heaps, which glibc keeps mapped; over hours of small allocations the resident size creeps up
although nothing leaks. One ``malloc_trim(0)`` a minute costs about a millisecond. Elsewhere (musl,
macOS, Windows) there is no such call and nothing is done.
"""
from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0


def malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return lambda: int(function(0))


class MemoryTrimmer:
    """A daemon thread that calls ``malloc_trim(0)`` every ``every`` seconds until ``stop`` is set."""

    def __init__(self, stop: threading.Event, every: float = TRIM_EVERY_S,
                 trim: Callable[[], int] | None = None) -> None:
        self._stop = stop
        self._every = every
        self._trim = trim if trim is not None else malloc_trim()
        self.trims = 0
        self._thread = threading.Thread(target=self._run, name="memory-trim", daemon=True)

    def start(self) -> MemoryTrimmer:
        if self._trim is not None:
            self._thread.start()
        return self

    def _run(self) -> None:
        assert self._trim is not None
        while not self._stop.wait(self._every):
            try:
                self._trim()
            except Exception:  # noqa: BLE001 - an optimisation must never take the agent down
                log.debug("malloc_trim failed", exc_info=True)
                return
            self.trims += 1
