"""The agent's self-report (``status.json``) and its reading by ``sefwd status``."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from forwarder import __version__
from forwarder.deadletter import sinks_with_dead_letters
from forwarder.logutil import redact
from forwarder.records import rfc3339, utcnow

STATUS_FILE = "status.json"


def write_status(path: Path, data: dict[str, Any]) -> None:
    """Replace atomically, without fsync: status is advisory and rewritten every few seconds."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)


def _steady(data: dict[str, Any]) -> dict[str, Any]:
    """The snapshot less what moves on every poll (poll count, last poll time)."""
    imds = data.get("imds")
    if not isinstance(imds, dict):
        return data
    return {**data, "imds": {k: v for k, v in imds.items() if k not in ("polls", "last_poll_ok")}}


class StatusReporter:
    """Writes ``status.json`` from a snapshot callable: within ``interval`` seconds of a change, and
    at least every ``refresh`` seconds so the last-poll time stays current.

    A rewrite costs about a millisecond of CPU (serialize, write, rename); doing it every couple of
    seconds on an idle agent cost more than the polls themselves (README: performance).
    """

    def __init__(self, state_dir: Path, snapshot: Callable[[], dict[str, Any]], stop: threading.Event,
                 interval: float = 5.0, refresh: float = 30.0) -> None:
        self.path = state_dir / STATUS_FILE
        self._snapshot = snapshot
        self._stop = stop
        self._interval = interval
        self._refresh = refresh
        self._written: dict[str, Any] | None = None
        self._written_at = 0.0
        self._thread = threading.Thread(target=self._run, name="status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            data = self._snapshot()
            if _steady(data) != self._written or time.monotonic() - self._written_at >= self._refresh:
                self.write(data)

    def write(self, data: dict[str, Any] | None = None, **extra: Any) -> None:
        data = self._snapshot() if data is None else data
        self._written = _steady(data)
        self._written_at = time.monotonic()
        data = {**data, **extra}
        data["updated"] = rfc3339(utcnow())
        data["pid"] = os.getpid()
        data["version"] = __version__
        try:
            write_status(self.path, data)
        except OSError:
            pass  # a full disk must not stop the agent over a report file


def agent_running(state_dir: Path) -> bool:
    """Whether an agent holds the state dir's lock."""
    try:
        import fcntl
    except ImportError:
        return (state_dir / STATUS_FILE).exists()
    try:
        fd = os.open(state_dir / "agent.lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def read_status(state_dir: Path) -> dict[str, Any]:
    """Everything ``sefwd status`` shows, from files only (works with the agent up or down)."""
    out: dict[str, Any] = {"state_dir": str(state_dir), "running": agent_running(state_dir)}
    try:
        out["agent"] = orjson.loads((state_dir / STATUS_FILE).read_bytes())
    except (OSError, ValueError):
        out["agent"] = None
    try:
        state = orjson.loads((state_dir / "state.json").read_bytes())
        doc = orjson.loads(state["document"]) if state.get("document") else None
    except (OSError, ValueError, KeyError, TypeError):
        doc = None
    out["document_incarnation"] = doc.get("DocumentIncarnation") if isinstance(doc, dict) else None
    out["current_events"] = doc.get("Events", []) if isinstance(doc, dict) else []
    out["dead_letters"] = sinks_with_dead_letters(state_dir / "deadletter")
    return out


def format_status(s: dict[str, Any]) -> str:
    """A human page for ``sefwd status``."""
    lines = []
    agent = s.get("agent") or {}
    running = "running" if s["running"] else "NOT running"
    lines.append(f"agent: {running} (state dir {s['state_dir']})")
    if agent:
        age = ""
        try:
            from datetime import datetime

            updated = datetime.fromisoformat(agent["updated"].replace("Z", "+00:00"))
            age = f", report {int((utcnow() - updated).total_seconds())}s old"
        except (KeyError, ValueError):
            pass
        imds = agent.get("imds", {})
        lines.append(
            f"last poll ok: {imds.get('last_poll_ok') or 'never'}; polls {imds.get('polls', 0)}, "
            f"IMDS errors {imds.get('imds_errors', 0)}, bad documents {imds.get('bad_documents', 0)}{age}"
        )
        j = agent.get("journal", {})
        lines.append(f"journal: {j.get('size_bytes', 0)} bytes, records {j.get('oldest_index', 0)}..{j.get('next_index', 0)}")
        for name, sk in sorted(agent.get("sinks", {}).items()):
            oldest = sk.get("oldest_undelivered_age_s")
            lines.append(
                f"  sink {name}: backlog {sk.get('backlog', 0)}"
                + (f" (oldest {oldest:.1f}s)" if oldest is not None else "")
                + f", delivered {sk.get('delivered', 0)}, retries {sk.get('retries', 0)}, "
                f"dead letters {s['dead_letters'].get(name, 0)}"
                + (f", last error {redact(str(sk['last_error']))}" if sk.get("last_error") else "")
            )
        for what in ("corrupt_skipped", "dropped_full", "cursor_resets"):
            if j.get(what):
                lines.append(f"  journal {what.replace('_', ' ')}: {j[what]}")
    else:
        lines.append("no status report yet (the agent has not run with this state dir)")
    extra = {k: v for k, v in s["dead_letters"].items() if k not in (agent.get("sinks") or {})}
    for name, n in extra.items():
        lines.append(f"  sink {name} (not configured now): dead letters {n}")
    events = s.get("current_events") or []
    lines.append(f"current events (DocumentIncarnation {s.get('document_incarnation')}): {len(events)}")
    for e in events:
        lines.append(
            f"  {e.get('EventId')} {e.get('EventType')} {e.get('EventStatus')} NotBefore={e.get('NotBefore') or '-'} "
            f"Resources={','.join(e.get('Resources') or [])}"
        )
    return "\n".join(lines)


def now_ms() -> int:
    return int(time.time() * 1000)
