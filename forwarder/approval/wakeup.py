"""Wake idle action workers when due work may have appeared, without losing a wake-up in between.

A worker takes ``mark()`` before it looks at the store and, finding nothing, ``wait(mark, ...)``:
the wait returns at once if a ``notify`` came after the mark, even one sent before the worker
reached its wait. (A bare ``Condition.wait`` after the look would sleep through such a notify: the
due action would wait for the worker's idle timeout, 30 s, longer than a Spot eviction's notice.)
"""
from __future__ import annotations

import threading


class Wakeup:
    """A generation counter under a condition: wake-ups are counted, never lost."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0

    def mark(self) -> int:
        """Take before looking for work; pass to ``wait``."""
        with self._cond:
            return self._generation

    def notify(self, n: int = 1) -> None:
        """Work may be there for ``n`` workers."""
        with self._cond:
            self._generation += 1
            self._cond.notify(n)

    def notify_all(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, mark: int, timeout: float, stop: threading.Event | None = None) -> bool:
        """Until a notify after ``mark`` (or ``stop``): True; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._generation != mark or (stop is not None and stop.is_set()), timeout)
