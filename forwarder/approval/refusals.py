"""Aggregated audit of refused callback requests: at most one ``approval.refused`` record per
reason and client per window, carrying a count, so a flood costs a bounded number of writes.

The first refusal of a (reason, client) is recorded at once with ``Count: 1``, so a single bad
request shows up in the audit without delay. Later ones are only counted; when the window since
the last record ends, one record carries their count (the fields are the latest refusal's). A
refusal arriving after a quiet window is again recorded at once, carrying what was still counted.
Refusals by the rate limiter are never recorded at once (a flood controls their number): their
first record comes when the window since the first one ends. Stopping writes what is counted.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forwarder.approval.callback import _client_host

WINDOW = 60.0
# Refused before any other check, so an attacker controls their number: never one write each.
UNRECORDED_FIRST = frozenset({"rate_limited"})
MAX_CLIENTS = 10_000  # keys tracked at once; past it, new clients are counted together as "other"


def client_group(client: str) -> str:
    """The client a refusal is counted for: ``1.2.3.4:5678`` → ``1.2.3.4``, ``[2001:db8::1]:80`` →
    ``2001:db8::/64`` (one host's share), as the callback's per-client connection cap groups them."""
    if client.startswith("[") and "]" in client:
        host = client[1 : client.index("]")]
    else:
        host, sep, port = client.rpartition(":")
        host = host if sep and port.isdigit() and ":" not in host else client
    return _client_host(host)


@dataclass
class _Tally:
    fields: dict[str, Any]  # the latest refusal's
    held: int = 0  # refusals counted since the last record
    since: float = 0.0  # when the first of them came
    last: float | None = None  # when the last record was written


class RefusalAggregator:
    """One record per (reason, client group) per ``window`` at most; see the module docstring."""

    def __init__(self, submit: Callable[[dict[str, Any]], None], stop: threading.Event, *,
                 window: float = WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        self._submit = submit
        self._stop = stop
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._thread = threading.Thread(target=self._run, name="refusal-audit", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fields: dict[str, Any]) -> None:
        """Audit callback of the server: refused requests are aggregated, other outcomes pass through."""
        if fields.get("Outcome") != "refused":
            self._submit(fields)
            return
        reason = str(fields.get("Reason"))
        key = (reason, client_group(str(fields.get("Client"))))
        now = self._clock()
        with self._lock:
            if key not in self._tallies and len(self._tallies) >= MAX_CLIENTS:
                key = (reason, "other")
            tally = self._tallies.setdefault(key, _Tally(fields))
            tally.fields = fields
            if reason not in UNRECORDED_FIRST and (tally.last is None or now - tally.last >= self._window):
                out = {**fields, "Count": tally.held + 1}
                tally.held, tally.last = 0, now
            else:
                if tally.held == 0:
                    tally.since = now
                tally.held += 1
                return
        self._submit(out)

    def flush(self, force: bool = False) -> None:
        """Write the count of every key whose window ended (all with ``force``); forget idle keys."""
        now = self._clock()
        out = []
        with self._lock:
            for key, tally in list(self._tallies.items()):
                due = (tally.since if tally.last is None else tally.last) + self._window
                if tally.held and (force or now >= due):
                    out.append({**tally.fields, "Count": tally.held})
                    tally.held, tally.last = 0, now
                elif not tally.held and (tally.last is None or now - tally.last >= self._window):
                    del self._tallies[key]
        for fields in out:
            self._submit(fields)

    def _run(self) -> None:
        while not self._stop.wait(min(self._window, 5.0)):
            self.flush()
        self.flush(force=True)
