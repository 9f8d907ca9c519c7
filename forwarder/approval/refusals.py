"""Aggregated audit of refused callback requests: at most one ``approval.refused`` record per
reason and client per window, carrying a count, so a flood costs a bounded number of writes."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

WINDOW = 60.0
# Refused before any other check, so an attacker controls their number: never one write each.
UNRECORDED_FIRST = frozenset({"rate_limited"})


def _host(client: str) -> str:
    """``1.2.3.4:5678`` or ``[::1]:5678`` without the port: one client opens many connections."""
    host, sep, port = client.rpartition(":")
    return host if sep and port.isdigit() else client


class RefusalAggregator:
    """The first refusal of a (reason, client) in a window is audited at once; the rest as one count."""

    def __init__(self, submit: Callable[[dict[str, Any]], None], stop: threading.Event, *,
                 window: float = WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self._submit = submit
        self._stop = stop
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], float] = {}  # window start per key
        self._held: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}  # last fields, count since
        self._thread = threading.Thread(target=self._run, name="refusal-audit", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fields: dict[str, Any]) -> None:
        """Audit callback of the server: refused requests are aggregated, other outcomes pass through."""
        if fields.get("Outcome") != "refused":
            self._submit(fields)
            return
        key = (str(fields.get("Reason")), _host(str(fields.get("Client"))))
        now = self._clock()
        with self._lock:
            started = self._open.get(key)
            if started is None and key[0] not in UNRECORDED_FIRST:
                self._open[key] = now
                first = True
            else:
                self._open.setdefault(key, now)
                _, n = self._held.get(key, (fields, 0))
                self._held[key] = (fields, n + 1)
                first = False
        if first:
            self._submit({**fields, "Count": 1})

    def flush(self, force: bool = False) -> None:
        """Submit one record per key whose window ended (all with ``force``) and close those windows."""
        now = self._clock()
        out = []
        with self._lock:
            for key, started in list(self._open.items()):
                if force or now - started >= self._window:
                    del self._open[key]
                    held = self._held.pop(key, None)
                    if held is not None:
                        out.append({**held[0], "Count": held[1]})
        for fields in out:
            self._submit(fields)

    def _run(self) -> None:
        while not self._stop.wait(min(self._window, 5.0)):
            self.flush()
        self.flush(force=True)
