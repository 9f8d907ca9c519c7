"""Logging helpers: stderr setup and rate-limiting of repeated identical errors."""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable


def setup_logging(level: str = "info") -> None:
    """All logs go to stderr: stdout carries records only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    if level.lower() != "debug":
        # The Azure SDKs log every HTTP request at INFO: noise for an agent that sends all day.
        for name in ("azure", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)


class RateLimitedLog:
    """Logs an error once per ``interval`` per key, then says how often it repeated meanwhile."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval:
            self._last[key] = (last[0], last[1] + 1)
            return
        suppressed = last[1] if last else 0
        if suppressed:
            msg += " (repeated %d times since last report)"
            args = (*args, suppressed)
        self._last[key] = (now, 0)
        self._log.log(level, msg, *args)

    def clear(self, key: str) -> None:
        """The condition is over: the next occurrence is logged at once."""
        self._last.pop(key, None)
