"""The Azure VM extension's heartbeat file ([agent] heartbeat_file), refreshed while the agent runs.

With ``reportHeartbeat`` in the extension's manifest, the Azure guest agent reports the handler
as this file says (``Ready``/``NotReady`` and the message) and as ``Unresponsive`` once the file
is 600 s old; the VM extension's root timer copies this file, checked, to the guest agent's ``heartbeatFile``.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)

REFRESH = 30.0  # well inside the guest agent's 600 s
FAILING_POLLS = 3  # IMDS polls failed in a row before the agent calls itself NotReady
MAX_MESSAGE = 1000  # what the portal shows of a message


def heartbeat(snapshot: dict[str, Any] | None, *, stopped: bool = False) -> list[dict[str, Any]]:
    """The guest agent's heartbeat document for a status snapshot (see Agent.snapshot)."""
    imds = (snapshot or {}).get("imds") or {}
    failures = int(imds.get("consecutive_failures") or 0)
    last_ok = imds.get("last_poll_ok") or "never"
    sinks = (snapshot or {}).get("sinks") or {}
    backlog = ", ".join(
        f"{name} backlog {s.get('backlog', 0)}" + (f" dead letters {s['dead_lettered']}" if s.get("dead_lettered") else "")
        for name, s in sinks.items() if isinstance(s, dict)
    )
    if stopped:
        ready, text = False, f"sefwd stopped (last IMDS poll ok {last_ok})"
    elif not imds.get("polls"):
        ready, text = True, "sefwd starting: first IMDS poll under way"
    elif failures >= FAILING_POLLS:
        ready, text = False, f"sefwd running but IMDS failing: {failures} polls in a row failed (last ok {last_ok})"
    else:
        ready, text = True, f"sefwd running: last IMDS poll ok {last_ok}, {imds.get('polls', 0)} polls"
    if backlog and not stopped:
        text += f"; sinks: {backlog}"
    return [{"version": 1.0, "heartbeat": {
        "status": "Ready" if ready else "NotReady",
        "code": 0 if ready else 1,
        "formattedMessage": {"lang": "en-US", "message": text[:MAX_MESSAGE]},
    }}]


def write_heartbeat(path: Path, doc: list[dict[str, Any]]) -> None:
    """Replace ``path`` atomically (the guest agent may read it at any moment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(orjson.dumps(doc))
    os.replace(tmp, path)


class HeartbeatFile:
    """Rewrites the heartbeat every ``interval`` seconds, and once more as stopped when ``stop`` is set;
    ``close()`` (the agent's last step) writes stopped as the file's last word, whatever the thread does."""

    def __init__(self, path: Path, snapshot: Callable[[], dict[str, Any]], stop: threading.Event,
                 interval: float = REFRESH) -> None:
        self.path = path
        self._snapshot = snapshot
        self._stop = stop
        self._interval = interval
        self._failed = False
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="extension-heartbeat", daemon=True)

    def start(self) -> HeartbeatFile:
        self.write()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.write()
        self.write(stopped=True)

    def close(self) -> None:
        """The stopped heartbeat, written now: the thread is a daemon, so an exiting agent would not
        wait for its own stopped write; no write after this one."""
        with self._lock:
            self._write(stopped=True)
            self._closed = True

    def write(self, *, stopped: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._write(stopped=stopped)

    def _write(self, *, stopped: bool) -> None:
        try:
            write_heartbeat(self.path, heartbeat(self._snapshot(), stopped=stopped))
            self._failed = False
        except OSError as exc:
            if not self._failed:  # once per run of failures, not every 30 s
                log.warning("cannot write the extension heartbeat %s: %s", self.path, exc)
            self._failed = True
